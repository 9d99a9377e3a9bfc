"""Times every config in an implementation's search space at the reference shapes.

    python tools/tune.py --op layer_norm [--implementation triton] [--shape rms]
        [--grid] [--match num_warps=8 --match prefetch_qk=True]

``--match FIELD=VALUE`` keeps only configs whose field prints as VALUE (repeatable;
the heuristic config is always timed, for reference).

Forward configs are timed on the forward (with ``--training``: on forward+backward,
where the forward keeps the residuals a training step asks of it, e.g. the GLU's
projections); backward configs on forward+backward with the forward at its
heuristic config. CUPTI kernel time on GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from tokamax._src import bench_suite
from tokamax._src import benchmarking
from tokamax._src.problem import Problem
from tokamax._src.tuning import context as tuning_context
from tokamax._src import registry


class _Fixed:
  """A config source: a fixed config for one Op class, and it records the args."""

  def __init__(self, cls=None, config=None):
    self.cls, self.config, self.args = cls, config, {}

  def lookup(self, op, args):
    self.args.setdefault(type(op), args)
    return self.config if type(op) is self.cls else None


def _matches(config, match: dict[str, str]) -> bool:
  fields = dataclasses.asdict(config)
  return all(str(fields[key]) == value for key, value in match.items())


def _unknown_field(cls, match: dict[str, str]) -> str | None:
  """Why `match` cannot select configs of `cls` (a field it lacks), or None."""
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(match) - set(fields))
  if not unknown:
    return None
  return (f"{cls.__name__} has no field {unknown[0]!r} (--match); its fields: "
          f"{', '.join(fields)}")


def _field_value(text: str) -> tuple[str, str]:
  if "=" not in text:
    raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
  key, value = text.split("=", 1)
  return key, value


def tune(problem: Problem, implementation: str, iterations: int,
         directions=("forward", "forward+backward"), match=None,
         training: bool = False) -> None:
  entry = registry.find(problem.op, implementation)
  fwd_cls, bwd_cls = registry.forward_class(entry), registry.backward_class(entry)
  inputs = problem.make_inputs()
  capture = _Fixed()
  grad, grad_args = bench_suite.fwd_bwd(lambda a: problem.call(a, implementation), inputs)
  with tuning_context.use(capture):
    try:
      jax.block_until_ready(grad(*grad_args))
    except NotImplementedError:  # a forward-only implementation: tune the forward
      jax.block_until_ready(jax.jit(lambda a: problem.call(a, implementation))(inputs))
  print(f"## {problem.op} {problem.name} ({implementation})", flush=True)
  for cls, direction in ((fwd_cls, "forward"), (bwd_cls, "forward+backward")):
    if cls is None or cls not in capture.args or direction not in directions:
      continue
    why = _unknown_field(cls.config_cls, match or {})
    if why:
      print(f"  {direction:<17} skipped: {why}", flush=True)
      continue
    args = capture.args[cls]
    heuristic = cls().heuristic_config(args)
    configs = [c for c in cls().search_space(args) if _matches(c, match or {})]
    for config in dict.fromkeys([heuristic, *configs]):
      source = _Fixed(cls, config)
      try:
        with tuning_context.use(source):
          if direction == "forward" and not training:
            f, fargs = jax.jit(lambda a: problem.call(a, implementation)), (inputs,)
          else:
            f, fargs = bench_suite.fwd_bwd(lambda a: problem.call(a, implementation), inputs)
          ms, _ = benchmarking.kernel_time_ms(f, *fargs, iterations=iterations)
        mark = " (heuristic)" if config == heuristic else ""
        print(f"  {direction:<17} {ms:8.3f} ms  {dataclasses.asdict(config)}{mark}", flush=True)
      except Exception as e:  # a config that fails is reported, the sweep goes on
        print(f"  {direction:<17} failed: {type(e).__name__}: {str(e)[:150]}  {config}",
              flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--op", action="append", required=True)
  parser.add_argument("--implementation", default="triton")
  parser.add_argument("--shape", help="substring of the problem name")
  parser.add_argument("--iterations", type=int, default=5)
  parser.add_argument("--direction", choices=("forward", "forward+backward"),
                      help="tune only the forward or only the backward configs")
  parser.add_argument("--training", action="store_true",
                      help="time forward configs in forward+backward")
  parser.add_argument("--grid", action="store_true",
                      help="the grid shapes (autotune --grid's) instead of the "
                           "reference shapes")
  parser.add_argument("--match", action="append", default=[], metavar="FIELD=VALUE",
                      type=_field_value,
                      help="only configs whose FIELD prints as VALUE (repeatable)")
  args = parser.parse_args()
  match = dict(args.match)
  directions = (args.direction,) if args.direction else ("forward", "forward+backward")
  suite = bench_suite.grid_suite() if args.grid else bench_suite.reference_suite()
  for problem in suite:
    if problem.op in args.op and (not args.shape or args.shape in problem.name):
      tune(problem, args.implementation, args.iterations, directions, match,
           args.training)


if __name__ == "__main__":
  main()
