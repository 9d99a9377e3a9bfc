"""Every Mosaic TPU kernel under TPU interpret mode's race detector.

`_common.detect_races()` runs the interpreter with its happens-before race
detector and two simulated TensorCores, so the "parallel" grid dims are split
between two threads: a kernel that declares a dim parallel while two of its
steps write one output block (or that reads a buffer a DMA is still writing)
is reported. Each test also checks the results against the XLA reference, so a
run that silently did nothing cannot pass, and that the detector recorded the
accesses of every kernel the call ran.

`test_detector_flags_a_racy_kernel` proves the check can fail: a kernel whose
two parallel steps write the same block is flagged, the same kernel with the
dim declared "arbitrary" is not.

Shapes are tiny: the detector makes the interpreter several times slower.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tokamax
from tokamax import testing
from tokamax._src.tuning import context as tuning_context
from tokamax._src import dispatch
from tokamax._src.ops import attention as attention_op
import tokamax_xla_reference as xla_ref
from tokamax_tpu_mosaic import _common
from tokamax_tpu_mosaic import attention as att
from tokamax_tpu_mosaic import gated_linear_unit as glu
from tokamax_tpu_mosaic import layer_norm as ln
from tokamax_tpu_mosaic import ragged_dot as rd

HIGHEST = jax.lax.Precision.HIGHEST
_seed = iter(range(10**6))

pytestmark = pytest.mark.skipif(jax.default_backend() == "tpu",
                                reason="the race detector is an interpret-mode tool")


def _keys(n):
  return jax.random.split(jax.random.key(next(_seed) + 777), n)


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _vjp_under_detector(fn, primals, num_kernels):
  """fn's output and its VJP at a random cotangent, traced and run under the detector."""
  with (tokamax.interpret(), tuning_context.use(_SmallBlocks()),
        _common.detect_races() as log):
    out, vjp = jax.vjp(fn, *primals)
    ct = _normal(_keys(1)[0], out.shape, out.dtype)
    grads = jax.block_until_ready(vjp(ct))
  assert not log.found, "the race detector reported a race (see the printed RACE DETECTED)"
  # The detector really looked: every kernel of the call recorded its accesses.
  assert log.kernels_checked >= num_kernels, (log.kernels_checked, num_kernels)
  return out, ct, grads


def _reference_vjp(fn, primals, ct):
  up = lambda x: None if x is None else x.astype(jnp.float32)
  out, vjp = jax.vjp(fn, *(up(p) for p in primals))
  return out, vjp(up(ct))


def _assert_all_close(got, want, dtype, names):
  for name, g, w in zip(names, got, want):
    testing.assert_close(g, w, dtype, what=name)


# ----------------------------------------------------------------------------
# The detector itself.
# ----------------------------------------------------------------------------


def _same_block_writer(semantics):
  """Two grid steps, both writing output block 0: racy when declared parallel."""

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  return pl.pallas_call(
      kernel, grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
      compiler_params=_common.compiler_params((semantics,)),
      interpret=_common.interpret_params())


@pytest.mark.smoke
@pytest.mark.parametrize("semantics,racy", [("parallel", True), ("arbitrary", False)])
def test_detector_flags_a_racy_kernel(semantics, racy):
  x = _normal(_keys(1)[0], (16, 128), jnp.float32)
  with tokamax.interpret(), _common.detect_races() as log:
    out = jax.block_until_ready(_same_block_writer(semantics)(x))
  assert log.kernels_checked == 1
  assert log.found == racy
  # Whichever step wrote last, the block holds one of the two halves, doubled.
  assert any(np.allclose(out, 2 * x[i * 8:(i + 1) * 8]) for i in range(2))


@pytest.mark.skipif(os.environ.get(_common.RACES_ENV, "") not in ("", "0"),
                    reason="the env var turns the detector on")
def test_detector_off_by_default():
  assert _common.interpret_params() is False  # not in interpret mode
  with tokamax.interpret():
    params = _common.interpret_params()
    assert not params.detect_races
    with _common.detect_races():
      params = _common.interpret_params()
      assert params.detect_races and params.num_cores_or_threads == _common.RACE_CORES
    assert not _common.interpret_params().detect_races


# ----------------------------------------------------------------------------
# Attention: forward (1 kernel) + backward (dK/dV and dQ kernels).
# ----------------------------------------------------------------------------


class _SmallBlocks:
  """Small tiles for every op of this package, so each kernel walks several blocks."""

  CONFIGS = {
      att.MosaicTpuAttention: att.AttentionConfig(128, 128),
      att.MosaicTpuAttentionVjp: att.AttentionVjpConfig(128, 128, 128, 128),
      rd.MosaicTpuRaggedDot: rd.RaggedDotConfig(block_m=16, block_k=128, block_n=128),
      rd.MosaicTpuRaggedDotVjp: rd.RaggedDotConfig(block_m=16, block_k=128, block_n=128),
      glu.MosaicTpuGatedLinearUnit: glu.GatedLinearUnitConfig(16, 128, 128),
      glu.MosaicTpuGatedLinearUnitVjp: glu.GatedLinearUnitConfig(16, 128, 128),
      ln.MosaicTpuLayerNorm: ln.LayerNormConfig(block_rows=16),
      ln.MosaicTpuLayerNormVjp: ln.LayerNormConfig(block_rows=16),
  }

  def lookup(self, op, args):
    del args
    return self.CONFIGS.get(type(op))


