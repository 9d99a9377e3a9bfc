"""Per-op timings beyond the reference shapes: norm widths and GLU aspect ratios.

    python tools/shape_sweep.py --op norms [--iterations 5]
    python tools/shape_sweep.py --op glu

norms: layer_norm and rms_norm at widths 1024-16384 with rows x width = 2^27
(bf16); glu: SwiGLU at small M / large N and the reverse. Each row: tokamax auto,
the kernels, the XLA reference and the plain-jnp program (the peer), forward and
forward+backward, in one process (the same rows as `python -m tokamax bench`).
Where `None` must not lose to the jnp program at any width (issue "norms at
bandwidth"), this is the table that shows it.
"""

from __future__ import annotations

import argparse

from tokamax._src import bench_suite
from tokamax._src.ops.gated_linear_unit import problems as gated_linear_unit_problems
from tokamax._src.ops.layer_norm import problems as layer_norm_problems
from tokamax._src.problem import Problem

import none_check
import tune

_NORM_ELEMENTS = 2**27
_NORM_WIDTHS = (1024, 2048, 4096, 8192, 12288, 16384)
# (M, K, N): small M with large N, and large M with small K and N.
_GLU_SHAPES = ((2048, 4096, 28672), (65536, 2048, 2048))


def problems(op: str) -> list[Problem]:
  if op == "norms":
    return [layer_norm_problems.problem(_NORM_ELEMENTS // d, d, rms)
            for d in _NORM_WIDTHS for rms in (False, True)]
  if op == "glu":
    return [gated_linear_unit_problems.problem(*shape) for shape in _GLU_SHAPES]
  raise ValueError(f"--op must be 'norms' or 'glu'; got {op!r}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--op", required=True, choices=["norms", "glu"])
  parser.add_argument("--implementation", action="append",
                      help="only this implementation (repeatable; 'auto' for None)")
  parser.add_argument("--iterations", type=none_check.positive_int, default=5)
  args = parser.parse_args()
  tune.check_implementations(parser, args.implementation)
  impls = [None, "triton", "mosaic_gpu", "xla"] if not args.implementation else [
      None if i == "auto" else i for i in args.implementation]
  print("\n".join(bench_suite.HEADER), flush=True)
  for p in problems(args.op):
    usable = [i for i in impls if i is None or i in _usable(p.op)]
    if args.implementation and len(usable) < len(impls):
      print(f"  ({p.op}: not usable here, left out: "
            f"{', '.join(i for i in impls if i not in usable)})", flush=True)
    print(bench_suite.markdown_table(bench_suite.run_problem(p, usable, iterations=args.iterations),
                               header=False), flush=True)


def _usable(op: str) -> set[str]:
  # Imported when first needed: only the rows that filter by usability ask.
  from tokamax._src import introspection
  return {s.name for s in introspection.implementations(op) if s.usable}


if __name__ == "__main__":
  main()
