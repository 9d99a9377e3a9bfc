"""`python -m tokamax bench`: the reference benchmark suite (shared/BENCHMARKS.md).

Each row times one op at one shape, forward or forward+backward, for every usable
tokamax implementation and the peers a user could call instead (cuDNN through
`jax.nn`, plain XLA, a dense matmul of the same FLOPs), all in the same run. Kernel
time comes from CUPTI on NVIDIA GPUs (`jax.experimental.mosaic.gpu.profiler`),
wall clock elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax._src import benchmarking
from tokamax._src import introspection

BF16 = jnp.bfloat16


def kernel_time_ms(f: Callable, *args, iterations: int = 10) -> tuple[float, str]:
  """Median time of ``f(*args)`` and the method: CUPTI kernel time on NVIDIA GPUs, else wall clock.

  A thin wrapper of `tokamax.benchmark`, the one timing implementation.
  """
  data = benchmarking.benchmark(f, args, iterations=iterations)
  return data.median_evaluation_time_ms, data.method


@dataclasses.dataclass
class Problem:
  """One benchmark shape: inputs, a tokamax call, the peers, and the work done."""

  op: str
  name: str
  make_inputs: Callable[[], tuple]
  call: Callable[..., Any]  # (inputs, implementation) -> out
  peers: dict[str, Callable[..., Any]]  # name -> (inputs) -> out
  flops: float = 0.0  # forward FLOPs
  bytes: float = 0.0  # forward bytes (norms)
  backward_factor: float = 3.5  # fwd+bwd work / fwd work (FLOPs)


def _rand(key, shape, dtype=BF16, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _attention(b, t, n, k, h, causal, dtype=BF16) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 3)
    return (_rand(ks[0], (b, t, n, h), dtype), _rand(ks[1], (b, t, k, h), dtype),
            _rand(ks[2], (b, t, k, h), dtype))
  flops = 4 * b * n * t * t * h / (2 if causal else 1)
  name = (f"B{b} T{t} N{n}" + (f" K{k}" if k != n else "") + f" H{h}"
          + (" causal" if causal else "") + ("" if dtype == BF16 else " f16"))
  return Problem(
      "dot_product_attention", name, make,
      lambda a, i: tokamax.dot_product_attention(*a, is_causal=causal, implementation=i),
      {"cudnn (jax.nn)": lambda a: jax.nn.dot_product_attention(
          *a, is_causal=causal, implementation="cudnn")},
      flops=flops)


def _ragged(m, k, n, g, random_sizes) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 3)
    if random_sizes:
      cuts = np.sort(np.random.default_rng(0).integers(0, m, g - 1))
      sizes = np.diff(np.concatenate([[0], cuts, [m]]))
    else:
      sizes = np.full(g, m // g)
    return (_rand(ks[0], (m, k)), _rand(ks[1], (g, k, n), scale=k**-0.5),
            jnp.asarray(sizes, jnp.int32))

  def dense(a):  # the same FLOPs as one batched matmul: the bound to reach
    lhs, rhs, _ = a
    # bf16 in and out (cuBLAS accumulates in float32): a float32 output would
    # make the backward's matmuls take a float32 cotangent.
    return jnp.einsum("gmk,gkn->gmn", lhs.reshape(g, m // g, k), rhs)
  peers = {"lax.ragged_dot": lambda a: jax.lax.ragged_dot(*a)}
  if m % g == 0:
    peers["dense batched matmul"] = dense
  return Problem("ragged_dot", f"M{m} K{k} N{n} G{g}" + (" random" if random_sizes else ""),
                 make, lambda a, i: tokamax.ragged_dot(*a, implementation=i), peers,
                 flops=2 * m * k * n, backward_factor=3.0)


def _norm(rows, d, rms) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 3)
    return (_rand(ks[0], (rows, d)), _rand(ks[1], (d,)), _rand(ks[2], (d,)))

  def xla(a):
    x, s, o = a
    xf = x.astype(jnp.float32)
    if rms:
      y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * s
    else:
      mu = jnp.mean(xf, -1, keepdims=True)
      y = (xf - mu) * jax.lax.rsqrt(jnp.var(xf, -1, keepdims=True) + 1e-6) * s + o
    return y.astype(x.dtype)
  op = "rms_norm" if rms else "layer_norm"
  call = ((lambda a, i: tokamax.rms_norm(a[0], a[1], implementation=i)) if rms else
          (lambda a, i: tokamax.layer_norm(*a, implementation=i)))
  return Problem("layer_norm", f"{op} {rows}x{d}", make, call, {"XLA (jnp)": xla},
                 bytes=2 * rows * d * 2, backward_factor=2.0)


def _glu(m, k, n) -> Problem:
  def make():
    ks = jax.random.split(jax.random.key(0), 2)
    return (_rand(ks[0], (m, k)), _rand(ks[1], (k, 2, n), scale=k**-0.5))

  def xla(a):
    x, w = a
    gate = jnp.dot(x, w[:, 0], preferred_element_type=jnp.float32)
    up = jnp.dot(x, w[:, 1], preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
  return Problem("gated_linear_unit", f"silu x{m}x{k} w{k}x2x{n}", make,
                 lambda a, i: tokamax.gated_linear_unit(*a, activation=jax.nn.silu,
                                                        implementation=i),
                 {"XLA (jnp)": xla}, flops=2 * 2 * m * k * n, backward_factor=3.0)


def reference_suite() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md."""
  return [
      _attention(4, 4096, 16, 16, 128, False), _attention(4, 4096, 16, 16, 128, True),
      _attention(2, 8192, 16, 16, 64, False), _attention(2, 8192, 16, 16, 64, True),
      _attention(2, 8192, 32, 8, 128, True),
      _attention(4, 4096, 16, 16, 128, False, jnp.float16),
      _attention(4, 4096, 16, 16, 128, True, jnp.float16),
      _ragged(16384, 2048, 16384, 16, False), _ragged(65536, 7168, 2048, 256, True),
      _norm(32768, 8192, False), _norm(32768, 8192, True),
      _glu(16384, 4096, 14336),
  ]


