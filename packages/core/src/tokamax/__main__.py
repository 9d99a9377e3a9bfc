"""Command line: ``python -m tokamax {info,demo}``."""

from __future__ import annotations

import argparse
import os
import sys

import jax

import tokamax
from tokamax._src import bench_models
from tokamax._src import bench_suite
from tokamax._src import benchmarking
from tokamax._src import demo


def info() -> None:
  """JAX and devices, installed backends, and the op x implementation matrix."""
  print(f"tokamax-core {tokamax.__version__}, JAX {jax.__version__}")
  print(f"devices: {', '.join(f'{d.device_kind} ({d.platform})' for d in jax.devices())}")
  print(f"interpret mode: {tokamax.interpret_mode()}")
  print("\nbackends:")
  for b in tokamax.backends():
    count = len(b.implementations)
    print(f"  {b.name:<16} {b.distribution or '?'} {b.version or ''}  [{b.status}] "
          f"{count} implementation{'s' * (count != 1)}")
  errors = tokamax.backend_errors()
  if errors:
    print("\nbackend errors:")
    for e in errors:
      print(f"  {e.backend} ({e.distribution}): {e.message}")
  print("\nimplementations (best first; usable here for a typical bf16 call?):")
  current = None
  for s in tokamax.implementations():
    if s.op != current:
      current = s.op
      print(f"  {s.op}")
    mark = "yes" if s.usable else "no "
    backward = "fwd+bwd" if s.has_backward else "fwd"
    reason = f"  - {s.reason}" if s.reason else ""
    print(f"    {s.name:<14} {mark} {backward:<8} priority {s.priority:<4} "
          f"{s.distribution}{reason}")