def _check_attention(b, t, s, n, kh, h, dtype, q_offset=None, **kw):
  kq, kk, kv = _keys(3)
  q, k, v = (_normal(kq, (b, t, n, h), dtype), _normal(kk, (b, s, kh, h), dtype),
             _normal(kv, (b, s, kh, h), dtype))

  def ours(q, k, v):
    if q_offset is None:
      return tokamax.dot_product_attention(q, k, v, implementation="mosaic_tpu", **kw)
    # q_offset is not a public argument: canonical args + dispatch, as the SPMD rules.
    args, _ = attention_op.canonical_args(q, k, v, **kw)
    args = dataclasses.replace(args, q_offset=jnp.int32(q_offset))
    return dispatch.call(attention_op.DEFINITION, args, "mosaic_tpu")

  window = kw.get("local_window_size")

  def ref(q, k, v):
    return xla_ref.attention(
        q, k, v, None, None, scale=1.0 / np.sqrt(h), is_causal=kw.get("is_causal", False),
        local_window=window, q_segment_ids=kw.get("q_segment_ids"),
        kv_segment_ids=kw.get("kv_segment_ids"), precision=HIGHEST,
        q_offset=q_offset)[0]

  out, ct, grads = _vjp_under_detector(ours, (q, k, v), num_kernels=3)
  want, want_grads = _reference_vjp(ref, (q, k, v), ct)
  _assert_all_close((out, *grads), (want, *want_grads), dtype, ("out", "dq", "dk", "dv"))


def test_attention_causal_gqa():
  # GQA: the dK/dV kernel walks 2 query heads per kv head.
  _check_attention(1, 256, 256, 2, 1, 128, jnp.bfloat16, is_causal=True)


def test_attention_window_unaligned():
  _check_attention(1, 200, 136, 1, 1, 64, jnp.float32, local_window_size=(60, 20))


def test_attention_q_offset():
  # Shifted causal window: block lists from the run-time offset, shifted masks.
  _check_attention(1, 200, 384, 2, 1, 64, jnp.float32, is_causal=True,
                   local_window_size=(150, None), q_offset=100)


def test_attention_segments_batch():
  seg = jnp.array([[0] * 100 + [1] * 156, [0] * 200 + [1] * 56], jnp.int32)
  _check_attention(2, 256, 256, 1, 1, 128, jnp.float32, q_segment_ids=seg,
                   kv_segment_ids=seg)


# ----------------------------------------------------------------------------
# ragged_dot: gmm forward, gmm (rhs^T) dlhs and tgmm drhs.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("group_sizes,num_held,offset", [
    ([9, 0, 20, 3], 4, None),  # an empty group; rows past the total
    ([7, 14, 0, 11], 2, 1),  # group_offset: rows of unheld groups are zeros
])
def test_ragged_dot(group_sizes, num_held, offset):
  m, k, n = 40, 256, 256  # 16-row tiles: visits straddle group boundaries
  kl, kr = _keys(2)
  lhs = _normal(kl, (m, k), jnp.float32)
  rhs = _normal(kr, (num_held, k, n), jnp.float32)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  off = None if offset is None else jnp.asarray(offset, jnp.int32)
  def ours(lhs, rhs):
    return tokamax.ragged_dot(lhs, rhs, sizes, group_offset=off,
                              implementation="mosaic_tpu")

  def ref(lhs, rhs):
    return xla_ref.ragged_dot(lhs, rhs, sizes, group_offset=off, precision=HIGHEST)

  out, ct, grads = _vjp_under_detector(ours, (lhs, rhs), num_kernels=3)
  want, want_grads = _reference_vjp(ref, (lhs, rhs), ct)
  _assert_all_close((out, *grads), (want, *want_grads), jnp.float32,
                    ("out", "dlhs", "drhs"))


# ----------------------------------------------------------------------------
# gated_linear_unit and layer_norm / rms_norm: forward and backward kernels.
# ----------------------------------------------------------------------------


def test_gated_linear_unit():
  m, k, n = 40, 256, 200  # ragged rows, padded N, two K steps
  kx, kw = _keys(2)
  x = _normal(kx, (m, k), jnp.bfloat16)
  w = (_normal(kw, (k, 2, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
  def ours(x, w):
    return tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                     implementation="mosaic_tpu")

  def ref(x, w):
    return xla_ref.gated_linear_unit(x, w, activation=jax.nn.silu, precision=HIGHEST)

  out, ct, grads = _vjp_under_detector(ours, (x, w), num_kernels=2)
  want, want_grads = _reference_vjp(ref, (x, w), ct)
  _assert_all_close((out, *grads), (want, *want_grads), jnp.bfloat16, ("out", "dx", "dw"))


@pytest.mark.parametrize("subtract_mean", [True, False])
def test_layer_norm(subtract_mean):
  r, d = 37, 200  # a partial last row block; D not a lane multiple
  kx, ks, ko = _keys(3)
  x = _normal(kx, (r, d), jnp.float32) * 1.5 + 0.7
  scale = 1.0 + 0.5 * _normal(ks, (d,), jnp.float32)
  offset = _normal(ko, (d,), jnp.float32)
  def ours(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean,
                              implementation="mosaic_tpu")

  def ref(x, scale, offset):
    return xla_ref.layer_norm(x, scale, offset, epsilon=1e-6,
                              subtract_mean=subtract_mean)[0]

  out, ct, grads = _vjp_under_detector(ours, (x, scale, offset), num_kernels=2)
  want, want_grads = _reference_vjp(ref, (x, scale, offset), ct)
  _assert_all_close((out, *grads), (want, *want_grads), jnp.float32,
                    ("y", "dx", "dscale", "doffset"))
