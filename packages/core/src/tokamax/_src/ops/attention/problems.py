"""Attention's benchmark shapes, and a typical call to ask implementations about."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokamax._src import benchmarking
from tokamax._src.ops.attention import api
from tokamax._src.ops.attention.api import AttentionArgs
from tokamax._src.problem import BF16, Problem, rand


def _jax_nn_attention_impl() -> str | None:
  """cuDNN on NVIDIA GPUs (the peer to beat), jax.nn's default elsewhere."""
  return "cudnn" if benchmarking.is_nvidia_gpu(jax.devices()[0]) else None


def visible_pairs(t: int, causal: bool, window: int | None) -> int:
  """(query, key) pairs a T x T attention computes: all, causal (each row its
  t + 1 keys), or a causal sliding window (at most `window` keys back, as Mistral's
  local_window_size=(window, 0))."""
  if not causal:
    if window is not None:
      raise ValueError("a bench window is a causal sliding window: pass causal=True")
    return t * t
  if window is None:
    return t * (t + 1) // 2
  w = min(window, t - 1)
  return (w + 1) * t - w * (w + 1) // 2


def problem(b, t, n, k, h, causal, dtype=BF16, window=None, sinks=False) -> Problem:
  """`window`: a causal sliding window of that many keys back. `sinks`: tokamax
  gets one sink per head; the peer (no sinks in jax.nn) runs the same call
  without them: a speed yardstick, not a numerical reference."""
  def make():
    ks = jax.random.split(jax.random.key(0), 4)
    inputs = (rand(ks[0], (b, t, n, h), dtype), rand(ks[1], (b, t, k, h), dtype),
              rand(ks[2], (b, t, k, h), dtype))
    return inputs + ((rand(ks[3], (n,), jnp.float32),) if sinks else ())
  flops = 4 * b * n * h * visible_pairs(t, causal, window)
  name = (f"B{b} T{t} N{n}" + (f" K{k}" if k != n else "") + f" H{h}"
          + (" causal" if causal else "") + (f" window {window}" if window else "")
          + (" sinks" if sinks else "") + ("" if dtype == BF16 else " f16"))
  local = None if window is None else (window, 0)
  peer_impl = _jax_nn_attention_impl()
  peer = "cudnn (jax.nn)" if peer_impl else "jax.nn"
  if sinks:
    peer += ", no sinks"

  def ours(a, i):
    q, k_, v = a[:3]
    return api.dot_product_attention(
        q, k_, v, is_causal=causal, local_window_size=local,
        sinks=a[3] if sinks else None, implementation=i)
  return Problem(
      "dot_product_attention", name, make, ours,
      {peer: lambda a: jax.nn.dot_product_attention(
          *a[:3], is_causal=causal, local_window_size=local, implementation=peer_impl)},
      flops=flops, reference=("tokamax xla",) if sinks else (peer, "tokamax xla"),
      dtype=jnp.dtype(dtype).name)


def reference_problems() -> list[Problem]:
  """The shapes of shared/BENCHMARKS.md, then sliding windows, sinks and head dim
  256 (shapes beyond that table which the models the library serves use)."""
  return [
      problem(4, 4096, 16, 16, 128, False), problem(4, 4096, 16, 16, 128, True),
      problem(2, 8192, 16, 16, 64, False), problem(2, 8192, 16, 16, 64, True),
      problem(2, 8192, 32, 8, 128, True),
      problem(4, 4096, 16, 16, 128, False, jnp.float16),
      problem(4, 4096, 16, 16, 128, True, jnp.float16),
      # Sliding windows (Mistral/Gemma style) and attention sinks (gpt-oss).
      problem(2, 8192, 32, 8, 128, True, window=1024),
      problem(1, 16384, 32, 8, 128, True, window=4096),
      problem(2, 4096, 32, 8, 128, True, sinks=True),
      # Head dim 256 (Gemma-2-9B-like heads).
      problem(2, 4096, 16, 8, 256, True),
  ]