def _fwd_bwd(fn: Callable, inputs: tuple) -> tuple[Callable, tuple]:
  """A training step's share of `fn`: the output and the float inputs' cotangents
  for a random cotangent ``dy`` of the output's dtype.

  The output is returned so that the forward runs even for a linear op
  (ragged_dot), whose gradient alone does not need it; ``dy`` keeps the output
  dtype so that the backward matmuls run in it, as in training.
  """
  float_idx = [i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating)]
  out_shape = jax.eval_shape(fn, inputs)
  dy = _rand(jax.random.key(7), out_shape.shape, out_shape.dtype)

  def with_floats(floats):
    full = list(inputs)
    for i, x in zip(float_idx, floats):
      full[i] = x
    return fn(tuple(full))

  def step(floats, dy):
    out, vjp = jax.vjp(with_floats, floats)
    return out, vjp(dy)
  return jax.jit(step), ([inputs[i] for i in float_idx], dy)


def run_problem(problem: Problem, implementations: list[str | None],
                directions=("forward", "forward+backward"), iterations: int = 10) -> list[dict]:
  inputs = problem.make_inputs()
  rows = []
  candidates = [(f"tokamax {i or 'auto'}", lambda a, i=i: problem.call(a, i))
                for i in implementations]
  candidates += list(problem.peers.items())
  for direction in directions:
    times = {}
    for label, fn in candidates:
      try:
        if direction == "forward":
          f, args = jax.jit(fn), (inputs,)
        else:
          f, args = _fwd_bwd(fn, inputs)
        ms, method = kernel_time_ms(f, *args, iterations=iterations)
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(op=problem.op, shape=problem.name, direction=direction,
                         implementation=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
        continue
      times[label] = ms
      work = problem.flops or problem.bytes
      if direction != "forward":
        work *= problem.backward_factor
      rate = work / (ms * 1e-3) / 1e12
      rows.append(dict(op=problem.op, shape=problem.name, direction=direction,
                       implementation=label, ms=ms, method=method,
                       rate=rate, unit="TFLOP/s" if problem.flops else "TB/s"))
    peer = next((times[p] for p in problem.peers if p in times), None)
    for row in rows:
      if row["direction"] == direction and "ms" in row and peer is not None:
        row["vs_peer"] = peer / row["ms"]
  return rows


def markdown_table(rows: list[dict]) -> str:
  lines = ["| op | shape | direction | implementation | ms | rate | x first peer |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['op']} | {r['shape']} | {r['direction']} | {r['implementation']} "
                   f"| failed: {r['error'][:80]} | | |")
      continue
    lines.append(f"| {r['op']} | {r['shape']} | {r['direction']} | {r['implementation']} | "
                 f"{r['ms']:.3f} | {r['rate']:.0f} {r['unit']} | "
                 f"{r.get('vs_peer', float('nan')):.2f} |")
  return "\n".join(lines)


def sequence_sweep(lengths=(1024, 2048, 4096, 8192, 16384), tokens=32768) -> list[Problem]:
  """Attention at a fixed token count (B * T) across sequence lengths (causal, H128)."""
  return [_attention(max(1, tokens // t), t, 16, 16, 128, True) for t in lengths]


def plot(rows: list[dict], out: str) -> list[str]:
  """PNG plots of `rows`: throughput per implementation for each problem, and
  attention throughput against sequence length. Needs matplotlib."""
  import os  # pylint: disable=g-import-not-at-top
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print("matplotlib is not installed: no plots written")
    return []
  os.makedirs(out, exist_ok=True)
  ok = [r for r in rows if "rate" in r]
  written = []
  problems = sorted({(r["op"], r["shape"]) for r in ok})
  fig, axes = plt.subplots(len(problems), 2, figsize=(12, 2.2 * len(problems)), squeeze=False)
  for i, (op, shape) in enumerate(problems):
    for j, direction in enumerate(("forward", "forward+backward")):
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


def main(ops: list[str] | None, out: str | None, iterations: int,
         implementations: list[str] | None, sweep: bool = False) -> None:
  problems = [p for p in reference_suite() if not ops or p.op in ops]
  if sweep:
    problems = sequence_sweep()
  print(f"tokamax bench on {jax.devices()[0].device_kind}, JAX {jax.__version__}")
  all_rows = []
  for p in problems:
    usable = [s.name for s in introspection.implementations(p.op) if s.usable]
    impls = implementations or [None] + [n for n in usable if n != "xla_chunked"]
    rows = run_problem(p, impls, iterations=iterations)
    if sweep:
      for r in rows:
        r.update(sweep=True, seq=int(p.name.split(" T")[1].split()[0]))
    print(markdown_table(rows), flush=True)
    all_rows += rows
  if out:
    import os  # pylint: disable=g-import-not-at-top
    os.makedirs(out, exist_ok=True)
    name = "bench_sweep" if sweep else "bench"
    with open(os.path.join(out, f"{name}.json"), "w") as f:
      json.dump(all_rows, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
      f.write(markdown_table(all_rows) + "\n")
    for path in plot(all_rows, out):
      print(f"wrote {path}")


def _first_party_only(result):
  """Keeps measurements of our own implementations (built in or tokamax-* packages),
  and the versions of just those packages, so shipped data depends on nothing else."""
  from tokamax._src import autotuning, registry  # pylint: disable=g-import-not-at-top
  dists = {}
  for op_entries in registry.get().entries.values():
    for e in op_entries:
      if e.builtin or (e.distribution or "").startswith("tokamax-"):
        dists[(e.op, e.name)] = e.distribution
  kept = [m for m in result.measurements if (m.op, m.implementation) in dists]
  used = {dists[(m.op, m.implementation)] for m in kept} | {"tokamax-core"}
  versions = {k: v for k, v in result.versions.items() if k == "jax" or k in used}
  return autotuning.AutotuningResult(kept, device_kind=result.device_kind,
                                     versions=versions, failures=result.failures)


def autotune_suite(ops: list[str] | None, shape: str | None, out: str, iterations: int,
                   timeout_s: float | None) -> None:
  """Autotunes the reference problems and writes ``out/<device slug>/<op>.json``."""
  import os  # pylint: disable=g-import-not-at-top

  from tokamax._src import autotuning, tuned_data  # pylint: disable=g-import-not-at-top
  result = autotuning.AutotuningResult()
  for p in reference_suite():
    if (ops and p.op not in ops) or (shape and shape not in p.name):
      continue
    inputs = p.make_inputs()
    print(f"autotuning {p.op} {p.name}", flush=True)
    result = result.merge(autotuning.autotune(
        lambda *a, p=p: p.call(a, None), *inputs, iterations=iterations,
        timeout_s=timeout_s, progress=False))
  result = _first_party_only(result)
  folder = os.path.join(out, tuned_data.device_slug(jax.devices()[0].device_kind))
  os.makedirs(folder, exist_ok=True)
  for op in sorted({m.op for m in result.measurements}):
    part = autotuning.AutotuningResult(
        [m for m in result.measurements if m.op == op], device_kind=result.device_kind,
        versions=result.versions, failures=[f for f in result.failures if f["op"] == op])
    with open(os.path.join(folder, f"{op}.json"), "w") as f:
      f.write(part.dumps())
    print(f"wrote {folder}/{op}.json: {len(part)} measurements, "
          f"{len(part.failures)} failed configs", flush=True)
