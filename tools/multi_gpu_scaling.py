"""Scaling of attention and ragged_dot over the GPUs of one host.

Weak scaling (the per-GPU problem stays the same as GPUs are added; efficiency =
time on 1 GPU / time on n GPUs, 100% is perfect):

- attention, data parallel: the batch is sharded (GSPMD under `jax.jit`);
- ragged_dot, token parallel: the rows are sharded, the expert weights replicated
  (the weight gradient is then all-reduced);
- ragged_dot, expert parallel: the MoE all-to-all layout of docs/sharding.md
  (each GPU holds its experts; tokens travel to them and back; capacity factor
  1.25).

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
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax

BF16 = jnp.bfloat16
_SHRINK = 1  # --smoke divides the big dims, to check the script on CPU devices


def _d(x: int) -> int:
  return max(x // _SHRINK, 16)


def per_call_ms(f, *args, calls: int = 20, repeats: int = 3) -> float:
  """Best of `repeats` averages over `calls` back-to-back calls (ms)."""
  jax.block_until_ready(f(*args))  # compile
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return min(times)


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


def _moe_all_to_all():
  """The worked example of docs/sharding.md, tested in the multidevice tests."""
  tests = os.path.join(os.path.dirname(__file__), "..", "packages", "core", "tests",
                       "multidevice")
  sys.path.insert(0, os.path.abspath(tests))
  from test_sharding import moe_all_to_all  # pylint: disable=import-outside-toplevel
  return moe_all_to_all


def ragged_dot_expert_parallel(mesh, n):
  """Per GPU: 16384 tokens, 16 experts of K2048 x N4096 (top-1, random experts),
  capacity factor 1.25."""
  keys = jax.random.split(jax.random.key(2), 4)
  m, k, nn, e_local = _d(16384) * n, _d(2048), _d(4096), 16
  x = _put(mesh, P("d"), _rand(keys[0], (m, k)))
  ids = _put(mesh, P("d"), jax.random.randint(keys[1], (m,), 0, e_local * n))
  w = _put(mesh, P("d"), _rand(keys[2], (e_local * n, k, nn)))
  dy = _put(mesh, P("d"), _rand(keys[3], (m, nn), jnp.float32))
  # Buffers of a capacity factor 1.25 per destination (random experts: none
  # overflows at these sizes), so each GPU's traffic and work stay constant.
  capacity = -(-5 * (m // n) // (4 * n))
  layer = jax.shard_map(
      functools.partial(_moe_all_to_all(), axis_name="d", num_shards=n,
                        capacity=capacity),
      mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P("d"))
  fn = lambda x, w, ids: layer(x, ids, w)
  fwd = jax.jit(fn)
  loss = _fwd_bwd(fn, (x, w), (ids,))
  return {"fwd": per_call_ms(fwd, x, w, ids),
          "fwd+bwd": per_call_ms(loss, (x, w), dy)}


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
  return {"fwd": per_call_ms(ring, q, k, v)}


PROBLEMS = {
    "attention_data_parallel[auto]": (
        "weak", lambda mesh, n: attention_data_parallel(mesh, n, None)),
    "attention_data_parallel[triton]": (
        "weak", lambda mesh, n: attention_data_parallel(mesh, n, "triton")),
    "ragged_dot_token_parallel": ("weak", ragged_dot_token_parallel),
    "ragged_dot_expert_parallel": ("weak", ragged_dot_expert_parallel),
    "ring_attention": ("strong", ring_attention_strong),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, jax.device_count()])
  parser.add_argument("--problem", action="append", choices=sorted(PROBLEMS))
  parser.add_argument("--out", default=None, help="write the rows as JSON here")
  parser.add_argument("--smoke", type=int, default=1,
                      help="divide the big dims by this (a quick check on CPUs)")
  opts = parser.parse_args()
  global _SHRINK
  _SHRINK = opts.smoke
  rows = []
  for name in opts.problem or PROBLEMS:
    kind, run = PROBLEMS[name]
    times = {}
    for n in opts.gpus:
      mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
      try:
        times[n] = run(mesh, n)
      except Exception as e:  # pylint: disable=broad-except
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