BENCH_HELP = """\
Per-op rows: every usable tokamax implementation against its peers (cuDNN through
jax.nn, XLA, jax.lax.ragged_dot, a dense matmul of the same FLOPs), forward and
forward+backward, with each row's relative L2 error against the reference peer.
Model rows (--model): one training step (value_and_grad of sum(out * dy) over
params and input) with tokamax defaults against the plain-JAX program (flax-dense:
the Flax NNX layer of examples/llama_nnx.py against plain Flax; run from the
repository's root).

Off a GPU the shapes are small unless --full. Times: CUPTI kernel time on NVIDIA
GPUs (CUDA events for programs with an XLA conditional), wall clock elsewhere;
--method loop: the wall time per call of calls issued back to back.

examples:
  python -m tokamax bench --model dense          # Llama-3-8B-sized decoder block
  python -m tokamax bench --model moe --size tokens=16384 --size experts=16
  python -m tokamax bench --model flax-dense     # the same layer in Flax NNX
  python -m tokamax bench --op all --model all --json run.json
  python -m tokamax bench --grid --op layer_norm  # None against each implementation, tuning grid
  python -m tokamax bench --op all --model all --compare benchmarks/baselines/nvidia_h200.json
"""


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tokamax",
                                   description="tokamax: kernels for JAX")
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("info", help="installed backends and what can run here")
  sub.add_parser("demo", help="a transformer block + MoE through tokamax")
  bench = sub.add_parser(
      "bench", help="the reference benchmark suite and model training steps "
                    "(GPU: CUPTI time)",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description=BENCH_HELP)
  bench.add_argument("--op", action="append",
                     help="only this op (repeatable; 'all' for every op, e.g. with --model)")
  bench.add_argument("--implementation", action="append",
                     help="only this implementation (repeatable; 'auto' for None)")
  bench.add_argument("--shape", action="append",
                     help="only problems whose name contains this (repeatable: any "
                          "of them; e.g. 'window', 'sinks', 'B4 T4096'; a trailing $ "
                          "ends the name: 'H128$' leaves out 'H128 causal')")
  bench.add_argument("--peer", action="append", metavar="NAME",
                     help="only the peers whose label contains NAME (repeatable; "
                          "'none' for none), e.g. --peer dense; a reference "
                          "peer left out leaves the error column to the next "
                          "reference that runs (e.g. 'tokamax xla'), if any")
  bench.add_argument("--model", action="append",
                     choices=["dense", "moe", "flax-dense", "all"],
                     help="time a training step of this model, tokamax vs plain JAX "
                          "(flax-dense: the decoder layer of examples/llama_nnx.py, "
                          "tokamax.flax vs plain Flax; 'all': dense and moe) "
                          "(repeatable; alone it skips the per-op suite)")
  bench.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                     help="a model size (repeatable): dense, flax-dense: dim heads "
                          "kv_heads head_dim ffn batch seq dtype; moe: tokens dim ffn "
                          "experts top_k dtype")
  shapes = bench.add_mutually_exclusive_group()
  shapes.add_argument("--quick", action="store_true", default=None,
                      help="small shapes (the default where the platform is not a GPU)")
  shapes.add_argument("--full", dest="quick", action="store_false",
                      help="the reference (GPU-sized) shapes, also off a GPU")
  shapes.add_argument("--grid", action="store_true",
                      help="the shapes tuned data is measured on (autotune --grid's: "
                           "more sizes than the reference shapes; per-op rows only, "
                           "not with --model)")
  bench.add_argument("--iterations", type=int, default=10)
  bench.add_argument("--method", choices=benchmarking.METHODS,
                     help="how to time (default: kernel time by CUPTI on NVIDIA GPUs, "
                          "CUDA events for programs with an XLA conditional, wall "
                          "clock elsewhere); 'loop': the wall time per call of "
                          f"{benchmarking.LOOP_CALLS} calls issued back to back, what "
                          "a training loop sees, gaps between kernels included")
  bench.add_argument("--out", help="folder for bench.json, bench.md and PNG plots "
                                   "(bench_grid.* with --grid; plots need matplotlib: "
                                   "tokamax-core[plot])")
  bench.add_argument("--json", dest="json_path", metavar="PATH",
                     help="write every row (time, rate, ratio, rel. error) and the "
                          "device, JAX and tokamax versions to PATH")
  bench.add_argument("--compare", metavar="BASELINE",
                     help="compare with a --json file (e.g. benchmarks/baselines/"
                          "<device>.json); exit 1 on a regression")
  bench.add_argument("--from-json", metavar="PATH",
                     help="take the rows from a --json file instead of running")
  bench.add_argument("--threshold", type=float, default=0.10,
                     help="--compare: a tokamax row slower than its baseline by more "
                          "than this fraction is a regression (default 0.10)")
  bench.add_argument("--error-growth", type=float, default=2.0,
                     help="--compare: a row whose relative error exceeds this factor of "
                          "its baseline's is a regression (default 2)")
  bench.add_argument("--sweep", action="store_true",
                     help="attention throughput against sequence length instead")
  tune = sub.add_parser("autotune", help="autotune the reference shapes; write tuned data")
  tune.add_argument("--op", action="append",
                    help="only this op (repeatable; 'all' for every op)")
  tune.add_argument("--shape", action="append",
                    help="only problems whose name contains this (repeatable: any of "
                         "them; a trailing $ ends the name: 'H128$' leaves out "
                         "'H128 causal')")
  tune.add_argument("--out", required=True,
                    help="folder to write <device_kind_slug>/<op>.json into (e.g. a "
                         "backend package's tuned-data folder)")
  tune.add_argument("--iterations", type=int, default=5)
  tune.add_argument("--timeout", type=float, default=None, help="seconds per problem")
  tune.add_argument("--grid", action="store_true",
                    help="the grid shapes instead (each implementation's heuristic "
                         "config only), written to <op>_grid.json: which "
                         "implementation wins where, for implementation=None")
  tune.add_argument("--skip", action="append", default=[], metavar="IMPLEMENTATION",
                    help="do not measure this implementation (repeatable)")
  tune.add_argument("--keep", action="append", default=[], metavar="DISTRIBUTION",
                    help="also write the measurements of this distribution's "
                         "implementations (repeatable; a plugin's, to ship in it): "
                         "by default only tokamax-core's and its backends' are")
  args = parser.parse_args(argv)
  try:
    return _run_command(parser, args)
  except bench_suite.NoMatchingShape as e:
    parser.error(f"--shape: {e}")
  except bench_suite.UnknownOp as e:
    parser.error(f"--op: {e}")
  except bench_suite.NoMatchingPeer as e:
    parser.error(f"--peer: {e}")


