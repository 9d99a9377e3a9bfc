"""Release trains: one version, changelog and tag series per package.

    python tools/release.py release PACKAGE [--dry-run] [--part patch|minor|major | --version X]
    python tools/release.py check-changelogs

`release` (docs/releasing.md): the version in pyproject.toml is the next release's
while it has no tag `<distribution>-v<version>`; once tagged, a release bumps it
(patch by default). It moves the changelog's "Unreleased" entries under the new
version, restamps the package's tuned data when its kernels did not change since
they were tuned, builds the sdist and wheel into dist/ and checks them
(tools/dist.py), then commits those files alone and tags the commit. With
--dry-run it does all of that in a copy and shows what it would change, touching
nothing in the repository.

`check-changelogs` (CI) fails when a package changed since its last tag (tests
aside) while its changelog's "Unreleased" section is empty; a package never tagged
must have its first release described there. It also fails when core's plugin
API version is not named in core's changelog.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from packaging.version import Version

import dist
import repo_packages as pkgs

UNRELEASED = "## [Unreleased]"


def git(*args: str, check: bool = True) -> str:
  proc = subprocess.run(["git", *args], cwd=pkgs.ROOT, capture_output=True, text=True)
  if check and proc.returncode:
    raise SystemExit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
  return proc.stdout.strip()


# ------------------------------------------------------------------ changelogs and tags


def unreleased_entries(changelog: str) -> list[str]:
  """The non-blank lines between "## [Unreleased]" and the next "## " heading."""
  if UNRELEASED not in changelog:
    return []
  section = changelog.split(UNRELEASED, 1)[1].split("\n## ", 1)[0]
  return [line for line in section.splitlines() if line.strip()]


def tagged_versions(package: pkgs.Package) -> list[Version]:
  tags = git("tag", "--list", f"{package.tag_prefix}*").split()
  return sorted(Version(t.removeprefix(package.tag_prefix)) for t in tags)


def changed_since(tag: str, package: pkgs.Package) -> list[str]:
  """Files of the package that differ from `tag` (working tree included), tests aside."""
  folder = package.path.relative_to(pkgs.ROOT).as_posix()
  names = git("diff", "--name-only", tag, "--", folder).splitlines()
  names += git("ls-files", "--others", "--exclude-standard", "--", folder).splitlines()
  return sorted(n for n in set(names)
                if not n.startswith(f"{folder}/tests/") and n != f"{folder}/CHANGELOG.md")


def last_release(package: pkgs.Package) -> str | None:
  """The last release's tag or, in a clone without tags, its release commit."""
  tags = tagged_versions(package)
  if tags:
    return f"{package.tag_prefix}{tags[-1]}"
  # A clone may come without tags (CI's may): the commit `release` made says it too.
  commit = git("log", "-1", "--format=%H", "--fixed-strings",
               f"--grep=Release {package.name} ")
  return commit or None


def changelog_problems(package: pkgs.Package) -> list[str]:
  entries = unreleased_entries((package.path / "CHANGELOG.md").read_text())
  if entries:
    return []
  tag = last_release(package)
  if tag is None:
    return [f"{package.name} was never released (no tag {package.tag_prefix}*): its "
            f"CHANGELOG.md must describe the first release under {UNRELEASED!r}"]
  changed = changed_since(tag, package)
  if changed:
    shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
    return [f"{package.name} changed since {tag} ({shown}) but CHANGELOG.md has "
            f"nothing under {UNRELEASED!r}"]
  return []


def plugin_api_problems() -> list[str]:
  """Core's changelog must say which plugin API version the current core speaks."""
  core = pkgs.find("core")
  source = (core.path / "src/tokamax/_src/plugin.py").read_text()
  version = re.search(r"(?m)^PLUGIN_API_VERSION = (\d+)$", source).group(1)
  if f"Plugin API version {version}" not in (core.path / "CHANGELOG.md").read_text():
    return [f"tokamax-core speaks plugin API version {version}, which its CHANGELOG.md "
            f"never names (write 'Plugin API version {version}' in the entry that changed it)"]
  return []


def check_changelogs() -> int:
  problems = plugin_api_problems()
  for package in pkgs.all_packages():
    problems += changelog_problems(package)
  for problem in problems:
    print(f"FAIL {problem}")
  print(f"changelogs of {len(pkgs.all_packages())} packages: "
        f"{'ok' if not problems else f'{len(problems)} problems'}")
  return 1 if problems else 0


# ------------------------------------------------------------------ one release


def next_version(package: pkgs.Package, part: str, explicit: str | None) -> Version:
  """The current version while it is untagged, else the bump of the last tag."""
  tags = tagged_versions(package)
  current = Version(package.version)
  if explicit:
    new = Version(explicit)
  elif current not in tags:
    new = current
  else:
    major, minor, micro = (list(current.release) + [0, 0])[:3]
    new = Version({"major": f"{major + 1}.0.0", "minor": f"{major}.{minor + 1}.0",
                   "patch": f"{major}.{minor}.{micro + 1}"}[part])
  if tags and new <= tags[-1]:
    raise SystemExit(f"{package.name} {new} is not newer than its last release {tags[-1]}")
  return new


