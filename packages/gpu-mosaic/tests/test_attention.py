"""Tests of the Mosaic GPU attention forward (FA3-style).

Numerical tests here run natively on a Hopper GPU (on a CPU with JAX >= 0.12 the
kernels also run in the Mosaic GPU interpreter: test_interpret.py); on the CPU the
registration, every refusal, the configs and the lowering to Mosaic GPU IR for
"cuda" (through `jax.export`) are checked.
"""

import dataclasses
import functools
import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops import attention as attention_op
from tokamax_gpu_mosaic import attention as mat
from tokamax_gpu_mosaic import attention_kernel_bwd as akb
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import attention_kernel_common as akc
from tokamax_gpu_mosaic import attention_kernel_fwd as akf

HIGHEST = jax.lax.Precision.HIGHEST
_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))


def gpu(test):
  """A native test: skipped off a Hopper GPU, and marked `gpu` so that the
  native run of README.md (`pytest -m gpu`) selects it."""
  hopper_only = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
  return pytest.mark.gpu(hopper_only(test))


_H200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
_REGISTER_SPLIT_LOST = _common.register_split_lost


@pytest.fixture(autouse=True)
def _register_split_kept(request, monkeypatch):
  """Off the GPU the heuristics checked are those of the register split kept
  (JAX 0.11's compile) on any JAX; the `jax_version` tests check JAX 0.12's
  regime, and the GPU tests run what the installed JAX compiles."""
  if request.node.get_closest_marker("gpu") is None:
    monkeypatch.setattr(_common, "register_split_lost", lambda: None)


_seed = iter(range(1_000_000))


def _qkv(b, t, s, n, k, h, dtype):
  rng = np.random.default_rng(next(_seed))
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  key = jnp.asarray(rng.standard_normal((b, s, k, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, k, h)), dtype)
  return q, key, v


def _reference(q, k, v, causal, scale=None):
  up = lambda x: x.astype(jnp.float32)
  return tokamax.dot_product_attention(up(q), up(k), up(v), is_causal=causal,
                                       scale=scale, precision=HIGHEST,
                                       implementation="xla")


def _reference_lse(q, k, causal, scale):
  """Natural log-sum-exp per (batch, head, query row) of the scaled logits."""
  n, kh = q.shape[2], k.shape[2]
  kf = jnp.repeat(k.astype(jnp.float32), n // kh, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kf,
                      precision=HIGHEST) * scale
  if causal:
    t, s = q.shape[1], k.shape[1]
    visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None]
    logits = jnp.where(visible, logits, -jnp.inf)
  return jax.nn.logsumexp(logits, axis=-1)


def _check(b, t, s, n, k, h, causal, dtype=jnp.bfloat16, config=None, grads=True,
           scale=None):
  q, key, v = _qkv(b, t, s, n, k, h, dtype)
  op = mat.MosaicGpuAttention(config)

  def run(q, key, v):
    return tokamax.dot_product_attention(q, key, v, is_causal=causal, scale=scale,
                                         implementation=op)
  with tokamax.record_dispatch() as records:
    out = jax.jit(run)(q, key, v)
  assert any(r.implementation == "mosaic_gpu" and r.direction == "forward"
             for r in records), records
  assert out.dtype == dtype
  testing.assert_close(out, _reference(q, key, v, causal, scale), dtype,
                       what="forward", gpu=True)

  # The residual: natural log-sum-exp, checked directly.
  args, _ = attention_op.canonical_args(q, key, v, is_causal=causal, scale=scale)
  _, res = jax.jit(lambda a: op.forward(a, config))(args)
  want = _reference_lse(q, key, causal, args.scale)
  assert res["lse"].shape == want.shape and res["lse"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(res["lse"]), np.asarray(want),
                             rtol=2e-2 if dtype == jnp.bfloat16 else 2e-3,
                             atol=2e-2 if dtype == jnp.bfloat16 else 2e-3)
  if not grads:
    return
  cot = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal(out.shape),
                    dtype)

  def loss(q, key, v, impl):
    y = tokamax.dot_product_attention(q, key, v, is_causal=causal, scale=scale,
                                      precision=HIGHEST if impl == "xla" else None,
                                      implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))
  with tokamax.record_dispatch() as records:
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, key, v, op)
  assert any(r.implementation == "mosaic_gpu" and r.direction == "forward"
             for r in records), records
  # An Op instance without a `vjp` of its own: dispatch chooses the backward (ours
  # or another one, fed this forward's residuals).
  assert len([r for r in records if r.direction == "backward"]) == 1, records
  up = lambda x: x.astype(jnp.float32)
  # Jitted: run eagerly, the float32 reference's backward took over a minute.
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
      up(q), up(key), up(v), "xla")
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == dtype
    testing.assert_close(g, w, dtype, what=name, scale=2, gpu=True)


# ----------------------------------------------------------------------------
# GPU (Hopper) numerical tests.
# ----------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_grads(dtype, h, causal):
  _check(2, 512, 512, 4, 4, h, causal, dtype)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,k", [(8, 2), (4, 1)])
def test_gqa_mqa(causal, n, k):
  _check(1, 384, 384, n, k, 128, causal)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s", [(256, 640), (640, 256), (200, 330), (1, 77),
                                 (130, 1000)])
def test_t_ne_s_and_padding(causal, t, s):
  _check(1, t, s, 2, 1, 64, causal, grads=t != 1)


@pytest.mark.parametrize("rows,tile,padded_to", [
    (3000, 128, None),  # a multiple of TMA's 8-row tile: read as it is
    (200, 128, None),
    (3001, 128, 3072),  # its tiled view would not divide
    (77, 128, 128),     # shorter than one block
    (120, 128, 128),
])
def test_pad_rows_for_tma(rows, tile, padded_to):
  x = _cotangent((2, rows, 3, 64), jnp.bfloat16)
  got = _common.pad_rows_for_tma(x, 1, tile)
  if padded_to is None:
    assert got is x
  else:
    assert got.shape == (2, padded_to, 3, 64)
    np.testing.assert_array_equal(np.asarray(got[:, :rows]), np.asarray(x))
    assert not np.asarray(got[:, rows:]).any()


def test_pad_rows_for_tma_pads_in_the_interpreter():
  # The interpreter's slices clamp where TMA would read zeros: it gets padding.
  x = _cotangent((1, 256 + 8, 2, 64), jnp.bfloat16)
  with tokamax.interpret():
    got = _common.pad_rows_for_tma(x, 1, 128)
  if _common.interpreter_runs_these_kernels():
    assert got.shape[1] == 384
  else:
    assert got is x  # no interpreter runs the kernels: nothing is traced there


@pytest.mark.parametrize("t,s,q_rows,kv_rows", [
    (3000, 1000, 3000, 1000),  # odd block counts, TMA's zeros: no copy
    (3001, 1000, 3072, 1000),
    (200, 77, 200, 128),
])
def test_forward_wrapper_pads_only_what_tma_cannot_read(t, s, q_rows, kv_rows,
                                                         monkeypatch):
  # `mosaic_attention` with the kernel replaced: the rows each operand reaches
  # the kernel with, and the shapes returned (lse sliced from whole blocks).
  seen = {}

  def kernel(q, k, v, *extras, **kw):
    seen.update(q=q.shape[1], k=k.shape[1], v=v.shape[1])
    tp = -(-q.shape[1] // 128) * 128
    return (jnp.zeros(q.shape, q.dtype),
            jnp.zeros((q.shape[0], q.shape[2], tp), jnp.float32))
  monkeypatch.setattr(akf, "flash_forward", kernel)
  q = jnp.zeros((2, t, 4, 64), jnp.bfloat16)
  k = jnp.zeros((2, s, 2, 64), jnp.bfloat16)
  out, lse = akf.mosaic_attention(q, k, k, scale=0.125, causal=False,
                                  config=mat.AttentionConfig(block_kv=128,
                                                             num_stages=2))
  assert seen == dict(q=q_rows, k=kv_rows, v=kv_rows)
  assert out.shape == (2, t, 4, 64) and lse.shape == (2, 4, t)


def test_backward_wrapper_pads_only_what_tma_cannot_read(monkeypatch):
  # `mosaic_attention_bwd` with both kernels replaced: the rows q, dO (T) and
  # k, v (S) reach them with; lse and delta always in whole 128-row blocks.
  seen = []

  def kernel(name):
    def run(q, k, v, do, lse2, delta, *extras, **kw):
      seen.append((name, q.shape[1], do.shape[1], k.shape[1], v.shape[1],
                   lse2.shape[2], delta.shape[2]))
      grads = kw.get("grads", ("dq",))
      return tuple(jnp.zeros(k.shape if g != "dq" else q.shape, jnp.float32)
                   for g in grads) if name == "dkv" else jnp.zeros(q.shape, q.dtype)
    return run
  monkeypatch.setattr(akb, "flash_dkv", kernel("dkv"))
  monkeypatch.setattr(akb, "flash_dq", kernel("dq"))
  for t, s, rows in ((3000, 1000, (3000, 1000)), (3001, 1000, (3072, 1000)),
                     (200, 77, (200, 128))):
    seen.clear()
    q = jnp.zeros((1, t, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, s, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, t), jnp.float32)
    dq, dk, dv = akb.mosaic_attention_bwd(q, k, k, q, q, lse, scale=0.125, causal=False,
                                          config=mat.AttentionVjpConfig(128, 128, 2))
    tp = -(-t // 128) * 128
    assert seen == [(n, rows[0], rows[0], rows[1], rows[1], tp, tp)
                    for n in ("dkv", "dq")], (t, s, seen)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@gpu
@pytest.mark.parametrize("t,s,causal,fuse_dq", [
    (3000, 3000, False, False),
    (136, 1000, False, False),  # a 64-row query box wholly past T
    (1000, 1000, True, True),  # the fused dQ's additions past T
    (3000, 3000, True, False),
])
def test_rows_past_the_end_read_as_zeros(t, s, causal, fuse_dq):
  # The wrappers hand lengths that are no multiple of the blocks to the kernels
  # unpadded (`_common.pad_rows_for_tma`): TMA must read zeros past T and S and
  # drop stores there. Batch row 1 holds NaNs: rows read from it instead (a V
  # row past S times P = 0, a dO row past T) would turn batch row 0 to NaN.
  h, scale = 128, 128**-0.5
  q, key, v = _qkv(2, t, s, 4, 2, h, jnp.bfloat16)
  dout = _cotangent((2, t, 4, h), jnp.bfloat16)
  nan = lambda x: x.at[1].set(jnp.nan)
  first = lambda x: x[:1]
  fwd = jax.jit(functools.partial(mat.mosaic_attention, scale=scale, causal=causal,
                                  config=mat.AttentionConfig()))
  out, lse = fwd(*map(nan, (q, key, v)))
  want = _reference(first(q), first(key), first(v), causal, scale)
  testing.assert_close(first(out), want, jnp.bfloat16, what="out", gpu=True)
  bwd = jax.jit(functools.partial(
      mat.mosaic_attention_bwd, scale=scale, causal=causal,
      config=mat.AttentionVjpConfig(64, 128, 2, fuse_dq=fuse_dq)))
  grads = bwd(*map(nan, (q, key, v)), out, nan(dout), lse)
  up = lambda x: first(x).astype(jnp.float32)
  wants = _reference_vjp(lambda q, key, v: _reference(q, key, v, causal, scale),
                         (up(q), up(key), up(v)), up(dout))
  for name, g, w in zip(("dq", "dk", "dv"), grads, wants):
    testing.assert_close(first(g), w, jnp.bfloat16, what=name, scale=2, gpu=True)


@gpu
def test_single_key_step():
  # One key tile per block (the producer streams a single step).
  _check(1, 128, 128, 2, 2, 128, False, grads=False)
  _check(1, 128, 128, 2, 2, 128, True, grads=False)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256(causal):
  _check(1, 384, 384, 2, 2, 256, causal, grads=False)


@gpu
def test_scale():
  _check(1, 256, 256, 2, 2, 64, True, scale=0.37, grads=False)
  _check(1, 256, 256, 2, 2, 64, False, scale=-0.2, grads=False)


@gpu
@pytest.mark.parametrize("h,config", [
    (64, mat.AttentionConfig(block_kv=64, num_stages=4)),
    (64, mat.AttentionConfig(block_kv=192, num_stages=2)),
    (64, mat.AttentionConfig(block_kv=128, num_stages=4)),
    (128, mat.AttentionConfig(block_kv=64, num_stages=3)),
    (128, mat.AttentionConfig(block_kv=128, num_stages=2)),
    (128, mat.AttentionConfig(block_kv=128, num_stages=2, fence_softmax=False)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_configs(h, config, causal):
  # S = 7 * 64: partial last key tiles for the wider tiles; several ring laps.
  _check(1, 640, 448, 4, 2, h, causal, config=config, grads=False)


# `overlap_qk`: intra-warpgroup pipelining (Q K^T of tile i+1 issued with P_i V_i).
_OVERLAP = mat.AttentionConfig(block_kv=128, num_stages=2, overlap_qk=True)
_OVERLAP_64 = mat.AttentionConfig(block_kv=64, num_stages=2, overlap_qk=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_overlap_forward(dtype, h, causal):
  _check(2, 512, 512, 4, 4, h, causal, dtype, config=_OVERLAP,
         grads=dtype == jnp.bfloat16)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,k", [(8, 2), (4, 1)])
@pytest.mark.parametrize("config", [_OVERLAP, _OVERLAP_64])
def test_overlap_gqa_mqa(causal, n, k, config):
  _check(1, 384, 384, n, k, 128, causal, config=config, grads=False)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s", [(256, 640), (640, 256), (200, 330), (1, 77),
                                 (130, 1000)])
@pytest.mark.parametrize("h,config", [(64, _OVERLAP), (128, _OVERLAP_64)])
def test_overlap_padding(causal, t, s, h, config):
  _check(1, t, s, 2, 1, h, causal, config=config, grads=False)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,config", [
    (128, _OVERLAP),  # one key tile: only the first turn and the last P V
    (128, _OVERLAP_64),  # causal: warpgroup 0 one tile, then one released
    (64, _OVERLAP_64),
    (100, _OVERLAP),  # one padded key tile
])
def test_overlap_single_key_step(causal, s, config):
  _check(1, 128, s, 2, 2, 128, causal, config=config, grads=False)


@gpu
@pytest.mark.parametrize("h,config", [
    (64, mat.AttentionConfig(block_kv=64, num_stages=3, overlap_qk=True)),
    (64, mat.AttentionConfig(block_kv=64, num_stages=4, overlap_qk=True,
                             fence_softmax=False)),
    (64, mat.AttentionConfig(block_kv=128, num_stages=3, overlap_qk=True)),
    (64, mat.AttentionConfig(block_kv=128, num_stages=4, overlap_qk=True)),
    (64, mat.AttentionConfig(block_kv=192, num_stages=2, overlap_qk=True)),
    (64, mat.AttentionConfig(block_kv=192, num_stages=4, overlap_qk=True)),
    (128, mat.AttentionConfig(block_kv=64, num_stages=4, overlap_qk=True)),
    (128, mat.AttentionConfig(block_kv=128, num_stages=2, overlap_qk=True,
                              fence_softmax=False)),
    (256, mat.AttentionConfig(block_kv=64, num_stages=2, overlap_qk=True)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_overlap_configs(h, config, causal):
  # S = 7 * 64: partial last key tiles for the wider tiles; several ring laps.
  _check(1, 640, 448, 4, 2, h, causal, config=config, grads=False)


@gpu
@pytest.mark.parametrize("config", [_OVERLAP, _OVERLAP_64])
def test_overlap_long_causal(config):
  # Many ring laps; with 64-key tiles warpgroup 0 releases one tile per block.
  _check(1, 2048, 2048, 2, 2, 128, True, config=config, grads=False)
  _check(1, 1024, 1024, 2, 2, 64, True, config=config, grads=False, scale=0.3)


@gpu
def test_overlap_scale():
  _check(1, 256, 256, 2, 2, 64, True, scale=0.37, config=_OVERLAP, grads=False)
  _check(1, 256, 256, 2, 2, 64, False, scale=-0.2, config=_OVERLAP, grads=False)


# ----------------------------------------------------------------------------
# Forward features: lengths, window, soft cap, segments, q_offset.
# ----------------------------------------------------------------------------


def _feature_args(b, t, s, n, k, h, dtype, *, causal=False, window=None,
                  soft_cap=None, q_len=None, kv_len=None, segments=None,
                  q_offset=None, scale=None):
  q, key, v = _qkv(b, t, s, n, k, h, dtype)
  kw = {}
  if segments is not None:
    kw = dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])
  args, _ = attention_op.canonical_args(
      q, key, v, is_causal=causal, local_window_size=window, logits_soft_cap=soft_cap,
      query_seq_lengths=None if q_len is None else np.asarray(q_len, np.int32),
      key_value_seq_lengths=None if kv_len is None else np.asarray(kv_len, np.int32),
      scale=scale, **kw)
  if q_offset is not None:
    args = dataclasses.replace(args, q_offset=jnp.int32(q_offset))
  return args


def _dense_reference(args):
  """Output and lse of the contract, densely in float32 (the test oracle)."""
  up = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  q, key, v = up(args.query), up(args.key), up(args.value)
  b, t, n, _ = q.shape
  s, kh = key.shape[1], key.shape[2]
  key = np.repeat(key, n // kh, axis=2)
  v = np.repeat(v, n // kh, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, key) * args.scale
  if args.logits_soft_cap is not None:
    cap = args.logits_soft_cap
    logits = cap * np.tanh(logits / cap)
  rows = np.arange(t)[:, None] + (0 if args.q_offset is None
                                  else int(args.q_offset))
  cols = np.arange(s)[None, :]
  vis = np.ones((b, 1, t, s), bool)
  left, right = args.visible_window
  if left is not None:
    vis &= (cols >= rows - left)[None, None]
  if right is not None:
    vis &= (cols <= rows + right)[None, None]
  if args.key_value_seq_lengths is not None:
    vis &= (cols < np.asarray(args.key_value_seq_lengths)[:, None, None])[:, None]
  if args.q_segment_ids is not None:
    qs, ks = np.asarray(args.q_segment_ids), np.asarray(args.kv_segment_ids)
    vis &= (qs[:, :, None] == ks[:, None, :])[:, None]
  if args.query_seq_lengths is not None:
    vis &= (np.arange(t)[None, :] < np.asarray(args.query_seq_lengths)[:, None]
            )[:, None, :, None]
  logits = np.where(vis, logits, -np.inf)
  m = logits.max(axis=-1, keepdims=True)
  seen = np.isfinite(m)
  p = np.where(vis, np.exp(logits - np.where(seen, m, 0.0)), 0.0)
  l = p.sum(axis=-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p / np.where(seen, l, 1.0), v)
  lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), np.inf)[..., 0]
  return out.astype(np.float32), lse.astype(np.float32)


def _check_features(b, t, s, n, k, h, dtype=jnp.bfloat16, config=None, **features):
  args = _feature_args(b, t, s, n, k, h, dtype, **features)
  op = mat.MosaicGpuAttention(config)
  op.check_supported(args, _H200)
  out, res = jax.jit(lambda a: op.forward(a, config))(args)
  want, want_lse = _dense_reference(args)
  assert out.dtype == dtype and out.shape == want.shape
  testing.assert_close(out, want, dtype, what="forward", gpu=True)
  lse = np.asarray(res["lse"])
  assert lse.shape == want_lse.shape and lse.dtype == np.float32
  # Rows that see no key: lse +inf, output exactly 0 (never NaN).
  empty = np.isinf(want_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  out_rows = np.asarray(jnp.asarray(out, jnp.float32)).transpose(0, 2, 1, 3)
  assert not np.isnan(out_rows).any()
  assert (out_rows[empty] == 0).all()
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
  np.testing.assert_allclose(lse[~empty], want_lse[~empty], rtol=tol, atol=tol)


def test_feature_oracle_matches_xla():
  # The dense oracle above (output and lse) agrees with the XLA reference (CPU,
  # float32), q_offset included: the GPU feature tests trust it.
  import tokamax_xla_reference  # lazy: another package, needed by these tests only
  for kw in (dict(causal=True, window=(7, None), kv_len=[50, 0]),
             dict(window=(3, 5), soft_cap=2.0, q_len=[40, 9]),
             dict(segments=(np.repeat(np.arange(4), 16)[None].repeat(2, 0),
                            np.repeat(np.arange(4), 20)[None].repeat(2, 0)[:, :70]),
                  causal=True),
             dict(causal=True, q_offset=-20),
             dict(window=(10, 3), q_offset=37, kv_len=[70, 30])):
    args = _feature_args(2, 64, 70, 2, 1, 16, jnp.float32, **kw)
    out, lse = _dense_reference(args)
    want_out, want_lse = tokamax_xla_reference.attention(
        args.query, args.key, args.value, scale=args.scale, is_causal=args.is_causal,
        local_window=args.local_window, logits_soft_cap=args.logits_soft_cap,
        query_seq_lengths=args.query_seq_lengths,
        key_value_seq_lengths=args.key_value_seq_lengths,
        q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
        precision=HIGHEST, q_offset=args.q_offset)
    np.testing.assert_allclose(out, np.asarray(want_out), rtol=1e-4, atol=1e-4)
    want_lse = np.asarray(want_lse)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(want_lse))
    finite = np.isfinite(want_lse)
    assert finite.any()
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    if "q_len" in kw:  # rows past the query length: lse +inf
      assert np.isposinf(lse[1, :, 9:]).all() and np.isfinite(lse[1, :, :9]).all()


def _packed(b, length, sizes):
  """Segment ids of packed sequences with these sizes (the rest: id -1)."""
  ids = np.full((b, length), -1, np.int32)
  for bb in range(b):
    pos = 0
    for i, size in enumerate(sizes[bb % len(sizes)]):
      ids[bb, pos:pos + size] = i
      pos += size
  return ids


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128])
def test_lengths(dtype, h):
  _check_features(3, 384, 512, 4, 2, h, dtype, q_len=[384, 100, 0],
                  kv_len=[512, 77, 300])
  _check_features(2, 300, 333, 2, 1, h, dtype, causal=True, q_len=[257, 1],
                  kv_len=[0, 333])


@gpu
@pytest.mark.parametrize("window", [(64, 0), (100, 30), (0, 0), (None, 17),
                                    (300, None), (5, 5)])
@pytest.mark.parametrize("block_kv", [64, 128])
def test_local_window(window, block_kv):
  config = mat.AttentionConfig(block_kv=block_kv, num_stages=2)
  _check_features(2, 640, 704, 8, 2, 128, config=config, window=window)  # GQA
  _check_features(1, 200, 330, 2, 2, 64, config=config, window=window,
                  causal=True)


@gpu
@pytest.mark.parametrize("h,config", [
    (64, mat.AttentionConfig(block_kv=192, num_stages=3)),
    (128, mat.AttentionConfig(block_kv=64, num_stages=4)),
    (256, mat.AttentionConfig(block_kv=64, num_stages=2)),
])
def test_window_lengths_configs(h, config):
  # Several ring laps with the ring counted from the union's first tile.
  _check_features(2, 1024, 1024, 2, 1, h, config=config, window=(200, 0),
                  kv_len=[1000, 513], q_len=[1024, 700])


@gpu
@pytest.mark.parametrize("cap", [1.0, 10.0])
@pytest.mark.parametrize("config", [None, _OVERLAP, mat.AttentionConfig(block_kv=64)])
@pytest.mark.parametrize("causal", [False, True])
def test_soft_cap(cap, config, causal):
  _check_features(2, 384, 384, 4, 2, 128, config=config, soft_cap=cap,
                  causal=causal)
  _check_features(1, 256, 256, 2, 2, 64, config=config, soft_cap=cap,
                  causal=causal, scale=-0.3)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_kv", [64, 128])
def test_segments(causal, block_kv):
  # Three 128-row K/V stages and the key-id ring overflow shared memory at H128.
  config = mat.AttentionConfig(block_kv=block_kv, num_stages=3 if block_kv == 64
                               else 2)
  t = 512
  ids = _packed(2, t, [[100, 28, 300, 84], [7, 500]])
  _check_features(2, t, t, 4, 2, 128, config=config, segments=(ids, ids),
                  causal=causal)
  # Unsorted ids, T != S, some keys in no query's segment, lengths too.
  rng = np.random.default_rng(next(_seed))
  qs = rng.integers(0, 3, (1, 200)).astype(np.int32)
  ks = rng.integers(1, 5, (1, 333)).astype(np.int32)
  _check_features(1, 200, 333, 2, 1, 64, config=config, segments=(qs, ks),
                  causal=causal, kv_len=[250], window=(None, 40))


@gpu
@pytest.mark.parametrize("offset", [-300, -64, 0, 37, 128, 1000])
@pytest.mark.parametrize("window", [None, (100, 0), (50, 50)])
def test_q_offset(offset, window):
  # As a query shard / ring-attention block: rows at t + offset.
  _check_features(2, 256, 512, 4, 2, 128, causal=window is None, window=window,
                  q_offset=offset)
  _check_features(1, 200, 333, 2, 1, 64, causal=True, window=window, q_offset=offset,
                  kv_len=[300], soft_cap=5.0)


_TILES = [dict(tiles_per_block=2), dict(tiles_per_block=3), dict(persistent=True)]


@gpu
@pytest.mark.parametrize("tiles", _TILES)
@pytest.mark.parametrize("config", [_OVERLAP, _OVERLAP_64,
                                    mat.AttentionConfig(block_kv=64, num_stages=3)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_per_block(tiles, config, causal):
  # Several query tiles a block: Q in two buffers, the key ring counted on from
  # tile to tile. 7 tiles: some blocks run fewer; odd lengths pad. Causal with
  # 64-key tiles: a warpgroup skips the block's last key tile.
  config = dataclasses.replace(config, **tiles)
  _check(1, 896, 896, 8, 2, 128, causal, config=config)
  _check(2, 300, 257, 4, 4, 64, causal, config=config, grads=False)
  # Persistent: more tiles than SMs, several rounds a block.
  _check(2, 2048, 2048, 16, 4, 128, causal, config=config, grads=False)


@gpu
@pytest.mark.parametrize("config", [
    _OVERLAP, _OVERLAP_64, dataclasses.replace(_OVERLAP, persistent=True),
    dataclasses.replace(_OVERLAP_64, tiles_per_block=2)])
def test_overlap_window(config):
  # overlap_qk with a window alone (`akc.overlap_takes`): causal sliding windows
  # wider and narrower than a key tile, several tiles a block; a two-sided
  # window with a soft cap where the last block's second warpgroup holds padded
  # rows only (T % 128 = 44, one masked tile); T < S; H64 and GQA.
  _check_features(2, 1024, 1024, 8, 2, 128, config=config, causal=True,
                  window=(256, 0))
  _check_features(1, 300, 333, 4, 4, 128, config=config, window=(100, 30),
                  soft_cap=5.0)
  _check_features(2, 640, 700, 4, 2, 64, config=config, causal=True, window=(40, 0))
  _check_features(1, 2048, 2048, 16, 4, 128, config=config, causal=True,
                  window=(1000, 0))


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_head_group(causal):
  # Blocks in groups of 3 (batch row, head) pairs: the last group short (2 x 8
  # query heads, 2 x 2 key/value heads); GQA, odd lengths; forward and both
  # backward kernels.
  for config in (mat.AttentionConfig(block_kv=64, num_stages=3, head_group=3),
                 # Persistent blocks taking the order from `_Forward.deal` (rounds).
                 mat.AttentionConfig(overlap_qk=True, persistent=True, head_group=3)):
    _check(2, 896, 700, 8, 2, 128, causal, config=config, grads=False)
    _check(1, 300, 257, 5, 5, 64, causal, config=config, grads=False)
    _check(2, 2048, 2048, 16, 4, 128, causal, config=config, grads=False)
  vjp = mat.AttentionVjpConfig(64, 128, 2, head_group=3)
  _check_bwd_features_direct(2, 640, 704, 8, 2, 128, config=vjp, causal=causal)
  _check_bwd_features_direct(2, 256, 300, 4, 4, 256, causal=causal, config=(
      mat.AttentionVjpConfig(32, 32, 2, split_dkv=True, block_q_dv=64,
                             head_group=3)))
  # Dynamic key ranges (window, key lengths) take the same order; packed
  # segments in the split H256 passes (in the interpreter:
  # test_interpret.py's `test_head_group_with_32_row_steps_and_segments`).
  _check_bwd_features_direct(2, 512, 512, 4, 2, 128, config=vjp, causal=True,
                             window=(200, 0), kv_len=[512, 300])
  ids = _packed(2, 512, [[100, 28, 300, 84], [7, 500]])
  _check_bwd_features_direct(2, 512, 512, 4, 2, 256, causal=True,
                             segments=(ids, ids), config=(
      mat.AttentionVjpConfig(32, 32, 2, split_dkv=True, block_q_dv=64,
                             head_group=1)))


@gpu
@pytest.mark.parametrize("tiles", [dict(tiles_per_block=2), dict(tiles_per_block=4),
                                   dict(persistent=True)])
def test_tiles_per_block_features(tiles):
  config = mat.AttentionConfig(block_kv=64, num_stages=3, **tiles)
  _check_features(2, 1024, 1024, 2, 1, 128, config=config, window=(200, 0),
                  kv_len=[1000, 513], q_len=[1024, 700])
  _check_features(1, 640, 704, 4, 2, 128, config=config, window=(64, 0),
                  causal=True)
  ids = _packed(2, 512, [[100, 28, 300, 84], [7, 500]])
  _check_features(2, 512, 512, 4, 2, 128, config=config, segments=(ids, ids),
                  causal=True)
  _check_features(1, 200, 333, 2, 1, 64, config=config, causal=True, q_offset=37,
                  kv_len=[300], soft_cap=5.0)
  # 192 tiles: persistent blocks run two rounds, across batch rows.
  _check_features(2, 1536, 1536, 8, 2, 128, config=config, window=(300, 0),
                  causal=True, kv_len=[1536, 1000], q_len=[1400, 1536])


@gpu
def test_rows_that_see_nothing():
  # Whole blocks, single warpgroups and single rows with no visible key.
  _check_features(2, 384, 256, 2, 2, 128, q_offset=-200, causal=True)
  _check_features(2, 256, 256, 2, 2, 128, kv_len=[0, 0])
  _check_features(1, 256, 256, 2, 2, 64, window=(0, 0), kv_len=[100])
  qs = np.zeros((1, 256), np.int32)
  ks = np.ones((1, 256), np.int32)
  _check_features(1, 256, 256, 2, 2, 64, segments=(qs, ks))
  qs[:, 64:128] = 1
  _check_features(1, 256, 256, 2, 2, 64, segments=(qs, ks), causal=True)


@gpu
def test_features_through_dispatch_with_grads():
  # Forward here, backward from whichever implementation dispatch takes.
  q, key, v = _qkv(2, 256, 320, 4, 2, 128, jnp.bfloat16)
  kw = dict(is_causal=True, local_window_size=(96, None), logits_soft_cap=20.0,
            key_value_seq_lengths=jnp.array([320, 150], jnp.int32),
            query_seq_lengths=jnp.array([256, 200], jnp.int32))
  cot = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal(q.shape),
                    jnp.bfloat16)

  def loss(q, key, v, impl):
    y = tokamax.dot_product_attention(q, key, v, precision=HIGHEST if impl == "xla"
                                      else None, implementation=impl, **kw)
    return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))
  op = mat.MosaicGpuAttention()
  with tokamax.record_dispatch() as records:
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, key, v, op)
  assert any(r.implementation == "mosaic_gpu" and r.direction == "forward"
             for r in records), records
  up = lambda x: x.astype(jnp.float32)
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
      up(q), up(key), up(v), "xla")
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


