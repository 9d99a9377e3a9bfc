"""GPU conformance sweep of `tokamax.dot_product_attention` at realistic sizes.

The conformance suite (`tokamax.testing`) uses small shapes, so some paths never run
there: jax.nn's cuDNN path, for one, only takes calls at sizes where it can run. This
sweep checks every registered GPU implementation of attention (found through the
registry, not a fixed list) and ``implementation=None`` against the float32 XLA
reference (`tokamax_xla_reference.attention` on float32 upcasts at
``Precision.HIGHEST``, run over query blocks where the dense scores would not fit)
at T, S up to 16384, T != S, odd lengths, over windows (with and without
``is_causal``), per-batch lengths with rows that see no key, segment ids, bias,
mask, logits soft cap, attention sinks, GQA/MQA, head dims 64/128/256, bfloat16
and float16: the forward (alone, and the one that feeds the backward) and dq, dk,
dv, dbias, dsinks for a random cotangent.

Per case and implementation: a `NotImplementedError` is a refusal (a skip, with the
reason); a result must be within the dtype's tolerance of `tokamax.testing` (the
relative L2 and max-abs checks of `testing.assert_close`; gradients at twice the
forward's, as the conformance suite does). A wrong result is a failure. Dispatch
records show that the named implementation ran the forward; the backward that ran
is recorded (it may be another implementation's).

Run it on a GPU (about 6 minutes on one H200: 193 tests, 323 s in session 71,
before the t1024s4096 cases; --dist loadgroup keeps each case's reference on one
worker, computed once)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -n 4 --dist loadgroup \\
        -m gpu integration_tests/test_gpu_attention_sweep.py -rs

``TOKAMAX_SWEEP_LOG=<file>`` appends one JSON line per test (status, which
implementations ran forward and backward, errors, seconds).
``TOKAMAX_SWEEP_SCALE=<factor>`` multiplies every length (and large window) by the
factor, so the same sweep runs on a CPU (`xla_chunked`, `xla`, `triton` in interpret
mode; the others refuse there)::

    TOKAMAX_SWEEP_SCALE=0.01 python -m pytest -m gpu \\
        integration_tests/test_gpu_attention_sweep.py -k "xla_chunked and t4097s3001"

``TOKAMAX_SWEEP_RANDOM=<count>`` adds that many drawn cases (``TOKAMAX_SWEEP_SEED``,
default 0, picks them): lengths 1-16384, head counts, GQA/MQA, head dims, dtypes and
random mixes of every feature, as an outside checker would choose them (20-24
such cases ran in 170 s on an H200; their ids start with ``r<seed>_``)::

    TOKAMAX_SWEEP_RANDOM=24 TOKAMAX_SWEEP_SEED=72 python -m pytest -n 4 \\
        --dist loadgroup -m gpu integration_tests/test_gpu_attention_sweep.py -k r72_

Without a GPU and without that variable, the sweep's tests skip. `test_harness_smoke`
(not marked gpu) runs a few tiny cases through the same harness on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax.testing import _conformance

OP = "dot_product_attention"
_ON_GPU = jax.default_backend() == "gpu"
_SCALE_ENV = "TOKAMAX_SWEEP_SCALE"
_LOG_ENV = "TOKAMAX_SWEEP_LOG"
# Dense float32 scores of the reference in one block at most this many elements
# (B * N * T_block * S): 2**27 is 512 MiB, a few GiB with autodiff's temporaries.
_REFERENCE_BLOCK_ELEMENTS = 2**27
# Gradients are compared at twice the forward's tolerance (as `testing.check_case`).
_GRAD_TOLERANCE_SCALE = 2.0


# ---------------------------------------------------------------- the grid


@dataclasses.dataclass(frozen=True)
class SweepCase:
  """One attention call of the sweep, at full scale.

  Lengths (`t`, `s`, windows) are scaled by `TOKAMAX_SWEEP_SCALE` when inputs are
  made; per-batch sequence lengths are fractions of T and S.
  """

  size: str
  feature: str
  b: int
  t: int
  s: int
  n: int
  k: int
  h: int = 128
  dtype: str = "bfloat16"
  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  # Fractions of T and S for batch rows 0, 1, ... (the first B are used).
  q_lengths: tuple[float, ...] | None = None
  kv_lengths: tuple[float, ...] | None = None
  segments: bool = False
  bias: str | None = None  # which dims are full: "BNTS", "1NTS", "B1TS"
  # A large negative bias on every key of the first query rows and on the last
  # keys (padding): the additive mask of older code, "-1e9", or "min" (the
  # dtype's minimum, as Hugging Face's Flax models build it). Those rows'
  # weights are uniform; a backward that recomputes them from a float32 lse
  # loses log(S) there, and "min" overflows to -inf when scaled to base 2.
  bias_masks_rows: str | None = None
  mask: str | None = None
  soft_cap: float | None = None
  sinks: bool = False  # one random logit per query head

  @property
  def id(self) -> str:
    return f"{self.size}-{self.feature}-{self.dtype}-h{self.h}"

  def __str__(self):
    return self.id


SIZES = {
    # T != S, odd lengths; GQA.
    "t4097s3001": dict(b=2, t=4097, s=3001, n=4, k=2),
    # T < S, odd lengths; MQA.
    "t1023s4097": dict(b=2, t=1023, s=4097, n=4, k=1),
    # Long: T = S = 16384; GQA.
    "t16384": dict(b=1, t=16384, s=16384, n=4, k=2),
    # T < S, both multiples of 64 (sizes cuDNN's backward takes); GQA.
    "t1024s4096": dict(b=2, t=1024, s=4096, n=4, k=2),
    # 8 query heads on one kv head, T > S, lengths off the tile: Mosaic GPU's backward
    # then has fewer dK/dV blocks than SMs and splits the kv head (kv_split).
    "mqa_t3000s2049": dict(b=2, t=3000, s=2049, n=8, k=1),
}

# Window sizes are in full-scale positions: "large" ones shrink with the scale.
FEATURES = {
    "base": dict(),
    "causal": dict(is_causal=True),
    "win_L0_large": dict(window=(1000, 0)),
    "win_L0_small": dict(window=(7, 0)),
    "win_0R": dict(window=(0, 300)),
    "win_LR": dict(window=(128, 64)),
    "win_L_unbounded": dict(window=(500, None)),  # right side None: unbounded
    "win_L0_causal": dict(window=(1000, 0), is_causal=True),
    "win_LR_causal": dict(window=(33, 900), is_causal=True),
    "win_0R_causal": dict(window=(0, 5), is_causal=True),
    "lengths": dict(q_lengths=(1.0, 0.55), kv_lengths=(0.4, 0.0)),
    "lengths_causal": dict(q_lengths=(0.8, 0.25), kv_lengths=(0.3, 1.0),
                           is_causal=True),
    "lengths_window": dict(kv_lengths=(0.5, 0.1), window=(200, 0)),
    "segments": dict(segments=True),
    "segments_causal": dict(segments=True, is_causal=True),
    "bias": dict(bias="1NTS"),
    "bias_causal": dict(bias="B1TS", is_causal=True),
    "bias_masks_rows": dict(bias="B1TS", bias_masks_rows="-1e9"),
    "bias_min_masks_rows": dict(bias="B1TS", bias_masks_rows="min"),
    "mask": dict(mask="B1TS"),
    "mask_bias_window": dict(mask="1NTS", bias="B1TS", window=(300, 300)),
    "soft_cap": dict(soft_cap=2.0),
    "soft_cap_causal_window": dict(soft_cap=2.0, is_causal=True, window=(256, 0)),
    "combined": dict(is_causal=True, window=(1000, 0), segments=True,
                     kv_lengths=(0.9, 0.6), soft_cap=8.0),
    "combined_no_segments": dict(is_causal=True, window=(300, 0), bias="B1TS",
                                 q_lengths=(0.7, 1.0), kv_lengths=(1.0, 0.5)),
    "sinks": dict(sinks=True),
    "sinks_causal": dict(sinks=True, is_causal=True),
    "sinks_window_lengths": dict(sinks=True, is_causal=True, window=(1000, 0),
                                 q_lengths=(1.0, 0.55), kv_lengths=(0.8, 0.0)),
}

# Every feature at bfloat16, head dim 128 on the first size; a subset on the others.
# Compile time dominates (a few seconds per implementation and case, 15 for some
# kernels), so the features are crossed with sizes, dtypes and head dims sparsely.
_FEATURES_PER_SIZE = {
    # The largest first: xdist hands out case groups in this order.
    "t16384": ("causal", "win_L0_large", "win_LR", "lengths_window"),
    "t4097s3001": ("base", "causal", "win_L0_large", "win_L0_small", "win_0R",
                   "win_LR", "win_L0_causal", "win_LR_causal", "win_0R_causal",
                   "lengths", "lengths_window", "bias", "bias_masks_rows",
                   "bias_min_masks_rows", "mask",
                   "mask_bias_window",
                   "combined", "combined_no_segments", "sinks",
                   "sinks_window_lengths"),
    "t1023s4097": ("win_L0_large", "segments_causal", "bias_causal", "bias_masks_rows",
                   "soft_cap_causal_window", "sinks_causal"),
    # Per-batch lengths (a batch row with no keys among them) where every
    # implementation's backward runs them, cuDNN's included.
    "t1024s4096": ("lengths", "lengths_causal"),
    "mqa_t3000s2049": ("base", "causal", "lengths", "segments_causal",
                       "win_L0_large", "sinks_causal"),
}
# Dtypes and head dims crossed over a few features: (size, feature, dtype, h).
_CROSSED = [
    ("t16384", "win_L0_large", "float16", 128),
    ("t4097s3001", "win_LR_causal", "float16", 128),
    ("t4097s3001", "win_L0_large", "float16", 64),
    ("t4097s3001", "causal", "bfloat16", 256),
    ("t4097s3001", "win_LR", "float16", 256),
    ("t1023s4097", "lengths", "float16", 64),
    ("t4097s3001", "sinks_causal", "float16", 64),
    ("t1024s4096", "lengths", "float16", 256),
    ("mqa_t3000s2049", "causal", "float16", 256),
    ("mqa_t3000s2049", "base", "bfloat16", 64),
]
# "xla" is the reference's own dense code (it materializes [B, N, T, S]): checked
# on these cases only.
_DENSE_XLA_CASES = {
    "t4097s3001-win_L0_large-bfloat16-h128", "t4097s3001-combined-bfloat16-h128",
    "t4097s3001-combined_no_segments-bfloat16-h128",
    "t4097s3001-mask_bias_window-bfloat16-h128", "t1023s4097-win_L0_large-bfloat16-h128",
    "t16384-win_L0_large-bfloat16-h128", "t4097s3001-win_LR-float16-h256",
    "t1023s4097-lengths-float16-h64",
}


# Random cases (`TOKAMAX_SWEEP_RANDOM=<count>`, `TOKAMAX_SWEEP_SEED=<seed>`): calls of
# the kinds a user or an outside checker picks, drawn rather than listed, so that
# each new seed tries feature mixes, lengths and head counts no fixed list holds.
_RANDOM_ENV = "TOKAMAX_SWEEP_RANDOM"
_SEED_ENV = "TOKAMAX_SWEEP_SEED"
# Most drawn lengths are realistic (256-16384), a fifth short (1-255); B * N * T * S
# stays below this many score elements, so that a case's float32 reference (over
# query blocks, at HIGHEST precision) runs in seconds.
_RANDOM_MAX_SCORES = 2**29


def _random_score_limit(bias, mask) -> int:
  """A dense bias or mask is B * N * T * S host and device elements (several
  copies in float32): fewer of them than of scores alone."""
  return _RANDOM_MAX_SCORES >> (3 if bias or mask else 0)


def _random_length(rng: np.random.Generator) -> int:
  """A length log-uniform over 256-16384 (1-255 one time in five): odd, off
  the tiles, or a power of two."""
  low, high = (1, 256) if rng.random() < 0.2 else (256, 16384)
  n = int(np.exp(rng.uniform(np.log(low), np.log(high))))
  kind = rng.integers(3)
  if kind == 0:
    return n | 1  # odd
  if kind == 1:
    return n
  return 1 << (n.bit_length() - 1)  # a power of two


def _random_window(rng: np.random.Generator, t: int, s: int):
  """A (left, right) window: sides 0, small, large or None (unbounded)."""
  def side():
    kind = rng.integers(4)
    if kind == 0:
      return 0
    if kind == 1:
      return int(rng.integers(1, 64))
    if kind == 2:
      return int(rng.integers(64, max(65, max(t, s))))
    return None
  while True:
    window = (side(), side())
    if window != (None, None):
      return window


def random_case(seed: int, index: int) -> SweepCase:
  """The `index`-th random case of `seed` (the same on every worker)."""
  rng = np.random.default_rng([seed, index])
  k = int(rng.choice([1, 2, 4]))
  n = k * int(rng.choice([1, 2, 4, 8]))
  h = int(rng.choice([64, 128, 128, 256]))
  t = _random_length(rng)
  s = t if rng.random() < 0.4 else _random_length(rng)
  b = int(rng.integers(1, 4))
  features: dict[str, Any] = {}
  if rng.random() < 0.5:
    features["is_causal"] = True
  if rng.random() < 0.4:
    features["window"] = _random_window(rng, t, s)
  if rng.random() < 0.25:
    features["q_lengths"] = tuple(float(f) for f in rng.choice(
        [0.0, 0.3, 0.55, 1.0], b))
  if rng.random() < 0.25:
    features["kv_lengths"] = tuple(float(f) for f in rng.choice(
        [0.0, 0.1, 0.6, 1.0], b))
  if rng.random() < 0.2:
    features["segments"] = True
  if rng.random() < 0.15:
    features["bias"] = str(rng.choice(["BNTS", "1NTS", "B1TS", "11TS"]))
  if rng.random() < 0.1:
    features["mask"] = str(rng.choice(["B1TS", "1NTS", "BNTS"]))
  if rng.random() < 0.15:
    features["soft_cap"] = float(rng.choice([2.0, 30.0]))
  if rng.random() < 0.2:
    features["sinks"] = True
  dtype = str(rng.choice(["bfloat16", "float16"]))
  limit = _random_score_limit(features.get("bias"), features.get("mask"))
  while b > 1 and b * n * t * s > limit:
    b -= 1
  while n > k and b * n * t * s > limit:
    n //= 2
  while b * n * t * s > limit:  # one row and kv head: shorten the longer side
    t, s = (t // 2 | 1, s) if t >= s else (t, s // 2 | 1)
  for name, default in (("q_lengths", 1.0), ("kv_lengths", 1.0)):
    if name in features:  # one fraction per batch row
      features[name] = (features[name] + (default,) * b)[:b]
  feature = "_".join(sorted(features)) or "plain"
  return SweepCase(size=f"r{seed}_{index}-b{b}t{t}s{s}n{n}k{k}", feature=feature,
                   dtype=dtype, h=h, b=b, t=t, s=s, n=n, k=k, **features)


def random_cases() -> list[SweepCase]:
  count = int(os.environ.get(_RANDOM_ENV) or 0)
  seed = int(os.environ.get(_SEED_ENV) or 0)
  return [random_case(seed, i) for i in range(count)]


def _make_case(size, feature, dtype="bfloat16", h=128) -> SweepCase:
  return SweepCase(size=size, feature=feature, dtype=dtype, h=h, **SIZES[size],
                   **FEATURES[feature])


def sweep_cases() -> list[SweepCase]:
  cases = [_make_case(size, f) for size, feats in _FEATURES_PER_SIZE.items()
           for f in feats]
  cases[len(_FEATURES_PER_SIZE["t16384"]):len(_FEATURES_PER_SIZE["t16384"])] = [
      _make_case(*c) for c in _CROSSED]
  assert len({c.id for c in cases}) == len(cases)
  return cases


def gpu_implementations() -> list[str]:
  """The registered implementations of attention that can run on a GPU."""
  return [s.name for s in tokamax.implementations(OP)
          if set(s.platforms) & {"gpu", "cuda"}]


# ---------------------------------------------------------------- inputs


def _scaled(n: int, scale: float) -> int:
  if scale == 1.0:
    return n
  m = max(1, int(round(n * scale)))
  return m + 1 if n % 2 and not m % 2 else m  # odd stays odd


def _scaled_window(w: int | None, scale: float) -> int | None:
  return w if w is None or w < 32 else max(1, int(round(w * scale)))


@dataclasses.dataclass
class Inputs:
  """One case's inputs, host-side (numpy), float arrays in the case's dtype."""

  floats: dict[str, np.ndarray]  # query, key, value[, bias][, sinks]
  mask: np.ndarray | None
  q_lengths: np.ndarray | None
  kv_lengths: np.ndarray | None
  q_segments: np.ndarray | None
  kv_segments: np.ndarray | None
  window: tuple[int | None, int | None] | None
  scale: float
  cotangent: np.ndarray  # exact in the dtype, stored as float32


def make_inputs(case: SweepCase, scale: float) -> Inputs:
  rng = np.random.default_rng(_conformance.default_seed(case.id))
  dtype = jnp.dtype(case.dtype)
  b, n, k, h = case.b, case.n, case.k, case.h
  t, s = _scaled(case.t, scale), _scaled(case.s, scale)

  def normal(shape):
    return np.asarray(jnp.asarray(rng.standard_normal(shape, np.float32), dtype))

  floats = dict(query=normal((b, t, n, h)), key=normal((b, s, k, h)),
                value=normal((b, s, k, h)))
  full = dict(B=b, N=n, T=t, S=s)
  if case.bias:
    floats["bias"] = normal(tuple(full.get(d, 1) for d in case.bias))
    if case.bias_masks_rows:
      bias = floats["bias"].copy()
      large = (float(jnp.finfo(dtype).min) if case.bias_masks_rows == "min"
               else float(case.bias_masks_rows))
      bias[..., :3, :] = large
      bias[..., s - s // 5:] = large
      floats["bias"] = bias
  if case.sinks:
    # Spread so that some sinks outweigh a row's keys and some do not.
    floats["sinks"] = normal((n,)) * 3
  mask = None
  if case.mask:
    mask = rng.random(tuple(full.get(d, 1) for d in case.mask)) < 0.7
    mask[..., 0, :] = False  # a query row with no visible key
  q_lengths = kv_lengths = None
  if case.q_lengths:  # the first B fractions
    q_lengths = np.asarray([int(round(f * t)) for f in case.q_lengths[:b]], np.int32)
  if case.kv_lengths:
    kv_lengths = np.asarray([int(round(f * s)) for f in case.kv_lengths[:b]], np.int32)
  q_segments = kv_segments = None
  if case.segments:
    q_segments = np.sort(rng.integers(0, 4, (b, t)), -1).astype(np.int32)
    kv_segments = np.sort(rng.integers(0, 4, (b, s)), -1).astype(np.int32)
    kv_segments[0] = np.minimum(kv_segments[0], 2)  # segment 3 of row 0: no keys
  window = None
  if case.window is not None:
    window = tuple(_scaled_window(w, scale) for w in case.window)
  cotangent = np.asarray(jnp.asarray(normal((b, t, n, h)), jnp.float32))
  return Inputs(floats, mask, q_lengths, kv_lengths, q_segments, kv_segments, window,
                1.0 / float(np.sqrt(h)), cotangent)


# ---------------------------------------------------------------- the reference


# Without XLA's GEMM autotuning: it took half a minute per new reference shape on
# an H200 (the reference's speed does not matter; the checked kernels keep theirs).
@functools.partial(jax.jit, static_argnames=("static",),
                   compiler_options={"xla_gpu_autotune_level": 0})
def _reference_block(floats, mask, q_lengths, kv_lengths, q_segments, kv_segments,
                     q_offset, cotangent, *, static):
  import tokamax_xla_reference
  scale, is_causal, window, soft_cap = static

  def f(fl):
    return tokamax_xla_reference.attention(
        fl["query"], fl["key"], fl["value"], fl.get("bias"), mask, scale=scale,
        is_causal=is_causal, local_window=window, logits_soft_cap=soft_cap,
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        q_segment_ids=q_segments, kv_segment_ids=kv_segments,
        precision=jax.lax.Precision.HIGHEST, q_offset=q_offset, sinks=fl.get("sinks"))

  out, vjp, lse = jax.vjp(f, floats, has_aux=True)
  (grads,) = vjp(cotangent)
  return out, lse, grads


def reference(case: SweepCase, x: Inputs,
              block_elements: int = _REFERENCE_BLOCK_ELEMENTS) -> dict[str, np.ndarray]:
  """The float32 reference: out, empty (bool [B, T, N]: rows with no visible key)
  and d<name> for each float input; host float32.

  Query rows are independent given all keys, so the dense reference runs over
  blocks of queries (``q_offset`` places a block for the causal mask and window;
  per-row mask, bias, lengths and segment ids are sliced). The last block ends at
  T and overlaps the one before; its overlapping rows get a zero cotangent, so
  they add nothing to dk, dv, dsinks and a broadcast dbias.
  """
  f32 = {name: jnp.asarray(v, jnp.float32) for name, v in x.floats.items()}
  b, t, n, _ = f32["query"].shape
  s = f32["key"].shape[1]
  block = max(1, min(t, block_elements // max(1, b * n * s)))
  static = (x.scale, case.is_causal, x.window, case.soft_cap)
  mask = None if x.mask is None else jnp.asarray(x.mask)
  kv_lengths = None if x.kv_lengths is None else jnp.asarray(x.kv_lengths)
  kv_segments = None if x.kv_segments is None else jnp.asarray(x.kv_segments)
  cotangent = jnp.asarray(x.cotangent)

  def rows(a, start, axis):  # a block of query rows, unless broadcast over T
    if a is None or a.shape[axis] == 1:
      return a
    return jax.lax.slice_in_dim(a, start, start + block, axis=axis)

  out = np.zeros((b, t, n, f32["value"].shape[-1]), np.float32)
  empty = np.zeros((b, t, n), bool)
  dq = np.zeros(f32["query"].shape, np.float32)
  bias = f32.get("bias")
  bias_rows = bias is not None and bias.shape[2] == t
  dbias = np.zeros(bias.shape, np.float32) if bias is not None else None
  dk = dv = dbias_sum = dsinks = None
  done = 0
  while done < t:
    start = min(done, t - block)
    keep = jnp.arange(start, start + block) >= done
    block_floats = dict(query=rows(f32["query"], start, 1), key=f32["key"],
                        value=f32["value"])
    if "sinks" in f32:
      block_floats["sinks"] = f32["sinks"]
    if bias is not None:
      block_floats["bias"] = rows(bias, start, 2)
    q_lengths = None
    if x.q_lengths is not None:
      q_lengths = jnp.clip(jnp.asarray(x.q_lengths) - start, 0, block)
    q_segments = None if x.q_segments is None else rows(jnp.asarray(x.q_segments),
                                                        start, 1)
    block_cotangent = jnp.where(keep[None, :, None, None],
                                rows(cotangent, start, 1), 0.0)
    o, lse, g = _reference_block(block_floats, rows(mask, start, 2), q_lengths,
                                 kv_lengths, q_segments, kv_segments,
                                 jnp.int32(start), block_cotangent, static=static)
    new = slice(done - start, block)
    out[:, done:start + block] = np.asarray(o)[:, new]
    empty[:, done:start + block] = np.moveaxis(np.isinf(np.asarray(lse)), 1, 2)[:, new]
    dq[:, done:start + block] = np.asarray(g["query"])[:, new]
    dk = g["key"] if dk is None else dk + g["key"]
    dv = g["value"] if dv is None else dv + g["value"]
    if "sinks" in g:
      dsinks = g["sinks"] if dsinks is None else dsinks + g["sinks"]
    if bias_rows:
      dbias[:, :, done:start + block] = np.asarray(g["bias"])[:, :, new]
    elif bias is not None:
      dbias_sum = g["bias"] if dbias_sum is None else dbias_sum + g["bias"]
    done = start + block
  result = dict(out=out, empty=empty, dquery=dq, dkey=np.asarray(dk),
                dvalue=np.asarray(dv))
  if bias is not None:
    result["dbias"] = dbias if bias_rows else np.asarray(dbias_sum)
  if dsinks is not None:
    result["dsinks"] = np.asarray(dsinks)
  return result


_reference_cache: dict[Any, Any] = {}


def cached_inputs_and_reference(case: SweepCase, scale: float):
  """The last case's inputs and reference (each worker keeps one case)."""
  key = (case, scale)
  if key not in _reference_cache:
    _reference_cache.clear()
    started = time.perf_counter()
    x = make_inputs(case, scale)
    _reference_cache[key] = (x, reference(case, x))
    _log(dict(case=case.id, implementation="(reference)", status="computed",
              seconds=round(time.perf_counter() - started, 2)))
  return _reference_cache[key]


