"""Tests of the Mosaic GPU attention forward (FA3-style).

Numerical tests run natively on a Hopper GPU only (JAX's Mosaic GPU interpreter does
not run warp-specialized kernels); on the CPU the registration, every refusal, the
configs and the lowering to Mosaic GPU IR for "cuda" (through `jax.export`) are
checked.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops import attention as attention_op
from tokamax_gpu_mosaic import attention as mat

HIGHEST = jax.lax.Precision.HIGHEST
_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))
gpu = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
_H200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
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
  # Our backward refuses: another one ran on this forward's residuals.
  assert any(r.direction == "backward" and r.implementation != "mosaic_gpu"
             for r in records), records
  up = lambda x: x.astype(jnp.float32)
  want = jax.grad(loss, argnums=(0, 1, 2))(up(q), up(key), up(v), "xla")
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


def _args(t=256, s=256, n=2, k=2, h=64, dtype=jnp.bfloat16, hv=None, **kw):
  q, key, v = _qkv(1, t, s, n, k, h, dtype)
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
                 tokamax.DeviceInfo("cpu", "cpu", interpret=True),
                 tokamax.DeviceInfo("gpu", "NVIDIA A100", compute_capability="8.0")):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      mat.MosaicGpuAttention().check_supported(args, device)


@pytest.mark.parametrize("kw,reason", [
    (dict(bias=np.ones((1, 2, 256, 256), np.float32) * 0.5), "bias"),
    (dict(mask=np.tril(np.ones((256, 256), bool))), "bool mask"),
    (dict(q_segment_ids=np.zeros((1, 256), np.int32),
          kv_segment_ids=np.zeros((1, 256), np.int32)), "segment ids"),
    (dict(local_window_size=(16, 0)), "local window"),
    (dict(logits_soft_cap=30.0), "soft cap"),
    (dict(query_seq_lengths=np.array([100], np.int32)), "query sequence lengths"),
    (dict(key_value_seq_lengths=np.array([100], np.int32)),
     "key/value sequence lengths"),
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


def test_refuses_q_offset():
  args = dataclasses.replace(_args(is_causal=True), q_offset=jnp.int32(64))
  with pytest.raises(NotImplementedError, match="q_offset"):
    mat.MosaicGpuAttention().check_supported(args, _H200)


def test_backward_refuses():
  with pytest.raises(NotImplementedError, match="backward is not written"):
    mat.MosaicGpuAttentionVjp().check_supported(_args(), _H200)


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
