"""Exports an experiment's packages beside main's, so one device call can run both.

    python tools/experiment_overlay.py NAME COMMIT [--out .whl/exp]

An experiment lands as a commit that adds it and a commit that takes it out
(`git revert` of the second restores it). This script applies the reverse of
COMMIT, the commit that took the experiment out, to a throwaway worktree of
HEAD (`git revert --no-commit COMMIT`) and copies each package whose source
that changes (``packages/*/src/<package>``, whole) to ``OUT/NAME/<package>``,
and each changed test file to ``OUT/NAME/tests/``.
Under ``.whl/`` the overlay travels with the device call's carried wheels; a
step then runs the experiment ahead of the installed packages:

    PYTHONPATH=.whl/exp/NAME:$PYTHONPATH python tools/tune.py ... --ab-env SWITCH=1
    PYTHONPATH=.whl/exp/NAME:$PYTHONPATH python -m pytest .whl/exp/NAME/tests/test_x.py

(the installed packages are imported by module name, so the overlay's copy
wins; tests run from the overlay import it the same way).
"""

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _git(*args, cwd=ROOT) -> str:
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                        text=True).stdout


def changed_paths(worktree: pathlib.Path) -> list[str]:
  """The paths the restored experiment changes against HEAD."""
  return _git("diff", "--name-only", "HEAD", cwd=worktree).split()


def overlay_parts(paths: list[str]) -> tuple[set[str], set[str]]:
  """(package source directories, test files) among `paths`, as paths
  relative to the repository root."""
  packages, tests = set(), set()
  for path in paths:
    parts = pathlib.PurePosixPath(path).parts
    if len(parts) > 4 and parts[0] == "packages" and parts[2] == "src":
      packages.add("/".join(parts[:4]))
    elif len(parts) > 3 and parts[0] == "packages" and parts[2] == "tests":
      tests.add(path)
  return packages, tests


def build(name: str, commit: str, out: pathlib.Path, root: pathlib.Path = ROOT
          ) -> pathlib.Path:
  """Writes the overlay of the experiment `commit` took out to ``out/name``
  (replacing it) and returns that directory."""
  target = out / name
  with tempfile.TemporaryDirectory() as tmp:
    worktree = pathlib.Path(tmp) / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(worktree), "HEAD", cwd=root)
    try:
      _git("revert", "--no-commit", commit, cwd=worktree)
      packages, tests = overlay_parts(changed_paths(worktree))
      if not packages and not tests:
        raise SystemExit(f"reverting {commit} changes no package source or test: "
                         "nothing to overlay")
      shutil.rmtree(target, ignore_errors=True)
      target.mkdir(parents=True)
      for package in sorted(packages):
        shutil.copytree(worktree / package, target / pathlib.PurePosixPath(package).name,
                        ignore=shutil.ignore_patterns("__pycache__"))
      for test in sorted(tests):
        (target / "tests").mkdir(exist_ok=True)
        shutil.copy2(worktree / test, target / "tests")
    finally:
      _git("worktree", "remove", "--force", str(worktree), cwd=root)
  return target


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("name", help="the overlay's directory name")
  parser.add_argument("commit", help="the commit that took the experiment out")
  parser.add_argument("--out", default=".whl/exp")
  args = parser.parse_args(argv)
  target = build(args.name, args.commit, ROOT / args.out)
  shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
  print(f"{shown}: {', '.join(sorted(p.name for p in target.iterdir()))}")
  print(f"run with PYTHONPATH={shown}:$PYTHONPATH")
  return 0


if __name__ == "__main__":
  sys.exit(main())
