"""`implementation=None` against every implementation of ragged_dot, one run per shape.

    python tools/none_check.py [--shape M,K,N,G[,random]] ... [--iterations 10]

For each shape (default: the H200 grid's random-split shapes and six it was never
tuned at), times `None` and each named implementation, forward and forward+backward,
interleaved (`bench_suite.run_problem`, no peers), and prints None's time over the
fastest named one's. Exit status 1 if any is above 1.03 (the issue's 3%): the check
that the tuned data, and the rule carrying it between grid points, pick well at
router-like group sizes. Needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tokamax._src import bench_suite
from tokamax._src.ops.ragged_dot import problems

DEFAULT_SHAPES = [
    # The grid's random-split shapes (problems.grid_problems).
    (32768, 2048, 1408, 64, True), (16384, 4096, 4096, 64, True),
    (65536, 7168, 2048, 256, True), (8192, 7168, 2048, 256, True),
    (65536, 2048, 768, 128, True), (65536, 4096, 1536, 128, True),
    (65536, 768, 2048, 128, True),
    # Never tuned at.
    (32768, 4096, 2048, 32, True), (65536, 3072, 1024, 128, True),
    (16384, 2048, 4096, 16, True), (40960, 5120, 1536, 160, True),
    (24576, 2048, 1408, 64, True), (16384, 4096, 14336, 8, True),
]


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
  worst = 0.0
  for shape in args.shape or DEFAULT_SHAPES:
    p = dataclasses.replace(problems.problem(*shape), peers={}, reference=())
    rows = bench_suite.run_problem(p, [None, *named], iterations=args.iterations)
    for direction in p.directions:
      ms = {r["implementation"].removeprefix("tokamax "): r.get("ms")
            for r in rows if r["direction"] == direction}
      best = min((v for k, v in ms.items() if k != "auto" and v), default=None)
      if ms.get("auto") is None or best is None:
        print(f"| {p.name} | {direction} | failed: {rows} |", flush=True)
        worst = float("inf")
        continue
      ratio = ms["auto"] / best
      worst = max(worst, ratio)
      cells = " | ".join(f"{k} {v:.3f}" if v else f"{k} failed" for k, v in ms.items())
      print(f"| {p.name} | {direction} | {cells} | None/best {ratio:.3f} |", flush=True)
  print(f"worst None/best: {worst:.3f}")
  return 1 if worst > 1.03 else 0


if __name__ == "__main__":
  sys.exit(main())
