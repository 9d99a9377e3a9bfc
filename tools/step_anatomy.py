"""Where a model's training step spends its time: kernels, gaps, and the host.

For the tokamax and plain programs of `python -m tokamax bench --model M`, in
one process, interleaved (`benchmarking.time_interleaved`), three times per step:

- `kernels`: the sum of the step's kernel times (CUPTI; what the bench reports);
- `span`: device time from the step's first kernel to its last (CUDA events in
  the program): kernels plus the gaps between them;
- `loop`: the wall time per step of steps issued back to back (what a training
  loop sees): span plus what the host adds between steps, and plus what the
  chip loses when it runs steps without a pause (its power cap lowers its
  clock; the two CUDA-based times above are of one step after a pause).

Then, to tell those apart: how long the host spends issuing each step of such
a loop (a step whose call waits on the device shows here), the loop keeping
every output alive, and the kernel time per step when steps run back to back
(the power cap shows here). Last, unless `--host-only`, the kernel count of
each program and the kernels whose time differs most between the two (CUPTI
per-kernel times of one step, median over rounds that alternate the programs;
`tools/kernel_breakdown.py --model M` lists every launch, one program after
the other).
Run on an NVIDIA GPU from the repository's root:

    python tools/step_anatomy.py --model dense
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import numpy as np
from tokamax._src import bench_models
from tokamax._src import benchmarking

import kernel_breakdown
import none_check
import tune

METHODS = {"kernels": "cupti", "span": "cuda_events", "loop": "loop"}


def _kernel_times(contenders, rounds=5) -> dict[str, dict[str, tuple[int, float]]]:
  """Per program, per kernel name: (launches, total ms) in one call (CUPTI):
  `kernel_breakdown.per_launch_medians` over `rounds` rounds that alternate the
  programs (a chip that warms over the run slows whichever program would be
  measured last), summed by name."""
  from jax.experimental.mosaic.gpu import profiler  # loads CUDA: NVIDIA GPUs only
  runs = {program: [] for program in contenders}
  for round_ in range(rounds):
    for program in benchmarking.round_order(contenders, round_):
      c = contenders[program]
      runs[program].append(profiler.measure(c.run.compiled, aggregate=False)(
          *c.flat_args)[1] or [])
  totals = {}
  for program, program_runs in runs.items():
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ms in kernel_breakdown.per_launch_medians(program_runs):
      per_name[name][0] += 1
      per_name[name][1] += ms
    totals[program] = {name: (n, ms) for name, (n, ms) in per_name.items()}
  return totals


def _sustained_kernel_ms(contenders, rounds=3):
  """Per program, its kernel time per step (CUPTI) over `LOOP_CALLS` steps
  issued back to back: first step, median, last step (each the median over
  `rounds` loops, the programs alternating). A chip that slows under
  sustained load (power cap) shows here as kernel time."""
  from jax.experimental.mosaic.gpu import profiler  # loads CUDA: NVIDIA GPUs only
  loops = {program: [] for program in contenders}
  for round_ in range(rounds):
    for program in benchmarking.round_order(contenders, round_):
      c = contenders[program]
      loops[program].append(profiler.measure(
          c.run.compiled, iterations=benchmarking.LOOP_CALLS)(*c.flat_args)[1])
  return {program: tuple(float(np.median([f(times) for times in runs]))
                         for f in (lambda t: t[0], np.median, lambda t: t[-1]))
          for program, runs in loops.items()}


_VARIANTS = ("last output kept", "all outputs kept")


def _loop_once(contender, variant, issue):
  """Wall ms per step of one loop; appends each call's host time to `issue`."""
  compiled, args = contender.run.compiled, contender.flat_args
  jax.block_until_ready(compiled(*args))
  outs, start = [], time.perf_counter()
  for _ in range(benchmarking.LOOP_CALLS):
    call_start = time.perf_counter()
    out = compiled(*args)
    issue.append(time.perf_counter() - call_start)
    outs = outs + [out] if variant == "all outputs kept" else [out]
  jax.block_until_ready(outs)
  return (time.perf_counter() - start) * 1e3 / benchmarking.LOOP_CALLS