@gpu
def test_named_implementation_dispatch():
  q, key, v = _qkv(1, 256, 256, 2, 2, 128, jnp.bfloat16)
  with tokamax.record_dispatch() as records:
    out = tokamax.dot_product_attention(q, key, v, is_causal=True,
                                        implementation="mosaic_gpu")
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "mosaic_gpu")], records
  testing.assert_close(out, _reference(q, key, v, True), jnp.bfloat16, gpu=True)


# ----------------------------------------------------------------------------
# CPU tests: registration, refusals, configs, lowering for CUDA.
# ----------------------------------------------------------------------------


def test_registered():
  names = {(s.op, s.name) for s in tokamax.implementations()}
  assert ("dot_product_attention", "mosaic_gpu") in names


def _args(t=256, s=256, n=2, k=2, h=64, dtype=jnp.bfloat16, hv=None, b=1, **kw):
  q, key, v = _qkv(b, t, s, n, k, h, dtype)
  if hv is not None:
    v = v[..., :hv]
  return attention_op.canonical_args(q, key, v, kw.pop("bias", None),
                                     kw.pop("mask", None), **kw)[0]


def test_accepts_plain_call_on_hopper():
  for kw in ({}, {"is_causal": True}, {"n": 8, "k": 2}, {"t": 100, "s": 333},
             {"h": 128}, {"h": 256, "dtype": jnp.float16}):
    mat.MosaicGpuAttention().check_supported(_args(**kw), _H200)


def test_refuses_non_hopper_devices():
  args = _args()
  for device in (tokamax.DeviceInfo("cpu", "cpu"),
                 tokamax.DeviceInfo("gpu", "NVIDIA A100", compute_capability="8.0")):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      mat.MosaicGpuAttention().check_supported(args, device)


@pytest.mark.smoke
@pytest.mark.parametrize("kw,reason", [
    (dict(bias=np.ones((1, 2, 256, 256), np.float32) * 0.5), "bias"),
    (dict(mask=np.tril(np.ones((256, 256), bool))), "bool mask"),
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(h=80), "head dims"),
    (dict(h=32), "head dims"),
    (dict(h=128, hv=64), "head dims"),
    (dict(t=0), "empty"),
    (dict(s=0), "empty"),
    (dict(precision=jax.lax.DotAlgorithmPreset.F16_F16_F32), "dot algorithm"),
])
def test_refusals(kw, reason):
  with pytest.raises(NotImplementedError, match=reason):
    mat.MosaicGpuAttention().check_supported(_args(**kw), _H200)


def test_accepts_features_on_hopper():
  op = mat.MosaicGpuAttention()
  assert "q_offset" in op.supported_features
  for kw in (dict(q_segment_ids=np.zeros((1, 256), np.int32),
                  kv_segment_ids=np.zeros((1, 256), np.int32)),
             dict(local_window_size=(16, 0)), dict(logits_soft_cap=30.0),
             dict(query_seq_lengths=np.array([100], np.int32)),
             dict(key_value_seq_lengths=np.array([100], np.int32))):
    op.check_supported(_args(**kw), _H200)
  op.check_supported(
      dataclasses.replace(_args(is_causal=True), q_offset=jnp.int32(64)), _H200)


@pytest.mark.parametrize("is_h100", [False, True])
def test_overlap_schedule_takes_windows_that_hold_the_diagonal(is_h100, monkeypatch):
  # overlap_qk's first turn computes a key tile, so every block's first
  # warpgroup needs one: the search space has it for a window alone that holds
  # each row's own position with T <= S (a warpgroup of padded rows computes
  # one masked tile); never for lengths, segment ids, q_offset or T > S, and it
  # is refused when asked for there. The heuristic takes it for such windows at
  # H128 on both cards (1.01-1.05x on the H100, 1.023-1.048x on the H200:
  # notes/MEASUREMENTS.md sessions 93 and 96), and keeps the plain schedule
  # with every other dynamic feature.
  monkeypatch.setattr(_common, "is_h100", lambda: is_h100)
  op = mat.MosaicGpuAttention()
  overlap = mat.AttentionConfig(overlap_qk=True)
  causal_window = _args(h=128, t=200, s=333, is_causal=True, local_window_size=(50, 0))
  takes = [_args(h=128, local_window_size=(16, 0)),
           _args(h=128, t=300, s=300, local_window_size=(100, 30)),  # padded rows
           causal_window, dataclasses.replace(causal_window, logits_soft_cap=5.0)]
  refuses = [_args(h=128, key_value_seq_lengths=np.array([100], np.int32)),
             _args(h=128, query_seq_lengths=np.array([100], np.int32)),
             _args(h=128, q_segment_ids=np.zeros((1, 256), np.int32),
                   kv_segment_ids=np.zeros((1, 256), np.int32)),
             _args(h=128, t=333, s=200, local_window_size=(16, 0)),  # T > S
             dataclasses.replace(causal_window, q_offset=jnp.int32(64))]
  for args in takes:
    assert op.heuristic_config(args).overlap_qk
    assert not op.heuristic_config(
        dataclasses.replace(args, query=args.query[..., :64], key=args.key[..., :64],
                            value=args.value[..., :64])).overlap_qk  # H64: never
    assert any(c.overlap_qk for c in op.search_space(args))
    out, res = jax.eval_shape(lambda a: op.forward(a, overlap), args)
    assert out.shape == args.query.shape and res["lse"].shape == (1, 2, args.query.shape[1])
  for args in refuses:
    assert not op.heuristic_config(args).overlap_qk
    space = op.search_space(args)
    assert space and not any(c.overlap_qk for c in space)
    with pytest.raises(NotImplementedError, match="overlap_qk"):
      jax.eval_shape(lambda a: op.forward(a, overlap), args)
  # Static features: T > S takes it (the causal range is never empty there);
  # soft cap and causal alone keep it in the heuristic (static switches).
  assert any(c.overlap_qk for c in op.search_space(_args(h=128, t=333, s=200,
                                                         is_causal=True)))
  assert op.heuristic_config(_args(h=128, logits_soft_cap=5.0,
                                   is_causal=True)).overlap_qk


def _brute_visible(rows, cols, q_limit, kv_limit, off, left, right):
  r = rows[:, None] + off
  c = cols[None, :]
  vis = (rows[:, None] < q_limit) & (c < kv_limit)
  if left is not None:
    vis &= c >= r - left
  if right is not None:
    vis &= c <= r + right
  return vis