def grid_problems() -> list[Problem]:
  """The shapes tuned data is measured on (`autotune --grid`): sequence lengths
  4x apart at 32768 tokens, head dims 64-256, MHA and GQA (each head dim: the two
  rank differently, notes/MEASUREMENTS.md, session 13, item 5), causal or not, and
  sliding windows; calls between them take the nearest ones' ranking
  (`tuning.nearest`).

  And the same at 8192 tokens (T1024 and T4096), a quarter of the work: there
  the rankings can turn (H200, notes/MEASUREMENTS.md session 53, items 5-6:
  mosaic_gpu's forward at its heuristic config ran 1.05x cuDNN's at B2 T4096
  N16 K8 H256 causal and 0.96x at B8 T4096 N32 K8 H256 causal, its nearest
  point at 32768 tokens), and the end-to-end benchmark's dense block (B2 T4096
  N32 K8 H128 causal) is one of them.

  And lengths no multiple of 128 (T1000, T4000, T15000 at about 32768 tokens,
  T1000 and T4000 at about 8192):
  calls at lengths no multiple of 128 take only their data, calls at lengths
  no multiple of 8 none (`nearest.TILE_ALIGNED`: Mosaic GPU runs other
  kernels there).

  And one batch row of T2048 (2048 tokens): with few blocks a head the
  rankings turn again. Mosaic GPU's forward+backward ran 1.07x faster than
  cuDNN's at B1 T2048 N32 K8 H128 without causal, where the nearest point, B2
  T4096, ranked cuDNN's backward first (H200, notes/MEASUREMENTS.md session 76,
  item 1).

  And multi-query attention (8 query heads on one kv head) at H128, at the
  same lengths: the GQA points (32 on 8) are more than `nearest.RADIUS` away from it,
  so `None` took the registry's order there, cuDNN's forward, which ran 1.05x
  Mosaic GPU's at B1 T15616 N8 K1 H128 (H200, notes/MEASUREMENTS.md, session
  72, item 4). And the same at H64, which the H128 points are too far from:
  `None` ran 1.05x the fastest forward+backward at B1 T4096 N8 K1 H64 (H200,
  notes/MEASUREMENTS.md, session 76, item 3).

  And the windows (causal, W1024 at T8192, W4096 at T16384) at MHA H64 and
  H128 as well as GQA H128: a window call of another kind (MHA against GQA)
  has no point within `nearest.RADIUS` of its own, so without them `None` took
  the registry's order, cuDNN, at MHA H64 windows where Mosaic GPU ran
  1.04-1.09x faster (H100, B2 T8192 N16 H64 W1024, B4 T4096 N16 H64 W2048;
  notes/MEASUREMENTS.md, session 82, item 3). (Since session 86 the other
  head sharing's points answer where a call's own kind has none near,
  `nearest.KIND_FALLBACK`.)

  And the bench's W4096 window at one batch row (B1 T16384, 16384 tokens): its
  nearest point, B2 T16384, ranked Mosaic GPU and cuDNN even over forward+backward
  (12.5413 against 12.5409 ms), and at B1 `None` ran cuDNN 3.8% slower than
  Mosaic GPU (H100, notes/MEASUREMENTS.md, session 95, item 4)."""
  shapes = []
  for tokens, lengths in ((32768, (1024, 4096, 16384)), (8192, (1024, 4096)),
                          (32768, (1000, 4000, 15000)), (8192, (1000, 4000)),
                          (2048, (2048,))):
    for t in lengths:
      for h in (64, 128, 256):
        for n, k in ((16, 16), (32, 8)):
          shapes += [(tokens // t, t, n, k, h, c) for c in (False, True)]
  for tokens, lengths in ((32768, (1024, 4096, 16384)), (8192, (1024, 4096)),
                          (32768, (1000, 4000, 15000)), (8192, (1000, 4000)),
                          (2048, (2048,))):
    shapes += [(tokens // t, t, 8, 1, h, c)
               for t in lengths for h in (64, 128) for c in (False, True)]
  windows = [problem(32768 // t, t, n, k, h, True, window=w)
             for n, k, h in ((32, 8, 128), (16, 16, 64), (16, 16, 128))
             for t, w in ((8192, 1024), (16384, 4096))]
  windows += [problem(1, 16384, n, k, h, True, window=4096)
              for n, k, h in ((32, 8, 128), (16, 16, 64), (16, 16, 128))]
  return [problem(*s) for s in shapes] + windows


def quick_problems() -> list[Problem]:
  """Small shapes of the same kinds, for CPUs (seconds each)."""
  return [
      problem(1, 256, 4, 4, 64, False), problem(1, 256, 4, 4, 64, True),
      problem(1, 256, 8, 2, 64, True),
      problem(1, 256, 8, 2, 64, True, window=64),
      problem(1, 256, 8, 2, 64, True, sinks=True),
  ]


def probe_args() -> AttentionArgs:
  """A typical bf16 call, as shapes only, to ask `check_supported` about."""
  s = jax.ShapeDtypeStruct
  return AttentionArgs(query=s((2, 1024, 8, 128), BF16), key=s((2, 1024, 8, 128), BF16),
                       value=s((2, 1024, 8, 128), BF16), scale=128**-0.5,
                       is_causal=True)