# ---------------------------------------------------------------- one check


class Refused(Exception):
  """The implementation raised NotImplementedError (message: its reason)."""


def _attention_fn(case: SweepCase, x: Inputs, implementation):
  def call(floats, extras):
    return tokamax.dot_product_attention(
        floats["query"], floats["key"], floats["value"], floats.get("bias"),
        extras["mask"], scale=x.scale, is_causal=case.is_causal,
        query_seq_lengths=extras["q_lengths"],
        key_value_seq_lengths=extras["kv_lengths"], local_window_size=x.window,
        logits_soft_cap=case.soft_cap, q_segment_ids=extras["q_segments"],
        kv_segment_ids=extras["kv_segments"], sinks=floats.get("sinks"),
        implementation=implementation)
  return call


def run_case(case: SweepCase, implementation: str | None, scale: float = 1.0, *,
             _call_window: Any = "same") -> dict[str, Any]:
  """Runs `implementation` on `case` and checks it against the reference.

  Returns:
    A record: status "passed" with which implementations ran forward and
    backward and the relative L2 errors.

  Raises:
    Refused: the implementation raised NotImplementedError (forward, or backward
      after a forward that matched the reference).
    AssertionError: a result off the reference (every check's message).
  """
  x, ref = cached_inputs_and_reference(case, scale)
  if _call_window != "same":  # the harness's own test: a deliberately wrong call
    x = dataclasses.replace(x, window=_call_window)
  call = _attention_fn(case, x, implementation)
  dtype = jnp.dtype(case.dtype)
  floats = {name: jnp.asarray(v) for name, v in x.floats.items()}
  extras = dict(mask=x.mask, q_lengths=x.q_lengths, kv_lengths=x.kv_lengths,
                q_segments=x.q_segments, kv_segments=x.kv_segments)
  extras = {name: None if v is None else jnp.asarray(v) for name, v in extras.items()}
  cotangent = jnp.asarray(x.cotangent, dtype)

  @jax.jit
  def forward_and_grads(floats, extras, cotangent):
    out = call(floats, extras)  # the forward alone (inference)
    out_for_grad, vjp = jax.vjp(lambda f: call(f, extras), floats)
    (grads,) = vjp(cotangent)
    return out, out_for_grad, grads

  @jax.jit
  def forward_only(floats, extras):
    return call(floats, extras)

  started = time.perf_counter()
  try:
    return _run_and_check(case, implementation, x, ref, forward_and_grads,
                          forward_only, floats, extras, cotangent, started)
  except Refused as e:
    if not getattr(e, "logged", False):
      _log(dict(case=case.id, implementation=implementation, status="refused",
                reason=str(e)[:500]))
    raise
  except AssertionError:
    raise  # logged with its errors
  except Exception as e:
    _log(dict(case=case.id, implementation=implementation, status="error",
              reason=f"{type(e).__name__}: {str(e)[:1500]}",
              seconds=round(time.perf_counter() - started, 2)))
    raise