def _run_command(parser, args) -> int:
  if args.command == "info":
    info()
  elif args.command == "demo":
    demo.run()
  elif args.command == "autotune":
    _check_iterations(parser, args.iterations)
    try:  # "skip it if it is there": an absent one is not an error, but said
      bench_suite.check_implementation_names(args.skip)
    except bench_suite.UnknownImplementation as e:
      print(f"note: --skip: {e}", file=sys.stderr)
    try:
      bench_suite.check_distributions(tuple(args.keep))
    except ValueError as e:
      parser.error(f"--keep: {e}")
    return bench_suite.autotune_suite(args.op, args.shape, args.out, args.iterations,
                                      args.timeout, grid=args.grid, skip=tuple(args.skip),
                                      keep=tuple(args.keep))
  elif args.command == "bench":
    impls = None if not args.implementation else [
        None if i == "auto" else i for i in args.implementation]
    try:
      sizes = bench_models.parse_sizes(args.size)
    except ValueError as e:
      parser.error(str(e))
    if args.grid and (args.sweep or args.model):
      parser.error("--grid times per-op rows at the tuning grid's shapes: not with "
                   "--sweep (another set of shapes) or --model")
    _check_bench_args(parser, args, sizes)
    return bench_suite.main(args.op, args.out, args.iterations, impls, args.sweep,
                      models=args.model, quick=args.quick, sizes=sizes,
                      json_path=args.json_path, compare_path=args.compare,
                      from_json=args.from_json, threshold=args.threshold,
                      error_growth=args.error_growth, shapes=args.shape,
                      grid=args.grid, peers=args.peer, method=args.method)
  return 0


def _check_iterations(parser, iterations: int) -> None:
  if iterations < 1:
    parser.error(f"--iterations must be at least 1; got {iterations}")


def _check_implementation_names(parser, flag: str, names) -> None:
  try:
    bench_suite.check_implementation_names(names)
  except bench_suite.UnknownImplementation as e:
    parser.error(f"{flag}: {e}")


def _check_bench_args(parser, args, sizes: dict[str, str]) -> None:
  """Usage errors found before anything runs: a long GPU run must not end in
  one, nor print an empty table for a value that selects nothing."""
  _check_iterations(parser, args.iterations)
  if args.threshold < 0:
    parser.error(f"--threshold is a fraction >= 0; got {args.threshold}")
  if args.error_growth < 1:
    parser.error(f"--error-growth is a factor >= 1 of the baseline's error; got "
                 f"{args.error_growth}")
  if args.from_json:
    run_flags = [flag for flag, value in (
        ("--op", args.op), ("--shape", args.shape), ("--implementation", args.implementation),
        ("--peer", args.peer), ("--model", args.model), ("--size", args.size),
        ("--sweep", args.sweep), ("--grid", args.grid), ("--method", args.method),
        ("--quick" if args.quick else "--full", args.quick is not None)) if value]
    if run_flags:
      parser.error(f"--from-json takes rows already run: not with "
                   f"{', '.join(run_flags)}")
  for flag, path in (("--from-json", args.from_json), ("--compare", args.compare)):
    if path:
      try:
        bench_suite.load_rows(path)
      except bench_suite.BadRowsFile as e:
        parser.error(f"{flag}: {e}")
  if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
    parser.error(f"--out {args.out}: not a folder")
  if args.json_path and os.path.isdir(args.json_path):
    parser.error(f"--json {args.json_path}: a folder, not a file")
  if args.sweep and (args.op or args.model or args.quick is not None):
    parser.error("--sweep times attention against sequence length at its own "
                 "(GPU-sized) shapes: not with --op, --model, --quick or --full")
  if args.size and not args.model:
    parser.error("--size sets a model's size: it needs --model")
  per_op = [flag for flag, value in (("--shape", args.shape),
                                     ("--implementation", args.implementation),
                                     ("--peer", args.peer)) if value]
  if args.model and not args.op and per_op:
    parser.error(f"with --model alone no per-op rows run, so {', '.join(per_op)} "
                 "would select nothing (add --op)")
  for model in args.model or ():
    for name in bench_models.MODELS if model == "all" else (model,):
      try:
        bench_models.make_size(name, False, sizes)
      except ValueError as e:
        parser.error(str(e))
  _check_implementation_names(parser, "--implementation", args.implementation)


if __name__ == "__main__":
  sys.exit(main())