def test_key_range_matches_brute_force():
  rng = np.random.default_rng(0)
  windows = [(None, None), (None, 0), (0, 0), (5, 0), (100, 3), (None, 17),
             (300, None), (1, 1), (64, 64)]
  key_range = jax.jit(akc.key_range, static_argnums=(1, 5, 6, 7))
  for trial in range(300):
    bkv = int(rng.choice([64, 128, 192, 256]))
    t = int(rng.integers(1, 700))
    s = int(rng.integers(1, 700))
    left, right = windows[trial % len(windows)]
    q_limit = int(rng.integers(0, t + 1))
    kv_limit = int(rng.integers(0, s + 1))
    off = int(rng.integers(-300, 300)) if trial % 3 else 0
    r0 = 64 * int(rng.integers(0, -(-t // 64)))
    lo, fl, fh, hi = (int(x) for x in key_range(
        jnp.int32(r0), 64, jnp.int32(q_limit), jnp.int32(kv_limit), jnp.int32(off),
        left, right, bkv))
    n_kv = -(-s // bkv)
    vis = _brute_visible(np.arange(r0, r0 + 64), np.arange(n_kv * bkv), q_limit,
                         kv_limit, off, left, right)
    valid_rows = np.arange(r0, r0 + 64) < q_limit
    case = (bkv, t, s, left, right, q_limit, kv_limit, off, r0, lo, fl, fh, hi)
    assert 0 <= lo <= fl <= fh <= hi, case
    for j in range(max(n_kv, hi)):
      tile = vis[:, j * bkv:(j + 1) * bkv]
      if tile.any():
        assert lo <= j < hi <= n_kv, (case, j)
      if fl <= j < fh:
        assert tile[valid_rows].all(), (case, j)


def test_union_and_segment_ranges():
  i32 = jnp.int32
  assert [int(x) for x in akc.union((i32(3), i32(3)), (i32(1), i32(4)))] == [1, 4]
  assert [int(x) for x in akc.union((i32(2), i32(5)), (i32(0), i32(0)))] == [2, 5]
  lo, hi = akc.union((i32(7), i32(7)), (i32(0), i32(0)))
  assert int(hi) <= int(lo)
  rng = np.random.default_rng(1)
  for trial in range(40):
    t, s = int(rng.integers(1, 400)), int(rng.integers(1, 400))
    bkv = int(rng.choice([64, 128]))
    if trial % 2:  # packed: sorted ids
      qs = np.sort(rng.integers(0, 5, (2, t))).astype(np.int32)
      ks = np.sort(rng.integers(0, 5, (2, s))).astype(np.int32)
    else:
      qs = rng.integers(0, 4, (2, t)).astype(np.int32)
      ks = rng.integers(0, 4, (2, s)).astype(np.int32)
    tp, sp = -(-t // 128) * 128, -(-s // bkv) * bkv
    table = np.asarray(akc.segment_tile_range(jnp.asarray(qs), jnp.asarray(ks), t,
                                               s, tp, sp, bkv))
    assert table.shape == (2, tp // 64, 2)
    for bb in range(2):
      for g in range(tp // 64):
        lo, hi = table[bb, g]
        q_ids = qs[bb, g * 64:(g + 1) * 64]
        for j in range(sp // bkv):
          if np.isin(ks[bb, j * bkv:(j + 1) * bkv], q_ids).any():
            assert lo <= j < hi, (trial, bb, g, j, lo, hi)
        if trial % 2 and q_ids.size:  # packed: exactly the meeting tiles
          meets = [np.isin(ks[bb, j * bkv:(j + 1) * bkv], q_ids).any()
                   for j in range(sp // bkv)]
          if any(meets):
            assert meets[lo] and meets[hi - 1]


def test_backward_accepts_plain_call_on_hopper():
  for kw in ({}, {"is_causal": True}, {"n": 8, "k": 2}, {"n": 4, "k": 1},
             {"t": 100, "s": 333}, {"h": 128}, {"h": 128, "dtype": jnp.float16}):
    mat.MosaicGpuAttentionVjp().check_supported(_args(**kw), _H200,
                                                {"lse": jnp.zeros((1, 2, 256))})


def test_backward_refuses_non_hopper_devices():
  for device in (tokamax.DeviceInfo("cpu", "cpu"),
                 tokamax.DeviceInfo("gpu", "NVIDIA A100", compute_capability="8.0")):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      mat.MosaicGpuAttentionVjp().check_supported(_args(), device)


@pytest.mark.parametrize("kw,reason", [
    (dict(bias=np.ones((1, 2, 256, 256), np.float32) * 0.5), "bias"),
    (dict(mask=np.tril(np.ones((256, 256), bool))), "bool mask"),
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(h=80), "head dims"),
    (dict(h=128, hv=64), "head dims"),
    (dict(t=0), "empty"),
    (dict(precision=jax.lax.DotAlgorithmPreset.F16_F16_F32), "dot algorithm"),
])
def test_backward_refusals(kw, reason):
  # Checked on the arguments themselves, not through the forward's check: the
  # forward may learn features this backward does not handle.
  with pytest.raises(NotImplementedError, match=reason):
    mat.MosaicGpuAttentionVjp().check_supported(_args(**kw), _H200)


def test_backward_refuses_missing_lse():
  with pytest.raises(NotImplementedError, match="lse"):
    mat.MosaicGpuAttentionVjp().check_supported(_args(), _H200, {})


def test_bwd_features_accepted_on_hopper():
  op = mat.MosaicGpuAttentionVjp()
  assert "q_offset" in op.supported_features
  lse = {"lse": jnp.zeros((1, 2, 256))}
  for kw in (dict(q_segment_ids=np.zeros((1, 256), np.int32),
                  kv_segment_ids=np.zeros((1, 256), np.int32)),
             dict(local_window_size=(16, 0)), dict(logits_soft_cap=30.0),
             dict(query_seq_lengths=np.array([100], np.int32)),
             dict(key_value_seq_lengths=np.array([100], np.int32)),
             dict(local_window_size=(16, 0), is_causal=True, h=128,
                  logits_soft_cap=5.0)):
    op.check_supported(_args(**kw), _H200, lse)
  op.check_supported(
      dataclasses.replace(_args(is_causal=True), q_offset=jnp.int32(64)), _H200, lse)


def _kernel_calls(exported) -> int:
  """Mosaic GPU kernels an exported program launches."""
  return len(re.findall(r"custom_call @mosaic_gpu", exported.mlir_module()))


def test_backward_configs_fit():
  for bad in (dict(block_q=96), dict(block_kv=256), dict(num_stages=1),
              dict(block_q=16, split_dkv=True)):
    with pytest.raises(ValueError):
      mat.AttentionVjpConfig(**bad)
  with pytest.raises(ValueError, match="block_q=32 goes with split_dkv=True"):
    mat.AttentionVjpConfig(block_q=32, block_kv=64)
  for h in (64, 128):
    for dtype in (jnp.bfloat16, jnp.float16):
      args = _args(h=h, dtype=dtype)
      op = mat.MosaicGpuAttentionVjp()
      space = op.search_space(args)
      assert space and op.heuristic_config(args) in space
      for config in space:
        assert max(mat.bwd_smem_bytes(config, h, 2)) <= 227 * 1024 - 1024
        assert h + config.block_q <= 192  # dK, dV, S^T, dP^T registers
  # H128: dK and dV leave room for 64 query rows per dK/dV step only.
  assert {c.block_q for c in mat.MosaicGpuAttentionVjp().search_space(
      _args(h=128))} == {64}
  # Every tiling comes in all four schedules (the fused kernel in one: here,
  # without causal, at H64's 128-row steps and H128's 64-row ones).
  for h in (64, 128):
    op = mat.MosaicGpuAttentionVjp()
    space = op.search_space(_args(h=h))
    assert len(set(space)) == len(space)
    assert {(c.ping_pong, c.ping_pong_dq) for c in space} == {
        (False, False), (True, False), (False, True), (True, True)}
    fused = {c for c in space if c.fuse_dq}
    assert all(not (c.ping_pong or c.ping_pong_dq) for c in fused)
    assert {c.block_q for c in fused} == {8192 // h}
    plain = {c for c in space if not (c.ping_pong or c.ping_pong_dq or c.fuse_dq)}
    assert len(space) == 4 * len(plain) + len(fused)
    config = op.heuristic_config(_args(h=h))
    assert not (config.ping_pong or config.ping_pong_dq)


def test_backward_head_dim_256_configs():
  # Only dK and dV in two passes with 32-row steps at two stages fit there.
  op = mat.MosaicGpuAttentionVjp()
  for dtype in (jnp.bfloat16, jnp.float16):
    args = _args(h=256, dtype=dtype)
    space = op.search_space(args)
    assert {(c.block_q, c.block_kv, c.num_stages, c.split_dkv, c.block_q_dv)
            for c in space} == {(32, 32, 2, True, None), (32, 32, 2, True, 64)}
    assert {(c.ping_pong, c.ping_pong_dq) for c in space} == {
        (False, False), (True, False), (False, True), (True, True)}
    assert op.heuristic_config(args) in space
    for config in space:
      assert max(mat.bwd_smem_bytes(config, 256, 2)) <= 227 * 1024 - 1024
  # A config that does not fit says which limit and what fits.
  args = _args(h=256)
  with pytest.raises(ValueError, match="shared memory.*heuristic's config here is"):
    op.backward(args, {"lse": None}, None, None,
                mat.AttentionVjpConfig(32, 32, 3, split_dkv=True))
  with pytest.raises(ValueError, match="dK and dV.*smaller block_q or split_dkv=True"):
    op.backward(_args(h=128), {"lse": None}, None, None,
                mat.AttentionVjpConfig(128, 64, 2))
  with pytest.raises(ValueError, match="block_q_dv is the dV pass's step"):
    mat.AttentionVjpConfig(64, 64, 2, block_q_dv=64)
  # The dV pass (no V tile) takes 64-row steps: measured faster (attention.py).
  assert op.heuristic_config(args).block_q_dv == 64


@pytest.mark.smoke
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,n,k,t,s,config", [
    (64, 4, 4, 512, 512, None),
    (128, 4, 4, 512, 512, None),
    (128, 8, 2, 384, 640, None),  # GQA, T != S
    (64, 4, 1, 200, 333, mat.AttentionVjpConfig(128, 64, 3)),  # MQA, padded
    (128, 2, 2, 128, 128, mat.AttentionVjpConfig(64, 64, 2)),  # one step of each
    (64, 2, 1, 640, 256, mat.AttentionVjpConfig(128, 128, 4)),  # T > S
    (128, 2, 2, 1, 77, mat.AttentionVjpConfig(64, 64, 4)),  # f16 below
    # Ping-pong schedules (dK/dV, dQ, both).
    (128, 4, 4, 512, 512, mat.AttentionVjpConfig(64, 128, 2, ping_pong=True)),
    (64, 8, 2, 384, 640, mat.AttentionVjpConfig(128, 128, 2, ping_pong=True,
                                                 ping_pong_dq=True)),  # GQA
    (64, 4, 1, 200, 333, mat.AttentionVjpConfig(128, 64, 3, ping_pong_dq=True)),
    (128, 2, 2, 128, 128, mat.AttentionVjpConfig(64, 64, 2, ping_pong=True,
                                                 ping_pong_dq=True)),  # one step
    (64, 2, 1, 640, 256, mat.AttentionVjpConfig(128, 128, 4, ping_pong=True,
                                                ping_pong_dq=True)),  # T > S
    (128, 2, 2, 1, 77, mat.AttentionVjpConfig(64, 64, 4, ping_pong=True,
                                              ping_pong_dq=True)),  # f16 below
    # H256: dK and dV in two passes, 32-row steps (the heuristic), GQA, padded.
    (256, 4, 4, 512, 512, None),
    (256, 8, 2, 200, 333, None),
    (256, 4, 4, 384, 384, mat.AttentionVjpConfig(32, 32, 2, ping_pong=True,
                                                 ping_pong_dq=True, split_dkv=True)),
    # 64-row steps in the dV pass (it holds K alone).
    (256, 8, 2, 200, 333, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True,
                                                 block_q_dv=64)),
    # The same machinery at H64 (not in its search space).
    (64, 4, 4, 512, 512, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True)),
    # Blocks in head groups (3 query heads a group in the dQ kernel, 3 key/value
    # heads in the dK/dV kernel: short last groups both).
    (128, 8, 4, 384, 640, mat.AttentionVjpConfig(64, 128, 2, head_group=3)),
    # dQ in the dK/dV kernel (without causal: its blocks' rotated order).
    (64, 4, 2, 512, 512, mat.AttentionVjpConfig(128, 128, 2, ping_pong=True,
                                                fuse_dq=True)),
    (128, 8, 2, 700, 640, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True)),
    # The score products from the statistics, dK's dS^T from shared memory.
    (128, 4, 4, 700, 640, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True,
                                                 stats_in_accumulators=True,
                                                 dk_from_smem=True)),
    (128, 8, 2, 700, 640, mat.AttentionVjpConfig(64, 128, 2, ping_pong=True,
                                                 stats_in_accumulators=True)),
    (64, 4, 4, 512, 512, mat.AttentionVjpConfig(128, 128, 2, fuse_dq=True,
                                                stats_in_accumulators=True)),
    # Its dQ additions overlapped under MHA (the H100's heuristic).
    (128, 4, 4, 700, 640, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True,
                                                 overlap_dq_adds=True)),
    # H128's configs where the register split is lost (JAX >= 0.12): dK and dV
    # apart, 64-key dQ steps; in head groups and with ping-pong.
    (128, 4, 4, 512, 512, mat.AttentionVjpConfig(64, 64, 2, split_dkv=True)),
    (128, 8, 2, 700, 640, mat.AttentionVjpConfig(64, 64, 2, split_dkv=True,
                                                 head_group=2)),
    (128, 4, 4, 384, 384, mat.AttentionVjpConfig(64, 64, 2, split_dkv=True,
                                                 ping_pong=True, ping_pong_dq=True)),
])
def test_backward_lowers_for_cuda(causal, h, n, k, t, s, config):
  pytest.importorskip("absl")
  dtype = jnp.float16 if t == 1 else jnp.bfloat16
  args = _args(t=t, s=s, n=n, k=k, h=h, is_causal=causal, dtype=dtype)
  config = config or mat.MosaicGpuAttentionVjp().heuristic_config(args)
  # Split below H256 (in it at H128 only where the register split is lost),
  # head groups not sized by `l2_head_group`, the fused dQ with ping-pong and
  # the score products from the statistics (opt-in): outside it.
  if (not (config.split_dkv and h < 256) and not config.head_group
      and not config.fuse_dq and not config.stats_in_accumulators):
    assert config in mat.MosaicGpuAttentionVjp().search_space(args)
  q, key = args.query, args.key
  sds = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
  exported = jax.export.export(
      jax.jit(lambda q, key, v, o, do, lse: mat.mosaic_attention_bwd(
          q, key, v, o, do, lse, scale=0.125, causal=causal, config=config)),
      platforms=["cuda"])(sds(q.shape), sds(key.shape), sds(key.shape), sds(q.shape),
                          sds(q.shape), sds((1, n, t), jnp.float32))
  # The dK/dV kernel (twice with split_dkv) and the dQ kernel (fused: one).
  assert _kernel_calls(exported) == (1 if config.fuse_dq else
                                     3 if config.split_dkv else 2)
  assert [(a.shape, a.dtype) for a in exported.out_avals] == [
      (q.shape, dtype), (key.shape, dtype), (key.shape, dtype)]


def test_configs_fit():
  with pytest.raises(ValueError):
    mat.AttentionConfig(block_kv=96)
  with pytest.raises(ValueError):
    mat.AttentionConfig(num_stages=1)
  for h in (64, 128, 256):
    args = _args(h=h)
    op = mat.MosaicGpuAttention()
    space = op.search_space(args)
    assert space and op.heuristic_config(args) in space
    for config in space:
      assert mat.smem_bytes(config, h, 2) <= 227 * 1024 - 1024
    overlapped = {(c.block_kv, c.num_stages) for c in space if c.overlap_qk}
    assert overlapped and {c.overlap_qk for c in space} == {False, True}
    assert max(b for b, _ in overlapped) == {64: 192, 128: 128, 256: 64}[h]
  assert mat.MosaicGpuAttention().heuristic_config(_args(h=64)) == (
      mat.AttentionConfig(block_kv=128, num_stages=2))


@pytest.mark.parametrize("h,overlap", [(64, False), (128, True), (256, True)])
def test_heuristic_overlaps_where_measured_faster(h, overlap):
  # The forward's intra-warpgroup overlap measured faster on the H200 at H128
  # and H256 and slower at H64 (`attention._heuristic_tiles`); in the
  # interpreter, which cannot run it, the plain schedule at every head dim.
  op = mat.MosaicGpuAttention()
  for causal in (False, True):
    args = _args(h=h, t=4096, s=4096, is_causal=causal)
    assert op.heuristic_config(args).overlap_qk == overlap
    with tokamax.interpret():
      if _common.interpreter_runs_these_kernels():
        assert not op.heuristic_config(args).overlap_qk


@pytest.mark.parametrize("kw,wide", [
    ({}, True),
    ({"t": 9000, "s": 9000, "n": 8, "k": 2}, True),  # GQA, S no multiple of 192
    ({"t": 1000, "s": 9000}, False),  # T != S: not measured
    ({"s": 4096, "t": 4096}, False),  # 0.97-0.98x at 4096 keys
    ({"is_causal": True}, False),  # persistent causal tiles instead
    ({"local_window_size": (4096, 4096)}, False),  # dynamic key ranges: not measured
    ({"logits_soft_cap": 30.0}, False),
    ({"h": 128}, False),
])
def test_heuristic_takes_wide_key_steps_at_long_h64(kw, wide):
  # H64 without causal masking from 8192 keys: 192-key steps, a block a query
  # tile (`attention._long_plain_h64`: measured 1.013-1.054x on the H200),
  # where 256 query tiles would otherwise run in persistent blocks.
  kw = {"t": 8192, "s": 8192, "n": 4, "k": 4, "h": 64, **kw}
  config = mat.MosaicGpuAttention().heuristic_config(_args(**kw))
  assert (config.block_kv == 192 and not config.persistent) == wide, config


@gpu
def test_wide_key_steps_at_long_h64():
  # The heuristic's config where it takes 192-key steps (S % 192 = 136: the last
  # key tile is partly padding, and so is the last query tile), forward and
  # gradients against the reference.
  config = mat.MosaicGpuAttention().heuristic_config(_args(t=8200, s=8200, n=4, k=2))
  assert config.block_kv == 192, config
  _check(1, 8200, 8200, 4, 2, 64, False, grads=True)


@pytest.mark.parametrize("kw,persistent", [
    ({}, True),  # every query tile sees every key
    # Causal: the tiles shorten; persistent where it measured faster (H64, or
    # up to 2048 keys), else a block a tile.
    ({"is_causal": True}, True),
    ({"is_causal": True, "h": 128}, True),
    ({"is_causal": True, "h": 128, "t": 4096, "s": 4096}, False),
    ({"is_causal": True, "t": 4096, "s": 4096}, True),
    # Causal with key lengths: dynamic ranges, not measured persistent.
    ({"is_causal": True, "key_value_seq_lengths": np.asarray([1000])}, False),
    ({"is_causal": True, "local_window_size": (64, 0)}, True),  # sliding window
    ({"local_window_size": (64, 32)}, True),
    ({"local_window_size": (None, 17)}, False),  # the tiles shorten
    ({"local_window_size": (64, None)}, False),  # the tiles lengthen
    ({"h": 256}, False),  # two Q buffers do not fit next to the key ring
    ({"t": 256, "s": 256, "n": 2, "k": 2}, False),  # 4 tiles: fewer than the SMs
])
def test_heuristic_persistent(kw, persistent):
  kw = {"t": 2048, "s": 2048, "n": 16, "k": 16, **kw}  # 256 tiles
  config = mat.MosaicGpuAttention().heuristic_config(_args(**kw))
  assert config.persistent == persistent, config
  with pytest.raises(ValueError, match="leave tiles_per_block at 1"):
    mat.AttentionConfig(persistent=True, tiles_per_block=2)


def test_an_explicit_config_that_does_not_fit_is_named():
  # Three 128-row K/V stages at H128 need more than the 227 KiB of shared memory.
  too_big = mat.AttentionConfig(block_kv=128, num_stages=3)
  with pytest.raises(ValueError, match=r"does not fit at head dim 128.*fewer"):
    mat.MosaicGpuAttention().forward(_args(h=128), too_big)
  # 128 query rows next to H128 exceed the backward's register budget.
  with pytest.raises(ValueError, match=r"does not fit at head dim 128.*smaller"):
    mat.MosaicGpuAttentionVjp().backward(
        _args(h=128), {"lse": None}, None, None,
        mat.AttentionVjpConfig(block_q=128, block_kv=128, num_stages=2))


@pytest.mark.smoke
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,n,k,t,s,config", [
    (64, 4, 4, 512, 512, None),
    (128, 4, 4, 512, 512, None),
    (128, 8, 2, 384, 640, None),  # GQA, T != S
    (64, 4, 1, 200, 333, mat.AttentionConfig(block_kv=192, num_stages=3,
                                             fence_softmax=False)),  # MQA, padded
    (256, 2, 2, 256, 256, None),
    (128, 4, 4, 512, 512, mat.AttentionConfig(overlap_qk=True)),
    (128, 8, 2, 384, 640, mat.AttentionConfig(block_kv=64, num_stages=3,
                                              overlap_qk=True)),  # GQA
    (64, 4, 1, 200, 333, mat.AttentionConfig(block_kv=64, num_stages=2,
                                             overlap_qk=True,
                                             fence_softmax=False)),  # padded
    (64, 2, 2, 128, 128, mat.AttentionConfig(overlap_qk=True)),  # one key step
    (64, 2, 2, 512, 512, mat.AttentionConfig(block_kv=128, num_stages=4,
                                             overlap_qk=True)),
    (64, 2, 1, 640, 448, mat.AttentionConfig(block_kv=192, num_stages=3,
                                             overlap_qk=True)),
    (256, 2, 2, 256, 256, mat.AttentionConfig(block_kv=64, overlap_qk=True)),
    # Several query tiles a block (the last block short of its third).
    (128, 8, 2, 896, 640, mat.AttentionConfig(overlap_qk=True, tiles_per_block=3)),
    (64, 4, 1, 200, 333, mat.AttentionConfig(block_kv=64, num_stages=3,
                                             tiles_per_block=2)),
    (128, 8, 2, 896, 640, mat.AttentionConfig(overlap_qk=True, persistent=True)),
    # 256 tiles: several persistent rounds a block.
    (128, 16, 4, 2048, 2048, mat.AttentionConfig(block_kv=64, overlap_qk=True,
                                                 persistent=True)),
    (64, 16, 4, 2048, 2048, mat.AttentionConfig(block_kv=64, num_stages=3,
                                                persistent=True)),
    # Blocks in head groups (the last group short: 8 heads in groups of 3), and
    # persistent blocks dealt that order (`_Forward.deal`, several rounds).
    (128, 8, 2, 384, 640, mat.AttentionConfig(overlap_qk=True, head_group=3)),
    (128, 16, 4, 2048, 2048, mat.AttentionConfig(overlap_qk=True, persistent=True,
                                                 head_group=3)),
])
def test_lowers_for_cuda(causal, h, n, k, t, s, config):
  pytest.importorskip("absl")
  args = _args(t=t, s=s, n=n, k=k, h=h, is_causal=causal)
  op = mat.MosaicGpuAttention()
  config = config or op.heuristic_config(args)
  exported = jax.export.export(
      jax.jit(lambda q, key, v: mat.mosaic_attention(
          q, key, v, scale=0.125, causal=causal, config=config)),
      platforms=["cuda"])(*(jax.ShapeDtypeStruct(x.shape, x.dtype)
                            for x in (args.query, args.key, args.value)))
  text = exported.mlir_module()
  assert "mosaic_gpu" in text
  out, lse = exported.out_avals
  assert out.shape == (1, t, n, h) and lse.shape == (1, n, t)


# ----------------------------------------------------------------------------
# Backward (GPU numerics; the CPU checks are above).
# ----------------------------------------------------------------------------


def _grad_loss(causal, scale, cot, impl):
  def loss(q, key, v):
    y = tokamax.dot_product_attention(q, key, v, is_causal=causal, scale=scale,
                                      precision=HIGHEST if impl == "xla" else None,
                                      implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))
  return loss


def _cotangent(shape, dtype):
  return jnp.asarray(np.random.default_rng(next(_seed)).standard_normal(shape), dtype)


def _reference_vjp(f, primals, cotangent):
  """`f`'s VJP at `primals` applied to `cotangent`, jitted: eagerly the float32
  reference compiles op by op, minutes at the larger shapes."""
  return jax.jit(lambda p, c: jax.vjp(f, *p)[1](c))(primals, cotangent)


