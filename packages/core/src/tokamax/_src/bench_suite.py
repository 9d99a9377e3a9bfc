"""`python -m tokamax bench`: the reference benchmark suite (shared/BENCHMARKS.md).

Each row times one op at one shape, forward or forward+backward, for every usable
tokamax implementation and the peers a user could call instead (cuDNN through
`jax.nn`, plain XLA, a dense matmul of the same FLOPs), all in the same run. By
default kernel time comes from CUPTI on NVIDIA GPUs
(`jax.experimental.mosaic.gpu.profiler`; CUDA events for programs with an XLA
conditional), wall clock elsewhere; `method` (`--method`) picks another
(`benchmarking.METHODS`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax._src import autotuning
from tokamax._src import benchmarking
from tokamax._src import introspection
from tokamax._src import bench_models
from tokamax._src import gpu_state
from tokamax._src.ops import catalog
from tokamax._src.ops.attention import problems as attention_problems
from tokamax._src import registry
from tokamax._src.dispatch.candidates import runs_on
from tokamax._src.op import DeviceInfo
from tokamax._src.problem import Problem, rand
from tokamax._src.tuning import shipped

BF16 = jnp.bfloat16


def format_rate(rate: float) -> str:
  """At least three significant figures: 678, 4.27, 0.0123 (no exponent)."""
  if rate != rate or rate in (float("inf"), float("-inf")):
    return str(rate)
  if rate == 0 or abs(rate) >= 100:
    return f"{rate:.0f}"
  digits = 2 - int(np.floor(np.log10(abs(rate))))
  return f"{rate:.{digits}f}"


def reference_suite() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md, every op's."""
  return [p for problems in catalog.PROBLEMS.values() for p in problems.reference_problems()]


def grid_suite() -> list[Problem]:
  """The shapes tuned data is measured on, every op's (`autotune --grid`)."""
  return [p for problems in catalog.PROBLEMS.values() for p in problems.grid_problems()]


def quick_suite() -> list[Problem]:
  """Small shapes of the same kinds, for CPUs (seconds each) and `--quick`."""
  return [p for problems in catalog.PROBLEMS.values() for p in problems.quick_problems()]


def use_quick_shapes(quick: bool | None = None) -> bool:
  """`quick` if given, else small shapes everywhere but on GPUs."""
  return jax.default_backend() != "gpu" if quick is None else quick


def fwd_bwd(fn: Callable, inputs: tuple) -> tuple[Callable, tuple]:
  """A training step's share of `fn`: the output and the float inputs' cotangents
  for a random cotangent ``dy`` of the output's dtype.

  The output is returned so that the forward runs even for a linear op
  (ragged_dot), whose gradient alone does not need it; ``dy`` keeps the output
  dtype so that the backward matmuls run in it, as in training.
  """
  float_idx = _float_indices(inputs)
  out_shape = jax.eval_shape(fn, inputs)
  dy = rand(jax.random.key(7), out_shape.shape, out_shape.dtype)

  def step(floats, dy):
    full = list(inputs)
    for i, x in zip(float_idx, floats):
      full[i] = x
    return float_vjp(fn, tuple(full), dy)
  return jax.jit(step), ([inputs[i] for i in float_idx], dy)


def _float_indices(inputs: tuple) -> list[int]:
  return [i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating)]


def float_vjp(fn: Callable, inputs: tuple, dy) -> tuple:
  """``fn(inputs)`` and the cotangents of `inputs`' float entries (a list, in
  their order) for the output cotangent `dy`."""
  float_idx = _float_indices(inputs)

  def with_floats(floats):
    full = list(inputs)
    for i, x in zip(float_idx, floats):
      full[i] = x
    return fn(tuple(full))
  out, vjp = jax.vjp(with_floats, [inputs[i] for i in float_idx])
  return out, vjp(dy)


def _pair_tolerance(dtype: str) -> float:
  return bench_models.pair_tolerance(dtype)


AUTO_LABEL = "tokamax auto"  # the rows of implementation=None


def select_peers(problem: Problem, names: list[str] | None) -> Problem:
  """`problem` with only the peers whose label contains one of `names` (case
  apart; ``[]`` or ``["none"]``: no peers); None keeps them all. A reference
  that is a peer left out is dropped from `problem.reference`, which names the
  rows' error yardsticks in order: the next one (e.g. ragged_dot's ``tokamax
  xla``) serves where it runs, else the rows have no error.

  The peers can cost more than everything else at GPU sizes (at M65536,
  `lax.ragged_dot` runs 100 times the kernels' time and its backward fails to
  allocate 64 GiB), where a run only asks `None` against the implementations
  (`--grid`)."""
  if names is None:
    return problem
  peers = {label: fn for label, fn in problem.peers.items()
           if any(_peer_named(n, label) for n in names)}
  return dataclasses.replace(problem, peers=peers, reference=tuple(
      r for r in problem.reference if r in peers or r not in problem.peers))


def _peer_named(name: str, label: str) -> bool:
  """Whether ``--peer`` value `name` selects the peer `label` (a part of it,
  case apart; "none" selects none)."""
  return name.lower() != "none" and name.lower() in label.lower()