def _run_and_check(case, implementation, x, ref, forward_and_grads, forward_only,
                   floats, extras, cotangent, started):
  del x
  dtype = jnp.dtype(case.dtype)
  backward_refusal = None
  # On a CPU, a named Pallas kernel runs in interpret mode; None gets what users
  # get there.
  interpret = not _ON_GPU and implementation is not None
  with tokamax.interpret(interpret), tokamax.record_dispatch() as records:
    try:
      outs = jax.block_until_ready(forward_and_grads(floats, extras, cotangent))
    except NotImplementedError as e:
      backward_refusal = e
      del records[:]
      try:
        outs = (jax.block_until_ready(forward_only(floats, extras)), None, None)
      except NotImplementedError as e2:
        raise Refused(str(e2)) from e2
  forward_ran = sorted({r.implementation for r in records if r.direction == "forward"})
  backward_ran = sorted({r.implementation for r in records
                         if r.direction == "backward"})
  record = dict(case=case.id, implementation=implementation, forward=forward_ran,
                backward=backward_ran, errors={})
  problems = []

  def check(what, actual, expected, tol_scale):
    record["errors"][what] = testing.relative_l2_error(
        np.asarray(jnp.asarray(actual, jnp.float32)), expected)
    try:
      testing.assert_close(actual, expected, dtype, what=f"{case.id} {what}",
                           scale=tol_scale, gpu=_ON_GPU)
    except AssertionError as e:
      problems.append(str(e))

  def check_empty_rows(what, out):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    bad = ref["empty"] & np.any(out != 0, axis=-1)
    if bad.any():
      problems.append(f"{case.id} {what}: {int(bad.sum())} (batch, query, head) rows "
                      "with no visible key are not 0")

  out, out_for_grad, grads = outs
  if out.dtype != dtype:
    problems.append(f"{case.id}: output dtype {out.dtype}, expected {dtype}")
  check("forward", out, ref["out"], 1.0)
  check_empty_rows("forward", out)
  if out_for_grad is not None:
    check("forward (for grad)", out_for_grad, ref["out"], 1.0)
    check_empty_rows("forward (for grad)", out_for_grad)
    for name, g in grads.items():
      if g.dtype != dtype:
        problems.append(f"{case.id}: d{name} dtype {g.dtype}, expected {dtype}")
      check(f"d{name}", g, ref[f"d{name}"], _GRAD_TOLERANCE_SCALE)
  if implementation is not None and forward_ran != [implementation]:
    problems.append(f"{case.id}: implementation={implementation!r} but the forward "
                    f"ran {forward_ran}")
  if out_for_grad is not None and not backward_ran:
    problems.append(f"{case.id}: no backward was dispatched")
  record["seconds"] = round(time.perf_counter() - started, 2)
  if problems:
    record["status"] = "failed"
    _log(record)
    raise AssertionError("\n".join(problems))
  if backward_refusal is not None:
    record["status"] = "backward refused"
    record["reason"] = str(backward_refusal)[:500]
    _log(record)
    refused = Refused(f"forward matches the reference (ran {forward_ran}); the "
                      f"backward refused: {backward_refusal}")
    refused.logged = True
    raise refused
  record["status"] = "passed"
  _log(record)
  return record


