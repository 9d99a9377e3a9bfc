"""`implementation=None` against every implementation of ragged_dot, one run per shape.

    python tools/none_check.py [--shape M,K,N,G[,random]] ... [--iterations 10]

For each shape (default: the H200 grid's random-split shapes and six it was never
tuned at), times `None` and each named implementation, forward and forward+backward,
interleaved (`bench_suite.run_problem`, no peers), and prints every time and None's
over the fastest named one's (`bench_suite.auto_against_fastest`). Exit status 1 if any is
more than `bench_suite.AUTO_MARGIN` (3%) slower: the check that the tuned data, and
the rule carrying it between grid points, pick well at router-like group sizes.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys

from tokamax._src import bench_suite
from tokamax._src.ops.ragged_dot import problems

# Never tuned at: other group counts, K and N between the grid's.
OFF_GRID_SHAPES = [
    (32768, 4096, 2048, 32, True), (65536, 3072, 1024, 128, True),
    (16384, 2048, 4096, 16, True), (40960, 5120, 1536, 160, True),
    (24576, 2048, 1408, 64, True), (16384, 4096, 14336, 8, True),
]


def default_problems() -> list:
  """The grid's random-split problems, then the off-grid shapes."""
  grid = [p for p in problems.grid_problems() if p.name.endswith(" random")]
  return grid + [problems.problem(*s) for s in OFF_GRID_SHAPES]


def parse_shape(text: str) -> tuple:
  parts = text.split(",")
  if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "random"):
    raise argparse.ArgumentTypeError(f"--shape wants M,K,N,G[,random], got {text!r}")
  return (*map(int, parts[:4]), len(parts) == 5)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", type=parse_shape, action="append")
  parser.add_argument("--implementation", action="append",
                      default=None, help="default: mosaic_gpu and triton")
  parser.add_argument("--iterations", type=int, default=10)
  args = parser.parse_args()
  named = args.implementation or ["mosaic_gpu", "triton"]
  chosen = ([problems.problem(*s) for s in args.shape] if args.shape
            else default_problems())
  worst = 0.0
  for p in chosen:
    p = bench_suite.select_peers(p, [])
    rows = bench_suite.run_problem(p, [None, *named], iterations=args.iterations)
    found = bench_suite.auto_against_fastest(rows)
    if len(found) < len(p.directions):  # None or every named one failed
      print(f"| {p.name} | failed: {[r for r in rows if 'error' in r]} |", flush=True)
      worst = float("inf")
    for f in found:
      worst = max(worst, f["ratio"])
      # Every implementation's time, so that a miss shows what None passed over.
      times = " | ".join(
          f"{r['implementation'].removeprefix('tokamax ')} {r['ms']:.3f}" for r in rows
          if r.get("direction") == f["direction"] and "ms" in r)
      print(f"| {p.name} | {f['direction']} | {times} | fastest {f['fastest']} | "
            f"None/best {f['ratio']:.3f} |", flush=True)
  print(f"worst None/best: {worst:.3f}")
  return 1 if worst > 1 + bench_suite.AUTO_MARGIN else 0


if __name__ == "__main__":
  sys.exit(main())
