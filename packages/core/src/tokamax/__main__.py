"""Command line: ``python -m tokamax {info,demo}``."""

from __future__ import annotations

import argparse
import sys


def info() -> None:
  """JAX and devices, installed backends, and the op x implementation matrix."""
  import jax  # pylint: disable=g-import-not-at-top

  import tokamax  # pylint: disable=g-import-not-at-top
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m tokamax",
                                   description="tokamax: kernels for JAX")
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("info", help="installed backends and what can run here")
  sub.add_parser("demo", help="a transformer block + MoE through tokamax")
  bench = sub.add_parser("bench", help="the reference benchmark suite (GPU: CUPTI time)")
  bench.add_argument("--op", action="append", help="only this op (repeatable)")
  bench.add_argument("--implementation", action="append",
                     help="only this implementation (repeatable; 'auto' for None)")
  bench.add_argument("--iterations", type=int, default=10)
  bench.add_argument("--out", help="folder for bench.json, bench.md and PNG plots")
  bench.add_argument("--sweep", action="store_true",
                     help="attention throughput against sequence length instead")
  tune = sub.add_parser("autotune", help="autotune the reference shapes; write tuned data")
  tune.add_argument("--op", action="append", help="only this op (repeatable)")
  tune.add_argument("--shape", help="only problems whose name contains this")
  tune.add_argument("--out", required=True,
                    help="folder to write <device_kind_slug>/<op>.json into (e.g. a "
                         "backend package's tuned-data folder)")
  tune.add_argument("--iterations", type=int, default=5)
  tune.add_argument("--timeout", type=float, default=None, help="seconds per problem")
  args = parser.parse_args(argv)
  if args.command == "info":
    info()
  elif args.command == "demo":
    from tokamax._src import demo  # pylint: disable=g-import-not-at-top
    demo.run()
  elif args.command == "autotune":
    from tokamax._src import bench  # pylint: disable=g-import-not-at-top
    bench.autotune_suite(args.op, args.shape, args.out, args.iterations, args.timeout)
  elif args.command == "bench":
    from tokamax._src import bench  # pylint: disable=g-import-not-at-top
    impls = None if not args.implementation else [
        None if i == "auto" else i for i in args.implementation]
    bench.main(args.op, args.out, args.iterations, impls, args.sweep)
  return 0


if __name__ == "__main__":
  sys.exit(main())