def implementations_taking(problem: Problem) -> list[str]:
  """The implementations a bench runs at `problem` by default: those usable at
  their op's typical call (`tokamax.implementations`), and those of this
  platform that refused only that call but take this one (asked by tracing it,
  without running it: e.g. an RMS-only norm, refused at a LayerNorm call)."""
  device = DeviceInfo.of()
  names = []
  for status in introspection.implementations(problem.op):
    if status.usable:
      names.append(status.name)
    elif (runs_on(status.platforms, device)
          and not status.reason.startswith("failed to load")
          and _traces(problem, status.name)):
      names.append(status.name)
  return names


def _traces(problem: Problem, implementation: str) -> bool:
  """Whether `implementation` takes `problem`'s call (traced on abstract inputs)."""
  try:
    shapes = jax.eval_shape(problem.make_inputs)
    jax.eval_shape(lambda a: problem.call(a, implementation), shapes)
  except Exception:  # noqa: BLE001 (a refusal, or any failure: not run by default)
    return False
  return True


def run_problem(problem: Problem, implementations: list[str | None],
                directions=("forward", "forward+backward"), iterations: int = 10,
                method: str | None = None) -> list[dict]:
  """One row per candidate and direction: time, rate, ratio to the first peer
  (``vs_peer``) and relative L2 error against the reference candidate
  (``rel_err``, with ``tol``; outputs and gradients, the worst leaf). `method`:
  how to time (`benchmarking.METHODS`; None: the device's default)."""
  rows = []
  candidates = [(f"tokamax {i}" if i else AUTO_LABEL, lambda a, i=i: problem.call(a, i))
                for i in implementations]
  candidates += list(problem.peers.items())
  labels = [label for label, _ in candidates]
  directions = [d for d in directions if d in problem.directions]
  try:
    inputs = problem.make_inputs()
  except Exception as e:  # pylint: disable=broad-exception-caught
    # E.g. out of device memory on a smaller card (the H100's 80 GB at
    # ragged_dot's G256 fp8 problem): the problem's cells fail, the run goes on.
    error = f"{type(e).__name__} making the inputs: {str(e)[:200]}"
    return [dict(op=problem.op, shape=problem.name, direction=d, implementation=label,
                 error=error) for d in directions for label in labels]
  # The reference runs first so that each candidate's output can be compared and freed.
  order = sorted(range(len(candidates)), key=lambda j: (
      problem.reference.index(labels[j]) if labels[j] in problem.reference
      else len(problem.reference)))
  tol = _pair_tolerance(problem.dtype)
  work = problem.flops or problem.bytes
  for direction in directions:
    by_label, contenders, reference = {}, {}, None
    base = dict(op=problem.op, shape=problem.name, direction=direction)
    for j in order:  # compile each, run it once, compare its output
      label, fn = candidates[j]
      row = dict(base, implementation=label)
      try:
        f, args = (jax.jit(fn), (inputs,)) if direction == "forward" else fwd_bwd(fn, inputs)
        with tokamax.record_dispatch() as records:
          contenders[label] = benchmarking.prepare(f, *args)
        if label == AUTO_LABEL:
          # What `None` chose, forward and backward: the first thing to read
          # where it trails a named implementation.
          row["dispatch"] = bench_models.dispatch_summary(records).get(problem.op, {})
        out = contenders[label].output
        contenders[label].output = None  # freed once compared
        against = reference
        if against is None and label in problem.reference:
          against = (label, out)
        if against is not None and (label in problem.reference or
                                    label.startswith("tokamax")):
          # Runs are asynchronous: a failure of this one (e.g. out of device
          # memory) surfaces here, and makes a failed cell like any other.
          errors = bench_models.relative_errors(out, against[1])
          row.update(rel_err=max(errors.values(), default=0.0), tol=tol,
                     reference=against[0])
        reference = against
        del out
      except Exception as e:
        contenders.pop(label, None)
        by_label[label] = dict(base, implementation=label,
                               error=f"{type(e).__name__}: {str(e)[:200]}")
        continue
      by_label[label] = row
      if label in problem.untimed:
        del contenders[label]
        row["note"] = "not timed"
    times = {}
    timed = benchmarking.time_interleaved(contenders, iterations, method)
    for label, data in timed.items():
      row = by_label[label]
      if isinstance(data, Exception):
        by_label[label] = dict(base, implementation=label,
                               error=f"{type(data).__name__}: {str(data)[:200]}")
        continue
      ms = times[label] = data.median_evaluation_time_ms
      scaled = work * (problem.backward_factor if direction != "forward" else 1)
      row.update(ms=ms, method=data.method, rate=scaled / (ms * 1e-3) / 1e12,
                 unit="TFLOP/s" if problem.flops else "TB/s")
    del contenders, timed
    reference = None
    peer = next((times[p] for p in problem.peers if p in times), None)
    for label in labels:
      row = by_label[label]
      if "ms" in row and peer is not None:
        row["vs_peer"] = peer / row["ms"]
      rows.append(row)
  return rows


HEADER = ["| op | shape | direction | implementation | ms | rate | x first peer | rel. error |",
          "|---|---|---|---|---|---|---|---|"]