def _check_backward(b, t, s, n, k, h, causal, dtype=jnp.bfloat16, scale=None):
  """Gradients through `implementation="mosaic_gpu"` (its own backward) against
  the XLA reference at HIGHEST precision on float32 upcasts."""
  q, key, v = _qkv(b, t, s, n, k, h, dtype)
  cot = _cotangent((b, t, n, h), dtype)
  with tokamax.record_dispatch() as records:
    got = jax.jit(jax.grad(_grad_loss(causal, scale, cot, "mosaic_gpu"),
                           argnums=(0, 1, 2)))(q, key, v)
  assert any(r.direction == "forward" and r.implementation == "mosaic_gpu"
             for r in records), records
  # The mosaic_gpu backward ran, and no other one.
  assert {r.implementation for r in records if r.direction == "backward"} == {
      "mosaic_gpu"}, records
  up = lambda x: x.astype(jnp.float32)
  want = jax.jit(jax.grad(_grad_loss(causal, scale, cot, "xla"), argnums=(0, 1, 2)))(
      up(q), up(key), up(v))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == dtype and g.shape == w.shape
    testing.assert_close(g, w, dtype, what=name, scale=2, gpu=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward(dtype, h, causal):
  _check_backward(2, 512, 512, 4, 4, h, causal, dtype)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_head_dim_256(dtype, causal):
  # dK and dV in two passes, 32-row steps; GQA and lengths off the tiles.
  _check_backward(2, 1024, 1024, 4, 4, 256, causal, dtype)
  _check_backward(1, 300, 457, 4, 2, 256, causal, dtype)


@gpu
def test_backward_head_dim_256_configs_natively():
  # The search space's other configs: the ping-pong schedules with one
  # accumulator a pass, and 64-row steps in the dV pass.
  config = mat.AttentionVjpConfig(32, 32, 2, ping_pong=True, ping_pong_dq=True,
                                  split_dkv=True)
  _check_bwd_features_direct(1, 384, 384, 4, 2, 256, config=config, causal=True)
  _check_bwd_features_direct(2, 256, 300, 4, 4, 256, config=config, causal=True,
                             window=(64, 0), kv_len=[300, 120])
  # 64-row steps in the dV pass, with and without ping-pong.
  for ping_pong in (False, True):
    config = mat.AttentionVjpConfig(32, 32, 2, ping_pong=ping_pong,
                                    ping_pong_dq=ping_pong, split_dkv=True,
                                    block_q_dv=64)
    _check_bwd_features_direct(2, 512, 457, 4, 2, 256, config=config, causal=True)
    ids = _packed(2, 512, [[100, 28, 300, 84], [7, 500]])
    _check_bwd_features_direct(2, 512, 512, 4, 2, 256, config=config, causal=True,
                               segments=(ids, ids), window=(200, 0))


@gpu
def test_backward_head_dim_256_features():
  # Gemma-like: a sliding window with a soft cap; key and query lengths.
  _check_bwd_features(2, 512, 512, 4, 2, 256, causal=True, window=(200, 0),
                      soft_cap=30.0, kv_len=[512, 300], q_len=[450, 512])


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,k,h", [(8, 2, 128), (4, 1, 128), (8, 1, 64)])
def test_backward_gqa_mqa(causal, n, k, h):
  _check_backward(1, 384, 384, n, k, h, causal)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s", [(200, 330), (1, 77), (640, 256), (256, 640),
                                 (130, 1000)])
@pytest.mark.parametrize("h", [64, 128])
def test_backward_lengths(causal, t, s, h):
  _check_backward(1, t, s, 4, 2, h, causal)


@gpu
def test_backward_scale():
  _check_backward(1, 256, 256, 2, 2, 64, True, scale=0.37)
  _check_backward(1, 256, 384, 2, 1, 128, False, scale=-0.2)


