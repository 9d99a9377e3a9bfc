"""Scaling of attention and ragged_dot over the GPUs of one host.

Weak scaling (the per-GPU problem stays the same as GPUs are added; efficiency =
time on 1 GPU / time on n GPUs, 100% is perfect):

- attention, data parallel: the batch is sharded (GSPMD under `jax.jit`);
- ragged_dot, token parallel: the rows are sharded, the expert weights replicated
  (the weight gradient is then all-reduced);
- ragged_dot, expert parallel: `tokamax.moe_all_to_all` (each GPU holds its
  experts; tokens travel to them and back; capacity factor 1.25), with one
  ragged_dot as the experts, and with an FFN of two (an MoE layer); `chunks`
  pieces overlap the all-to-alls with the experts' compute, `exchange=ring`
  replaces each all-to-all by one collective permute per other GPU;
- MoE layers with GLU experts at two published models' dimensions (per GPU a
  fixed number of experts and tokens).

Strong scaling (the whole problem stays the same; efficiency = t1 / (n * tn)):

- ring attention over a sequence sharded on every GPU (causal, zig-zag balanced).

Time per call: wall clock over back-to-back calls (asynchronous dispatch keeps the
GPUs busy, so per-call overhead hides behind problems of a millisecond or more);
the same method for 1 and for n GPUs.

Usage (on a host with several GPUs):
    python tools/multi_gpu_scaling.py --gpus 1 2 --out scaling.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax

try:
  from trace_summary import traced_summary  # run as a script: tools/ on the path
except ImportError:  # imported as tools.multi_gpu_scaling
  from tools.trace_summary import traced_summary

BF16 = jnp.bfloat16
_SHRINK = 1  # --smoke divides the big dims, to check the script on CPU devices


def _d(x: int) -> int:
  return max(x // _SHRINK, 16)


_HLO = {"dir": None, "tag": ""}  # --hlo: where compiled programs are written
_TRACE = {"on": False}  # --trace: print a per-GPU kernel-time summary per timing


def per_call_ms(f, *args, calls: int = 20, repeats: int = 3) -> float:
  """Best of `repeats` averages over `calls` back-to-back calls (ms)."""
  if _HLO["dir"]:
    _HLO["count"] = _HLO.get("count", 0) + 1
    path = os.path.join(_HLO["dir"], f"{_HLO['tag']}_{_HLO['count']}.txt")
    text = f.lower(*args).compile().as_text()
    with open(path, "w") as out:
      out.write(text)
    print(f"{os.path.basename(path)}: {schedule_summary(text)}", flush=True)
  jax.block_until_ready(f(*args))  # compile
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  if _TRACE["on"]:
    print(f"{_HLO.get('tag', '')} trace:\n{traced_summary(f, *args)}", flush=True)
  return min(times)


def schedule_summary(hlo_text: str) -> str:
  """The entry computation's order of collectives and kernels, in one line:
  ``<`` / ``>`` an all-to-all's start / done, ``A`` a synchronous all-to-all,
  ``[`` / ``]`` a collective permute's start / done, ``K`` a kernel custom call,
  ``.N`` N other instructions. Kernels between a start and its done overlap it."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  marks, others = [], 0
  for line in entry.splitlines()[1:]:
    mark = ("<" if "all-to-all-start" in line else ">" if "all-to-all-done" in line
            else "A" if " all-to-all(" in line
            else "[" if "collective-permute-start" in line
            else "]" if "collective-permute-done" in line
            else "K" if "custom-call(" in line and ("triton" in line or "mosaic" in line)
            else None)
    if mark is None:
      others += 1
      continue
    if others:
      marks.append(f".{others}")
      others = 0
    marks.append(mark)
  return " ".join(marks + ([f".{others}"] if others else []))