def _log(record):
  path = os.environ.get(_LOG_ENV)
  if path:
    with open(path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record, default=str) + "\n")


# ---------------------------------------------------------------- pytest


def _sweep_scale() -> float | None:
  text = os.environ.get(_SCALE_ENV)
  if text:
    return float(text)
  return 1.0 if _ON_GPU else None


_IMPLEMENTATIONS = gpu_implementations() + [None]
# Drawn cases that found a bug, kept: each fails on the code before its fix.
# r72_13 (B1 T128 S8192 H256 float16, key length 0): cuDNN's dk and dv were
# non-zero past the key length (session 72).
_KEPT_RANDOM_CASES = [random_case(72, 13)]
_CASES = sweep_cases() + _KEPT_RANDOM_CASES + [
    c for c in random_cases() if c not in _KEPT_RANDOM_CASES]  # each once


def _params():
  for case in _CASES:
    for name in _IMPLEMENTATIONS:
      if name == "xla" and case.id not in _DENSE_XLA_CASES:
        continue
      yield pytest.param(case, name, id=f"{case.id}-{name or 'auto'}",
                         marks=pytest.mark.xdist_group(case.id))


@pytest.mark.gpu
@pytest.mark.parametrize("case,implementation", list(_params()))
def test_sweep(case, implementation):
  scale = _sweep_scale()
  if scale is None:
    pytest.skip(f"needs a GPU (or {_SCALE_ENV}=<factor> to shrink the lengths)")
  try:
    record = run_case(case, implementation, scale)
  except Refused as e:
    pytest.skip(f"refused by {implementation}: {e}")
  if implementation is None:
    print(f"implementation=None ran forward {record['forward']}, backward "
          f"{record['backward']}")
  elif record["backward"] != [implementation]:
    print(f"{implementation}: backward ran {record['backward']}")


