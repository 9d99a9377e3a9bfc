"""What the large-logit check costs an attention training call with a bias.

The backwards of cuDNN and Triton run under `large_logits.guard`: a predicate on
the forward's lse and a `lax.cond` that sends calls with huge logits to the XLA
chunked backward. This times, in one process and interleaved, the same
forward+backward (random cotangent, key-padding bias) three ways:

- `bypassed`: the guard replaced by its backward alone (what the call cost before
  the check existed);
- `guarded`: as shipped;
- `rolled`: as shipped, but with the exact branch's loops over key chunks kept
  as while loops (`large_logits.UNROLLED_CHUNKS` 0), as before they were unrolled.

It checks that the three give the same gradients and that only the guarded ones
hold a conditional, then prints each time and bypassed / variant (below 1: the
variant is slower). `--method cuda_events` (the default; CUPTI cannot time a
conditional) times each call's device time between events inside the program;
`--method loop` (`benchmarking`'s) the wall time per call of calls issued
back to back, which also sees the GPU wait while the host reads a
conditional's predicate (what a training loop pays). Run on an NVIDIA GPU
from the repository's root:

    python tools/guard_cost.py --method loop
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
from tokamax._src import benchmarking
from tokamax._src.ops.attention import large_logits


def _bypass(args, dout, backward, lse=None):
  del args, dout, lse
  return backward()


@contextlib.contextmanager
def _variant(name):
  """The patches a variant traces under (none for `guarded`)."""
  if name == "bypassed":
    with mock.patch.object(large_logits, "guard", _bypass):
      yield
  elif name == "rolled":
    with mock.patch.object(large_logits, "UNROLLED_CHUNKS", 0):
      yield
  else:
    yield


def _inputs(batch, seq, heads, head_dim, full_bias, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, dy = (jax.random.normal(key, (batch, seq, heads, head_dim), dtype) for key in keys)
  # Key padding: the last quarter of each example's keys hidden by -1e9 (no row
  # is hidden whole, so the check passes and the kernel's own backward runs).
  padded = jnp.arange(seq) >= seq - seq // 4
  bias = jnp.where(padded, -1e9, 0.0).astype(dtype)
  shape = (batch, heads, seq, seq) if full_bias else (1, 1, seq, seq)
  return q, k, v, jnp.broadcast_to(bias, shape), dy


def _step(implementation, grad_bias):
  def attend(q, k, v, bias):
    return tokamax.dot_product_attention(q, k, v, bias, implementation=implementation)

  def step(q, k, v, bias, dy):
    if grad_bias:
      _, vjp = jax.vjp(attend, q, k, v, bias)
    else:
      _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, bias), q, k, v)
    return vjp(dy)
  return step


def _check_same(contenders):
  """The variants' gradients agree (the same kernels run; a tiny difference could
  only come from XLA fusing the casts around them otherwise)."""
  first_name, first = next(iter(contenders.items()))
  for name, c in contenders.items():
    for a, b in zip(jax.tree.leaves(first.output), jax.tree.leaves(c.output)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      err = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
      if not err <= 1e-3:
        raise SystemExit(f"{name} differs from {first_name}: relative L2 {err:.2e}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--implementation", action="append",
                      help="cudnn, triton (repeat; default both)")
  parser.add_argument("--shape", default="2,4096,16,128", help="B,T,N,H (T = S)")
  parser.add_argument("--variant", action="append",
                      help="bypassed, guarded, rolled (repeat; default all)")
  parser.add_argument("--grad-bias", action="store_true", help="the bias's gradient too")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--method", default="cuda_events",
                      choices=("cuda_events", "wallclock", "loop"),
                      help="cuda_events (each call's device time), wallclock, or loop "
                      "(wall time per call of calls issued back to back: what a "
                      "training loop sees, host waits included)")
  opts = parser.parse_args()
  batch, seq, heads, head_dim = map(int, opts.shape.split(","))
  variants = opts.variant or ["bypassed", "guarded", "rolled"]
  print(f"devices {jax.devices()}; JAX {jax.__version__}; B{batch} T{seq} N{heads} "
        f"H{head_dim} bf16, grad_bias={opts.grad_bias}")
  for implementation in opts.implementation or ["cudnn", "triton"]:
    for full_bias in (False, True):
      inputs = _inputs(batch, seq, heads, head_dim, full_bias, jnp.bfloat16)
      contenders = {}
      for name in variants:
        with _variant(name):
          contenders[name] = benchmarking.prepare(
              _step(implementation, opts.grad_bias), *inputs)
      for name, c in contenders.items():
        want = name != "bypassed"
        if c.run.has_conditional != want:
          raise SystemExit(f"{name}: has_conditional {c.run.has_conditional}, expected {want}")
      _check_same(contenders)
      results = benchmarking.time_interleaved(contenders, opts.rounds, method=opts.method)
      medians = {name: data.median_evaluation_time_ms for name, data in results.items()}
      base = medians.get("bypassed")
      bias = "[B, N, T, S]" if full_bias else "[1, 1, T, S]"
      for name, ms in medians.items():
        ratio = f"{base / ms:.3f}" if base else "-"
        print(f"| {implementation} | bias {bias} | {name} | {ms:.3f} ms | {ratio} |")


if __name__ == "__main__":
  main()
