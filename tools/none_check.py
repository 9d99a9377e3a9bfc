"""`implementation=None` against every named implementation, one run per shape.

    python tools/none_check.py [--shape M,K,N,G[,random]] ... [--iterations 10]
    python tools/none_check.py --op dot_product_attention [--shape B,T,N,K,H[,causal[,W]]] ...
    python tools/none_check.py --op gated_linear_unit [--shape M,K,N] ...
    python tools/none_check.py --op layer_norm [--shape ROWS,D[,rms]] ...
    python tools/none_check.py --op OP --random COUNT [--seed S]

For each shape (ragged_dot's default: the H200 grid's random-split shapes and six
it was never tuned at; the other ops': calls between or beyond their grid points,
`bench --grid` covering the points themselves), times `None` and each named
implementation (the XLA one included for GLU and the norms: `None` must not lose
to it either), forward and forward+backward, interleaved
(`bench_suite.run_problem`, no peers), and prints every time and None's over the
fastest named one's (`bench_suite.auto_against_fastest`). Exit status 1 if any is
more than `bench_suite.AUTO_MARGIN` (3%) slower: the check that the tuned data,
and the rule carrying it between grid points (`tuning.nearest`), pick well where
nothing was measured. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from tokamax._src import bench_suite
from tokamax._src.ops.attention import problems as attention_problems
from tokamax._src.ops.gated_linear_unit import problems as glu_problems
from tokamax._src.ops.layer_norm import problems as norm_problems
from tokamax._src.ops.ragged_dot import problems as ragged_dot_problems

# Never tuned at: other group counts, K and N between the grid's.
OFF_GRID_SHAPES = [
    (32768, 4096, 2048, 32, True), (65536, 3072, 1024, 128, True),
    (16384, 2048, 4096, 16, True), (40960, 5120, 1536, 160, True),
    (24576, 2048, 1408, 64, True), (16384, 4096, 14336, 8, True),
]
# (B, T, N, K, H, causal), bf16, never tuned at: token counts between the grid's
# 8192 and 32768 or beyond them, batch and length between grid points, 8 query
# heads a kv head, lengths that are no multiple of 128 (near the grid's T1000,
# T4000 and T15000 points) or of 8 (T1500: no grid points of that kind),
# multi-query attention (8 query heads on one kv head) between its grid points,
# one batch row where the one-kernel backward runs (under GQA without causal,
# and MHA H128 causal: at B1 they spilled and serialized their wgmmas where the
# grid's B2-B32 compile clean, notes/MEASUREMENTS.md session 75).
OFF_GRID_ATTENTION = [
    (4, 8192, 32, 8, 128, True), (1, 8192, 16, 16, 128, False),
    (16, 2048, 16, 16, 64, True), (2, 8192, 64, 8, 128, True),
    (8, 2048, 32, 8, 256, False), (1, 32768, 32, 8, 128, True),
    (4, 3000, 16, 16, 128, False), (2, 6144, 32, 8, 64, True),
    (1, 3000, 16, 16, 64, False), (2, 6000, 32, 8, 128, True),
    (16, 1500, 16, 16, 64, True), (1, 10000, 16, 16, 128, False),
    (1, 15616, 8, 1, 128, False), (4, 3000, 8, 1, 128, True),
    (1, 4096, 32, 8, 128, False), (1, 4096, 16, 16, 128, True),
]

# (M, K, N), bf16 SwiGLU, never tuned at: other model widths (5120/13824,
# 3072/8192), a short odd M at 5120/13824 (where `None`'s forward measured 1.08x
# the composed one's, session 72), an M that is no multiple of the tiles, M just
# past a multiple of 128 (`tuning.nearest.WHOLE_TILES`, session 73).
OFF_GRID_GLU = [
    (8192, 5120, 13824), (32768, 3072, 8192), (1073, 5120, 13824),
    (12000, 4096, 11008), (16384, 2048, 8192), (1025, 4096, 14336),
    (2049, 4096, 14336),
]
# (rows, D, rms), bf16, never tuned at: widths between the grid's 1024-16384,
# row counts between the grid's 2048, 4096 and 32768 or past them, rows no
# power of two. At 3072 rows the grid's neighbours rank the backwards
# differently (Triton's at 2048 rows, Mosaic GPU's at 4096; session 59).
OFF_GRID_NORM = [
    (8192, 5120, False), (8192, 5120, True), (16384, 2048, True),
    (65536, 3072, True), (12000, 4096, False), (2048, 12288, True),
    (3072, 4096, False), (3072, 1024, True),
    # Widths past whole 1024-column pieces (their own kind in tuned data).
    (8192, 2304, False), (16384, 4608, True),
]


def random_problems(op: str, count: int, seed: int) -> list:
  """`count` calls of `op` drawn with `seed`: the sizes a user (or an outside
  checker) might pick rather than the ones listed here, so that each new seed
  tries `None`'s choice where nothing was measured."""
  rng = np.random.default_rng([seed, sorted(OPS).index(op)])

  def pick(*values):
    return values[int(rng.integers(len(values)))]

  def log_uniform(low, high, multiple=1):
    value = int(np.exp(rng.uniform(np.log(low), np.log(high))))
    return max(multiple, value // multiple * multiple)

  drawn = []
  for _ in range(count):
    if op == "ragged_dot":  # MoE widths of DeepSeek-, Mixtral- and Qwen-like models
      k, n = pick(2048, 3072, 4096, 5120, 7168), pick(768, 1408, 1536, 2048, 4096,
                                                      14336, 28672)
      g = pick(8, 16, 32, 64, 128, 160, 256)
      m = log_uniform(max(4096, 16 * g), 65536, 8)
      while m * k * n > 2**42 and m > g * 64:  # a few ms at most
        m //= 2
      while g * k * n > 2**31 and g > 8:  # the weights: 4 GiB of bf16 at most
        g //= 2
      drawn.append(ragged_dot_problems.problem(m, k, n, g, bool(rng.random() < 0.8)))
    elif op == "dot_product_attention":
      kv, h = pick(1, 4, 8, 16, 32), pick(64, 128, 128, 256)
      n = kv * pick(1, 2, 4, 8)
      while n > 64:
        n //= 2
      t = pick(log_uniform(1024, 32768), log_uniform(1024, 32768, 128))
      b = max(1, 16384 // t) if rng.random() < 0.5 else max(1, 65536 // t)
      while b * n * t > 2**21 and b > 1:  # about 16k tokens of 128 heads or fewer
        b //= 2
      causal = bool(rng.random() < 0.6)
      window = pick(None, None, 512, 1024, 4096) if causal else None
      dtype = attention_problems.BF16 if rng.random() < 0.8 else jnp.float16
      drawn.append(attention_problems.problem(b, t, n, kv, h, causal, dtype,
                                              window=window))
    elif op == "gated_linear_unit":
      d = pick(2048, 3072, 4096, 5120, 8192)
      f = pick(d * 2, d * 3, d * 7 // 2, 11008, 13824, 14336)
      m = log_uniform(1024, 32768, pick(1, 8, 128))
      drawn.append(glu_problems.problem(m, d, f))
    else:
      d = log_uniform(1024, 16384, pick(128, 1024))
      rows = log_uniform(4096, 65536, pick(1, 8, 1024))
      while rows * d > 2**28:
        rows //= 2
      drawn.append(norm_problems.problem(rows, d, bool(rng.random() < 0.5)))
  return drawn


def default_problems() -> list:
  """ragged_dot's: the grid's random-split problems, then the off-grid shapes."""
  grid = [p for p in ragged_dot_problems.grid_problems() if p.name.endswith(" random")]
  return grid + [ragged_dot_problems.problem(*s) for s in OFF_GRID_SHAPES]


def shape_parser(usage: str, sizes: int, flag: str | None = None):
  """A `--shape` parser: `sizes` comma-separated integers, then optionally the
  word `flag` (its presence returned as a last bool); `usage` names the form."""
  def parse(text: str) -> tuple:
    parts = text.split(",")
    flagged = flag is not None and len(parts) == sizes + 1 and parts[-1] == flag
    if len(parts) != sizes and not flagged:
      raise argparse.ArgumentTypeError(f"--shape wants {usage}, got {text!r}")
    values = tuple(map(int, parts[:sizes]))  # ValueError: not an integer
    return values if flag is None else (*values, flagged)
  return parse


parse_shape = shape_parser("M,K,N,G[,random]", 4, "random")
_parse_attention_sizes = shape_parser(
    "B,T,N,K,H[,causal[,W]] for dot_product_attention", 5, "causal")


def parse_attention_shape(text: str) -> tuple:
  """B,T,N,K,H[,causal[,W]] -> (B, T, N, K, H, causal, W): W, a causal sliding
  window of W keys back (the bench's windows), None without one."""
  head, _, last = text.rpartition(",")
  if head.endswith(",causal") and last.isdigit():
    return (*_parse_attention_sizes(head), int(last))
  return (*_parse_attention_sizes(text), None)


def attention_problem(b, t, n, k, h, causal, window):
  """The problem of `parse_attention_shape`'s tuple."""
  return attention_problems.problem(b, t, n, k, h, causal, window=window)


parse_glu_shape = shape_parser("M,K,N for gated_linear_unit", 3)
parse_norm_shape = shape_parser("ROWS,D[,rms] for layer_norm", 2, "rms")


class _Op(NamedTuple):
  parse: Callable[[str], tuple]
  problem: Callable[..., object]
  defaults: Callable[[], list]
  implementations: tuple[str, ...]


OPS = {
    "ragged_dot": _Op(parse_shape, ragged_dot_problems.problem, default_problems,
                      ("mosaic_gpu", "triton")),
    "dot_product_attention": _Op(
        parse_attention_shape, attention_problem,
        lambda: [attention_problems.problem(*s) for s in OFF_GRID_ATTENTION],
        ("mosaic_gpu", "cudnn")),
    "gated_linear_unit": _Op(
        parse_glu_shape, glu_problems.problem,
        lambda: [glu_problems.problem(*s) for s in OFF_GRID_GLU],
        ("mosaic_gpu", "triton", "composed", "xla")),
    "layer_norm": _Op(
        parse_norm_shape, norm_problems.problem,
        lambda: [norm_problems.problem(*s) for s in OFF_GRID_NORM],
        ("mosaic_gpu", "triton", "xla")),
}


def positive_int(text: str) -> int:
  """An argparse type: an int >= 1 (the tools' --iterations)."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
  return value


def problems_from(parser, op_name: str, texts: list[str], flag: str = "--shape") -> list:
  """The problems of `texts` in `op_name`'s --shape form; a usage error of
  `parser` naming `flag` for a bad form."""
  op = OPS[op_name]
  try:
    return [op.problem(*op.parse(text)) for text in texts]
  except (argparse.ArgumentTypeError, ValueError) as e:  # ValueError: not an integer
    parser.error(f"{flag} for {op_name}: {e}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", choices=sorted(OPS), default="ragged_dot")
  parser.add_argument("--shape", action="append",
                      help="ragged_dot: M,K,N,G[,random]; dot_product_attention: "
                           "B,T,N,K,H[,causal[,W]] (W: a sliding window); "
                           "gated_linear_unit: M,K,N; "
                           "layer_norm: ROWS,D[,rms] (bf16)")
  parser.add_argument("--implementation", action="append", default=None,
                      help="default: mosaic_gpu and triton (ragged_dot), mosaic_gpu "
                           "and cudnn (dot_product_attention), mosaic_gpu, triton, "
                           "composed and xla (gated_linear_unit), mosaic_gpu, "
                           "triton and xla (layer_norm)")
  parser.add_argument("--iterations", type=positive_int, default=10)
  parser.add_argument("--random", type=positive_int, default=None, metavar="COUNT",
                      help="instead of the listed shapes, COUNT shapes drawn with "
                           "--seed (realistic model sizes, odd ones included)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  op = OPS[args.op]
  named = args.implementation or list(op.implementations)
  if args.shape and args.random:
    parser.error("--shape and --random: give one of them")
  if args.random:
    chosen = random_problems(args.op, args.random, args.seed)
  elif args.shape:
    chosen = problems_from(parser, args.op, args.shape)
  else:
    chosen = op.defaults()
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