def test_sweep_covers_gpu_implementations():
  """Every GPU implementation we ship is in the sweep (found through the registry)."""
  assert {"cudnn", "triton", "mosaic_gpu", "xla_chunked"} <= set(_IMPLEMENTATIONS)


_SMOKE_SCALE = 0.01


def test_harness_smoke():
  """A few tiny sweep cases through the same harness on any machine: a match
  passes, a refusal is reported as one, a wrong call is caught."""
  cases = [_make_case("t4097s3001", "win_L0_large"),
           _make_case("t1023s4097", "combined", "float16", 64),
           _make_case("t4097s3001", "mask_bias_window"),
           _make_case("t4097s3001", "sinks_window_lengths"),
           _make_case("t1023s4097", "bias_masks_rows"),
           _make_case("t4097s3001", "bias_min_masks_rows")]
  for case in cases:
    record = run_case(case, "xla_chunked", _SMOKE_SCALE)
    assert record["status"] == "passed" and record["forward"] == ["xla_chunked"]
    assert record["backward"], record
  record = run_case(cases[0], None, _SMOKE_SCALE)
  assert record["status"] == "passed" and record["forward"], record
  if not _ON_GPU:
    with pytest.raises(Refused, match="cuDNN"):
      run_case(cases[0], "cudnn", _SMOKE_SCALE)
  # The reference over query blocks (the last overlapping) equals one block; with
  # bias rows and bias broadcast over T, mask, lengths, segments, window, causal.
  for case in (cases[2], dataclasses.replace(cases[1], bias="1N1S", mask="BN1S")):
    x = make_inputs(case, _SMOKE_SCALE)
    whole = reference(case, x)
    b, t, n, _ = x.floats["query"].shape
    blocks = reference(case, x, block_elements=12 * b * n * x.floats["key"].shape[1])
    assert t % 12 and whole.keys() == blocks.keys()
    for name, value in whole.items():
      np.testing.assert_allclose(blocks[name], value, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{case.id} {name}")
  # (L, 0) called as (L, L): the result is wrong, and the harness must say so.
  window = _scaled_window(cases[0].window[0], _SMOKE_SCALE)
  with pytest.raises(AssertionError, match="forward"):
    run_case(cases[0], "xla_chunked", _SMOKE_SCALE, _call_window=(window, window))


def test_random_cases_are_reproducible_and_run():
  """`TOKAMAX_SWEEP_RANDOM`'s cases: the same for a seed on every worker, other for
  another seed, every feature drawn within 40 cases, and they run through the
  harness (tiny, on any machine)."""
  first = [random_case(5, i) for i in range(40)]
  assert first == [random_case(5, i) for i in range(40)]
  assert first != [random_case(6, i) for i in range(40)]
  assert len({c.id for c in first}) == len(first)
  drawn = {field for c in first for field in ("is_causal", "window", "q_lengths",
                                              "kv_lengths", "segments", "bias",
                                              "mask", "soft_cap", "sinks")
           if getattr(c, field)}
  assert len(drawn) == 9, drawn
  assert {c.h for c in first} == {64, 128, 256}
  assert {c.dtype for c in first} == {"bfloat16", "float16"}
  for c in first:
    assert c.b * c.n * c.t * c.s <= _random_score_limit(c.bias, c.mask)
    assert c.n % c.k == 0
    for lengths in (c.q_lengths, c.kv_lengths):
      assert lengths is None or len(lengths) == c.b
  for case in first[:4]:
    record = run_case(case, "xla_chunked", _SMOKE_SCALE)
    assert record["status"] == "passed" and record["forward"] == ["xla_chunked"]