def set_version(path: pathlib.Path, version: Version) -> None:
  text, count = re.subn(r'(?m)^version = ".*"$', f'version = "{version}"',
                        (path / "pyproject.toml").read_text())
  if count != 1:
    raise SystemExit(f"{path}/pyproject.toml: expected one 'version = ...' line")
  (path / "pyproject.toml").write_text(text)


def move_unreleased(path: pathlib.Path, version: Version, today: str) -> None:
  changelog = (path / "CHANGELOG.md").read_text()
  if not unreleased_entries(changelog):
    raise SystemExit(f"{path}/CHANGELOG.md has nothing under {UNRELEASED!r}: "
                     "say what this release changes first")
  changelog = changelog.replace(UNRELEASED, f"{UNRELEASED}\n\n## [{version}] - {today}", 1)
  (path / "CHANGELOG.md").write_text(changelog)


def tuned_data_is_current(package: pkgs.Package) -> tuple[bool, list[str]]:
  """Whether no source file but the tuned data changed since the tuned data did."""
  folder = package.path.relative_to(pkgs.ROOT).as_posix()
  tuned = sorted({f.parent.parent.relative_to(pkgs.ROOT).as_posix()
                  for f in package.tuned_files})
  last = git("log", "-1", "--format=%H", "--", *tuned)
  if not last:
    return False, ["(the tuned data is not committed)"]
  changed = git("diff", "--name-only", last, "--", f"{folder}/src",
                *(f":(exclude){t}" for t in tuned)).splitlines()
  return not changed, changed


def restamp_tuned_data(package: pkgs.Package, path: pathlib.Path, version: Version) -> None:
  """Carries the tuned data over to `version` when the kernels are those it measured."""
  if not package.tuned_files or str(version) == package.version:
    return
  current, changed = tuned_data_is_current(package)
  if not current:
    print(f"warning: {package.name}'s kernels changed since its tuned data was measured "
          f"({', '.join(changed[:5])}); it keeps version {package.version}, so tokamax "
          f"ignores it for {version} until retuned on the device (python -m tokamax "
          "autotune --out <package>/src/<module>/tuned)")
    return
  for source in package.tuned_files:
    target = path / source.relative_to(package.path)
    old = f'"{package.name}": "{package.version}"'
    text = target.read_text()
    if text.count(old) == 1:
      target.write_text(text.replace(old, f'"{package.name}": "{version}"'))


def show_diff(before: pathlib.Path, after: pathlib.Path, names: list[str]) -> None:
  for name in names:
    a, b = (before / name).read_text().splitlines(), (after / name).read_text().splitlines()
    sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(
        a, b, f"a/{name}", f"b/{name}", lineterm="", n=1))


def release(name: str, part: str, explicit: str | None, dry_run: bool) -> int:
  package = pkgs.find(name)
  version = next_version(package, part, explicit)
  tag = f"{package.tag_prefix}{version}"
  folder = package.path.relative_to(pkgs.ROOT).as_posix()
  if not dry_run and git("status", "--porcelain", "--", folder):
    raise SystemExit(f"{folder} has uncommitted changes: commit them first")
  work = pathlib.Path(tempfile.mkdtemp()) / package.folder if dry_run else package.path
  if dry_run:
    shutil.copytree(package.path, work, ignore=shutil.ignore_patterns("__pycache__"))
  set_version(work, version)
  move_unreleased(work, version, datetime.date.today().isoformat())
  restamp_tuned_data(package, work, version)
  outdir = work.parent / "dist" if dry_run else pkgs.ROOT / "dist"
  built = pkgs.load(work)
  dist.build(outdir, [built], isolated=not dry_run)
  problems = dist.check(outdir, [built])
  for problem in problems:
    print(f"FAIL {problem}")
  if dry_run:
    show_diff(package.path, work, ["pyproject.toml", "CHANGELOG.md"])
    print(f"dry run: would commit {folder} as 'Release {package.name} {version}', "
          f"tag {tag}; artifacts in {outdir}")
    return 1 if problems else 0
  if problems:
    git("checkout", "--", folder)
    raise SystemExit("the artifacts failed their checks: nothing committed")
  git("commit", "-m", f"Release {package.name} {version}", "--", folder)
  git("tag", "-a", tag, "-m", f"{package.name} {version}")
  print(f"tagged {tag}. Publish: git push origin {tag} && python -m twine upload "
        f"dist/{package.filename_stem}-{version}*")
  return 0


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="tools/release.py")
  sub = parser.add_subparsers(dest="command", required=True)
  rel = sub.add_parser("release", help="version bump, changelog, build, check, commit, tag")
  rel.add_argument("package", help="folder (core) or distribution (tokamax-core)")
  rel.add_argument("--dry-run", action="store_true", help="show it, change nothing")
  bump = rel.add_mutually_exclusive_group()
  bump.add_argument("--part", choices=["patch", "minor", "major"], default="patch")
  bump.add_argument("--version", help="this version instead of a bump")
  sub.add_parser("check-changelogs", help="CI: changed packages have changelog entries")
  args = parser.parse_args(argv)
  if args.command == "check-changelogs":
    return check_changelogs()
  return release(args.package, args.part, args.version, args.dry_run)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
