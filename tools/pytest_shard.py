"""Runs one shard of a pytest selection: every N-th collected test.

A GPU suite natively can outlast one device call (gpu-mosaic's test_attention.py
takes about 25 minutes on an H200 with 8 workers, a call at most 10), and a run
cut by its limit does not say which tests it reached. Shards of a fixed
collection do:

    python3 tools/pytest_shard.py 0/3 packages/gpu-mosaic/tests/test_attention.py -- -q -n 8 -m gpu
    python3 tools/pytest_shard.py 1/3 ...   # the next call, and so on

(`-m gpu`: the native tests only; the others, lowering and CPU checks, run in CI.)
Test i of the collection (in pytest's order) belongs to shard ``i % N``, so each
shard mixes the files' slow and fast tests alike. Arguments after ``--`` go to the
pytest run; its selection (``-m`` and ``-k``) applies to the collection too, so
that the shards split the selected tests. Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def selection(pytest_args: list[str]) -> list[str]:
  """The ``-m``/``-k`` options among `pytest_args`, as ``[option, value, ...]``,
  in any form pytest takes (``-m gpu``, ``-mgpu``, ``-m=gpu``)."""
  picked = []
  for i, arg in enumerate(pytest_args):
    option, attached = arg[:2], arg[2:]
    if option not in ("-m", "-k"):
      continue
    if attached:
      picked += [option, attached.removeprefix("=")]
    elif i + 1 < len(pytest_args):
      picked += [option, pytest_args[i + 1]]
  return picked


def collect(paths: list[str], select: list[str] = ()) -> list[str]:
  """The test IDs pytest collects from `paths` (with the `select` options), in
  its order, as absolute paths (collected with the file system's root as
  rootdir, so that the IDs name the same tests from any directory)."""
  out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:randomly", "--rootdir", os.sep, *select, *paths],
                       capture_output=True, text=True)
  ids = [os.sep + line for line in out.stdout.splitlines() if "::" in line]
  if out.returncode == 5 and select:  # pytest's "no tests collected"
    raise SystemExit(f"no test of {paths} is selected by {' '.join(select)}")
  if out.returncode != 0 or not ids:
    raise SystemExit(f"collection failed (exit {out.returncode}):\n{out.stdout[-2000:]}"
                     f"{out.stderr[-2000:]}")
  return ids


def shard(ids: list[str], index: int, count: int) -> list[str]:
  """Shard `index` of `count`: the IDs at positions index, index + count, ..."""
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"shard must be I/N with 0 <= I < N, got {index}/{count}")
  return ids[index::count]


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("shard", help="I/N: shard I (from 0) of N")
  parser.add_argument("paths", nargs="+", help="test files or folders")
  args = parser.parse_args(own)
  try:
    index, count = (int(x) for x in args.shard.split("/"))
  except ValueError:
    parser.error(f"shard must look like 0/3, got {args.shard!r}")
  try:
    shard([], index, count)  # refused before the collection, not after
  except ValueError as e:
    parser.error(str(e))
  ids = shard(collect(args.paths, selection(pytest_args)), index, count)
  print(f"shard {index}/{count}: {len(ids)} tests", flush=True)
  if not ids:
    return 0  # pytest given no IDs would run every test under the directory
  # `-p no:randomly` keeps the shard's order as collected (the plugin is
  # installed on some machines).
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly",
                         *pytest_args, *ids]).returncode


if __name__ == "__main__":
  sys.exit(main())