def _host_share(contenders, rounds=6):
  """Per program, over loops of `LOOP_CALLS` steps issued back to back: the
  median and the longest ms the host spent in a call (issuing the step; a call
  that waits on the device reads as long as a step), and the wall ms per step
  keeping only the last step's output (as `benchmarking`'s loop) and keeping
  every output alive. Programs and variants alternate their order by round."""
  issue = {program: [] for program in contenders}
  per_step = {(program, variant): [] for program in contenders for variant in _VARIANTS}
  for round_ in range(rounds):
    for program, variant in benchmarking.round_order(per_step, round_):
      per_step[program, variant].append(
          _loop_once(contenders[program], variant, issue[program]))
  return {program: (1e3 * float(np.median(issue[program])),
                    1e3 * float(np.max(issue[program])),
                    {variant: float(np.median(per_step[program, variant]))
                     for variant in _VARIANTS})
          for program in contenders}


def _device_times(contenders, iterations):
  """The kernels / span / loop table."""
  print("| program | kernels ms | span ms | loop ms | span - kernels | loop - span |")
  print("|---|---|---|---|---|---|")
  medians = {}
  for what, method in METHODS.items():
    for program, data in benchmarking.time_interleaved(
        contenders, iterations, method).items():
      if isinstance(data, Exception):
        raise SystemExit(f"{program}, {method}: {data}")
      medians[program, what] = data.median_evaluation_time_ms
  for program in contenders:
    kernels, span, loop = (medians[program, what] for what in METHODS)
    print(f"| {program} | {kernels:.3f} | {span:.3f} | {loop:.3f} | "
          f"{span - kernels:.3f} | {loop - span:.3f} |")
  print("\nratio plain / tokamax: " + ", ".join(
      f"{what} {medians['plain', what] / medians['tokamax', what]:.3f}" for what in METHODS))


def _kernel_table(contenders, top):
  """Kernel counts, and the kernels whose time differs most between the two."""
  per_kernel = _kernel_times(contenders)
  for program, times in per_kernel.items():
    print(f"{program}: {sum(n for n, _ in times.values())} kernel launches, "
          f"{len(times)} distinct kernels, {sum(ms for _, ms in times.values()):.3f} ms")
  names = set(per_kernel["plain"]) | set(per_kernel["tokamax"])
  def diff(name):
    return (per_kernel["tokamax"].get(name, (0, 0.0))[1]
            - per_kernel["plain"].get(name, (0, 0.0))[1])
  print(f"\nthe {top} kernels whose time differs most (tokamax - plain):")
  print("| kernel | plain launches | plain ms | tokamax launches | tokamax ms |")
  print("|---|---|---|---|---|")
  for name in sorted(names, key=lambda n: -abs(diff(n)))[:top]:
    p, t = (per_kernel[prog].get(name, (0, 0.0)) for prog in ("plain", "tokamax"))
    print(f"| {name[:70]} | {p[0]} | {p[1]:.3f} | {t[0]} | {t[1]:.3f} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="dense", choices=bench_models.MODELS)
  parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--iterations", type=none_check.positive_int, default=10)
  parser.add_argument("--top", type=int, default=15, help="kernel names to list")
  parser.add_argument("--host-only", action="store_true",
                      help="leave out the kernels / span / loop table and the "
                      "per-kernel table (the back-to-back kernel time still uses CUPTI)")
  opts = parser.parse_args()
  size = bench_models.make_size(opts.model, False,
                                tune.model_sizes(parser, opts.model, opts.size))
  params, x, dy = bench_models.inputs(opts.model, size)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: {opts.model} "
        f"{size.describe()}")
  contenders = {program: benchmarking.prepare(
      bench_models.training_step(opts.model, size, program), params, x, dy)
      for program in ("plain", "tokamax")}
  if not opts.host_only:
    _device_times(contenders, opts.iterations)
  print("\n| program | host ms per call, median | max | loop ms, last output kept | "
        "loop ms, all outputs kept |\n|---|---|---|---|---|")
  for program, (median, longest, loops) in _host_share(contenders).items():
    print(f"| {program} | {median:.3f} | {longest:.3f} | " + " | ".join(
        f"{ms:.3f}" for ms in loops.values()) + " |")
  print(f"\n| program | kernel ms per step, {benchmarking.LOOP_CALLS} steps back to back: "
        "first | median | last |\n|---|---|---|---|")
  for program, times in _sustained_kernel_ms(contenders).items():
    print(f"| {program} | " + " | ".join(f"{ms:.3f}" for ms in times) + " |")
  if not opts.host_only:
    _kernel_table(contenders, opts.top)


if __name__ == "__main__":
  main()
