"""Per-kernel CUPTI times of one implementation at the reference shapes.

    python tools/kernel_breakdown.py --op dot_product_attention \\
        --implementation mosaic_gpu --shape "B4 T4096 N16 H128" [--direction forward]
        [--grid] [--set head_group=8]
    python tools/kernel_breakdown.py --model dense [--size seq=2048] [--launches]

``--grid``: the grid shapes (``autotune --grid``'s) instead; ``--sweep norms``
(or ``glu``): ``tools/shape_sweep.py``'s. ``--set FIELD=VALUE``
(repeatable): tokamax's implementations run their heuristic configs with these
fields replaced, as one side of ``tools/tune.py --ab`` (under Nsight Compute,
the kernel of a config that is not the default).

Prints, for each matching problem, every GPU kernel the forward (or forward+backward)
launches with its median time over the iterations, so that a slow step can be pinned
on one kernel (e.g. the attention backward's dK/dV kernel against its dQ kernel).
The peers of the problem (cuDNN, XLA) are broken down too with ``--peers``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys

import jax

from tokamax._src import bench_suite
from tokamax._src import bench_models
from tokamax._src.tuning import context as tuning_context

import none_check
import shape_sweep
import tune


def breakdown(f, args, iterations: int) -> list[tuple[str, float]]:
  """(kernel name, median ms) per launch, in launch order (`per_launch_medians`)."""
  from jax.experimental.mosaic.gpu import profiler  # CUPTI: GPU machines only
  compiled = jax.jit(f).lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm up
  runs = []
  for _ in range(iterations):
    _, kernels = profiler.measure(compiled, aggregate=False)(*args)
    runs.append(kernels)
  return per_launch_medians(runs)


def per_launch_medians(runs: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
  """(kernel name, median ms) of each launch over the runs, in first-run order.

  A launch is the n-th kernel of its name in a run, not the n-th kernel: XLA
  may run independent kernels on several streams, so CUPTI can record them in
  another order from run to run, and keying by position then counts one launch
  under two keys (a step's total grows by the reordered kernels). The runs that
  launched the kernels most runs launched are kept; a minority that launched
  others is dropped with a note (an H200 run of the MoE step recorded 67 kernels
  in its first run and 72 in the four after it). Without a majority it is an
  error, not a median over the runs that had each kernel.
  """
  counts = [frozenset(collections.Counter(name for name, _ in kernels).items())
            for kernels in runs]
  common, agreeing = collections.Counter(counts).most_common(1)[0]
  if 2 * agreeing <= len(runs):
    raise ValueError("the runs launched different kernels: "
                     f"{[sum(n for _, n in c) for c in counts]} launches")
  if agreeing < len(runs):
    print(f"  (dropped {len(runs) - agreeing} of {len(runs)} runs that launched other "
          f"kernels: {[sum(n for _, n in c) for c in counts]} launches)",
          file=sys.stderr, flush=True)
    runs = [kernels for kernels, c in zip(runs, counts) if c == common]
  times, order = collections.defaultdict(list), {}
  for kernels in runs:
    seen = collections.Counter()
    for position, (name, ms) in enumerate(kernels):
      launch = (name, seen[name])
      seen[name] += 1
      times[launch].append(ms)
      order.setdefault(launch, position)
  return [(name, statistics.median(times[(name, n)]))
          for name, n in sorted(times, key=order.get)]


def report(label: str, f, args, iterations: int, min_share: float = 0.0) -> None:
  """Every launch in launch order (those of at least `min_share` of the total)."""
  kernels = breakdown(f, args, iterations)
  total = sum(ms for _, ms in kernels)
  print(f"  {label}: {total:.3f} ms in {len(kernels)} kernels", flush=True)
  for name, ms in kernels:
    if ms >= min_share * total:
      print(f"    {ms:8.3f} ms  {100 * ms / total:5.1f}%  {name[:110]}", flush=True)


def report_by_name(label: str, f, args, iterations: int) -> None:
  """Kernels summed by name, the largest first (a training step launches hundreds)."""
  totals = collections.Counter()
  counts = collections.Counter()
  for name, ms in breakdown(f, args, iterations):
    totals[name] += ms
    counts[name] += 1
  total = sum(totals.values())
  print(f"  {label}: {total:.3f} ms in {sum(counts.values())} kernels", flush=True)
  for name, ms in totals.most_common():
    if ms >= 0.005 * total:
      print(f"    {ms:8.3f} ms  {100 * ms / total:5.1f}%  x{counts[name]:<3d} {name[:100]}",
            flush=True)


def model_breakdown(model: str, sizes: dict[str, str], iterations: int,
                    launches: bool = False) -> None:
  """The plain-JAX and the tokamax training step of `model`, kernel by kernel:
  summed by name, or (`launches`) each launch of 0.5% of the step or more in
  launch order (one kernel name can be several ops: Mosaic GPU's kernels all
  share one)."""
  size = bench_models.make_size(model, False, sizes)
  params, x, dy = bench_models.inputs(model, size)
  print(f"## model {model} {size.describe()}", flush=True)
  for program in ("plain", "tokamax"):
    step = bench_models.training_step(model, size, program)
    if launches:
      report(program, step, (params, x, dy), iterations, min_share=0.005)
    else:
      report_by_name(program, step, (params, x, dy), iterations)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", choices=("dense", "moe"))
  parser.add_argument("--size", action="append", default=[], help="KEY=VALUE")
  parser.add_argument("--op", action="append", default=[])
  parser.add_argument("--implementation", action="append", default=[])
  parser.add_argument("--shape", help="a regular expression searched in the problem "
                      "name (as tools/tune.py's)")
  parser.add_argument("--direction", choices=("forward", "forward+backward"),
                      default="forward+backward")
  parser.add_argument("--peers", action="store_true")
  parser.add_argument("--iterations", type=none_check.positive_int, default=5)
  parser.add_argument("--launches", action="store_true",
                      help="--model: each launch in order, not sums by kernel name")
  parser.add_argument("--grid", action="store_true",
                      help="the grid shapes instead of the reference shapes")
  parser.add_argument("--sweep", choices=("norms", "glu"),
                      help="tools/shape_sweep.py's shapes instead of the reference shapes")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      type=tune._field_value,
                      help="tokamax's heuristic configs with FIELD set to VALUE")
  args = parser.parse_args()
  if not args.model and not args.op:
    parser.error("nothing selected: give --model, or --op (with --shape, --grid or "
                 "--sweep)")
  if args.launches and not args.model:
    parser.error("--launches lists a model step's launches: it needs --model")
  tune.check_implementations(parser, args.implementation)
  if args.model:
    model_breakdown(args.model, tune.model_sizes(parser, args.model, args.size),
                    args.iterations, args.launches)
  fields = {key: tune._literal(value) for key, value in args.set}
  if args.sweep:
    suite = shape_sweep.problems(args.sweep)
  else:
    suite = bench_suite.grid_suite() if args.grid else bench_suite.reference_suite()
  for problem in tune.select_problems(parser, suite, args.op, args.shape):
    problem_breakdown(problem, args.implementation or ["auto"], args.direction,
                      args.peers, args.iterations, fields)


def problem_breakdown(problem, implementations, direction: str, peers: bool,
                      iterations: int, fields: dict) -> None:
  """`report` for each implementation (and the peers) of one problem; tokamax's
  with `fields` replaced in their heuristic configs where given."""
  print(f"## {problem.op} {problem.name} ({direction})"
        + "".join(f" {k}={v!r}" for k, v in fields.items()), flush=True)
  inputs = problem.make_inputs()
  calls = {f"tokamax {impl}": (lambda i: lambda a: problem.call(a, i))(
               None if impl == "auto" else impl)
           for impl in implementations}
  if peers:
    calls.update(problem.peers)
  for label, call in calls.items():
    # Only where fields are set: an empty `_Replaced` would put every heuristic
    # config in place of the tuned ones that would otherwise run.
    source = tune._Replaced(fields) if fields and label.startswith("tokamax") else None
    try:
      with tuning_context.use(source) if source else contextlib.nullcontext():
        if direction == "forward":
          report(label, call, (inputs,), iterations)
        else:
          f, fargs = bench_suite.fwd_bwd(call, inputs)
          report(label, f, fargs, iterations)
    except Exception as e:  # a kernel that fails is reported, the others still run
      print(f"  {label}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    if source is not None and not source.applied:
      print(f"  {label}: no config of it has {sorted(fields)}: its own ran", flush=True)


if __name__ == "__main__":
  main()