def _rand(key, shape, dtype=BF16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _put(mesh, spec, x):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _fwd_bwd(fn, floats, others=()):
  """A jitted forward+backward of `fn` with a random cotangent."""
  def loss(fl, dy):
    return jnp.sum(fn(*fl, *others).astype(jnp.float32) * dy)
  return jax.jit(jax.grad(loss))


def attention_data_parallel(mesh, n, implementation):
  """Per GPU: B4 T4096 N16 H128 causal, bf16."""
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (4 * n, _d(4096), 16, _d(128))
  q, k, v = (_put(mesh, P("d"), _rand(kk, shape)) for kk in keys[:3])
  dy = _put(mesh, P("d"), _rand(keys[3], shape, jnp.float32))
  fn = functools.partial(tokamax.dot_product_attention, is_causal=True,
                         implementation=implementation)
  fwd = jax.jit(fn)
  loss = _fwd_bwd(fn, (q, k, v))
  return {"fwd": per_call_ms(fwd, q, k, v),
          "fwd+bwd": per_call_ms(loss, (q, k, v), dy)}


def ragged_dot_token_parallel(mesh, n):
  """Per GPU: M16384 K2048 N16384, G16 equal groups (weights replicated)."""
  keys = jax.random.split(jax.random.key(1), 3)
  m, k, nn, g = _d(16384) * n, _d(2048), _d(16384), 16
  lhs = _put(mesh, P("d"), _rand(keys[0], (m, k)))
  rhs = _put(mesh, P(), _rand(keys[1], (g, k, nn)))
  sizes = _put(mesh, P(), jnp.full((g,), m // g, jnp.int32))
  dy = _put(mesh, P("d"), _rand(keys[2], (m, nn), jnp.float32))
  fwd = jax.jit(tokamax.ragged_dot)
  loss = _fwd_bwd(tokamax.ragged_dot, (lhs, rhs), (sizes,))
  return {"fwd": per_call_ms(fwd, lhs, rhs, sizes),
          "fwd+bwd": per_call_ms(loss, (lhs, rhs), dy)}


def _expert_parallel(mesh, n, layer, floats, ids, dy):
  """Times `layer(x, ids, *weights)` (inside shard_map over "d") and its gradient."""
  sharded = jax.shard_map(layer, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  fn = lambda x, *rest: sharded(x, ids, *rest)
  fwd = jax.jit(fn)
  loss = _fwd_bwd(fn, floats)
  return {"fwd": per_call_ms(fwd, *floats),
          "fwd+bwd": per_call_ms(loss, floats, dy)}


def _capacity(assignments_per_gpu, n):
  """Slots per (source, destination) pair: a capacity factor of 1.25 (random
  experts: none overflows at these sizes), so each GPU's traffic and work stay
  constant."""
  return -(-5 * assignments_per_gpu // (4 * n))


def ragged_dot_expert_parallel(mesh, n, chunks):
  """Per GPU: 16384 tokens, 16 experts of K2048 x N4096 (top-1, random experts),
  capacity factor 1.25; one ragged_dot per device (`tokamax.moe_all_to_all` with
  the weights). The results travel back N-wide, twice the tokens' width: on 4
  H200s the transfers added 0.94 ms to a 0.66 ms forward (docs/sharding.md)."""
  keys = jax.random.split(jax.random.key(2), 4)
  m, k, nn, e_local = _d(16384) * n, _d(2048), _d(4096), 16
  x = _put(mesh, P("d"), _rand(keys[0], (m, k)))
  ids = _put(mesh, P("d"), jax.random.randint(keys[1], (m,), 0, e_local * n))
  w = _put(mesh, P("d"), _rand(keys[2], (e_local * n, k, nn)))
  dy = _put(mesh, P("d"), _rand(keys[3], (m, nn), jnp.float32))
  layer = functools.partial(tokamax.moe_all_to_all, axis_name="d", chunks=chunks,
                            capacity=_capacity(m // n, n))
  return _expert_parallel(mesh, n, layer, (x, w), ids, dy)


def moe_ffn_expert_parallel(mesh, n, chunks, exchange="all_to_all"):
  """Per GPU: 8192 tokens of width 2048, top-2 of 16 experts per GPU, each a
  2048 -> 4096 -> 2048 FFN (two ragged_dots, gelu between), capacity factor
  1.25: an MoE layer as models run it (tokens of model width both ways)."""
  keys = jax.random.split(jax.random.key(4), 5)
  m, d, f, e_local, top_k = _d(8192) * n, _d(2048), _d(4096), 16, 2
  x = _put(mesh, P("d"), _rand(keys[0], (m, d)))
  ids = _put(mesh, P("d"), _distinct_experts(keys[1], m, e_local * n, top_k))
  w_up = _put(mesh, P("d"), _rand(keys[2], (e_local * n, d, f)) * d ** -0.5)
  w_down = _put(mesh, P("d"), _rand(keys[3], (e_local * n, f, d)) * f ** -0.5)
  dy = _put(mesh, P("d"), _rand(keys[4], (m, top_k, d), jnp.float32))

  def layer(x, ids, w_up, w_down):
    def ffn(rows, sizes):
      return tokamax.ragged_dot(jax.nn.gelu(tokamax.ragged_dot(rows, w_up, sizes)),
                                w_down, sizes)
    return tokamax.moe_all_to_all(x, ids, ffn, axis_name="d", chunks=chunks,
                                  num_local_experts=e_local, exchange=exchange,
                                  capacity=_capacity(m // n * top_k, n))
  return _expert_parallel(mesh, n, layer, (x, w_up, w_down), ids, dy)


# Per-GPU MoE layers with GLU (silu) experts at published models' dimensions:
# (tokens per GPU, model width, expert width, experts per GPU, top_k).
MODEL_LAYERS = {
    # Mixtral-8x7B's expert dimensions; 4 experts per GPU (8 in the model).
    "mixtral": (8192, 4096, 14336, 4, 2),
    # DeepSeek-V3's routed experts (256 in the model, top-8); 16 per GPU.
    "deepseek": (4096, 7168, 2048, 16, 8),
}


def glu_moe_layer(mesh, n, model, exchange, chunks=1):
  """One MoE layer: gate and up projections in one ragged_dot, silu(gate) * up,
  the down projection in another; combined with the router's gates; capacity
  factor 1.25."""
  tokens, d, f, e_local, top_k = MODEL_LAYERS[model]
  keys = jax.random.split(jax.random.key(6), 6)
  m, d, f = _d(tokens) * n, _d(d), _d(f)
  x = _put(mesh, P("d"), _rand(keys[0], (m, d)))
  ids = _put(mesh, P("d"), _distinct_experts(keys[1], m, e_local * n, top_k))
  gates = _put(mesh, P("d"), jax.nn.softmax(
      jax.random.normal(keys[2], (m, top_k)), axis=-1).astype(BF16))
  w_in = _put(mesh, P("d"), _rand(keys[3], (e_local * n, d, 2 * f)) * d ** -0.5)
  w_out = _put(mesh, P("d"), _rand(keys[4], (e_local * n, f, d)) * f ** -0.5)
  dy = _put(mesh, P("d"), _rand(keys[5], (m, d), jnp.float32))

  def layer(x, ids, gates, w_in, w_out):
    def experts(rows, sizes):
      gate, up = jnp.split(tokamax.ragged_dot(rows, w_in, sizes), 2, axis=-1)
      return tokamax.ragged_dot(jax.nn.silu(gate) * up, w_out, sizes)
    return tokamax.moe_all_to_all(x, ids, experts, axis_name="d",
                                  num_local_experts=e_local, exchange=exchange,
                                  combine_weights=gates, chunks=chunks,
                                  capacity=_capacity(m // n * top_k, n))

  sharded = jax.shard_map(layer, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  fn = lambda x, w_in, w_out: sharded(x, ids, gates, w_in, w_out)
  loss = _fwd_bwd(fn, (x, w_in, w_out))
  return {"fwd": per_call_ms(jax.jit(fn), x, w_in, w_out, calls=10),
          "fwd+bwd": per_call_ms(loss, (x, w_in, w_out), dy, calls=10)}


def all_to_all_probe(mesh, n):
  """The FFN layer's dispatch buffer alone: [n, 1.25 * 16384 / n, 2048] bf16 per
  GPU through one all-to-all (80 MiB per GPU, (n - 1) / n of it remote)."""
  cap = _capacity(_d(16384), n)
  x = _put(mesh, P("d"), _rand(jax.random.key(5), (n * n, cap, _d(2048))))
  a2a = jax.jit(jax.shard_map(lambda b: jax.lax.all_to_all(b, "d", 0, 0, tiled=True),
                              mesh=mesh, in_specs=P("d"), out_specs=P("d")))
  return {"fwd": per_call_ms(a2a, x)}


def _distinct_experts(key, m, e, top_k):
  """[m, top_k] random experts, distinct within a token."""
  return jnp.argsort(jax.random.uniform(key, (m, e)), axis=1)[:, :top_k].astype(
      jnp.int32)


def ring_attention_strong(mesh, n):
  """B1 T32768 N16 H128 causal, zig-zag balanced, split over all n GPUs."""
  keys = jax.random.split(jax.random.key(3), 3)
  t = _d(32768)
  perm = tokamax.zigzag_permutation(t, n)
  q, k, v = (_put(mesh, P(None, "d"), _rand(kk, (1, t, 16, _d(128)))[:, perm])
             for kk in keys)
  ring = jax.jit(jax.shard_map(
      lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name="d", is_causal=True,
                                             load_balanced=True),
      mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, "d")))
  dy = _put(mesh, P(None, "d"), _rand(keys[2], (1, t, 16, _d(128)), jnp.float32))
  loss = _fwd_bwd(ring, (q, k, v))
  return {"fwd": per_call_ms(ring, q, k, v),
          "fwd+bwd": per_call_ms(loss, (q, k, v), dy)}


PROBLEMS = {
    "attention_data_parallel[auto]": (
        "weak", lambda mesh, n: attention_data_parallel(mesh, n, None)),
    "attention_data_parallel[triton]": (
        "weak", lambda mesh, n: attention_data_parallel(mesh, n, "triton")),
    "ragged_dot_token_parallel": ("weak", ragged_dot_token_parallel),
    **{f"ragged_dot_expert_parallel[chunks={c}]": (
        "weak", functools.partial(ragged_dot_expert_parallel, chunks=c))
       for c in (1, 2)},
    **{f"moe_ffn_expert_parallel[chunks={c}]": (
        "weak", functools.partial(moe_ffn_expert_parallel, chunks=c))
       for c in (1, 2, 4)},
    "moe_ffn_expert_parallel[ring]": (
        "weak", functools.partial(moe_ffn_expert_parallel, chunks=1,
                                  exchange="ring")),
    **{f"glu_moe_layer[{model},{exchange}]": (
        "weak", functools.partial(glu_moe_layer, model=model, exchange=exchange))
       for model in MODEL_LAYERS for exchange in ("all_to_all", "ring")},
    **{f"glu_moe_layer[{model},chunks=2]": (
        "weak", functools.partial(glu_moe_layer, model=model, exchange="all_to_all",
                                  chunks=2))
       for model in MODEL_LAYERS},
    "ring_attention": ("strong", ring_attention_strong),
    "all_to_all_probe": ("weak", all_to_all_probe),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, jax.device_count()])
  parser.add_argument("--problem", action="append", choices=sorted(PROBLEMS))
  parser.add_argument("--out", default=None, help="write the rows as JSON here")
  parser.add_argument("--hlo", default=None,
                      help="write each compiled program's HLO into this folder")
  parser.add_argument("--trace", action="store_true",
                      help="after timing, trace 3 calls and print where each GPU's "
                           "kernel time goes (communication, matmuls, other)")
  parser.add_argument("--smoke", type=int, default=1,
                      help="divide the big dims by this (a quick check on CPUs)")
  opts = parser.parse_args()
  global _SHRINK
  _SHRINK = opts.smoke
  _TRACE["on"] = opts.trace
  if opts.hlo:
    os.makedirs(opts.hlo, exist_ok=True)
    _HLO["dir"] = opts.hlo
  rows = []
  for name in opts.problem or PROBLEMS:
    kind, run = PROBLEMS[name]
    times = {}
    for n in opts.gpus:
      mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
      tag = "".join(c if c.isalnum() else "_" for c in f"{name}_{n}gpus")
      _HLO.update(tag=tag, count=0)
      try:
        times[n] = run(mesh, n)
      except Exception as e:  # a size that fails is reported, the others still run
        print(f"{name} on {n} GPU(s) failed: {type(e).__name__}: {e}"[:2000],
              flush=True)
        break
      print(f"{name} n={n}: {times[n]}", flush=True)
    if 1 not in times:
      continue
    for n, t in times.items():
      for direction, ms in t.items():
        base = times[1][direction]
        eff = base / ms if kind == "weak" else base / (n * ms)
        rows.append(dict(problem=name, scaling=kind, gpus=n, direction=direction,
                         ms=round(ms, 3), efficiency=round(eff, 3)))
  print("| problem | scaling | direction | GPUs | ms per call | efficiency |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['problem']} | {r['scaling']} | {r['direction']} | {r['gpus']} | "
          f"{r['ms']:.3f} | {100 * r['efficiency']:.0f}% |")
  if opts.out:
    with open(opts.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