def markdown_table(rows: list[dict], header: bool = True) -> str:
  """Rows as markdown; ``header=False`` for rows appended to a table already printed."""
  lines = list(HEADER) if header else []
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['op']} | {r['shape']} | {r['direction']} | {r['implementation']} "
                   f"| failed: {r['error'][:80]} | | | |")
      continue
    err = f"{r['rel_err']:.2g}" if "rel_err" in r else ""
    if r.get("reference") == r["implementation"]:
      err = "reference"
    if "rel_err" in r and r["rel_err"] > r.get("tol", float("inf")):
      err += " (> tol)"
    ratio = f"{r['vs_peer']:.2f}" if "vs_peer" in r else ""
    if "ms" not in r:  # run for the numbers only
      lines.append(f"| {r['op']} | {r['shape']} | {r['direction']} | "
                   f"{r['implementation']} | {r.get('note', '')} | | | {err} |")
      continue
    lines.append(f"| {r['op']} | {r['shape']} | {r['direction']} | {r['implementation']} | "
                 f"{r['ms']:.3f} | {format_rate(r['rate'])} {r['unit']} | {ratio} | {err} |")
  return "\n".join(lines)


def sequence_sweep(lengths=(1024, 2048, 4096, 8192, 16384), tokens=32768) -> list[Problem]:
  """Attention at a fixed token count (B * T) across sequence lengths (causal, H128)."""
  return [attention_problems.problem(max(1, tokens // t), t, 16, 16, 128, True)
          for t in lengths]


def plot(rows: list[dict], out: str) -> list[str]:
  """PNG plots of `rows`: throughput per implementation for each problem, and
  attention throughput against sequence length. Needs matplotlib."""
  try:
    import matplotlib  # optional: plots only where it is installed
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(PLOT_MISSING, file=sys.stderr)
    return []
  os.makedirs(out, exist_ok=True)
  ok = [r for r in rows if "rate" in r]
  written = []
  problems = sorted({(r["op"], r["shape"]) for r in ok})
  fig, axes = plt.subplots(len(problems), 2, figsize=(12, 2.2 * len(problems)), squeeze=False)
  for i, (op, shape) in enumerate(problems):
    directions = [d for d in ("forward", "forward+backward", "training step")
                  if any((r["op"], r["shape"], r["direction"]) == (op, shape, d) for r in ok)]
    for j in range(2):
      axes[i][j].set_visible(j < len(directions))
    for j, direction in enumerate(directions[:2]):
      sel = [r for r in ok if (r["op"], r["shape"], r["direction"]) == (op, shape, direction)]
      ax = axes[i][j]
      ax.barh([r["implementation"] for r in sel], [r["rate"] for r in sel])
      ax.set_title(f"{shape} {direction}", fontsize=8)
      ax.tick_params(labelsize=7)
      if sel:
        ax.set_xlabel(sel[0]["unit"], fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, "throughput.png")
  fig.savefig(path, dpi=110)
  written.append(path)
  sweep = [r for r in ok if r.get("sweep")]
  if sweep:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for j, direction in enumerate(("forward", "forward+backward")):
      ax = axes[0][j]
      for impl in sorted({r["implementation"] for r in sweep}):
        pts = sorted((r["seq"], r["rate"]) for r in sweep
                     if r["implementation"] == impl and r["direction"] == direction)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("sequence length (B * T = 32768, N16 H128, causal)")
      ax.set_ylabel("TFLOP/s")
      ax.set_title(f"attention {direction}")
      ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "attention_vs_seq.png")
    fig.savefig(path, dpi=110)
    written.append(path)
  return written


PLOT_MISSING = ("plots NOT written: matplotlib is not installed "
                "(pip install 'tokamax-core[plot]', or pip install matplotlib)")

# A row slower than its baseline by more than this fraction fails `--compare`.
# Run-to-run noise seen on the H200: about 8% on one GLU forward row over three
# runs (docs/benchmarks.md), under 2% elsewhere.
DEFAULT_THRESHOLD = 0.10
# A row whose relative error grows past this factor of its baseline's (floored at
# a tenth of its tolerance) fails `--compare`, even within tolerance.
DEFAULT_ERROR_GROWTH = 2.0


def row_key(row: dict) -> tuple[str, str, str, str]:
  return (row["op"], row["shape"], row["direction"], row["implementation"])


# "implementations": only where the run was limited to some (`--implementation`).
_ENVIRONMENT = ("device_kind", "platform", "jax", "tokamax", "date", "implementations")


def results_document(rows: list[dict], source: dict | None = None,
                     implementations: list[str | None] | None = None) -> dict:
  """What `--json` writes: the run's environment and every row; with `source`
  (the document the rows were loaded from, `--from-json`), that run's
  environment instead, as far as it names one. `implementations`: those the
  run was limited to (None: every usable one), as `--compare` needs to know."""
  device = jax.devices()[0]
  env = dict(device_kind=device.device_kind, platform=device.platform,
             jax=jax.__version__, tokamax=tokamax.__version__,
             date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  if implementations is not None:  # as --implementation takes them
    env["implementations"] = ["auto" if i is None else i for i in implementations]
  if source is not None:
    env = {key: source[key] for key in _ENVIRONMENT if key in source}
  return dict(env, rows=rows)


def write_json(path: str, rows: list[dict], source: dict | None = None,
               implementations: list[str | None] | None = None) -> None:
  """Writes `rows` as a `--json` document (creating the folder); `source` and
  `implementations`: as `results_document`'s."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results_document(rows, source, implementations), f, indent=1)


class BadRowsFile(ValueError):
  """A `--from-json` or `--compare` file that holds no benchmark rows."""


def load_rows(path: str) -> tuple[dict, list[dict]]:
  """(document, rows) of a `--json` file (or a bare list of rows, as `--out`
  writes); `BadRowsFile` saying why where it cannot be read as one."""
  try:
    with open(path) as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:
    raise BadRowsFile(f"{path}: {e}") from e
  doc, rows = ({}, doc) if isinstance(doc, list) else (doc, doc.get("rows") if isinstance(
      doc, dict) else None)
  keys = ("op", "shape", "direction", "implementation")
  if (not isinstance(rows, list) or not rows
      or not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows)):
    raise BadRowsFile(f"{path} holds no benchmark rows (a --json file: an object "
                      f"whose 'rows' are objects with {', '.join(keys)})")
  return doc, rows


_DEVICE_TIME_METHODS = {"cupti", "cuda_events"}


def compare(rows: list[dict], baseline: list[dict], threshold: float = DEFAULT_THRESHOLD,
            error_growth: float = DEFAULT_ERROR_GROWTH,
            same_device: bool = True, every_implementation: bool = True
            ) -> tuple[list[str], list[str]]:
  """Each baseline row against this run's row of the same key.

  Returns ``(report lines, failures)``. Failures: a tokamax row (implementation
  "tokamax ...") slower than its baseline by more than `threshold` (a fraction),
  or failing where it ran before; any row whose relative error exceeds its
  tolerance, or grew past `error_growth` x its baseline's (the baseline floored at
  tol / 10), or is NaN; with `every_implementation` (neither run was limited to
  some implementations, both ran on one known device kind), a tokamax row that
  ran in the baseline missing from a case the run measured (a backend that no
  longer imports, registers or takes the call). Peer rows (cuDNN, XLA, plain
  JAX) only report their change: they show the machine's noise, not a tokamax
  regression. Other rows of the baseline this run did not measure (e.g. other
  --op) are listed as not measured. Rows
  timed by another method than their baseline's (``method``), unless both are
  device time ("cupti", "cuda_events"), are compared for their numerics only, as
  are all rows where the baseline ran on another device (not `same_device`). A
  run that shares no row with the baseline compared nothing: a failure.
  """
  current = {row_key(r): r for r in rows}
  cases_run = {key[:3] for key in current}  # (op, shape, direction)
  report, failures = [], []
  known = {row_key(b) for b in baseline}
  for r in rows:
    if row_key(r) not in known:
      report.append(f"new (not in the baseline): {' / '.join(row_key(r))}")
  if not known & set(current):
    failures.append(f"nothing compared: none of this run's {len(current)} rows is in "
                    f"the baseline's {len(known)} (another --op, --shape, --quick or "
                    "device?)")
  for base in baseline:
    key = row_key(base)
    name = " / ".join(key)
    ours = key[3].startswith("tokamax")
    cur = current.get(key)
    if cur is None:
      if ours and every_implementation and "ms" in base and key[:3] in cases_run:
        line = (f"MISSING now (the case ran without it: its backend not installed, "
                f"not registered or refusing the call?): {name}")
        failures.append(line)
      else:
        line = f"not measured: {name}"
      report.append(line)
      continue
    if "ms" not in cur and "error" not in cur:
      continue  # run for the numbers only (`Problem.untimed`)
    if "ms" not in cur:
      line = f"FAILED now ({cur.get('error', '?')[:100]}): {name}"
      report.append(line)
      if "ms" in base and ours:
        failures.append(line)
      continue
    if "ms" not in base:
      report.append(f"runs now (failed in the baseline): {name}: {cur['ms']:.3f} ms")
      continue
    change = cur["ms"] / base["ms"] - 1
    line = (f"{name}: {cur['ms']:.3f} ms vs {base['ms']:.3f} ms ({change:+.1%})")
    methods = cur.get("method"), base.get("method")
    # Device time (kernels; CUDA events where a conditional hides kernels from
    # CUPTI) and wall time differ by the host's share and, back to back, by the
    # clock a power-capped chip falls to; "wallclock" waits after each call,
    # "loop" only after the last. Only like with like is compared for speed.
    comparable = same_device and (None in methods or methods[0] == methods[1]
                                  or set(methods) <= _DEVICE_TIME_METHODS)
    if not same_device:
      line += ": another device, speed not compared"
    elif not comparable:
      line = (f"{name}: {cur['ms']:.3f} ms by {methods[0]}, the baseline {base['ms']:.3f} "
              f"ms by {methods[1]}: speed not compared")
    slow = comparable and change > threshold
    if slow and ours:
      line = "SLOWER: " + line + f" > {threshold:.0%}"
      failures.append(line)
    elif slow:
      line += " (peer; not a failure)"
    err, tol = cur.get("rel_err"), cur.get("tol", base.get("tol"))
    if err is not None:
      base_err = base.get("rel_err")
      line += f"; rel. error {err:.3g}" + (f" (baseline {base_err:.3g})" if base_err is not None
                                           else "")
      problem = None
      if err != err:
        problem = "NaN error"
      elif tol is not None and err > tol:
        problem = f"error {err:.3g} > tolerance {tol:g}"
      elif base_err is not None and tol is not None and err > error_growth * max(
          base_err, tol / 10):
        problem = f"error grew {err / max(base_err, 1e-30):.1f}x (limit {error_growth:g}x)"
      if problem:
        line = f"NUMERICS ({problem}): " + line
        failures.append(line)
    report.append(line)
  return report, failures


def _print_compare(rows, baseline_path, threshold, error_growth, here: str | None,
                   every_implementation: bool = True) -> int:
  """`compare` printed; `here`: the device kind the rows ran on (None: unknown,
  taken as the baseline's for speed); `every_implementation`: whether this run
  took every implementation (`compare`'s, with the baseline's document)."""
  doc, baseline = load_rows(baseline_path)
  print(f"\ncompared with {baseline_path} ({doc.get('device_kind', '?')}, JAX "
        f"{doc.get('jax', '?')}, {doc.get('date', '?')}); speed threshold "
        f"{threshold:.0%}, error growth limit {error_growth:g}x")
  same_device = None in (doc.get("device_kind"), here) or doc["device_kind"] == here
  if not same_device:
    print(f"the baseline is from {doc['device_kind']}, these rows from {here}: "
          "numerics compared, speed not")
  # A missing row says a backend is gone only where both runs took every
  # implementation of one known device kind (a bare list, as --out writes,
  # names neither).
  every_implementation = (every_implementation and "implementations" not in doc
                          and None not in (doc.get("device_kind"), here)
                          and doc["device_kind"] == here)
  report, failures = compare(rows, baseline, threshold, error_growth, same_device,
                             every_implementation)
  for line in report:
    print("  " + line)
  if failures:
    print(f"{len(failures)} regression{'s' * (len(failures) != 1)}:")
    for line in failures:
      print("  " + line)
    return 1
  print("no regression")
  return 0


def main(ops: list[str] | None, out: str | None, iterations: int,
         implementations: list[str] | None, sweep: bool = False, *,
         models: list[str] | None = None, quick: bool | None = None,
         sizes: dict[str, str] | None = None, json_path: str | None = None,
         shapes: list[str] | None = None, grid: bool = False,
         compare_path: str | None = None, from_json: str | None = None,
         threshold: float = DEFAULT_THRESHOLD,
         error_growth: float = DEFAULT_ERROR_GROWTH,
         peers: list[str] | None = None, method: str | None = None) -> int:
  """Runs (or loads, `from_json`) the rows; writes, plots and compares them.

  `shapes`: only problems whose name contains one of these (`select_shapes`).
  `grid`: the shapes tuned data is measured on (`grid_suite`) instead of the
  reference shapes; with `implementations` None, each row group has `None`
  beside every usable implementation, so the closing summary says where
  `None` trails one. `peers`: only these peers (`select_peers`). `method`: how
  to time (`benchmarking.METHODS`; None: the device's default, kernel time on
  NVIDIA GPUs).

  Returns the exit status: 1 if `compare_path` found a regression, or a model
  row failed (`_model_row_failed`), else 0.
  """
  if grid and (sweep or quick or models):
    raise ValueError("grid takes neither sweep, quick nor models: per-op rows at "
                     "the tuning grid's own (GPU-sized) shapes")
  check_ops(ops)
  source = None
  if from_json:
    source, all_rows = load_rows(from_json)
    notes = []
    print(markdown_table(all_rows))
  else:
    all_rows, notes = _run(ops, iterations, implementations, sweep, models, quick, sizes,
                           shapes, json_path, grid, peers, method)
  status = 0
  for r in all_rows:
    if r["op"].startswith("model ") and _model_row_failed(r):
      status = 1
  if json_path:
    write_json(json_path, all_rows, source, implementations)
    print(f"wrote {json_path}")
  if out:
    os.makedirs(out, exist_ok=True)
    name = "bench_sweep" if sweep else "bench_grid" if grid else "bench"
    with open(os.path.join(out, f"{name}.json"), "w") as f:
      json.dump(all_rows, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
      f.write(markdown_table(all_rows) + "\n" + "".join(f"\n{n}\n" for n in notes))
    for path in plot(all_rows, out):
      print(f"wrote {path}")
  _print_auto_against_fastest(all_rows)
  if compare_path:
    # Rows loaded from a file that names no device (a bare list, as --out
    # writes) ran on an unknown one: compared as the baseline's.
    here = (source.get("device_kind") if source is not None
            else jax.devices()[0].device_kind)
    limited = (source is not None and "implementations" in source) or (
        source is None and implementations is not None)
    status = max(status, _print_compare(all_rows, compare_path, threshold, error_growth,
                                        here, every_implementation=not limited))
  return status


def _model_row_failed(row: dict) -> bool:
  """A model row that fails the run: tokamax's step did not run, or a step's
  numbers left the tolerance (or are NaN). A plain program that failed (e.g.
  out of memory where tokamax's step fits) is reported, not failed."""
  if "error" in row:
    return row["implementation"].startswith("tokamax")
  err = row.get("rel_err")
  return err is not None and (err != err or err > row.get("tol", float("inf")))


AUTO_MARGIN = 0.03  # `None` may be this much slower than the fastest of its run


def auto_against_fastest(rows: list[dict]) -> list[dict]:
  """Per (op, shape, direction) timed for `None` ("tokamax auto") and at least
  one named implementation: the fastest named one and ``ratio`` = auto's time
  / its time (above 1: `None` chose a slower one, or the run's spread)."""
  groups: dict[tuple, dict[str, float]] = {}
  ran: dict[tuple, dict] = {}
  for r in rows:
    if "ms" in r and r["implementation"].startswith("tokamax"):
      key = (r["op"], r["shape"], r["direction"])
      groups.setdefault(key, {})[r["implementation"]] = r["ms"]
      if r["implementation"] == AUTO_LABEL:
        ran[key] = r.get("dispatch", {})
  out = []
  for key, times in groups.items():
    auto = times.pop(AUTO_LABEL, None)
    if auto is None or not times:
      continue
    op, shape, direction = key
    fastest = min(times, key=times.get)
    out.append(dict(op=op, shape=shape, direction=direction, fastest=fastest,
                    auto_ms=auto, fastest_ms=times[fastest],
                    ratio=auto / times[fastest], dispatch=ran[key]))
  return out


def _print_auto_against_fastest(rows: list[dict]) -> None:
  found = auto_against_fastest(rows)
  slower = [f for f in found if f["ratio"] > 1 + AUTO_MARGIN]
  if not found:
    return
  print(f"\nimplementation=None against the fastest named implementation of the "
        f"run: within {AUTO_MARGIN:.0%} on {len(found) - len(slower)} of "
        f"{len(found)} rows")
  for f in slower:
    ran = (f" (None ran {bench_models.describe_dispatch(f['dispatch'])})"
           if f["dispatch"] else "")
    print(f"  {f['op']} / {f['shape']} / {f['direction']}: auto {f['auto_ms']:.3f} "
          f"ms, {f['fastest']} {f['fastest_ms']:.3f} ms ({f['ratio'] - 1:+.1%}){ran}")


def _run(ops, iterations, implementations, sweep, models, quick, sizes, shapes=None,
         json_path=None, grid=False, peers=None, method=None):
  """The rows of every selected problem and model; with `json_path`, the rows so far
  are written after each one, so that a run cut short (a device call's time limit)
  keeps what it measured."""
  quick = not grid and use_quick_shapes(quick)
  suite = grid_suite() if grid else quick_suite() if quick else reference_suite()
  run_ops = ops is not None or not models
  problems = [p for p in suite if not ops or "all" in ops or p.op in ops] if run_ops else []
  if sweep:
    problems = sequence_sweep()
  if shapes and problems:
    problems = select_shapes(problems, shapes)
  check_peers(problems, peers)
  models = list(dict.fromkeys(  # "all": the plain-JAX models, then any other named
      m for name in (models or [])
      for m in (bench_models.MODELS if name == "all" else (name,))))
  print(f"tokamax bench on {jax.devices()[0].device_kind}, JAX {jax.__version__}"
        f"{', quick shapes (--full for the reference shapes)' if quick and not sweep else ''}"
        f"{', the tuning grid' if grid else ''}"
        f"{f', timed by {method}' if method else ''}"
        f"{' (wall time per call of calls issued back to back)' if method == 'loop' else ''}")
  _print_gpu_state("at the start")
  print("\n".join(HEADER), flush=True)
  all_rows, notes = [], []
  for p in problems:
    impls = implementations or [None] + [
        n for n in implementations_taking(p) if n != "xla_chunked"]
    rows = run_problem(select_peers(p, peers), impls, iterations=iterations,
                       method=method)
    if sweep:
      for r in rows:
        r.update(sweep=True, seq=int(p.name.split(" T")[1].split()[0]))
    print(markdown_table(rows, header=False), flush=True)
    all_rows += rows
    if json_path:
      write_json(json_path, all_rows, implementations=implementations)
  for model in models:
    size = bench_models.make_size(model, quick, sizes)
    rows, text = bench_models.run_model(model, size, iterations=iterations, method=method)
    print(markdown_table(rows, header=False), flush=True)
    all_rows += rows
    notes.append(text)
    if json_path:
      write_json(json_path, all_rows, implementations=implementations)
  for text in notes:
    print("\n" + text)
  _print_gpu_state("at the end")
  return all_rows, notes


def _print_gpu_state(when: str) -> None:
  """The GPU's clock and power (`gpu_state.describe`) where nvidia-smi reports them."""
  state = gpu_state.describe() if jax.devices()[0].platform == "gpu" else None
  if state:
    print(f"GPU {when}: {state}", flush=True)


def _first_party_distributions() -> set[str] | None:
  """tokamax-core and the tokamax packages it requires or its extras install (the
  backends this repository ships); None where tokamax-core is not installed."""
  try:
    requires = importlib.metadata.requires("tokamax-core") or []
  except importlib.metadata.PackageNotFoundError:
    return None
  names = {registry.normalized(re.match(r"[A-Za-z0-9_.-]+", r).group(0))
           for r in requires}
  return {n for n in names if n.startswith("tokamax-")} | {"tokamax-core"}


def _first_party_only(result, also: tuple[str, ...] = ()):
  """Keeps measurements of our own implementations (built in, or from the packages
  `_first_party_distributions` names; any tokamax-* package where core is not
  installed) and of the distributions named in `also` (a plugin's, whose author
  ships the data), and the versions of just those packages, so shipped data
  depends on nothing else: not on another plugin installed beside them."""
  ours = _first_party_distributions()
  also = {registry.normalized(d) for d in also}
  dists = {}
  for op_entries in registry.get().entries.values():
    for e in op_entries:
      dist = registry.normalized(e.distribution or "")
      if (e.builtin or dist in also
          or (dist in ours if ours is not None else dist.startswith("tokamax-"))):
        dists[(e.op, e.name)] = e.distribution
  kept = [m for m in result.measurements if (m.op, m.implementation) in dists]
  used = {dists[(m.op, m.implementation)] for m in kept} | {"tokamax-core"}
  versions = {k: v for k, v in result.versions.items() if k == "jax" or k in used}
  failures = [f for f in result.failures
              if (f.get("op"), f.get("implementation")) in dists]
  return autotuning.AutotuningResult(kept, device_kind=result.device_kind,
                                     versions=versions, failures=failures)


def check_distributions(names: tuple[str, ...]) -> None:
  """Each of `names` is the distribution of a loaded backend (ValueError listing
  those otherwise: a disabled or broken one has nothing to keep)."""
  installed = {registry.normalized(b.distribution) for b in registry.backends()
               if b.distribution and b.status == "ok"}
  unknown = [n for n in names if registry.normalized(n) not in installed]
  if unknown:
    raise ValueError(f"{', '.join(unknown)}: no installed backend comes from "
                     f"{'it' if len(unknown) == 1 else 'them'}; installed: "
                     f"{', '.join(sorted(installed))}")


class NoMatchingShape(ValueError):
  """`--shape` names no problem of the selected suite."""


class NoMatchingPeer(ValueError):
  """`--peer` names no peer of the selected problems."""


def check_peers(problems: list[Problem], names: list[str] | None) -> None:
  """`NoMatchingPeer` listing the peers there are where one of `names` (``--peer``'s
  values, matched as `select_peers` does; "none" for none) matches none."""
  labels = sorted({label for p in problems for label in p.peers})
  missing = [n for n in names or () if n.lower() != "none"
             and not any(_peer_named(n, label) for label in labels)]
  if missing:
    raise NoMatchingPeer(f"no peer's label contains {missing}; the selected problems' "
                         f"peers are: {', '.join(labels) or 'none'}")


class UnknownImplementation(ValueError):
  """An implementation name no installed package registers."""


def check_implementation_names(names) -> None:
  """`UnknownImplementation` listing the installed implementations where one of
  `names` (``None``/"auto" aside) is none of them."""
  known = {name for _, name in registry.get().by_name}
  unknown = [n for n in names or () if n not in (None, "auto") and n not in known]
  if unknown:
    raise UnknownImplementation(
        f"no installed implementation is named {', '.join(map(repr, unknown))}; the "
        f"installed ones are {', '.join(sorted(known))}")


class UnknownOp(ValueError):
  """`--op` names an op the benchmark suites do not have."""


def check_ops(ops: list[str] | None) -> None:
  """`UnknownOp` naming the suites' ops where `ops` (``--op``'s values: op
  names or "all") holds another, so that a mistyped op does not print an
  empty table."""
  known = sorted(catalog.PROBLEMS)
  unknown = [op for op in ops or () if op != "all" and op not in known]
  if not unknown:
    return
  hint = ""
  if "rms_norm" in unknown:
    hint = ("; tokamax.rms_norm is the layer_norm op's: --op layer_norm --shape "
            "rms_norm for its rows")
  raise UnknownOp(f"no op {', '.join(map(repr, unknown))} in the benchmark suites; "
                  f"their ops are {', '.join(known)} (or 'all'){hint}")


def select_shapes(problems: list[Problem], shapes: list[str],
                  regex: bool = False) -> list[Problem]:
  """The `problems` whose name contains any of `shapes` (substrings, e.g.
  ``["G128", "G256"]``; one ending in ``$`` must end the name, so that
  ``"N16 H128$"`` leaves out ``"... N16 H128 causal"``), or with `regex` regular
  expressions searched in it, as the tools' ``--shape`` takes them;
  `NoMatchingShape` naming the problems there are where none matches, so that a
  mistyped name does not print an empty table."""
  if regex:
    patterns = [re.compile(s) for s in shapes]
    chosen = [p for p in problems if any(r.search(p.name) for r in patterns)]
  else:
    def names(shape: str, name: str) -> bool:
      return name.endswith(shape[:-1]) if shape.endswith("$") else shape in name
    chosen = [p for p in problems if any(names(s, p.name) for s in shapes)]
  if not chosen:
    names = sorted({p.name for p in problems})
    what = "matches" if regex else "contains any of"
    # A regular expression given as a substring matches nothing: say how the
    # option reads it (one --shape a pattern, a trailing $ anchoring the end).
    hint = ("" if regex or not any(c in s for s in shapes for c in "()|[]*+?\\^")
            else " (--shape takes substrings, not regular expressions: give one "
                 "--shape for each, a trailing $ to end the name)")
    raise NoMatchingShape(f"no problem's name {what} {shapes}{hint}; the "
                          f"selected suite's problems are: {', '.join(names)}")
  return chosen


def autotune_suite(ops: list[str] | None, shapes: list[str] | None, out: str,
                   iterations: int, timeout_s: float | None, grid: bool = False,
                   skip: tuple[str, ...] = (), keep: tuple[str, ...] = ()) -> int:
  """Autotunes the reference problems and writes ``out/<device slug>/<op>.json``.

  With `grid`: the grid problems instead, each implementation at its heuristic
  config only (which implementation wins where, for `implementation=None`; calls
  between grid points take the nearest ones': `tuning.nearest`), written to
  ``<op>_grid.json`` after each problem, so that a run cut short keeps its data.
  In both, calls an existing file holds and this run does not measure are kept,
  so that the shapes can be measured in several runs (``--shape``). `skip`:
  implementations not measured (e.g. the dense XLA attention at long sequences,
  out of memory or tens of times slower); an existing file's entries for them
  are kept, so that one implementation can be measured again after it changed
  (skip the others). Written are the measurements of this repository's
  packages' implementations, and of those of the distributions in `keep` (a
  plugin's author: theirs, ranked against ours).

  Returns the exit status: 1 where nothing was measured (the reference shapes'
  files then left as they were), else 0.
  """
  check_ops(ops)
  problems = [p for p in (grid_suite() if grid else reference_suite())
              if not ops or "all" in ops or p.op in ops]
  if shapes and problems:
    problems = select_shapes(problems, shapes)
  folder = os.path.join(out, shipped.device_slug(jax.devices()[0].device_kind))
  os.makedirs(folder, exist_ok=True)
  # Backends are discovered here, not within the first autotune: the exception of
  # a plugin that failed to load is kept (`tokamax.backend_errors()`), and with
  # its traceback every frame that was running, with their arrays.
  registry.get()
  result = autotuning.AutotuningResult()
  suffix = shipped.GRID_SUFFIX if grid else ""
  for p in problems:
    inputs = p.make_inputs()
    integer_inputs = p.integer_inputs and p.integer_inputs(inputs)
    # autotune times inputs of its own (random floats, these integer values): of
    # these arrays it needs the shapes, and holding them would keep a second set
    # of operands on the device throughout (7.9 GiB at ragged_dot M65536 K7168
    # N2048 G256).
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                 weak_type=getattr(x, "weak_type", False))
            for x in inputs]
    del inputs
    print(f"autotuning {p.op} {p.name}", flush=True)
    result = result.merge(autotuning.autotune(
        lambda *a, p=p: p.call(a, None), *args, iterations=iterations,
        timeout_s=timeout_s, progress=False, heuristics_only=grid, skip=skip,
        integer_inputs=integer_inputs))
    if grid:  # after each problem: a grid run cut short keeps its data
      _write_per_op(_with_earlier(_first_party_only(result, keep), folder, p.op, suffix, skip),
                    folder, suffix, only=p.op)
  if not _first_party_only(result, keep).measurements:
    print(f"autotune measured nothing: {len(result.failures)} failed configs over "
          f"{len(problems)} problems (every implementation skipped, failed or "
          "refused)", flush=True)
    return 1
  if not grid:
    for op in sorted({p.op for p in problems}):
      _write_per_op(_with_earlier(_first_party_only(result, keep), folder, op, suffix, skip),
                    folder, suffix, only=op)
  return 0


def _with_earlier(result, folder: str, op: str, suffix: str, skip: tuple[str, ...] = ()):
  """`result` and what `folder`'s ``<op><suffix>.json`` (the grid's, or the
  reference shapes') holds of the calls and directions it did not measure, and
  of the implementations it skipped: a run over some shapes (``--shape``), some
  implementations, or cut short (``--timeout``) adds to the file. (An
  implementation that this run tried on a call and direction and that failed or
  refused there loses its earlier entries for them: they describe code that no
  longer runs it.) The file records the earlier file's versions updated with
  this run's (a skipped implementation's package stays named). Tuned configs
  (no `suffix`) run under the versions their file names, so there the earlier
  entries are kept only where the earlier file's versions are this run's; the
  grid's only rank implementations and keep them."""
  path = os.path.join(folder, f"{op}{suffix}.json")
  if not os.path.exists(path):
    return result
  with open(path) as f:
    earlier = autotuning.AutotuningResult.loads(f.read())
  changed = sorted(name for name, version in earlier.versions.items()
                   if result.versions.get(name, version) != version)
  if not suffix and changed:
    print(f"{path}: tuned with other versions of {', '.join(changed)}; its calls "
          "this run did not measure are dropped", flush=True)
    return result
  # A call and direction this run tried (measured, or failed on) replaces the
  # earlier data of every implementation it did not skip.
  tried = ({(m.op, m.key, m.direction) for m in result.measurements}
           | {(f["op"], f["key"], f.get("direction")) for f in result.failures})

  def keep(op_name, key, direction, implementation):
    return (op_name, key, direction) not in tried or implementation in skip
  kept = [m for m in earlier.measurements
          if keep(m.op, m.key, m.direction, m.implementation)]
  failures = [f for f in earlier.failures
              if keep(f["op"], f["key"], f.get("direction"), f.get("implementation"))]
  return autotuning.AutotuningResult(
      [*kept, *result.measurements], device_kind=result.device_kind,
      versions={**earlier.versions, **result.versions},
      failures=[*failures, *result.failures])


def _write_per_op(result, folder: str, suffix: str, only: str | None = None) -> None:
  for op in sorted({m.op for m in result.measurements}):
    if only is not None and op != only:
      continue
    part = autotuning.AutotuningResult(
        [m for m in result.measurements if m.op == op], device_kind=result.device_kind,
        versions=result.versions, failures=[f for f in result.failures if f["op"] == op])
    path = os.path.join(folder, f"{op}{suffix}.json")
    with open(path, "w") as f:
      f.write(part.dumps())
    print(f"wrote {path}: {len(part)} measurements, {len(part.failures)} failed "
          "configs", flush=True)
