"""Where a model's training step spends its time: kernels, gaps, and the host.

For the tokamax and plain programs of `python -m tokamax bench --model M`, in
one process, interleaved (`benchmarking.time_interleaved`), three times per step:

- `kernels`: the sum of the step's kernel times (CUPTI; what the bench reports);
- `span`: device time from the step's first kernel to its last (CUDA events in
  the program): kernels plus the gaps between them;
- `loop`: the wall time per step of steps issued back to back (what a training
  loop sees): span plus what the host adds between steps.

Then the kernel count of each, and the kernels whose total time differs most
between the two programs (CUPTI per-kernel times of one step, by kernel name).
Run on an NVIDIA GPU from the repository's root:

    python tools/step_anatomy.py --model dense
"""

from __future__ import annotations

import argparse
import collections

import jax
from tokamax._src import bench_models
from tokamax._src import benchmarking

METHODS = {"kernels": "cupti", "span": "cuda_events", "loop": "loop"}


def _kernel_times(contender) -> dict[str, tuple[int, float]]:
  """Per kernel name: (launches, total ms) in one call (CUPTI)."""
  from jax.experimental.mosaic.gpu import profiler  # loads CUDA: NVIDIA GPUs only
  _, timings = profiler.measure(contender.run.compiled, aggregate=False)(
      *contender.flat_args)
  out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for name, ms in timings or []:
    out[name][0] += 1
    out[name][1] += ms
  return {name: (n, ms) for name, (n, ms) in out.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="dense", choices=bench_models.MODELS)
  parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--top", type=int, default=15, help="kernel names to list")
  opts = parser.parse_args()
  size = bench_models.make_size(opts.model, False, dict(kv.split("=", 1) for kv in opts.size))
  params, x, dy = bench_models.inputs(opts.model, size)
  print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}: {opts.model} "
        f"{size.describe()}")
  contenders = {program: benchmarking.prepare(
      bench_models.training_step(opts.model, size, program), params, x, dy)
      for program in ("plain", "tokamax")}
  print("| program | kernels ms | span ms | loop ms | gaps in span | host between steps |")
  print("|---|---|---|---|---|---|")
  medians = {}
  for what, method in METHODS.items():
    for program, data in benchmarking.time_interleaved(
        contenders, opts.iterations, method).items():
      if isinstance(data, Exception):
        raise SystemExit(f"{program}, {method}: {data}")
      medians[program, what] = data.median_evaluation_time_ms
  for program in contenders:
    kernels, span, loop = (medians[program, what] for what in METHODS)
    print(f"| {program} | {kernels:.3f} | {span:.3f} | {loop:.3f} | "
          f"{span - kernels:.3f} | {loop - span:.3f} |")
  print("\nratio plain / tokamax: " + ", ".join(
      f"{what} {medians['plain', what] / medians['tokamax', what]:.3f}" for what in METHODS))
  per_kernel = {program: _kernel_times(c) for program, c in contenders.items()}
  for program, times in per_kernel.items():
    print(f"{program}: {sum(n for n, _ in times.values())} kernel launches, "
          f"{len(times)} distinct kernels, {sum(ms for _, ms in times.values()):.3f} ms")
  names = set(per_kernel["plain"]) | set(per_kernel["tokamax"])
  def diff(name):
    return (per_kernel["tokamax"].get(name, (0, 0.0))[1]
            - per_kernel["plain"].get(name, (0, 0.0))[1])
  print(f"\nthe {opts.top} kernels whose time differs most (tokamax - plain):")
  print("| kernel | plain launches | plain ms | tokamax launches | tokamax ms |")
  print("|---|---|---|---|---|")
  for name in sorted(names, key=lambda n: -abs(diff(n)))[:opts.top]:
    p, t = (per_kernel[prog].get(name, (0, 0.0)) for prog in ("plain", "tokamax"))
    print(f"| {name[:70]} | {p[0]} | {p[1]:.3f} | {t[0]} | {t[1]:.3f} |")


if __name__ == "__main__":
  main()
