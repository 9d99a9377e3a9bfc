"""Builds the sdist and wheel of every package into one folder and checks them.

    python tools/dist.py build OUTDIR [PACKAGE ...]   # build (all five by default), then check
    python tools/dist.py check OUTDIR [PACKAGE ...]   # check what is already there

The checks are what a package index and a user on another machine rely on:
`twine check --strict` (metadata valid, README renders), dependencies by name and
version range only (a path or URL of the building machine makes a wheel that
nobody else can install), licence, readme, classifiers, requires-python and
project URLs in both artifacts, the LICENSE file inside them, backends' entry
points, and the tuned-data files of each backend inside its wheel. Each failure is
printed; the exit status is 1 if there was any.
"""

from __future__ import annotations

import email.parser
import json
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import repo_packages as pkgs

REQUIRED_FIELDS = ("License-Expression", "License-File", "Requires-Python", "Summary",
                   "Description-Content-Type")
REQUIRED_URLS = ("Homepage", "Source", "Changelog")


def build(outdir: pathlib.Path, selected: list[pkgs.Package], isolated: bool = True) -> None:
  """sdist, then the wheel built from that sdist (so a file missing from it shows)."""
  outdir.mkdir(parents=True, exist_ok=True)
  for package in selected:
    for old in outdir.glob(f"{package.filename_stem}-*"):
      old.unlink()  # a stale version would be served by the local index too
    flags = [] if isolated else ["--no-isolation"]
    subprocess.run([sys.executable, "-m", "build", *flags, "--outdir", str(outdir),
                    str(package.path)], check=True)


def artifacts(outdir: pathlib.Path, package: pkgs.Package) -> tuple[pathlib.Path, pathlib.Path]:
  stem = f"{package.filename_stem}-{package.version}"
  return outdir / f"{stem}.tar.gz", outdir / f"{stem}-py3-none-any.whl"


def wheel_files(wheel: pathlib.Path) -> dict[str, bytes]:
  with zipfile.ZipFile(wheel) as z:
    return {name: z.read(name) for name in z.namelist()}


def sdist_files(sdist: pathlib.Path) -> dict[str, bytes]:
  # Names without the leading "<name>-<version>/" folder.
  with tarfile.open(sdist) as t:
    return {m.name.split("/", 1)[1]: t.extractfile(m).read()
            for m in t.getmembers() if m.isfile() and "/" in m.name}


def dist_info(files: dict[str, bytes], suffix: str) -> tuple[str, bytes]:
  matches = [(n, d) for n, d in files.items()
             if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info")
             and n.endswith("/" + suffix)]
  return matches[0] if matches else (suffix, b"")


def metadata_problems(text: str, package: pkgs.Package, where: str) -> list[str]:
  """What is wrong with one METADATA / PKG-INFO for a package index."""
  msg = email.parser.Parser().parsestr(text)
  problems = [f"{where}: no {field}" for field in REQUIRED_FIELDS if not msg.get(field)]
  if msg.get("Version") != package.version:
    problems.append(f"{where}: version {msg.get('Version')}, pyproject says {package.version}")
  if not msg.get_all("Classifier"):
    problems.append(f"{where}: no classifiers")
  if len(msg.get_payload() or "") < 80:
    problems.append(f"{where}: the README (long description) is missing or too short")
  urls = dict(u.split(", ", 1) for u in msg.get_all("Project-URL") or [])
  problems += [f"{where}: no project URL {label!r}" for label in REQUIRED_URLS
               if not urls.get(label, "").startswith("https://")]
  for req in msg.get_all("Requires-Dist") or []:
    problems += requirement_problems(req, where)
  # A path of the building machine anywhere in the metadata (not only in a requirement).
  for marker in ("file:", str(pkgs.ROOT)):
    if marker in text:
      problems.append(f"{where}: the metadata contains {marker!r}")
  return problems


def requirement_problems(req: str, where: str) -> list[str]:
  """A requirement must name a distribution and, for our own, a version range."""
  name_part = req.split(";")[0]
  if "@" in name_part:
    return [f"{where}: direct reference {req!r} (must be by name and version range)"]
  if name_part.strip().lower().startswith("tokamax") and not any(
      op in name_part for op in (">", "<", "=", "~")):
    return [f"{where}: {req!r} has no version range"]
  return []


def license_problems(files: dict[str, bytes], names: list[str], where: str) -> list[str]:
  licence = (pkgs.ROOT / "LICENSE").read_bytes()
  present = [n for n in names if files.get(n) == licence]
  return [] if present else [f"{where}: no LICENSE identical to the repository's ({names})"]


def tuned_data_problems(package: pkgs.Package, files: dict[str, bytes], where: str) -> list[str]:
  """Every tuned-data file of the source tree is in the wheel, unchanged and valid JSON."""
  problems = []
  for source in package.tuned_files:
    inside = source.relative_to(package.path / "src").as_posix()
    if files.get(inside) != source.read_bytes():
      problems.append(f"{where}: tuned data {inside} missing or different")
      continue
    recorded = json.loads(files[inside]).get("versions", {}).get(package.name)
    if recorded != package.version:
      # Not an error: tokamax ignores it at run time (with a warning), as it should
      # when the kernels changed since they were tuned; tools/release.py says more.
      print(f"warning: {where}: {inside} was measured with {package.name} {recorded}; "
            f"{package.version} will ignore it until it is retuned")
  return problems


def wheel_problems(wheel: pathlib.Path, package: pkgs.Package) -> list[str]:
  files = wheel_files(wheel)
  where = wheel.name
  name, metadata = dist_info(files, "METADATA")
  problems = metadata_problems(metadata.decode(), package, where)
  problems += license_problems(files, [n for n in files if "/licenses/" in n], where)
  problems += tuned_data_problems(package, files, where)
  entry_points = dist_info(files, "entry_points.txt")[1].decode()
  if package.folder not in ("core", "xla-reference") and "[tokamax.backends]" not in entry_points:
    problems.append(f"{where}: no tokamax.backends entry point")
  if str(pkgs.ROOT) in entry_points:
    problems.append(f"{where}: entry_points.txt contains a path of this machine")
  return problems


def sdist_problems(sdist: pathlib.Path, package: pkgs.Package) -> list[str]:
  files = sdist_files(sdist)
  where = sdist.name
  problems = metadata_problems(files.get("PKG-INFO", b"").decode(), package, where)
  problems += license_problems(files, ["LICENSE"], where)
  problems += [f"{where}: no {f}" for f in ("README.md", "CHANGELOG.md", "pyproject.toml")
               if f not in files]
  return problems


def check(outdir: pathlib.Path, selected: list[pkgs.Package]) -> list[str]:
  problems = []
  found = []
  for package in selected:
    for artifact in artifacts(outdir, package):
      if not artifact.exists():
        problems.append(f"{artifact.name}: not built")
        continue
      found.append(artifact)
      checker = wheel_problems if artifact.suffix == ".whl" else sdist_problems
      problems += checker(artifact, package)
  if found:
    twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                            *map(str, found)], check=False)
    if twine.returncode:
      problems.append("twine check --strict failed (its output is above)")
  return problems


def main(argv: list[str]) -> int:
  command, outdir, names = argv[0], pathlib.Path(argv[1]).resolve(), argv[2:]
  selected = [pkgs.find(n) for n in names] if names else pkgs.all_packages()
  if command == "build":
    build(outdir, selected)
  problems = check(outdir, selected)
  for problem in problems:
    print(f"FAIL {problem}")
  print(f"{len(selected) * 2} artifacts in {outdir}: "
        f"{'all checks passed' if not problems else f'{len(problems)} problems'}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