@gpu
@pytest.mark.parametrize("h,config", [
    (64, mat.AttentionVjpConfig(64, 64, 2)),
    (64, mat.AttentionVjpConfig(128, 128, 3)),
    (64, mat.AttentionVjpConfig(128, 64, 4)),
    (128, mat.AttentionVjpConfig(64, 64, 3)),
    (128, mat.AttentionVjpConfig(64, 128, 2)),
    (128, mat.AttentionVjpConfig(64, 64, 4)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_configs(h, config, causal):
  # The backward alone, fed the XLA reference's output and log-sum-exp (as
  # dispatch feeds it another forward's residuals); several ring laps, GQA,
  # padded T and S.
  b, t, s, n, k = 1, 700, 450, 4, 2
  q, key, v = _qkv(b, t, s, n, k, h, jnp.bfloat16)
  dout = _cotangent((b, t, n, h), jnp.bfloat16)
  up = lambda x: x.astype(jnp.float32)
  scale = 1 / np.sqrt(h)
  out = _reference(q, key, v, causal).astype(jnp.bfloat16)
  lse = _reference_lse(q, key, causal, scale)
  got = jax.jit(functools.partial(mat.mosaic_attention_bwd, scale=scale, causal=causal,
                                  config=config))(q, key, v, out, dout, lse)
  want = _reference_vjp(lambda q, key, v: _reference(q, key, v, causal),
                        (up(q), up(key), up(v)), up(dout))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


_PING_PONGS = [
    mat.AttentionVjpConfig(64, 128, 2, ping_pong=True),
    mat.AttentionVjpConfig(64, 128, 2, ping_pong_dq=True),
    mat.AttentionVjpConfig(64, 128, 2, ping_pong=True, ping_pong_dq=True),
    mat.AttentionVjpConfig(64, 64, 3, ping_pong=True, ping_pong_dq=True),
    mat.AttentionVjpConfig(64, 64, 4, ping_pong=True, ping_pong_dq=True),
]


# Score entries (B * N * T * S) above which `_reference_backward` goes by key
# chunks: the dense reference's VJP holds several float32 [B, N, T, S] arrays
# (16 GiB allocations at B1 T16384 N8), which ran three test workers out of an
# 80 GB card (notes/MEASUREMENTS.md, sessions 84 and 87).
_DENSE_REFERENCE_MAX_SCORES = 2**27


def _reference_backward(q, key, v, dout, causal, scale,
                        dense_scores=_DENSE_REFERENCE_MAX_SCORES):
  """The float32 reference at HIGHEST precision on upcasts: its output, natural
  lse ``[B, N, T]`` and ``(dq, dk, dv)``. Dense up to `dense_scores` score
  entries, beyond by key chunks
  (tokamax_xla_reference's `attention_chunked` and its backward: O(T * 512)
  memory; `test_chunked_reference_matches_dense`)."""
  up = lambda x: x.astype(jnp.float32)
  (b, t, n, _), s = q.shape, key.shape[1]
  if b * n * t * s <= dense_scores:
    out = _reference(q, key, v, causal, scale)
    grads = _reference_vjp(lambda q, key, v: _reference(q, key, v, causal, scale),
                           (up(q), up(key), up(v)), up(dout))
    return out, _reference_lse(q, key, causal, scale), grads
  import tokamax_xla_reference  # lazy: another package, needed by these tests only
  kw = dict(scale=scale, is_causal=causal, precision=HIGHEST)
  primals = (up(q), up(key), up(v))
  out, lse = jax.jit(functools.partial(tokamax_xla_reference.attention_chunked, **kw))(
      *primals)
  grads = jax.jit(functools.partial(tokamax_xla_reference.attention_chunked_backward,
                                    **kw))(*primals, None, None, out, lse, up(dout))
  return out, lse, grads[:3]


@pytest.mark.parametrize("b,t,s,n,k,causal", [
    (2, 640, 640, 4, 2, True),  # GQA, a partial last key chunk (640 = 512 + 128)
    (1, 300, 1100, 2, 1, False),  # T < S, MQA, S no multiple of the chunk
])
def test_chunked_reference_matches_dense(b, t, s, n, k, causal):
  # The long backward tests' reference (by key chunks) agrees with the dense one
  # on the CPU, in float32: output, lse and each gradient.
  q, key, v = _qkv(b, t, s, n, k, 64, jnp.bfloat16)
  dout = _cotangent((b, t, n, 64), jnp.bfloat16)
  dense = _reference_backward(q, key, v, dout, causal, 0.125)
  chunked = _reference_backward(q, key, v, dout, causal, 0.125, dense_scores=0)
  names = ("out", "lse", "dq", "dk", "dv")
  for name, c, d in zip(names, jax.tree.leaves(chunked), jax.tree.leaves(dense)):
    np.testing.assert_allclose(np.asarray(c), np.asarray(d), rtol=1e-5, atol=1e-5,
                               err_msg=name)


def _check_backward_config(b, t, s, n, k, h, causal, config, scale=None):
  """The backward alone with `config`, fed the XLA reference's output and lse."""
  q, key, v = _qkv(b, t, s, n, k, h, jnp.bfloat16)
  dout = _cotangent((b, t, n, h), jnp.bfloat16)
  scale = 1 / np.sqrt(h) if scale is None else scale
  out, lse, want = _reference_backward(q, key, v, dout, causal, scale)
  got = jax.jit(functools.partial(mat.mosaic_attention_bwd, scale=scale, causal=causal,
                                  config=config))(q, key, v, out.astype(jnp.bfloat16),
                                                  dout, lse)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


def test_backward_fuse_dq_refusals(monkeypatch):
  with pytest.raises(ValueError, match="split_dkv"):
    mat.AttentionVjpConfig(32, 32, 2, split_dkv=True, fuse_dq=True)
  q, key, v = _qkv(1, 256, 200, 2, 2, 64, jnp.bfloat16)
  lse = jnp.zeros((1, 2, 256), jnp.float32)
  config = mat.AttentionVjpConfig(128, 128, 2, fuse_dq=True)
  for causal, kw, reason in (
      (True, dict(config=mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True)),
       "must be 64 x 128 or 128 x 64; got 64 x 64"),
      (False, {}, r"without causal needs S a multiple of 128 .*got T=256, S=200"),
      (True, dict(local_window=(64, 0)), "got a local window"),
      (True, dict(key_value_seq_lengths=jnp.asarray([100], jnp.int32)),
       "got key/value lengths"),
      (True, dict(q_offset=jnp.asarray([3], jnp.int32)), "got q_offset"),
      (True, dict(q_segment_ids=jnp.zeros((1, 256), jnp.int32),
                  kv_segment_ids=jnp.zeros((1, 200), jnp.int32)), "got segment ids"),
      (True, {}, r"T > S needs S a multiple of 128 .*got T=256, S=200")):
    with pytest.raises(NotImplementedError, match=reason):
      jax.eval_shape(functools.partial(mat.mosaic_attention_bwd, scale=0.125,
                                       causal=causal, **{"config": config, **kw}),
                     q, key, v, q, q, lse)
  # Without causal: the diagonals must be query tiles, and all of a head
  # group's key blocks resident at once.
  plain = functools.partial(akb.fused_dq_refusal, h=128, block_q=64, causal=False,
                            feat=akc.PLAIN)
  monkeypatch.setattr(akb._common, "num_sms", lambda: 132)  # an H100/H200 SXM
  assert plain(1024, 1024) is None and plain(16896, 16896) is None
  assert plain(1024, 512) is None  # T > S
  assert "S <= T" in plain(512, 1024)
  assert "at most 132 key blocks" in plain(17024, 17024)
  assert plain(4096, 4096, head_group=4) is None
  assert "groups of 5" in plain(4096, 4096, head_group=5)
  monkeypatch.setattr(akb._common, "num_sms", lambda: 78)  # fewer SMs, fewer blocks
  assert "at most 78 key blocks" in plain(16384, 16384)


def test_fused_kernel_drops_pallas_store_barriers_at_mha_h128_only(monkeypatch):
  # The fused kernel under MHA at H128 orders its shared memory itself; every
  # other backward kernel keeps Pallas' automatic barriers
  # (`_DkvKernel.__call__`).
  seen = []
  build = akb._pipeline.warpgroup_kernel

  def recording(*a, auto_barriers=True, **kw):
    seen.append(auto_barriers)
    return build(*a, auto_barriers=auto_barriers, **kw)
  monkeypatch.setattr(akb._pipeline, "warpgroup_kernel", recording)
  for k, h, fuse_dq, want in ((4, 128, True, [False]), (2, 128, True, [True]),
                              (4, 64, True, [True]), (4, 128, False, [True, True])):
    seen.clear()
    _trace_causal_backward(k, h, fuse_dq)
    assert seen == want, (k, h, fuse_dq, seen)


def _trace_causal_backward(k: int, h: int, fuse_dq: bool, ping_pong: bool = False) -> None:
  """Traces the backward kernels of a small causal call (4 query heads, `k`
  key/value heads, head dim `h`) without running them."""
  q, key, v = _qkv(1, 256, 256, 4, k, h, jnp.bfloat16)
  config = mat.AttentionVjpConfig(8192 // h, 128, 2, fuse_dq=fuse_dq, ping_pong=ping_pong,
                                  ping_pong_dq=ping_pong)
  jax.eval_shape(functools.partial(
      mat.mosaic_attention_bwd, scale=0.125, causal=True, config=config),
      q, key, v, q, q, jnp.zeros((1, 4, 256), jnp.float32))


def test_fused_kernel_overlaps_dq_additions_under_gqa_at_h128_only(monkeypatch):
  # Under GQA at H128 the producer frees a staged dQ tile once its copy has
  # read it and confirms each addition with the next one in flight
  # (`_DkvKernel.overlaps_dq_adds`); elsewhere it waits for each addition to
  # land before the next (under MHA, ptxas spills otherwise). The last stores'
  # wait is read-only in every case (`_DkvKernel`'s dK/dV epilogue).
  waits = []
  wait = akb.plgpu.wait_smem_to_gmem

  def recording(n, wait_read_only=False):
    waits.append((n, wait_read_only))
    return wait(n, wait_read_only=wait_read_only)
  monkeypatch.setattr(akb.plgpu, "wait_smem_to_gmem", recording)
  for k, h, overlaps in ((2, 128, True), (4, 128, False), (2, 64, False)):
    waits.clear()
    _trace_causal_backward(k, h, fuse_dq=True)
    want = {(0, False), (0, True)} | ({(1, False)} if overlaps else set())
    assert set(waits) == want, (k, h, waits)


def test_backward_computes_probs_early_at_h64_only(monkeypatch):
  # At H64 every backward kernel computes P from its first score product while
  # the second's wgmma runs (`_Shape.early_probs`: one accumulator read with a
  # wgmma still in flight); at H128 it waits for both (measured slower there),
  # and so does ping-pong (whose turn the early path does not pass).
  early_reads = []
  load = akb.plgpu.wgmma_accumulator_load

  def recording(acc, wait_n=0):
    early_reads.append(wait_n)
    return load(acc, wait_n=wait_n)
  monkeypatch.setattr(akb.plgpu, "wgmma_accumulator_load", recording)
  # (key/value heads, head dim, fused dQ, ping-pong, kernels reading early):
  # each such kernel traces its step twice, with and without the causal mask.
  for k, h, fuse_dq, ping_pong, kernels in (
      (4, 64, False, False, 2), (2, 64, False, False, 2), (4, 64, True, False, 1),
      (4, 64, False, True, 0), (4, 128, False, False, 0), (2, 128, True, False, 0)):
    early_reads.clear()
    _trace_causal_backward(k, h, fuse_dq, ping_pong)
    assert early_reads == [1] * 2 * kernels, (k, h, fuse_dq, ping_pong, early_reads)


def test_backward_fuse_dq_config_refusals():
  with pytest.raises(ValueError, match="orders its blocks itself.*head_major=True"):
    mat.AttentionVjpConfig(64, 128, 2, head_major=True, fuse_dq=True)
  with pytest.raises(ValueError, match="key_rings=2 splits the one-kernel.*fuse_dq=False"):
    mat.AttentionVjpConfig(64, 128, 2, key_rings=2)
  with pytest.raises(ValueError, match="key_rings must be >= 1; got 0"):
    mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, key_rings=0)
  with pytest.raises(ValueError, match="dk_from_smem reads dS.T from the rows.*fuse_dq=False"):
    mat.AttentionVjpConfig(64, 128, 2, dk_from_smem=True)
  with pytest.raises(ValueError, match="overlap_dq_adds=True orders the one-kernel.*"
                     "fuse_dq=False"):
    mat.AttentionVjpConfig(64, 128, 2, overlap_dq_adds=True)


@pytest.mark.parametrize("t,causal,rings,why", [
    (1024, False, 2, None),  # 8 key blocks, rings of 4
    (1024, False, 3, "a divisor of the 8 key blocks"),
    (1024, True, 2, "needs no causal"),
    (32768, False, 1, "at most 132 key blocks .* in 1 ring"),  # 256 blocks a ring
    (32768, False, 2, None),  # 128 a ring: resident
])
def test_backward_key_rings_refusals(monkeypatch, t, causal, rings, why):
  monkeypatch.setattr(akb, "resident_blocks", lambda: 132)
  got = akb.fused_dq_refusal(t, t, 128, 64, causal, akc.PLAIN, 0, rings)
  if why is None:
    assert got is None
  else:
    assert got is not None and re.search(why, got), got


@pytest.mark.parametrize("t,s,block_q,rings", [
    (1024, 1024, 64, 1), (1000, 896, 64, 1), (700, 512, 128, 1), (512, 512, 128, 1),
    (640, 384, 64, 1), (1024, 384, 128, 1), (1000, 1000, 64, 1), (640, 640, 128, 1),
    # In rings (`AttentionVjpConfig.key_rings`), a launch each: every ring's
    # blocks ranked among themselves. T = S (the rank from the step), T > S,
    # one block a ring.
    (1536, 1536, 64, 2), (1536, 1536, 64, 3), (1536, 1536, 128, 4),
    (1000, 768, 64, 3), (1024, 768, 128, 2), (768, 768, 64, 6)])
def test_backward_fuse_dq_rotated_rank_order(t, s, block_q, rings):
  # Without causal each key block visits every query tile from its diagonal on,
  # wrapping around: at each tile the ranks must be the blocks' order of arrival
  # (simulated here step by step), among the blocks of each ring, and no two
  # blocks arrive at one step.
  tp, sp = -(-t // 128) * 128, -(-s // 128) * 128
  nq, nk = tp // block_q, sp // 128
  config = mat.AttentionVjpConfig(block_q, 128, 2, fuse_dq=True, key_rings=rings)
  kernel = akb._DkvKernel(
      b=1, tp=tp, n=1, h=8192 // block_q, group=1, sp=sp, config=config,
      causal=False, feat=akc.PLAIN, dtype=jnp.bfloat16, scale=1.0)
  assert kernel.rotated and kernel.rings == rings
  blk = akb._DkvBlock(wg=0, ki=0, head=0, batch=0, k0=0, j_lo=0, j_fl=None, j_fh=None,
                      j_hi=None, own=None, n_j=nq, n_steps=nq, limits=None,
                      pass_turn=None)
  arrival, rank = {}, {}  # (tile, block) -> step, rank in its ring
  for kb in range(nk):
    blk = blk._replace(ki=kb, j_lo=kb * 128 // block_q)
    ring_kernel = dataclasses.replace(kernel, ring=kb % rings)
    for step in range(nq):
      j = int(kernel.step_tile(blk, step)[1])
      arrival[j, kb] = step
      rank[j, kb] = int(ring_kernel.step_rank(blk, step, j))
      if tp == sp:  # the rank the producer computes from the step alone
        assert int(kernel.rotated_rank(step)) == int(kernel.dq_rank(kb, j)), (kb, step)
  assert len(arrival) == nq * nk  # every block visits every tile once
  for j in range(nq):
    order = sorted(range(nk), key=lambda kb: arrival[j, kb])
    assert len({arrival[j, kb] for kb in order}) == nk, j
    assert [int(kernel.dq_rank(kb, j)) for kb in order] == list(range(nk)), j
    for ring in range(rings):  # launch `ring`: blocks ring, ring + rings, ...
      members = [kb for kb in order if kb % rings == ring]
      assert [rank[j, kb] for kb in members] == list(range(nk // rings)), (j, ring)


@pytest.mark.parametrize("fuse_dq,causal,soft_cap,grads,field,taken", [
    (True, True, None, ("dk", "dv"), None, True),  # the causal one kernel
    (True, False, None, ("dk", "dv"), None, False),  # without causal: ran slower
    (False, True, None, ("dk", "dv"), None, False),  # two kernels: more spills (GQA)
    (True, True, 20.0, ("dk", "dv"), None, False),  # a soft cap: tanh of raw scores
    (False, True, None, ("dv",), True, False),  # a dV-only pass has no dP^T
    (False, False, None, ("dk", "dv"), True, True),  # asked for
    (True, True, None, ("dk", "dv"), False, False),  # opted out
])
def test_backward_stats_in_accumulators_resolution(fuse_dq, causal, soft_cap, grads,
                                                   field, taken):
  # `AttentionVjpConfig.stats_in_accumulators=None` is the causal one kernel's
  # (measured faster there only: the field's comment); wherever it is taken,
  # both score products run and no soft cap needs the raw scores.
  config = mat.AttentionVjpConfig(64, 128, 2, fuse_dq=fuse_dq,
                                  stats_in_accumulators=field)
  feat = akc.Features(soft_cap=soft_cap) if soft_cap else akc.PLAIN
  kernel = akb._DkvKernel(b=2, tp=1024, n=4, h=128, group=1, sp=1024, config=config,
                          causal=causal, feat=feat, dtype=jnp.bfloat16, scale=1.0,
                          grads=grads)
  assert kernel.stats_in_accumulators is taken


@pytest.mark.parametrize("k,h,fuse_dq,field,overlaps", [
    (2, 128, True, None, True),  # GQA H128: the additions wait on DRAM
    (4, 128, True, None, False),  # MHA: plain products spill with it
    (2, 64, True, None, False),  # H64: spills with it
    (4, 128, True, True, True),  # asked for (the H100's heuristic under causal MHA)
    (2, 128, True, False, False),  # opted out
    (2, 128, False, None, False),  # the two kernels: no dQ additions
])
def test_backward_overlap_dq_adds_resolution(k, h, fuse_dq, field, overlaps):
  # `AttentionVjpConfig.overlap_dq_adds=None` is GQA H128's (the field's comment).
  config = mat.AttentionVjpConfig(64, 128, 2, fuse_dq=fuse_dq, overlap_dq_adds=field)
  kernel = akb._DkvKernel(b=2, tp=1024, n=4, h=h, group=4 // k, sp=1024,
                          config=config, causal=True, feat=akc.PLAIN,
                          dtype=jnp.bfloat16, scale=1.0, grads=("dk", "dv"))
  assert kernel.overlaps_dq_adds is overlaps


@pytest.mark.parametrize("t,s,block_q", [
    (1024, 1024, 64), (1000, 1100, 64), (700, 512, 128), (512, 512, 128),
    (640, 384, 64)])
def test_backward_fuse_dq_rank_order(t, s, block_q):
  # The key blocks that add into a query tile (those with a key some query of
  # the tile sees under the causal mask) take ranks 0, 1, ... from the highest
  # down: the first stores, so each rank must occur once.
  tp, sp = -(-t // 128) * 128, -(-s // 128) * 128
  kernel = akb._DkvKernel(
      b=1, tp=tp, n=1, h=8192 // block_q, group=1, sp=sp,
      config=mat.AttentionVjpConfig(block_q, 128, 2, fuse_dq=True), causal=True,
      feat=akc.PLAIN, dtype=jnp.bfloat16, scale=1.0)
  for j in range(tp // block_q):
    visitors = [kb for kb in range(sp // 128) if kb * 128 < (j + 1) * block_q]
    ranks = [int(kernel.dq_rank(kb, j)) for kb in visitors]
    assert ranks == list(range(len(visitors)))[::-1], j


@pytest.mark.parametrize("kw,fused", [
    (dict(b=2, n=4, k=4, is_causal=True), True),
    (dict(b=2, n=4, k=4, is_causal=True, dtype=jnp.float16), True),
    (dict(b=2, n=4, k=4, t=1000, s=1100, is_causal=True), True),  # T < S, padded
    (dict(n=4, k=4, is_causal=True), False),  # one batch row: serialized wgmmas
    (dict(n=8, k=2, is_causal=True), False),  # GQA: measured slower
    (dict(n=4, k=1, is_causal=True), False),  # MQA
    (dict(n=4, k=4), True),  # not causal: measured faster (MHA and GQA at H128)
    (dict(n=8, k=2), True),
    (dict(n=4, k=4, h=64), True),  # not causal, MHA H64: measured faster
    (dict(n=8, k=2, h=64), False),  # not causal, GQA H64: measured slower
    (dict(n=4, k=4, t=256, s=512), False),  # not causal, S > T: refused
    (dict(n=4, k=4, t=384, s=384), False),  # not causal, MHA H128, 3 key blocks:
    # the two kernels measured faster (session 78)
    (dict(n=4, k=4, t=512, s=512), True),  # 4 key blocks
    (dict(n=8, k=2, t=384, s=384), False),  # GQA, 3 key blocks: ptxas spills
    (dict(n=4, k=4, t=384, s=384, h=64), False),  # H64, 3 key blocks: spills
    (dict(b=2, n=4, k=4, is_causal=True, local_window_size=(64, 0)), False),  # refused
    (dict(b=2, n=4, k=4, t=256, s=200, is_causal=True), False),  # T > S, S % 128: refused
    (dict(b=2, n=4, k=4, is_causal=True, logits_soft_cap=5.0), False),  # not run natively
    (dict(b=2, n=4, k=4, is_causal=True, h=64), False),  # causal H64: 0.98-1.05x
])
def test_backward_heuristic_fuses_dq_where_measured(kw, fused, monkeypatch):
  monkeypatch.setattr(_common, "is_h100", lambda: False)  # the H200's rule
  # Small calls, the causal rule's block count out of the way (its own test).
  monkeypatch.setattr(mat, "_FUSED_CAUSAL_BLOCKS", 0)
  args = _args(**{"h": 128, **kw})
  op = mat.MosaicGpuAttentionVjp()
  config = op.heuristic_config(args)
  assert config.fuse_dq == fused, config
  # The search space holds the one-kernel backward exactly where it takes the
  # call, with no ping-pong and the default dQ step.
  space_fused = [c for c in op.search_space(args) if c.fuse_dq]
  takes = akb.fused_dq_refusal(args.query.shape[1], args.key.shape[1],
                               args.query.shape[-1], config.block_q, args.is_causal,
                               mat._features(args)) is None
  assert bool(space_fused) == (takes and args.logits_soft_cap is None)
  assert all(not c.ping_pong and c.block_kv == 128 for c in space_fused)
  if fused:
    assert config in op.search_space(args)


@pytest.mark.parametrize("kw,fused,overlapped", [
    (dict(b=2, n=4, k=4, is_causal=True), False, None),  # T256: the two kernels
    (dict(b=8, n=4, k=4, t=1536, s=1536, is_causal=True), False, None),
    (dict(b=2, n=4, k=4, t=2048, s=2048, is_causal=True), True, True),  # from 2048
    (dict(b=2, n=4, k=4, t=4096, s=4096, is_causal=True), True, True),
    (dict(n=4, k=4, t=4096, s=4096, is_causal=True), False, None),  # one batch row
    (dict(b=2, n=8, k=2, t=4096, s=4096, is_causal=True), False, None),  # GQA
    (dict(n=4, k=4), True, None),  # not causal: the one kernel, as on the H200
    (dict(n=4, k=4, h=64), True, None),
])
def test_backward_heuristic_fuses_dq_on_h100(kw, fused, overlapped, monkeypatch):
  # On the H100 the causal MHA one-kernel backward with its dQ additions
  # overlapped ran 1.010-1.069x the two kernels' speed from 2048 queries (and
  # 0.998x at B2 T8192) and lost at 1024 and 1536 (notes/MEASUREMENTS.md
  # sessions 89-90); without causal it stays faster, not overlapped (untimed
  # there). The causal rule's block count is out of the way (its own test).
  monkeypatch.setattr(_common, "is_h100", lambda: True)
  monkeypatch.setattr(mat, "_FUSED_CAUSAL_BLOCKS", 0)
  args = _args(**{"h": 128, **kw})
  op = mat.MosaicGpuAttentionVjp()
  config = op.heuristic_config(args)
  assert (config.fuse_dq, config.overlap_dq_adds) == (fused, overlapped), config
  assert config in op.search_space(args)


@pytest.mark.parametrize("is_h100", [False, True])
@pytest.mark.parametrize("b,t,one_kernel", [
    (2, 2048, False),  # 512 dK/dV blocks (batch x heads x 128-key blocks)
    (2, 4096, False),  # 1024
    (4, 2048, False),  # 1024
    (8, 1536, False),  # 1536
    (8, 2048, True),  # 2048
    (4, 4096, True),  # 2048
    (32, 1024, None),  # 4096: the one kernel on the H200, on the H100 below 2048 queries
])
def test_backward_heuristic_fuses_dq_from_2048_blocks(is_h100, b, t, one_kernel,
                                                      monkeypatch):
  # Causal MHA H128 N16: the two kernels ran 1.1-8.4% faster than the one kernel
  # below 2048 dK/dV blocks on the H200, the one kernel 1.9-2.7% faster at 2048
  # (notes/MEASUREMENTS.md session 90). Shapes alone decide: zero-filled inputs.
  monkeypatch.setattr(_common, "is_h100", lambda: is_h100)
  q = jnp.zeros((b, t, 16, 128), jnp.bfloat16)
  args = attention_op.canonical_args(q, q, q, None, None, is_causal=True)[0]
  config = mat.MosaicGpuAttentionVjp().heuristic_config(args)
  want = (not is_h100) if one_kernel is None else one_kernel
  assert config.fuse_dq == want, config
  assert config.overlap_dq_adds is (True if want and is_h100 else None), config


def test_backward_heuristic_overlaps_no_dq_adds_on_h200(monkeypatch):
  # On the H200 the overlap ran slower under MHA (notes/MEASUREMENTS.md session
  # 90): its one kernel keeps the kernel's own rule (GQA only), and its search
  # space holds the overlap.
  monkeypatch.setattr(_common, "is_h100", lambda: False)
  args = _args(b=8, t=4096, s=4096, n=16, k=16, h=128, is_causal=True)
  op = mat.MosaicGpuAttentionVjp()
  config = op.heuristic_config(args)
  assert config.fuse_dq and config.overlap_dq_adds is None, config
  assert dataclasses.replace(config, overlap_dq_adds=True) in op.search_space(args)


@pytest.mark.parametrize("is_h100,t,heuristic,groups", [
    (False, 4096, (True, 4), {(False, 8), (True, 4)}),
    (True, 1536, (False, 32), {(False, 32), (True, 16)}),
])
def test_backward_head_group_counts_the_fused_dq(is_h100, t, heuristic, groups,
                                                 monkeypatch):
  # Causal MHA H128 bf16: the dK/dV kernel's Q and dO take 2 MiB a head at T4096
  # (8 heads fit the 24 MiB budget), 0.75 MiB at T1536 (32 heads); the one
  # kernel's float32 dQ doubles that (4 and 16 heads). The heuristic groups by
  # the kernel it runs (the H200 at T4096 and the H100 from 2048 queries: the
  # one kernel; the H100 at T1536: the two), and the search space each config
  # by its own.
  monkeypatch.setattr(_common, "is_h100", lambda: is_h100)
  args = _args(b=8, t=t, s=t, n=16, k=16, h=128, is_causal=True)
  op = mat.MosaicGpuAttentionVjp()
  config = op.heuristic_config(args)
  assert (config.fuse_dq, config.head_group) == heuristic
  assert {(c.fuse_dq, c.head_group) for c in op.search_space(args)} == groups | {
      (False, 0), (True, 0)}


class _Device:
  def __init__(self, device_kind):
    self.device_kind = device_kind


@pytest.mark.parametrize("kind,h100", [
    ("NVIDIA H100 80GB HBM3", True),
    ("NVIDIA H100 PCIe", True),
    ("NVIDIA H200", False),
    ("NVIDIA GH200 480GB", False),
    ("cpu", False),
])
def test_is_h100_reads_the_device_kind(kind, h100, monkeypatch):
  monkeypatch.setattr(_common, "interpreting", lambda: False)
  monkeypatch.setattr(jax, "devices", lambda: [_Device(kind)])
  assert _common.is_h100() == h100


def test_is_h100_is_false_in_the_interpreter(monkeypatch):
  # Interpreted kernels follow the H200's rules whatever the host's GPU.
  monkeypatch.setattr(_common, "interpreting", lambda: True)
  monkeypatch.setattr(jax, "devices", lambda: [_Device("NVIDIA H100 80GB HBM3")])
  assert not _common.is_h100()


@gpu
@pytest.mark.parametrize("b,t,s,n,k,h,block_q,ping_pong", [
    (2, 1024, 1024, 4, 4, 64, 128, False),
    (2, 1024, 1024, 4, 4, 64, 128, True),  # ping-pong
    (1, 2048, 2048, 8, 2, 128, 64, False),  # GQA: 4 query heads a block
    (1, 1000, 1100, 4, 2, 128, 64, True),  # T < S, neither a tile multiple
    (2, 700, 512, 4, 1, 64, 128, False),  # MQA, T > S
    # MHA at H128: the kernel without Pallas' store barriers (`_DkvKernel`).
    (1, 1000, 1100, 4, 4, 128, 64, False),  # T < S
    (2, 640, 256, 4, 4, 128, 64, False),  # T > S
])
def test_backward_fuse_dq(b, t, s, n, k, h, block_q, ping_pong):
  config = mat.AttentionVjpConfig(block_q, 128, 2, ping_pong=ping_pong, fuse_dq=True)
  _check_backward_config(b, t, s, n, k, h, True, config)


@gpu
@pytest.mark.parametrize("b,t,s,n,k,h,block_q,rings", [
    (2, 1024, 1024, 4, 4, 128, 64, 1),  # MHA at H128: no Pallas store barriers
    (1, 2048, 2048, 8, 2, 128, 64, 1),  # GQA: 4 query heads a block
    (2, 1000, 896, 4, 4, 128, 64, 1),  # T > S, T no multiple of the tile
    (2, 1024, 1024, 4, 1, 64, 128, 1),  # H64's 128-row steps, MQA
    (1, 8192, 8192, 2, 2, 128, 64, 1),  # 64 key blocks a head, all resident
    # MHA H128 at counts of key blocks that are no power of two: the rank from
    # the step alone (`_DkvKernel.rotated_rank`).
    (2, 3072, 3072, 4, 4, 128, 64, 1),  # 24 blocks a head
    (1, 10240, 10240, 2, 2, 128, 64, 1),  # 80
    # In rings (`AttentionVjpConfig.key_rings`), a launch each.
    (2, 10240, 10240, 2, 2, 128, 64, 2),  # two rings of 40 blocks
    (2, 3072, 3072, 4, 4, 128, 64, 4),  # four of 6
    (1, 2048, 2048, 8, 2, 128, 64, 2),  # GQA
    (2, 1000, 768, 4, 4, 128, 64, 3),  # T > S, three rings of 2
    (2, 1024, 1024, 4, 1, 64, 128, 2),  # H64, MQA
])
def test_backward_fuse_dq_without_causal(b, t, s, n, k, h, block_q, rings):
  # Each key block visits every query tile from its diagonal on, wrapping
  # around (`_DkvKernel.rotated`); a ring's top block waits for its lowest at
  # the wrap.
  config = mat.AttentionVjpConfig(block_q, 128, 2, fuse_dq=True, key_rings=rings)
  _check_backward_config(b, t, s, n, k, h, False, config)


_SAVERS = dict(stats_in_accumulators=True)


@gpu
@pytest.mark.parametrize("b,t,s,n,k,h,causal,config", [
    # The one-kernel backward at one batch row (compiled clean with the
    # statistics in the accumulators, where it spills without), causal and in
    # rings, and with dK's dS^T from shared memory; ping-pong.
    (1, 4096, 4096, 4, 4, 128, True, dict(fuse_dq=True, **_SAVERS)),
    (1, 1000, 1100, 4, 4, 128, True, dict(fuse_dq=True, dk_from_smem=True, **_SAVERS)),
    (1, 10240, 10240, 2, 2, 128, False, dict(fuse_dq=True, key_rings=2, **_SAVERS)),
    (2, 1024, 1024, 4, 4, 128, False, dict(fuse_dq=True, ping_pong=True,
                                           dk_from_smem=True, **_SAVERS)),
    (1, 2048, 2048, 8, 2, 128, True, dict(fuse_dq=True, dk_from_smem=True, **_SAVERS)),
    # The two kernels: GQA, padded T and S, ping-pong; H64 (P from the first
    # product while the second runs).
    (1, 700, 450, 4, 2, 128, True, _SAVERS),
    (2, 512, 512, 4, 4, 128, False, dict(ping_pong=True, **_SAVERS)),
    (2, 1024, 1024, 4, 4, 64, True, _SAVERS),
    # H64's one kernel at 24 key blocks a head (offline: 512 B spilled and
    # serialized without).
    (1, 3072, 3072, 4, 4, 64, False, dict(block_q=128, fuse_dq=True, **_SAVERS)),
    # The one kernel's default (the statistics) at a length and batch where
    # the plain products spill and serialize (B8 T1000 N16, offline), and its
    # plain products (opted out).
    (8, 1000, 1000, 4, 4, 128, True, dict(fuse_dq=True)),
    (2, 1000, 1000, 4, 4, 128, True, dict(fuse_dq=True, stats_in_accumulators=False)),
    # With its dQ additions overlapped under MHA (the H100's heuristic), in head
    # groups, at lengths off the tiles and on them.
    (8, 1000, 1000, 4, 4, 128, True, dict(fuse_dq=True, overlap_dq_adds=True)),
    (4, 4096, 4096, 16, 16, 128, True, dict(fuse_dq=True, overlap_dq_adds=True,
                                             head_group=4)),
])
def test_backward_stats_in_accumulators(b, t, s, n, k, h, causal, config):
  # The dK/dV kernel's score products started from -lse2 / c and -delta.
  config = mat.AttentionVjpConfig(**{"block_q": 64, "block_kv": 128, "num_stages": 2,
                                     **config})
  _check_backward_config(b, t, s, n, k, h, causal, config)


@gpu
@pytest.mark.parametrize("t,n,k,h,causal,one_kernel", [
    (4096, 32, 32, 128, True, True),  # 2048 dK/dV blocks at two batch rows
    (3000, 64, 64, 128, True, True),  # not a multiple of the tiles: 3072 blocks
    (4096, 8, 8, 128, True, False),  # 512 blocks: the two kernels
    (4096, 8, 8, 128, False, True),  # without causal: each block wraps around
    (4096, 8, 2, 128, False, True),  # GQA without causal
    (4096, 8, 8, 64, False, True),  # H64 without causal: 128-row steps
    (16384, 8, 8, 64, False, True),  # 128 key blocks a head, all resident at once
])
def test_backward_heuristic_fused_at_length(t, n, k, h, causal, one_kernel):
  # The heuristic's one-kernel backward at realistic lengths (causal MHA in
  # head groups, from two batch rows and 2048 dK/dV blocks: below, the two
  # kernels, also checked). Where the register split is lost (JAX >= 0.12),
  # H128 runs the two-pass dK/dV instead: checked here as well.
  b = 2 if causal else 1
  args = _args(t=t, s=t, n=n, k=k, h=h, b=b, is_causal=causal)
  config = mat.MosaicGpuAttentionVjp().heuristic_config(args)
  if h == 128 and _common.register_split_lost():
    assert config.split_dkv and not config.fuse_dq and config.block_kv == 64, config
  elif not one_kernel:
    assert not config.fuse_dq and config.head_group, config
  else:
    assert config.fuse_dq and (config.head_group or not causal), config
    overlaps = causal and _common.is_h100()  # MHA on the H100
    assert config.overlap_dq_adds is (True if overlaps else None), config
  _check_backward_config(b, t, t, n, k, h, causal, config)


@gpu
@pytest.mark.parametrize("b,t,n,k,h,window", [
    (2, 4096, 32, 8, 128, None),  # the dense step's attention: 16 pairs
    (4, 3000, 16, 4, 64, None),  # not a multiple of the tiles
    (2, 2500, 32, 8, 256, None),  # H256's split dK/dV
    (2, 4096, 32, 8, 128, (1024, 0)),  # a causal sliding window
])
def test_backward_heuristic_gqa_head_groups_at_length(b, t, n, k, h, window):
  # The causal GQA heuristic's two kernels in head groups of 4 (batch row,
  # key/value head) pairs, at realistic lengths: the heuristic's from 4096
  # queries and keys; below, the test sets the group itself (the same kernels,
  # off the tiles).
  args = _args(t=t, s=t, n=n, k=k, h=h, b=b, is_causal=True, local_window_size=window)
  config = mat.MosaicGpuAttentionVjp().heuristic_config(args)
  assert config.kv_split == 1 and not config.fuse_dq, config
  assert config.head_group == (4 if t >= 4096 else 0), config
  config = dataclasses.replace(config, head_group=4)
  if window is None:
    _check_backward_config(b, t, t, n, k, h, True, config)
  else:
    _check_bwd_features_direct(b, t, t, n, k, h, config=config, causal=True,
                               window=window)


@pytest.mark.parametrize("is_h100", [False, True])
@pytest.mark.parametrize("kw,as_mha", [
    (dict(b=2, t=8192, n=32, k=8), True),  # 4096 blocks at the query heads
    (dict(b=2, t=15000, n=32, k=8), True),  # not a multiple of the tiles
    (dict(b=4, t=8192, n=8, k=1), True),  # MQA: 2048 blocks
    (dict(b=2, t=16384, n=64, k=8), True),  # 8 query heads a key/value head
    (dict(b=2, t=8192, n=8, k=1), False),  # MQA: 1024 blocks
    (dict(b=2, t=8000, n=32, k=8), False),  # below 8192 queries: head groups
    (dict(b=2, t=4096, n=32, k=8), False),
    (dict(b=2, t=8192, s=16384, n=32, k=8), False),  # T far from S: not measured
    (dict(b=2, t=16384, s=8192, n=32, k=8), False),
    (dict(b=1, t=16384, n=32, k=8), False),  # one batch row: serialized wgmmas
    (dict(b=2, t=8192, n=32, k=8, h=64), False),  # H64, H256: not measured
    (dict(b=2, t=8192, n=32, k=8, h=256), False),
    (dict(b=2, t=8192, n=32, k=8, is_causal=False), False),
])
def test_backward_heuristic_gqa_as_mha(kw, as_mha, is_h100, monkeypatch):
  # Causal GQA/MQA H128 from 8192 queries and keys, from two batch rows and 2048
  # dK/dV blocks counted at the query heads, on either card: the causal MHA one kernel on one head a query head read from each
  # key/value head, in the MHA one kernel's L2 group (Q, dO and a float32 dQ: 8
  # MiB a head at T8192, 3 fit in 24 MiB: 2; 14.6 MiB at T15000: 1), its dQ
  # additions overlapped on the H100 (notes/MEASUREMENTS.md sessions 92 and
  # 97). Shapes alone
  # decide: zero-filled inputs.
  monkeypatch.setattr(_common, "is_h100", lambda: is_h100)
  monkeypatch.setattr(_common, "num_sms", lambda: 132)
  monkeypatch.setattr(_common, "register_split_lost", lambda: None)
  kw = {"h": 128, "is_causal": True, "s": kw["t"], **kw}
  b, t, s, n, k, h = (kw.pop(name) for name in "btsnkh")
  q = jnp.zeros((b, t, n, h), jnp.bfloat16)
  key = jnp.zeros((b, s, k, h), jnp.bfloat16)
  args = attention_op.canonical_args(q, key, key, None, None, **kw)[0]
  bwd = mat.MosaicGpuAttentionVjp()
  config = bwd.heuristic_config(args)
  if as_mha:
    assert config.fuse_dq and config.kv_split == n // k, config
    assert config.head_group == (2 if t == 8192 else 1), config
    # The H200's ran faster without (None: not, one query head a block).
    assert config.overlap_dq_adds is (True if is_h100 else None), config
    assert config in bwd.search_space(args)
  else:
    assert not (config.fuse_dq and config.kv_split == n // k), config
  # Where JAX's compile loses the register split, H128 keeps its own backward.
  monkeypatch.setattr(_common, "register_split_lost", lambda: "lost")
  assert not bwd.heuristic_config(args).fuse_dq


@gpu
@pytest.mark.parametrize("overlap", [True, False])  # the H100's, the H200's
@pytest.mark.parametrize("b,t,n,k", [(2, 8192, 32, 8), (2, 8500, 16, 2)])
def test_backward_heuristic_gqa_as_mha_at_length(b, t, n, k, overlap):
  # The causal GQA heuristic's MHA one kernel on split key/value heads
  # (`attention._gqa_as_mha_backward`), at realistic lengths on and off the
  # tiles, with and without its dQ additions overlapped, against the XLA
  # reference's gradients.
  args = _args(t=t, s=t, n=n, k=k, h=128, b=b, is_causal=True)
  config = mat.MosaicGpuAttentionVjp().heuristic_config(args)
  if not _common.register_split_lost():
    assert config.fuse_dq and config.kv_split == n // k, config
    assert config.overlap_dq_adds is (True if _common.is_h100() else None), config
    config = dataclasses.replace(config, overlap_dq_adds=overlap)
  _check_backward_config(b, t, t, n, k, 128, True, config)


@gpu
@pytest.mark.parametrize("causal", [True, False])
# GQA; MHA (no Pallas store barriers), also with its dQ additions overlapped.
@pytest.mark.parametrize("k,overlap", [(4, None), (16, None), (16, True)])
def test_backward_fuse_dq_is_deterministic(k, overlap, causal):
  # Many blocks add into each query tile at once: the order of additions is
  # fixed by rank, so two runs agree bit for bit.
  b, t, n, h = 2, 4096, 16, 128
  q, key, v = _qkv(b, t, t, n, k, h, jnp.bfloat16)
  dout = _cotangent((b, t, n, h), jnp.bfloat16)
  scale = 1 / np.sqrt(h)
  out = _reference(q, key, v, causal, scale).astype(jnp.bfloat16)
  lse = _reference_lse(q, key, causal, scale)
  bwd = jax.jit(functools.partial(
      mat.mosaic_attention_bwd, scale=scale, causal=causal,
      config=mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, overlap_dq_adds=overlap)))
  first = bwd(q, key, v, out, dout, lse)
  for _ in range(3):
    again = bwd(q, key, v, out, dout, lse)
    for name, x, y in zip(("dq", "dk", "dv"), first, again):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("config", _PING_PONGS)
def test_backward_ping_pong(causal, h, config):
  if h == 64:  # wider dK/dV steps fit at H64
    config = dataclasses.replace(config, block_q=128)
  _check_backward_config(2, 512, 512, 4, 4, h, causal, config)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,k,h", [(8, 2, 128), (4, 1, 128), (8, 1, 64)])
def test_backward_ping_pong_gqa_mqa(causal, n, k, h):
  config = mat.AttentionVjpConfig(64, 128, 2, ping_pong=True, ping_pong_dq=True)
  _check_backward_config(1, 384, 384, n, k, h, causal, config)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,s", [(200, 330), (1, 77), (640, 256), (256, 640),
                                 (130, 1000), (128, 128)])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("config", [_PING_PONGS[2], _PING_PONGS[3]])
def test_backward_ping_pong_lengths(causal, t, s, h, config):
  _check_backward_config(1, t, s, 4, 2, h, causal, config)


@gpu
def test_backward_ping_pong_long_causal():
  # Many query tiles per key tile and ring laps in both kernels.
  both = dict(ping_pong=True, ping_pong_dq=True)
  _check_backward_config(1, 2048, 2048, 2, 2, 128, True,
                         mat.AttentionVjpConfig(64, 64, 2, **both))
  _check_backward_config(1, 1024, 1024, 4, 1, 64, True,
                         mat.AttentionVjpConfig(128, 128, 3, **both), scale=0.3)


@gpu
def test_backward_long_causal():
  # Many query tiles per key tile and ring laps in both kernels.
  _check_backward(1, 2048, 2048, 2, 2, 128, True)
  _check_backward(1, 1024, 1024, 4, 1, 64, True, scale=0.3)


@gpu
def test_backward_automatic_dispatch_takes_a_backward():
  # implementation=None: whichever forward and backward dispatch prefers; the
  # gradients stay right when ours runs from another forward's lse.
  q, key, v = _qkv(1, 256, 256, 2, 2, 128, jnp.bfloat16)
  cot = _cotangent(q.shape, jnp.bfloat16)
  with tokamax.record_dispatch() as records:
    got = jax.jit(jax.grad(_grad_loss(True, None, cot, None), argnums=(0, 1, 2)))(
        q, key, v)
  assert len([r for r in records if r.direction == "backward"]) == 1, records
  up = lambda x: x.astype(jnp.float32)
  want = jax.jit(jax.grad(_grad_loss(True, None, cot, "xla"), argnums=(0, 1, 2)))(
      up(q), up(key), up(v))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


def _each_features_on_each_shape(features: list[dict], shapes: list[tuple]) -> list:
  """``(features, causal, *shape)`` for every feature set on every shape, causal
  alternating so that each feature set and each shape lower both with and
  without the causal mask: every pair of the three, not their full product
  (lowering one case costs about a second of CI's CPU time)."""
  return [(f, (i + j) % 2 == 1, *shape)
          for i, f in enumerate(features) for j, shape in enumerate(shapes)]


@pytest.mark.smoke
@pytest.mark.parametrize("features,causal,h,n,k,t,s,config", _each_features_on_each_shape([
    dict(logits_soft_cap=5.0),
    dict(local_window=(64, 16)),
    dict(local_window=(None, 0), query_seq_lengths=True),
    dict(key_value_seq_lengths=True, query_seq_lengths=True),
    dict(segments=True),
    dict(segments=True, local_window=(100, 0), key_value_seq_lengths=True),
    dict(q_offset=True, local_window=(32, 0), logits_soft_cap=30.0),
    dict(q_offset=True),  # causal on some shapes; without it the offset is moot
    dict(sinks=True),
    dict(sinks=True, local_window=(64, 0), key_value_seq_lengths=True,
         query_seq_lengths=True),
], [
    (128, 8, 2, 384, 640, mat.AttentionConfig(block_kv=128, num_stages=2)),
    (64, 4, 1, 200, 333, mat.AttentionConfig(block_kv=192, num_stages=3)),
    (256, 2, 2, 256, 256, mat.AttentionConfig(block_kv=64, num_stages=2)),
    (128, 4, 2, 640, 512, mat.AttentionConfig(block_kv=64, num_stages=3,
                                              tiles_per_block=2)),
    (128, 16, 2, 1280, 1024, mat.AttentionConfig(block_kv=64, num_stages=3,
                                                 persistent=True)),  # 3 rounds
]))
def test_lowers_for_cuda_with_features(features, causal, h, n, k, t, s, config):
  pytest.importorskip("absl")
  b = 2
  features = dict(features)
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h))]
  names = []
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if features.pop(name, False):
      names.append(name)
      shapes.append(jax.ShapeDtypeStruct((b,), jnp.int32))
  if features.pop("segments", False):
    names += ["q_segment_ids", "kv_segment_ids"]
    shapes += [jax.ShapeDtypeStruct((b, t), jnp.int32),
               jax.ShapeDtypeStruct((b, s), jnp.int32)]
  if features.pop("q_offset", False):
    names.append("q_offset")
    shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
  if features.pop("sinks", False):
    names.append("sinks")
    shapes.append(jax.ShapeDtypeStruct((n,), jnp.float32))

  def run(q, key, v, *rest):
    return mat.mosaic_attention(q, key, v, scale=0.125, causal=causal,
                                config=config, **features, **dict(zip(names, rest)))
  exported = jax.export.export(jax.jit(run), platforms=["cuda"])(*shapes)
  assert "mosaic_gpu" in exported.mlir_module()
  out, lse = exported.out_avals
  assert out.shape == (b, t, n, h) and lse.shape == (b, n, t)


@pytest.mark.parametrize("causal", [False, True])
def test_soft_cap_lowers_with_overlap(causal):
  pytest.importorskip("absl")
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((1, 256, 4, 128), (1, 320, 2, 128), (1, 320, 2, 128))]
  exported = jax.export.export(jax.jit(lambda q, key, v: mat.mosaic_attention(
      q, key, v, scale=0.125, causal=causal, config=mat.AttentionConfig(
          overlap_qk=True), logits_soft_cap=10.0)), platforms=["cuda"])(*shapes)
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.smoke
@pytest.mark.parametrize("causal,window,t,s,config", [
    (True, (256, 0), 640, 640, mat.AttentionConfig(overlap_qk=True)),
    # The last block's second warpgroup of padded rows only (T % 128 = 44).
    (False, (100, 30), 300, 333, mat.AttentionConfig(block_kv=64, overlap_qk=True)),
    (True, (64, 0), 1280, 1280, mat.AttentionConfig(overlap_qk=True,
                                                     persistent=True)),  # 3 rounds
    (True, (None, 0), 640, 700, mat.AttentionConfig(overlap_qk=True,
                                                    tiles_per_block=2)),
])
def test_window_lowers_with_overlap(causal, window, t, s, config):
  pytest.importorskip("absl")
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            for shape in ((2, t, 16, 128), (2, s, 4, 128), (2, s, 4, 128))]
  exported = jax.export.export(jax.jit(lambda q, key, v: mat.mosaic_attention(
      q, key, v, scale=0.125, causal=causal, config=config, local_window=window,
      logits_soft_cap=10.0 if causal else None)), platforms=["cuda"])(*shapes)
  assert "mosaic_gpu" in exported.mlir_module()


# ----------------------------------------------------------------------------
# Backward features: lengths, window, q_offset, soft cap, segments.
# ----------------------------------------------------------------------------


def test_bwd_features_query_range_matches_brute_force():
  # The dK/dV kernel's query tiles for 64 key rows: every tile holding a
  # visible (query, key) pair is in [lo, hi); in [fl, fh) every valid query
  # sees every valid key of the block.
  rng = np.random.default_rng(2)
  windows = [(None, None), (None, 0), (0, 0), (5, 0), (100, 3), (None, 17),
             (300, None), (1, 1), (64, 64)]
  query_range = jax.jit(akc.query_range, static_argnums=(1, 5, 6, 7))
  for trial in range(300):
    bq = int(rng.choice([64, 128]))
    t = int(rng.integers(1, 700))
    s = int(rng.integers(1, 700))
    left, right = windows[trial % len(windows)]
    q_limit = int(rng.integers(0, t + 1))
    kv_limit = int(rng.integers(0, s + 1))
    off = int(rng.integers(-300, 300)) if trial % 3 else 0
    k0 = 64 * int(rng.integers(0, -(-s // 64)))
    lo, fl, fh, hi = (int(x) for x in query_range(
        jnp.int32(k0), 64, jnp.int32(q_limit), jnp.int32(kv_limit), jnp.int32(off),
        left, right, bq))
    n_q = -(-t // bq)
    # Rows: queries; columns: this block's keys.
    vis = _brute_visible(np.arange(n_q * bq), np.arange(k0, k0 + 64), q_limit,
                         kv_limit, off, left, right)
    valid_keys = np.arange(k0, k0 + 64) < kv_limit
    case = (bq, t, s, left, right, q_limit, kv_limit, off, k0, lo, fl, fh, hi)
    assert 0 <= lo <= fl <= fh <= hi, case
    for j in range(max(n_q, hi)):
      tile = vis[j * bq:(j + 1) * bq]
      if tile.any():
        assert lo <= j < hi <= n_q, (case, j)
      if fl <= j < fh:
        rows = np.arange(j * bq, (j + 1) * bq) < q_limit
        assert tile[rows][:, valid_keys].all(), (case, j)


def _np(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _ints(*xs):
  return [int(x) for x in xs]


def _segment_narrowed(rng_, table, bi, g, segments):
  lo, fl, fh, hi = rng_
  if segments:
    lo = max(lo, int(table[bi, g, 0]))
    hi = max(min(hi, int(table[bi, g, 1])), lo)
    fl = fh = lo
  return lo, fl, fh, hi


def _model_scores(s, dp, lse_b, delta_b, c, cap, visible):
  """One step's P and dS in float64, as the kernels compute them (unscaled dS;
  `lse_b`/`delta_b` already broadcast against `s`)."""
  with np.errstate(all="ignore"):
    if cap is None:
      z = s * c - lse_b
    else:
      th = np.tanh(s * (c / (akc.LOG2E * cap)))
      z = th * (cap * akc.LOG2E) - lse_b
    if visible is not None:
      z = np.where(visible, z, -np.inf)
    p = np.exp2(z)
    ds = p * (dp - delta_b)
    if cap is not None:
      ds = ds * (1.0 - th * th)
  return p, ds


def _tma_rows(x, rows):
  """What the kernels' TMA copies read of `x` [B, T, ...]: zeros past T, up to
  `rows` (T rounded up to whole blocks)."""
  return np.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _block_rows(x):
  return -(-x.shape[1] // 128) * 128


def _own_steps(lo, fl, fh, hi, ranges, w, own):
  """``(fl, fh, step)`` for each step consumer `w` computes of the union ``[lo,
  hi)`` (unmasked in ``[fl, fh)``): its own range's (`akc.own_steps`), or with
  `own` False (the kernel's `takes_own_steps`) all of the union's."""
  if own:
    lo, fl, fh, hi = _ints(*akc.own_steps(
        jnp.int32(lo), jnp.int32(hi), *(tuple(jnp.int32(x) for x in r) for r in ranges),
        w))
  return [(fl, fh, step) for step in range(lo, hi)]


def _model_dkv(q, k, v, do, lse2, delta, *extras, scale, causal, config, feat,
               grads=("dk", "dv"), kv_rep=1):
  """The dK/dV kernel's loops (ranges, masks, steps) in NumPy; returns `grads`
  (rows past S dropped, as TMA drops those stores), with `kv_rep` > 1 per
  block head (each key/value head read as that many)."""
  k, v = (akb.replicate_kv_heads(x, kv_rep) for x in (k, v))
  shape = akb._shape(q, k, scale=scale, causal=causal, config=config, feat=feat)
  q, k, v, do, lse2, delta = (_np(x) for x in (q, k, v, do, lse2, delta))
  s = k.shape[1]
  q, do = (_tma_rows(x, _block_rows(q)) for x in (q, do))
  k, v = (_tma_rows(x, _block_rows(k)) for x in (k, v))
  b, tp, n, h = q.shape
  sp, nk = k.shape[1], k.shape[2]
  group, bq, rows = n // nk, config.pass_block_q(grads), 64
  nq, c = tp // bq, scale * akc.LOG2E
  lims = np.asarray(extras[0]) if feat.dynamic else None
  if feat.segments:
    table, q_ids, kv_ids = (np.asarray(x) for x in extras[1:4])
  query_range = jax.jit(akc.query_range, static_argnums=(1, 5, 6, 7))
  dk, dv = np.zeros(k.shape), np.zeros(v.shape)
  for bi in range(b):
    for kh in range(nk):
      for ki in range(sp // 128):
        k0 = ki * 128
        if feat.dynamic:
          q_limit, kv_limit, off = (int(x) for x in lims[bi])
          ranges = [_segment_narrowed(_ints(*query_range(
              jnp.int32(k0 + w * rows), rows, jnp.int32(q_limit),
              jnp.int32(kv_limit), jnp.int32(off), feat.left, feat.right, bq)),
              table if feat.segments else None, bi, ki * 2 + w, feat.segments)
                    for w in (0, 1)]
          lo, fl, fh, hi = _ints(*akc.shared_steps(*(
              tuple(jnp.int32(x) for x in r) for r in ranges)))
          assert lo <= fl <= fh <= hi
        own = akb._DkvKernel(**shape, grads=grads).takes_own_steps
        for w in (0, 1):
          r0 = k0 + w * rows
          if feat.dynamic:
            steps = [(j, not wfl <= j < wfh)
                     for wfl, wfh, j in _own_steps(lo, fl, fh, hi, ranges, w, own)]
          elif causal:
            j_clear = min((r0 + rows - 1 + bq - 1) // bq, nq)
            first = min(max(k0 // bq, r0 // bq), nq) if own else k0 // bq
            steps = [(j, j < j_clear) for j in range(first, nq)]
          else:
            steps = [(j, False) for j in range(nq)]
          kt, vt = k[bi, r0:r0 + rows, kh], v[bi, r0:r0 + rows, kh]
          for g in range(group):
            head = kh * group + g
            for j, masked in steps:
              tq = slice(j * bq, (j + 1) * bq)
              qt, dot = q[bi, tq, head], do[bi, tq, head]
              key = np.arange(r0, r0 + rows)[:, None]
              query = np.arange(j * bq, (j + 1) * bq)[None, :]
              visible = None
              if masked and not feat.dynamic:
                visible = key <= query
              elif masked:
                pos = query + off
                visible = np.ones((rows, bq), bool)
                if feat.left is not None:
                  visible &= key >= pos - feat.left
                if feat.right is not None:
                  visible &= key <= pos + feat.right
                if feat.segments:
                  visible &= (kv_ids[bi, r0:r0 + rows, None]
                              == q_ids[bi, None, j * bq:(j + 1) * bq])
              p, ds = _model_scores(kt @ qt.T, vt @ dot.T, lse2[bi, head, tq][None],
                                    delta[bi, head, tq][None], c, feat.soft_cap,
                                    visible)
              dv[bi, r0:r0 + rows, kh] += p @ dot
              dk[bi, r0:r0 + rows, kh] += ds @ qt
          if feat.kv_len:
            keep = (np.arange(r0, r0 + rows) < kv_limit)[:, None]
            dk[bi, r0:r0 + rows, kh] = np.where(keep, dk[bi, r0:r0 + rows, kh], 0)
            dv[bi, r0:r0 + rows, kh] = np.where(keep, dv[bi, r0:r0 + rows, kh], 0)
  out = {"dk": jnp.asarray(dk[:, :s] * scale, jnp.float32),
         "dv": jnp.asarray(dv[:, :s], jnp.float32)}
  return tuple(out[g] for g in grads)


def _model_dq(q, k, v, do, lse2, delta, *extras, scale, causal, s_true, config,
              feat):
  """The dQ kernel's loops in NumPy (reads and stores as `_model_dkv`'s)."""
  shape = akb._shape(q, k, scale=scale, causal=causal, config=config, feat=feat)
  own = akb._DqKernel(**shape, s_true=s_true).takes_own_steps
  q, k, v, do, lse2, delta = (_np(x) for x in (q, k, v, do, lse2, delta))
  t = q.shape[1]
  q, do = (_tma_rows(x, _block_rows(q)) for x in (q, do))
  k, v = (_tma_rows(x, _block_rows(k)) for x in (k, v))
  b, tp, n, h = q.shape
  sp, nk = k.shape[1], k.shape[2]
  group, bkv, rows = n // nk, config.block_kv, 64
  n_kv, c = sp // bkv, scale * akc.LOG2E
  lims = np.asarray(extras[0]) if feat.dynamic else None
  if feat.segments:
    table, q_ids, kv_ids = (np.asarray(x) for x in extras[1:4])
  key_range = jax.jit(akc.key_range, static_argnums=(1, 5, 6, 7))
  dq = np.zeros(q.shape)
  for bi in range(b):
    for head in range(n):
      kvh = head // group
      for qi in range(tp // 128):
        tile0 = qi * 128
        if feat.dynamic:
          q_limit, kv_limit, off = (int(x) for x in lims[bi])
          ranges = [_segment_narrowed(_ints(*key_range(
              jnp.int32(tile0 + w * rows), rows, jnp.int32(q_limit),
              jnp.int32(kv_limit), jnp.int32(off), feat.left, feat.right, bkv)),
              table if feat.segments else None, bi, qi * 2 + w, feat.segments)
                    for w in (0, 1)]
          lo, fl, fh, hi = _ints(*akc.shared_steps(*(
              tuple(jnp.int32(x) for x in r) for r in ranges)))
          assert lo <= fl <= fh <= hi
        for w in (0, 1):
          r0 = tile0 + w * rows
          if feat.dynamic:
            steps = [(i, not wfl <= i < wfh) for wfl, wfh, i in _own_steps(
                lo, fl, fh, hi, ranges, w, own)]
          else:
            n_block = (min(-(-(tile0 + 128) // bkv), n_kv) if causal else n_kv)
            n_clear = (min((r0 + 1) // bkv, s_true // bkv) if causal
                       else s_true // bkv)
            steps = [(i, i >= n_clear) for i in range(n_block)]
          tq = slice(r0, r0 + rows)
          qt, dot = q[bi, tq, head], do[bi, tq, head]
          for i, masked in steps:
            tk = slice(i * bkv, (i + 1) * bkv)
            kt, vt = k[bi, tk, kvh], v[bi, tk, kvh]
            query = np.arange(r0, r0 + rows)[:, None]
            key = np.arange(i * bkv, (i + 1) * bkv)[None, :]
            visible = None
            if masked:
              visible = np.ones((rows, bkv), bool)
              if not feat.dynamic:
                if causal:
                  visible &= key <= query
                visible &= key < s_true
              else:
                pos = query + off
                visible &= key < kv_limit
                if feat.left is not None:
                  visible &= key >= pos - feat.left
                if feat.right is not None:
                  visible &= key <= pos + feat.right
                if feat.segments:
                  visible &= (q_ids[bi, tq, None]
                              == kv_ids[bi, None, i * bkv:(i + 1) * bkv])
            _, ds = _model_scores(qt @ kt.T, dot @ vt.T, lse2[bi, head, tq][:, None],
                                  delta[bi, head, tq][:, None], c, feat.soft_cap,
                                  visible)
            dq[bi, tq, head] += ds @ kt
  return jnp.asarray(dq[:, :t] * scale, jnp.float32)


_BWD_MODEL_CASES = [
    # (t, s, n, k, config ((block_q, block_kv) at 2 stages, or a config), features)
    (200, 330, 4, 2, (64, 128), dict(q_len=[200, 77], kv_len=[300, 1])),
    (200, 330, 4, 2, (128, 64), dict(causal=True, q_len=[150, 3],
                                     kv_len=[0, 260])),
    (256, 384, 2, 1, (64, 64), dict(window=(64, 16))),
    (300, 200, 2, 2, (128, 128), dict(window=(None, 17), kv_len=[150, 200])),
    (192, 320, 2, 1, (64, 128), dict(window=(50, 0), q_offset=37)),
    (256, 256, 2, 2, (64, 64), dict(causal=True, q_offset=-200)),
    (256, 512, 4, 2, (128, 64), dict(causal=True, window=(100, None),
                                     q_offset=130, q_len=[256, 100])),
    (200, 330, 2, 1, (64, 128), dict(soft_cap=2.0)),
    (200, 330, 2, 1, (64, 128), dict(soft_cap=3.0, causal=True)),
    (256, 320, 2, 2, (64, 64), dict(soft_cap=2.0, window=(40, 40),
                                    kv_len=[300, 100])),
    (256, 256, 4, 2, (64, 128), dict(causal=True, segments="packed")),
    (200, 333, 2, 1, (128, 64), dict(segments="random", kv_len=[250, 333],
                                     window=(None, 40))),
    (256, 256, 2, 2, (64, 64), dict(segments="disjoint")),
    # Each key/value head read as two or four (`kv_split`), dynamic features.
    (256, 256, 4, 1, mat.AttentionVjpConfig(64, 128, 2, kv_split=2),
     dict(causal=True, segments="packed")),
    (200, 330, 8, 2, mat.AttentionVjpConfig(64, 128, 2, kv_split=4),
     dict(q_len=[200, 77], kv_len=[300, 1], window=(64, 16))),
    # The static paths, to trust the model itself.
    (200, 330, 4, 2, (64, 128), dict()),
    (330, 200, 4, 2, (128, 64), dict(causal=True)),
    # Static causal at 64- and 32-row steps: warpgroup 1 idles through the first
    # query tiles of its block (`_DkvKernel.takes_own_steps`).
    (300, 300, 4, 2, (64, 128), dict(causal=True)),
    (200, 200, 2, 1, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True), dict(causal=True)),
    # dK and dV in two passes (H256's), the dV pass at its own 64-row step with
    # its own segment table.
    (256, 256, 4, 2, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True, block_q_dv=64),
     dict(causal=True, segments="late", window=(100, 0))),
    (200, 333, 2, 1, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True),
     dict(segments="random", kv_len=[250, 333])),
]


def _model_segments(kind, t, s):
  rng = np.random.default_rng(next(_seed))
  if kind == "packed":
    ids = _packed(2, max(t, s), [[100, 28, 60, 68], [7, 249]])
    return ids[:, :t], ids[:, :s]
  if kind == "random":
    return (rng.integers(0, 3, (2, t)).astype(np.int32),
            rng.integers(1, 5, (2, s)).astype(np.int32))
  if kind == "late":  # a key block whose first matching query is far past it
    ids = _packed(2, max(t, s), [[128, 128], [30, 226]])
    return ids[:, :t], ids[:, :s]
  return np.zeros((2, t), np.int32), np.ones((2, s), np.int32)


@pytest.mark.parametrize("case", range(len(_BWD_MODEL_CASES)))
def test_bwd_features_tile_model_matches_autodiff(case, monkeypatch):
  # `mosaic_attention_bwd` (wrapper: lse sanitizing, padding, limits, segment
  # tables) with both kernels replaced by NumPy models of their loops (tile
  # ranges, shared steps, masks, soft-cap derivative, zeroed rows), against
  # autodiff of the XLA reference: checks the index logic the GPU runs.
  import tokamax_xla_reference  # lazy: another package, needed by these tests only
  t, s, n, k, config, feats = _BWD_MODEL_CASES[case]
  if isinstance(config, tuple):
    config = mat.AttentionVjpConfig(*config, 2)
  feats = dict(feats)
  if "segments" in feats:
    feats["segments"] = _model_segments(feats["segments"], t, s)
  args = _feature_args(2, t, s, n, k, 16, jnp.float32, **feats)
  monkeypatch.setattr(akb, "flash_dkv", _model_dkv)
  monkeypatch.setattr(akb, "flash_dq", _model_dq)
  kw = dict(is_causal=args.is_causal, local_window=args.local_window,
            logits_soft_cap=args.logits_soft_cap,
            query_seq_lengths=args.query_seq_lengths,
            key_value_seq_lengths=args.key_value_seq_lengths,
            q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
            q_offset=args.q_offset)

  def ref(q, key, v):
    return tokamax_xla_reference.attention(q, key, v, scale=args.scale,
                                           precision=HIGHEST, **kw)
  (out, lse), vjp = jax.vjp(ref, args.query, args.key, args.value)
  dout = _cotangent(out.shape, jnp.float32)
  want = vjp((dout, jnp.zeros_like(lse)))
  kw["causal"] = kw.pop("is_causal")
  got = mat.mosaic_attention_bwd(
      args.query, args.key, args.value, out, dout, lse, scale=args.scale,
      config=config, **kw)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and np.isfinite(g).all(), name
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4 * np.abs(w).max() + 1e-6,
                               err_msg=name)
  # Rows past the lengths: zero gradients.
  if args.query_seq_lengths is not None:
    for bi, limit in enumerate(np.asarray(args.query_seq_lengths)):
      assert (np.asarray(got[0])[bi, limit:] == 0).all()
  if args.key_value_seq_lengths is not None:
    for bi, limit in enumerate(np.asarray(args.key_value_seq_lengths)):
      assert (np.asarray(got[1])[bi, limit:] == 0).all()
      assert (np.asarray(got[2])[bi, limit:] == 0).all()


def test_bwd_features_configs_fit_with_segments():
  seg = dict(q_segment_ids=np.zeros((1, 256), np.int32),
             kv_segment_ids=np.zeros((1, 256), np.int32))
  op = mat.MosaicGpuAttentionVjp()
  for h in (64, 128):
    args = _args(h=h, **seg)
    config = op.heuristic_config(args)
    # The default tiles still fit (segment ids: the fused kernel refuses).
    default = op.heuristic_config(_args(h=h))
    assert config == dataclasses.replace(default, fuse_dq=False)
    space = op.search_space(args)
    assert config in space
    for c in space:
      assert max(mat.bwd_smem_bytes(c, h, 2, segments=True)) <= 227 * 1024 - 1024
  assert all(a > b for a, b in zip(
      mat.bwd_smem_bytes(mat.AttentionVjpConfig(), 128, 2, segments=True),
      mat.bwd_smem_bytes(mat.AttentionVjpConfig(), 128, 2)))


@pytest.mark.smoke
@pytest.mark.parametrize("features,causal,h,n,k,t,s,config", _each_features_on_each_shape([
    dict(query_seq_lengths=True, key_value_seq_lengths=True),
    dict(local_window=(64, 16)),
    dict(local_window=(None, 0), query_seq_lengths=True),
    dict(logits_soft_cap=5.0),
    dict(segments=True),
    dict(segments=True, local_window=(100, 0), key_value_seq_lengths=True,
         logits_soft_cap=30.0),
    dict(q_offset=True, local_window=(32, 0)),
    dict(q_offset=True),  # causal on one shape; without it the offset is moot
], [
    (128, 8, 2, 384, 640, mat.AttentionVjpConfig(64, 128, 2)),
    (64, 4, 1, 200, 333, mat.AttentionVjpConfig(128, 64, 3, ping_pong=True,
                                                ping_pong_dq=True)),
]))
def test_bwd_features_lower_for_cuda(features, causal, h, n, k, t, s, config):
  pytest.importorskip("absl")
  b = 2
  features = dict(features)
  sds = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  shapes = [sds((b, t, n, h)), sds((b, s, k, h)), sds((b, s, k, h)),
            sds((b, t, n, h)), sds((b, t, n, h)), sds((b, n, t), jnp.float32)]
  names = []
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if features.pop(name, False):
      names.append(name)
      shapes.append(sds((b,), jnp.int32))
  if features.pop("segments", False):
    names += ["q_segment_ids", "kv_segment_ids"]
    shapes += [sds((b, t), jnp.int32), sds((b, s), jnp.int32)]
  if features.pop("q_offset", False):
    names.append("q_offset")
    shapes.append(sds((), jnp.int32))

  def run(q, key, v, o, do, lse, *rest):
    return mat.mosaic_attention_bwd(q, key, v, o, do, lse, scale=0.125,
                                    causal=causal, config=config, **features,
                                    **dict(zip(names, rest)))
  exported = jax.export.export(jax.jit(run), platforms=["cuda"])(*shapes)
  assert _kernel_calls(exported) == 2
  assert [(a.shape, a.dtype) for a in exported.out_avals] == [
      ((b, t, n, h), jnp.bfloat16), ((b, s, k, h), jnp.bfloat16),
      ((b, s, k, h), jnp.bfloat16)]


# GPU: gradients through implementation="mosaic_gpu" (its forward and backward)
# against the XLA reference on float32 upcasts. Select with `-k bwd_features`.


def _check_bwd_features(b, t, s, n, k, h, dtype=jnp.bfloat16, **features):
  """jax.grad with a random cotangent, ours (named) against XLA's in float32."""
  args = _feature_args(b, t, s, n, k, h, dtype, **features)
  kw = dict(is_causal=args.is_causal, local_window_size=args.local_window,
            logits_soft_cap=args.logits_soft_cap,
            query_seq_lengths=args.query_seq_lengths,
            key_value_seq_lengths=args.key_value_seq_lengths,
            q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
            scale=args.scale)
  cot = _cotangent(args.query.shape, dtype)

  def loss(q, key, v, impl):
    y = tokamax.dot_product_attention(
        q, key, v, precision=HIGHEST if impl == "xla" else None,
        implementation=impl, **kw)
    return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))
  with tokamax.record_dispatch() as records:
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
        args.query, args.key, args.value, "mosaic_gpu")
  assert {r.implementation for r in records if r.direction == "backward"} == {
      "mosaic_gpu"}, records
  up = lambda x: x.astype(jnp.float32)
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(
      up(args.query), up(args.key), up(args.value), "xla")
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.dtype == dtype and g.shape == w.shape
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    testing.assert_close(g, w, dtype, what=name, scale=2, gpu=True)
  if args.query_seq_lengths is not None:
    for bi, limit in enumerate(np.asarray(args.query_seq_lengths)):
      assert (np.asarray(got[0], np.float32)[bi, limit:] == 0).all()
  if args.key_value_seq_lengths is not None:
    for bi, limit in enumerate(np.asarray(args.key_value_seq_lengths)):
      assert (np.asarray(got[1], np.float32)[bi, limit:] == 0).all()
      assert (np.asarray(got[2], np.float32)[bi, limit:] == 0).all()


def _check_bwd_features_direct(b, t, s, n, k, h, config=None, **features):
  """The backward alone (q_offset is not in the public API; an explicit
  config), fed the XLA reference's output and lse, against its VJP."""
  import tokamax_xla_reference  # lazy: another package, needed by these tests only
  args = _feature_args(b, t, s, n, k, h, jnp.bfloat16, **features)
  config = config or mat.MosaicGpuAttentionVjp().heuristic_config(args)
  kw = dict(is_causal=args.is_causal, local_window=args.local_window,
            logits_soft_cap=args.logits_soft_cap,
            query_seq_lengths=args.query_seq_lengths,
            key_value_seq_lengths=args.key_value_seq_lengths,
            q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
            q_offset=args.q_offset)
  up = lambda x: x.astype(jnp.float32)

  def ref(q, key, v):
    return tokamax_xla_reference.attention(q, key, v, scale=args.scale,
                                           precision=HIGHEST, **kw)
  @jax.jit  # see _reference_vjp
  def ref_vjp(q, key, v, dout):
    (out, lse), vjp = jax.vjp(ref, q, key, v)
    return out, lse, vjp((dout, jnp.zeros_like(lse)))
  dout = _cotangent((b, t, n, h), jnp.bfloat16)
  out, lse, want = ref_vjp(up(args.query), up(args.key), up(args.value), up(dout))
  kw["causal"] = kw.pop("is_causal")
  got = jax.jit(lambda *a: mat.mosaic_attention_bwd(
      *a, scale=args.scale, config=config, **kw))(
          args.query, args.key, args.value, out.astype(jnp.bfloat16), dout, lse)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


@gpu
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_features_lengths(h, causal):
  # Awkward T != S, lengths not multiples of 128, an empty batch element.
  _check_bwd_features(3, 300, 333, 4, 2, h, causal=causal, q_len=[300, 100, 0],
                      kv_len=[333, 77, 200])


@gpu
@pytest.mark.parametrize("window,causal", [((64, 0), False), ((100, 30), False),
                                           ((300, None), True)])
def test_bwd_features_window(window, causal):
  _check_bwd_features(2, 640, 704, 8, 2, 128, window=window, causal=causal)  # GQA
  _check_bwd_features(1, 200, 330, 2, 2, 64, window=window, causal=causal,
                      kv_len=[250])


@gpu
@pytest.mark.parametrize("offset,window", [(37, (50, 50)), (-300, None)])
def test_bwd_features_q_offset(offset, window):
  _check_bwd_features_direct(2, 256, 512, 4, 2, 128, causal=window is None,
                             window=window, q_offset=offset)
  _check_bwd_features_direct(1, 200, 333, 2, 1, 64, causal=True, window=window,
                             q_offset=offset, kv_len=[300])


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_features_soft_cap(dtype, causal):
  if causal:  # GQA
    _check_bwd_features(2, 384, 384, 4, 2, 128, dtype, soft_cap=10.0, causal=True)
  else:  # a tight cap, a negative scale, a query length
    _check_bwd_features(1, 200, 256, 2, 2, 64, dtype, soft_cap=1.0, scale=-0.3,
                        q_len=[150])


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_features_segments(causal):
  t = 512
  ids = _packed(2, t, [[100, 28, 300, 84], [7, 500]])
  _check_bwd_features(2, t, t, 8, 2, 128, segments=(ids, ids), causal=causal)  # GQA
  rng = np.random.default_rng(next(_seed))
  qs = rng.integers(0, 3, (1, 200)).astype(np.int32)
  ks = rng.integers(1, 5, (1, 333)).astype(np.int32)
  _check_bwd_features(1, 200, 333, 4, 1, 64, segments=(qs, ks), causal=causal,
                      kv_len=[250], window=(None, 40))  # MQA


@gpu
@pytest.mark.parametrize("config", [
    mat.AttentionVjpConfig(64, 64, 3),
    mat.AttentionVjpConfig(64, 128, 2, ping_pong=True, ping_pong_dq=True),
    mat.AttentionVjpConfig(128, 64, 4, ping_pong=True, ping_pong_dq=True),
])
def test_bwd_features_configs(config):
  # Ring laps counted from the union's first tile, ping-pong with shared steps.
  h = 64 if config.block_q == 128 else 128
  _check_bwd_features_direct(2, 1024, 1024, 2, 1, h, config=config,
                             window=(200, 0), kv_len=[1000, 513],
                             q_len=[1024, 700], soft_cap=20.0)
  ids = _packed(1, 700, [[300, 150, 250]])
  _check_bwd_features_direct(1, 700, 700, 2, 2, h, config=config,
                             segments=(ids, ids), causal=True, q_offset=64)


@gpu
def test_bwd_features_rows_that_see_nothing():
  _check_bwd_features(2, 256, 256, 2, 2, 128, kv_len=[0, 0])
  _check_bwd_features(1, 256, 256, 2, 2, 64, window=(0, 0), kv_len=[100])
  qs = np.zeros((1, 256), np.int32)
  ks = np.ones((1, 256), np.int32)
  qs[:, 64:128] = 1
  _check_bwd_features(1, 256, 256, 2, 2, 64, segments=(qs, ks), causal=True)
  _check_bwd_features_direct(2, 384, 256, 2, 2, 128, q_offset=-200, causal=True)


@gpu
def test_backward_skips_key_tiles_of_padding_only():
  """S = 192 with 64-row key tiles: S is padded to 256, so the last key tile holds
  padding only. Logits near -128 put lse below -88, where exp2 of a padded key's
  score (0) overflows; visiting that tile made dQ inf * 0 = NaN."""
  import tokamax_xla_reference  # lazy: another package, needed by these tests only
  b, t, s, n, h = 1, 128, 192, 2, 64
  rng = np.random.default_rng(next(_seed))
  q = jnp.asarray(4.0 + np.abs(rng.standard_normal((b, t, n, h))), jnp.bfloat16)
  key = jnp.asarray(-4.0 - np.abs(rng.standard_normal((b, s, n, h))), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.bfloat16)
  scale = h ** -0.5
  up = lambda x: x.astype(jnp.float32)

  def ref(q, key, v):
    return tokamax_xla_reference.attention(q, key, v, scale=scale, precision=HIGHEST)
  (out, lse), vjp = jax.vjp(ref, up(q), up(key), up(v))
  assert float(jnp.max(lse)) < -89.0  # the regime where the padded tile overflowed
  dout = _cotangent(out.shape, jnp.bfloat16)
  want = vjp((up(dout), jnp.zeros_like(lse)))
  got = jax.jit(lambda *a: mat.mosaic_attention_bwd(
      *a, scale=scale, causal=False, config=mat.AttentionVjpConfig(64, 64, 2)))(
          q, key, v, out.astype(jnp.bfloat16), dout, lse)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
    testing.assert_close(g, w, jnp.bfloat16, what=name, scale=2, gpu=True)


def _forward(causal=True, t=4096, s=None, n=16, b=4, window=None, **config):
  s = t if s is None else s
  return akf._Forward(
      b=b, tp=-(-t // 128) * 128, n=n, h=128, group=1, sp=s, config=mat.AttentionConfig(
          persistent=True, block_kv=64 if window else 128, **config),
      causal=causal, s_true=s,
      feat=akc.features(causal, window, None, False, False, False, False),
      dtype=jnp.bfloat16, has_sinks=False, scale=0.1)


@pytest.mark.parametrize("causal,head_group", [
    (False, 0), (False, 8), (True, 0), (True, 8), (True, 3)])
def test_persistent_deal(causal, head_group):
  """Which tiles each persistent block runs (`_Forward.deal`): every tile once,
  each SM's in run order; round-robin where the tiles are even; where they are
  not (causal: tile i of a head visits i + 1 key tiles), no SM's work above the
  mean by more than one tile's (list scheduling's bound), and at the
  heuristic's power-of-two head group within 1% of it, where the snake deal
  before it gave one SM 1.64x the mean."""
  b, n, t = 4, 16, 4096
  nq = t // 128
  fwd = _forward(causal, t, n=n, b=b, head_group=head_group)
  deal, total, sms = fwd.deal, b * n * nq, _common.num_sms()
  assert deal.shape[0] == sms
  assert fwd.grid() == dict(grid=(sms,), grid_names=("sm",))
  assert sorted(deal[deal >= 0].tolist()) == list(range(total))
  for row in deal:
    mine = row[row >= 0]
    assert (np.diff(mine) > 0).all() and (row[len(mine):] == -1).all()
  if not causal:
    assert deal.shape == (sms, -(-total // sms))
    flat = np.arange(deal.size).reshape(deal.shape[1], sms).T  # sm + j * sms
    np.testing.assert_array_equal(deal, np.where(flat < total, flat, -1))
    return
  # The key tiles of the tile at each position: the run order goes longest
  # first, so position p along a head's tiles is tile nq - 1 - p.
  flat = jnp.arange(total)
  pos = (akc.grouped_position(flat, nq, n, b, head_group)[0] if head_group
         else flat % nq)
  cost = nq - np.asarray(pos) + 1  # its key tiles, plus one for load and store
  load = np.asarray([cost[row[row >= 0]].sum() for row in deal])
  assert load.max() - load.mean() <= cost.max(), (load.max(), load.mean())
  if head_group == 8:
    assert load.max() <= 1.01 * load.mean(), (load.max(), load.mean())


@pytest.mark.parametrize("kw", [
    dict(head_group=3, n=5, b=3, t=1000), dict(head_group=8, n=6, b=1, t=2048),
    dict(head_group=0, n=4, b=2, t=640), dict(causal=False, head_group=4, n=3, b=3),
    dict(window=(300, 0), t=1200, s=1500), dict(causal=False, window=(200, 50)),
    dict(causal=False, window=(None, 70), t=900, s=700), dict(t=700, s=1300)])
def test_persistent_deal_cost_follows_the_kernel(kw):
  """The deal's NumPy view of the run order and of each tile's key steps is
  the kernel's own: `akc.grouped_position` and `akc.key_range` (dynamic) or
  `kv_end` (static), evaluated eagerly."""
  fwd = _forward(**kw)
  flat = jnp.arange(fwd.nq * fwd.n * fwd.b)
  if fwd.config.head_group:
    want = akc.grouped_position(flat, fwd.nq, fwd.n, fwd.b, fwd.config.head_group)[0]
  else:
    want = flat % fwd.nq
  np.testing.assert_array_equal(fwd.position_tiles(), np.asarray(want))
  r0 = jnp.arange(fwd.nq) * 128
  if fwd.feat.dynamic:
    lo, _, _, hi = akc.key_range(r0, 128, fwd.tp, fwd.s_true, 0, fwd.feat.left,
                                 fwd.feat.right, fwd.bkv)
    want = hi - lo
  else:
    want = jnp.broadcast_to(fwd.kv_end(r0 + 128), r0.shape)
  np.testing.assert_array_equal(fwd.tile_steps(), np.asarray(want))


@pytest.mark.parametrize("tiles,heads,batch,group", [
    (5, 4, 3, 4), (3, 2, 3, 4), (4, 3, 1, 8), (2, 6, 2, 1), (3, 5, 2, 3)])
def test_grouped_block_order(tiles, heads, batch, group):
  total = tiles * heads * batch
  assert akc.block_grid(tiles, heads, batch, "q", False, group) == dict(
      grid=(total,), grid_names=("grouped",))
  # A block's position from its grid index (the kernel's lax.axis_index, here
  # under vmap's axis name).
  position = jax.vmap(
      lambda _: jnp.stack(akc.block_position(tiles, heads, batch, "q", group)),
      axis_name="grouped")
  pos = np.asarray(position(jnp.arange(total)))  # [total, (tile, head, batch row)]
  # Every (tile, head, batch row) exactly once.
  assert sorted(map(tuple, pos.tolist())) == list(
      itertools.product(range(tiles), range(heads), range(batch)))
  # Group by group of `group` (batch row, head) pairs, heads fastest (GQA's query
  # heads of one key/value head together), the last group short; within a group
  # the tile advances slowest, so the longest tiles (reversed by the kernels)
  # of all its heads run first.
  pair = pos[:, 2] * heads + pos[:, 1]
  for first in range(0, heads * batch, group):
    members = range(first, min(first + group, heads * batch))
    span = slice(first * tiles, members[-1] * tiles + tiles)
    assert sorted(set(pair[span].tolist())) == list(members)
    assert (np.diff(pos[span, 0]) >= 0).all()
    assert (pos[span, 0] == np.repeat(np.arange(tiles), len(members))).all()


def test_head_group_configs(monkeypatch):
  # The backward's key/value head split counts blocks against the SMs.
  monkeypatch.setattr(_common, "num_sms", lambda: 132)  # an H100/H200 SXM
  with pytest.raises(ValueError, match="head_group must be >= 0"):
    mat.AttentionConfig(head_group=-1)
  with pytest.raises(ValueError, match="leave head_major at None"):
    mat.AttentionConfig(head_group=4, head_major=False)
  with pytest.raises(ValueError, match="not with tiles_per_block > 1"):
    mat.AttentionConfig(head_group=4, tiles_per_block=2)
  mat.AttentionConfig(head_group=4, persistent=True)  # dealt in group order
  with pytest.raises(ValueError, match="leave head_major at None"):
    mat.AttentionVjpConfig(64, 64, 2, head_group=2, head_major=True)
  # Pairs whose [rows, h] operands fit 24 MiB, a power of two: H256 T4096 bf16
  # K and V take 4 MiB a head (6 fit: 4); H128 2 MiB (12: 8); with a float32
  # dQ beside them 4 MiB (6: 4); GQA with 4 query heads a key/value head shares
  # them (48: 32); never fewer than one.
  assert mat.l2_head_group(4096, 256, 4, 1) == 4
  assert mat.l2_head_group(4096, 128, 4, 1) == 8
  assert mat.l2_head_group(4096, 128, 8, 1) == 4
  assert mat.l2_head_group(4096, 128, 4, 4) == 32
  assert mat.l2_head_group(1 << 20, 256, 4, 1) == 1
  # In the search spaces where the blocks would otherwise go tile-major (causal,
  # dynamic ranges); in the heuristics of causal calls (the ones measured).
  fwd, bwd = mat.MosaicGpuAttention(), mat.MosaicGpuAttentionVjp()
  causal = _args(t=4096, s=4096, n=16, k=16, h=256, is_causal=True)
  full = _args(t=4096, s=4096, n=16, k=16, h=256, is_causal=False)
  assert {c.head_group for c in fwd.search_space(causal)} == {0, 4}
  assert {c.head_group for c in bwd.search_space(causal)} == {0, 4}
  # Every config again with the group, persistent ones (H128) included.
  causal_128 = _args(t=4096, s=4096, n=16, k=16, h=128, is_causal=True)
  space = fwd.search_space(causal_128)
  assert ({dataclasses.replace(c, head_group=0) for c in space if c.head_group}
          == {c for c in space if not c.head_group})
  assert any(c.persistent and c.head_group == 8 for c in space)
  assert {c.head_group for c in fwd.search_space(full)} == {0}
  assert {c.head_group for c in bwd.search_space(full)} == {0}
  assert fwd.heuristic_config(causal).head_group == 4
  assert bwd.heuristic_config(causal).head_group == 4
  assert fwd.heuristic_config(full).head_group == 0
  assert bwd.heuristic_config(full).head_group == 0
  # GQA: the forward's K and V are shared by a key/value head's 4 query heads; the
  # dK/dV kernel reads those 4 heads' Q and dO.
  gqa = _args(t=4096, s=4096, n=16, k=4, h=128, is_causal=True)
  assert fwd.heuristic_config(gqa).head_group == 32
  # The backward: groups of 4 pairs (the L2 sizes, 1-2 pairs, measured slower)
  # at 4096-8192 queries and keys, each key/value head unsplit (at B1 here: split
  # in two). H64 for the bounds: from 8192 H128 runs split into MHA
  # (`_gqa_as_mha_backward`, its own test).
  assert bwd.heuristic_config(gqa).head_group == 0
  gqa = _args(t=4096, s=4096, n=16, k=4, h=128, b=2, is_causal=True)
  assert bwd.heuristic_config(gqa).head_group == 4
  assert {c.head_group for c in bwd.search_space(gqa)} == {0, 4}
  for t, group in ((2048, 0), (4000, 0), (8192, 4), (8320, 0), (16384, 0)):
    args = _args(t=t, s=t, n=16, k=4, h=64, b=4, is_causal=True)
    assert bwd.heuristic_config(args).kv_split == 1, t
    assert bwd.heuristic_config(args).head_group == group, t
  chunk = _args(t=512, s=4096, n=16, k=4, h=128, b=4, is_causal=True)  # T far from S
  assert bwd.heuristic_config(chunk).head_group == 0
  # Every head dim, MQA, a causal window (all measured grouped).
  for kw in (dict(n=32, k=8, h=64), dict(n=32, k=8, h=256), dict(n=8, k=1, h=128, b=8),
             dict(n=32, k=8, h=128, local_window_size=(1024, 0))):
    kw = dict(dict(t=4096, s=4096, b=2, is_causal=True), **kw)
    config = bwd.heuristic_config(_args(**kw))
    assert (config.head_group, config.kv_split) == (4, 1), kw
  gqa_full = _args(t=4096, s=4096, n=16, k=4, h=128, is_causal=False)
  assert bwd.heuristic_config(gqa_full).head_group == 0
  # A causal sliding window: grouped. A two-sided window alone (dynamic key
  # ranges, not measured grouped): in the search space only.
  sliding = _args(t=4096, s=4096, n=16, k=16, h=128, is_causal=True,
                  local_window_size=(512, 0))
  assert fwd.heuristic_config(sliding).head_group == 8
  assert bwd.heuristic_config(sliding).head_group == 8
  window = _args(t=4096, s=4096, n=16, k=16, h=128, local_window_size=(512, 512))
  assert fwd.heuristic_config(window).head_group == 0
  assert 8 in {c.head_group for c in fwd.search_space(window)}


def test_grid_order_head_major_only_where_blocks_do_equal_work():
  # Mosaic GPU launches the last grid axis fastest: head-major puts the tiles last.
  assert akc.block_grid(32, 16, 4, "q", True) == dict(
      grid=(4, 16, 32), grid_names=("batch", "heads", "q"))
  assert akc.block_grid(32, 16, 4, "kv", False) == dict(
      grid=(32, 16, 4), grid_names=("kv", "heads", "batch"))
  full = akc.features(False, None, None, False, False, False, False)
  causal = akc.features(True, None, None, False, False, False, False)
  window = akc.features(False, (64, 64), None, False, False, False, False)
  assert akc.head_major(None, False, full)
  assert not akc.head_major(None, True, causal)
  assert not akc.head_major(None, False, window)
  assert not akc.head_major(False, False, full) and akc.head_major(True, True, causal)


# JAX >= 0.12 compiles Mosaic GPU kernels as relocatable code where ptxas ignores
# setmaxnreg (`_common.register_split_lost`): automatic choice passes the
# attention kernels over there; a user who names them still gets them, warned.


@pytest.fixture
def jax_version(monkeypatch):
  """Sets the JAX version `_common` reads, natively (not interpreting)."""
  monkeypatch.setattr(_common, "register_split_lost", _REGISTER_SPLIT_LOST)
  monkeypatch.setattr(_common, "interpreting", lambda: False)
  return lambda version: monkeypatch.setattr(jax, "__version_info__", version)


@pytest.mark.smoke
def test_register_split_lost_from_jax_0_12(jax_version, monkeypatch):
  jax_version((0, 11, 2))
  assert _common.register_split_lost() is None
  jax_version((0, 12, 0))
  assert "ignores the warpgroups' register split" in _common.register_split_lost()
  monkeypatch.setattr(_common, "interpreting", lambda: True)  # nothing compiled
  assert _common.register_split_lost() is None


@pytest.mark.smoke
@pytest.mark.parametrize("op_class", [mat.MosaicGpuAttention, mat.MosaicGpuAttentionVjp])
def test_declines_where_the_register_split_is_lost(jax_version, op_class):
  args = _args(is_causal=True)
  jax_version((0, 11, 2))
  assert op_class().declines(args) is None
  jax_version((0, 12, 0))
  assert "setmaxnreg" in op_class().declines(args)
  assert "head dim 256" in op_class().declines(_args(h=256, is_causal=True))
  assert op_class().declines(_args(h=128, is_causal=True)) is None  # adapted


def test_head_dim_128_runs_configs_that_fit_where_the_split_is_lost(jax_version):
  fwd, bwd = mat.MosaicGpuAttention(), mat.MosaicGpuAttentionVjp()
  for kw in ({"is_causal": True}, {}, {"n": 8, "k": 2, "is_causal": True}):
    args = _args(t=4096, s=4096, n=kw.pop("n", 4), k=kw.pop("k", 4), h=128, **kw)
    jax_version((0, 11, 2))
    assert fwd.heuristic_config(args).block_kv == 128
    assert not bwd.heuristic_config(args).split_dkv
    jax_version((0, 12, 0))
    assert fwd.heuristic_config(args).block_kv == 64
    config = bwd.heuristic_config(args)
    assert config.split_dkv and not config.fuse_dq and config.block_kv == 64
    assert config in bwd.search_space(args)  # autotuning on JAX 0.12 starts there
    assert fwd.heuristic_config(args) in fwd.search_space(args)
  # A sliding window keeps its 128-key steps (64 measured slower there).
  window = _args(t=4096, s=4096, n=4, k=4, h=128, is_causal=True,
                 local_window_size=(1024, 0))
  assert fwd.heuristic_config(window).block_kv == 128


@pytest.mark.smoke
def test_automatic_choice_passes_over_it_where_the_split_is_lost(jax_version):
  # A soft cap: cuDNN (ahead of mosaic_gpu in the registry) refuses it, so
  # automatic choice would take mosaic_gpu next, and a user naming it gets it.
  from tokamax._src.dispatch import candidates, selection
  args = _args(h=64, is_causal=True, logits_soft_cap=30.0)

  def choose(implementation):
    found = candidates.expand("dot_product_attention", implementation, _H200)
    return selection.choose_forward("dot_product_attention", args, _H200, found)

  jax_version((0, 11, 2))
  assert choose(None).candidate.label == "mosaic_gpu"
  jax_version((0, 12, 0))
  chosen = choose(None)
  assert chosen.candidate.label != "mosaic_gpu"
  assert any(label == "mosaic_gpu" and "setmaxnreg" in why
             for label, why in chosen.rejected_labels())
  assert choose("mosaic_gpu").candidate.label == "mosaic_gpu"


def test_warns_when_run_with_the_split_lost(jax_version):
  jax_version((0, 12, 0))
  with pytest.warns(UserWarning, match="attention forward may run slowly here.*0.64x"):
    jax.eval_shape(lambda a: mat.MosaicGpuAttention().forward(a, None),
                   _args(is_causal=True))
  # At H128 its configs fit: no warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.eval_shape(lambda a: mat.MosaicGpuAttention().forward(a, None),
                   _args(h=128, is_causal=True))


@pytest.mark.parametrize("n,k,split", [(8, 1, 8), (8, 1, 2), (8, 2, 4), (6, 2, 3)])
def test_kv_split_replicas_sum_to_the_grouped_gradients(n, k, split):
  """`AttentionVjpConfig.kv_split`: the gradients of grouped attention equal
  those of the same call with each key/value head replicated `split` times
  (`replicate_kv_heads`), each copy's gradients summed back
  (`sum_kv_replicas`): the identity the backward relies on, checked with the
  XLA reference's backward in float32."""
  q, key, v = (x.astype(jnp.float32) for x in _qkv(2, 96, 80, n, k, 16, jnp.bfloat16))
  dout = _cotangent((2, 96, n, 16), jnp.float32)

  def grads(key, value, fold):
    def f(q, key, value):
      return tokamax.dot_product_attention(q, key, value, is_causal=True,
                                           implementation="xla", precision=HIGHEST)
    dq, dk, dv = jax.vjp(f, q, key, value)[1](dout)
    return dq, fold(dk), fold(dv)
  want = grads(key, v, lambda g: g)
  got = grads(akb.replicate_kv_heads(key, split), akb.replicate_kv_heads(v, split),
              lambda g: akb.sum_kv_replicas(g, split))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == w.shape, name
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
  assert akb.replicate_kv_heads(key, 1) is key and akb.sum_kv_replicas(key, 1) is key


def test_kv_split_refusals():
  with pytest.raises(ValueError, match="kv_split must be >= 1; got 0"):
    mat.AttentionVjpConfig(kv_split=0)
  q, key, v = _qkv(1, 128, 128, 8, 2, 64, jnp.bfloat16)
  lse = jnp.zeros((1, 8, 128), jnp.float32)
  with pytest.raises(ValueError, match=r"kv_split=3 must divide the 4 query heads per "
                     r"key/value head \(N=8, K=2\)"):
    mat.mosaic_attention_bwd(q, key, v, q, q, lse, scale=0.125, causal=True,
                             config=mat.AttentionVjpConfig(kv_split=3))


@pytest.mark.parametrize("b,t,n,k,causal,split,lost_split,searched", [
    # Causal: the fewest copies that give each of 132 SMs a dK/dV block.
    (2, 4096, 8, 1, True, 4, 4, {1, 2, 4, 8}),  # 64 blocks
    (8, 1024, 8, 1, True, 4, 4, {1, 2, 4, 8}),  # 64 blocks
    (8, 4096, 8, 1, True, 1, 1, {1, 2, 8}),  # 256 blocks: as many as SMs or more
    (2, 4096, 8, 8, True, 1, 1, {1}),  # MHA: nothing to split
    (1, 2048, 32, 8, True, 2, 2, {1, 2}),  # GQA, 4 query heads a kv head, 128 blocks
    (1, 1000, 32, 8, True, 4, 4, {1, 4}),  # 64 blocks
    (1, 2048, 16, 2, True, 8, 8, {1, 2, 8}),  # 8 query heads a kv head, 32 blocks
    (1, 2048, 9, 1, True, 9, 9, {1, 9}),  # 9: no split in two
    (1, 2048, 8, 4, True, 1, 1, {1}),  # 2 query heads a kv head: not measured split
    # Without causal: where 4 copies take no more blocks than SMs, the fewest
    # that give each SM a block; else 2 where the one-kernel backward runs (key
    # blocks a power of two; not where JAX's compile loses the register split)
    # or 2 copies take no more blocks than SMs.
    (1, 2048, 8, 1, False, 8, 8, {1, 2, 8}),  # 16 blocks
    (1, 4096, 8, 1, False, 8, 8, {1, 2, 8}),  # 32 blocks
    (1, 2048, 16, 2, False, 8, 8, {1, 2, 8}),  # 32 blocks, 8 query heads a kv head
    (1, 4224, 8, 1, False, 4, 4, {1, 2, 4, 8}),  # 33 blocks (4 x 33 = 132 SMs)
    (1, 2048, 16, 1, False, 8, 8, {1, 2, 8, 16}),  # 16 query heads: 8 (measured) at most
    (1, 1024, 12, 1, False, 6, 6, {1, 2, 6, 12}),  # 12: its largest divisor up to 8
    (8, 4096, 8, 1, False, 2, 1, {1, 2, 8}),  # 256 blocks
    (2, 4000, 8, 1, False, 2, 2, {1, 2, 8}),  # 64 blocks, two kernels
    (4, 3000, 8, 1, False, 1, 1, {1, 2, 8}),  # 96 blocks, two kernels
    (2, 4224, 8, 1, False, 2, 2, {1, 2, 8}),  # 66 blocks (2 x 66 = 132 SMs)
    (1, 8576, 8, 1, False, 1, 1, {1, 2, 8}),  # 67 blocks
    (1, 2048, 9, 1, False, 1, 1, {1, 9}),  # 9: no split in two
    (1, 2048, 32, 8, False, 1, 1, {1}),  # GQA, 4 query heads a kv head
])
def test_backward_heuristic_splits_kv_heads(
    monkeypatch, b, t, n, k, causal, split, lost_split, searched):
  monkeypatch.setattr(_common, "num_sms", lambda: 132)
  s = jax.ShapeDtypeStruct
  args = tokamax.AttentionArgs(s((b, t, n, 128), jnp.bfloat16), s((b, t, k, 128), jnp.bfloat16),
                               s((b, t, k, 128), jnp.bfloat16), scale=0.088, is_causal=causal)
  op = mat.MosaicGpuAttentionVjp()
  config = op.heuristic_config(args)
  assert config.kv_split == split, config
  assert config in op.search_space(args)
  assert {c.kv_split for c in op.search_space(args)} == searched
  # Where JAX's compile loses the register split (H128's other backward), too.
  monkeypatch.setattr(_common, "register_split_lost", lambda: "lost")
  lost = op.heuristic_config(args)
  assert lost.split_dkv and lost.kv_split == lost_split, lost


@gpu
@pytest.mark.parametrize("b,t,s,n,k,h,causal,config", [
    (1, 1024, 1024, 8, 1, 128, True, mat.AttentionVjpConfig(64, 128, 2, kv_split=8)),
    (2, 700, 640, 8, 1, 128, False, mat.AttentionVjpConfig(64, 128, 2, kv_split=2)),
    (1, 2048, 2048, 8, 1, 128, False, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True,
                                                             kv_split=8)),
    (1, 1024, 1024, 8, 2, 64, False, mat.AttentionVjpConfig(128, 128, 2, fuse_dq=True,
                                                             kv_split=4)),
    (1, 512, 512, 8, 2, 256, True, mat.AttentionVjpConfig(32, 32, 2, split_dkv=True,
                                                          kv_split=2)),
])
def test_backward_kv_split(b, t, s, n, k, h, causal, config):
  _check_backward_config(b, t, s, n, k, h, causal, config)
