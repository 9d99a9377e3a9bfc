"""Pallas Triton flash attention vs the XLA oracle, in Pallas interpret mode.

Small blocks (16) are forced through a config source so that every test walks
several query and key blocks, partial edge blocks and the masked/unmasked split.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.tuning import context as tuning_context
from tokamax_gpu_triton import attention as tri
import tokamax_xla_reference as ref_attention

# Natively on a GPU, in Pallas interpret mode on the CPU.
_ON_CPU = jax.default_backend() == "cpu"

class _SmallBlocks:
  """A config source giving 16-row tiles to both kernels' ops."""

  def __init__(self, prefetch_qk=False):
    self.prefetch_qk = prefetch_qk

  def lookup(self, op, args):
    del args
    if isinstance(op, tri.TritonAttentionVjp):
      return tri.AttentionVjpConfig(16, 16, 16, 16, 4, 4, 2)
    if isinstance(op, tri.TritonAttention):
      return tri.AttentionConfig(16, 16, 4, 2, prefetch_qk=self.prefetch_qk)
    return None


_seed = iter(range(10**6))


def _keys(n):
  return jax.random.split(jax.random.key(next(_seed) + 1234), n)


def _qkv(b, t, s, n, k, h, hv, dtype):
  kq, kk, kv = _keys(3)
  q = jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(kk, (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, k, hv), jnp.float32).astype(dtype)
  return q, key, v


def _check(name, got, want, dtype):
  testing.assert_close(got, want, dtype, what=name, gpu=not _ON_CPU)


def _ref_kwargs(kw, h):
  window = kw.get("local_window_size")
  if isinstance(window, int):
    window = (window, window)
  return dict(
      scale=kw.get("scale", 1.0 / np.sqrt(h)), is_causal=kw.get("is_causal", False),
      local_window=window, logits_soft_cap=kw.get("logits_soft_cap"),
      query_seq_lengths=kw.get("query_seq_lengths"),
      key_value_seq_lengths=kw.get("key_value_seq_lengths"),
      q_segment_ids=kw.get("q_segment_ids"), kv_segment_ids=kw.get("kv_segment_ids"),
      precision=jax.lax.Precision.HIGHEST)


def _compare(q, k, v, bias=None, mask=None, *, grads=True, prefetch_qk=False, **kw):
  """Forward and gradients (random cotangent) of triton vs the float32 oracle."""
  dtype = q.dtype
  diff = (q, k, v) if bias is None else (q, k, v, bias)

  def tri_fn(*xs):
    b = xs[3] if bias is not None else None
    return tokamax.dot_product_attention(*xs[:3], b, mask, implementation="triton",
                                         **kw)

  up = lambda x: x.astype(jnp.float32)
  rkw = _ref_kwargs(kw, q.shape[-1])
  mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)

  def ref_fn(*xs):
    b = None
    if bias is not None:
      b = xs[3].reshape((1,) * (4 - xs[3].ndim) + xs[3].shape)
    return ref_attention.attention(*xs[:3], b, mask4, **rkw)[0]

  with (tokamax.interpret(_ON_CPU),
        tuning_context.use(_SmallBlocks(prefetch_qk))):
    out, vjp = jax.vjp(tri_fn, *diff)
    want, ref_vjp = jax.vjp(ref_fn, *map(up, diff))
    _check("out", out, want, dtype)
    assert out.dtype == dtype
    if not grads:
      return
    ct = jax.random.normal(_keys(1)[0], out.shape, jnp.float32).astype(dtype)
    got_g = vjp(ct)
    want_g = ref_vjp(up(ct))
  for name, g, w in zip(("dq", "dk", "dv", "dbias"), got_g, want_g):
    _check(name, g, w, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_gqa(dtype):
  _compare(*_qkv(2, 37, 53, 4, 2, 32, 32, dtype))


@pytest.mark.parametrize("t,s", [(48, 48), (40, 70), (70, 40), (1, 17)])
def test_causal(t, s):
  _compare(*_qkv(1, t, s, 2, 1, 32, 32, jnp.float32), is_causal=True)


def test_causal_bf16_head80_mqa():
  _compare(*_qkv(2, 64, 64, 3, 1, 80, 80, jnp.bfloat16), is_causal=True)


@pytest.mark.parametrize("window", [(5, 3), (None, 4), (7, None), 0])
def test_local_window(window):
  _compare(*_qkv(1, 50, 61, 2, 2, 32, 32, jnp.float32), local_window_size=window)


def test_window_with_causal():
  _compare(*_qkv(1, 67, 67, 2, 1, 32, 32, jnp.float32), is_causal=True,
           local_window_size=(20, None))


def test_head_dims_differ():
  _compare(*_qkv(1, 23, 31, 2, 1, 80, 32, jnp.float32), scale=0.3)


@pytest.mark.parametrize("bias_shape", [(2, 2, 29, 41), (1, 2, 1, 41), (2, 1, 29, 1)])
def test_bias(bias_shape):
  # Full-batch biases also run without GQA (one query head per kv head).
  q, k, v = _qkv(2, 29, 41, 2, bias_shape[0], 32, 32, jnp.float32)
  bias = jax.random.normal(_keys(1)[0], bias_shape, jnp.float32)
  _compare(q, k, v, bias, is_causal=bias_shape[0] == 1)


def test_bias_soft_cap_bf16():
  q, k, v = _qkv(1, 33, 40, 4, 2, 32, 32, jnp.bfloat16)
  bias = jax.random.normal(_keys(1)[0], (1, 4, 33, 40), jnp.bfloat16)
  _compare(q, k, v, bias, logits_soft_cap=2.0, local_window_size=(9, 9))


@pytest.mark.parametrize("mask_shape", [(2, 1, 31, 45), (1, 1, 1, 45), (2, 2, 31, 1)])
def test_mask(mask_shape):
  q, k, v = _qkv(2, 31, 45, 2, 2, 32, 32, jnp.float32)
  mask = jax.random.bernoulli(_keys(1)[0], 0.6, mask_shape)
  # Some rows see nothing: they must come out as zeros (and zero gradient).
  if mask_shape[2] > 1:
    mask = mask.at[:, :, 3].set(False)
  _compare(q, k, v, None, mask)


def test_lengths():
  q, k, v = _qkv(3, 35, 47, 2, 1, 32, 32, jnp.float32)
  _compare(q, k, v, query_seq_lengths=jnp.array([35, 17, 0], jnp.int32),
           key_value_seq_lengths=jnp.array([9, 47, 30], jnp.int32), is_causal=True)


def test_segments_soft_cap():
  q, k, v = _qkv(2, 40, 40, 2, 1, 32, 32, jnp.float32)
  q_seg = jnp.sort(jax.random.randint(_keys(1)[0], (2, 40), 0, 3), axis=-1)
  kv_seg = jnp.sort(jax.random.randint(_keys(1)[0], (2, 40), 0, 3), axis=-1)
  _compare(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, logits_soft_cap=5.0)


def test_unit_sizes():
  _compare(*_qkv(1, 1, 1, 1, 1, 32, 32, jnp.float32))


def test_large_blocks_default_config():
  """The heuristic config (blocks larger than the sequences) also works."""
  q, k, v = _qkv(1, 20, 24, 2, 1, 96, 96, jnp.bfloat16)
  with tokamax.interpret(_ON_CPU):
    out = tokamax.dot_product_attention(q, k, v, implementation="triton")
  want = tokamax.dot_product_attention(q, k, v, implementation="xla")
  _check("out", out, want, jnp.bfloat16)


@pytest.mark.smoke
def test_dispatch_records_triton_both_directions():
  q, k, v = _qkv(1, 16, 16, 2, 1, 32, 32, jnp.float32)
  loss = lambda q: jnp.sum(tokamax.dot_product_attention(q, k, v,
                                                         implementation="triton"))
  with tokamax.interpret(_ON_CPU), tokamax.record_dispatch() as records:
    jax.grad(loss)(q)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert ("dot_product_attention", "forward", "triton") in got
  assert ("dot_product_attention", "backward", "triton") in got


@pytest.mark.smoke
def test_check_supported_refuses():
  q, k, v = _qkv(1, 16, 16, 1, 1, 32, 32, jnp.float32)
  args = tokamax.AttentionArgs(q, k, v, scale=0.1)
  interp = tokamax.DeviceInfo("cpu", "cpu", interpret=True)
  tri.TritonAttention().check_supported(args, interp)
  with pytest.raises(NotImplementedError, match="lse"):
    tri.TritonAttentionVjp().check_supported(args, interp, residuals={})
  with pytest.raises(NotImplementedError, match="NVIDIA"):
    tri.TritonAttention().check_supported(args, tokamax.DeviceInfo("cpu", "cpu"))
  big = tokamax.AttentionArgs(*_qkv(1, 4, 4, 1, 1, 512, 512, jnp.float32))
  with pytest.raises(NotImplementedError, match="head dim"):
    tri.TritonAttention().check_supported(big, interp)
  f64 = tokamax.AttentionArgs(*(x.astype(jnp.int32) for x in (q, k, v)))
  with pytest.raises(NotImplementedError, match="dtype"):
    tri.TritonAttention().check_supported(f64, interp)
  # The refusal of empty inputs names the shapes (which input is empty).
  empty = tokamax.AttentionArgs(q, k[:, :0], v[:, :0])
  with pytest.raises(NotImplementedError,
                     match=r"empty.*key \(1, 0, 1, 32\), value \(1, 0, 1, 32\)"):
    tri.TritonAttention().check_supported(empty, interp)


@pytest.mark.parametrize(
    "case", [c for c in testing.all_cases("dot_product_attention")
             if c.name.startswith("q_offset")], ids=str)
def test_q_offset_small_blocks(case):
  """Shifted query positions move the block ranges: check them over many blocks."""
  with tokamax.interpret(_ON_CPU), tuning_context.use(_SmallBlocks()):
    testing.check_case(case, "triton", "float32")


@pytest.mark.parametrize("kw", [
    dict(), dict(is_causal=True), dict(local_window_size=(20, 9)),
    dict(key_value_seq_lengths=jnp.array([37, 5]), is_causal=True),
], ids=["plain", "causal", "window", "kv_len_causal"])
def test_prefetch_qk(kw):
  """Scores computed one key block ahead: same results, over ranges that start,
  end and are empty at block edges (T != S, partial last block)."""
  q, k, v = _qkv(2, 45, 61, 2, 1, 32, 32, jnp.float32)
  _compare(q, k, v, grads=False, prefetch_qk=True, **kw)


def test_prefetch_configs_only_where_prefetch_applies():
  q, k, v = _qkv(1, 64, 64, 2, 2, 128, 128, jnp.bfloat16)
  space = tri.TritonAttention().search_space(tokamax.AttentionArgs(q, k, v))
  assert any(c.prefetch_qk for c in space)
  bias = jnp.zeros((1, 2, 64, 64), jnp.float32)
  with_bias = tokamax.AttentionArgs(q, k, v, bias=bias)
  assert not any(c.prefetch_qk for c in tri.TritonAttention().search_space(with_bias))
  f32 = tokamax.AttentionArgs(*(x.astype(jnp.float32) for x in (q, k, v)))
  assert not any(c.prefetch_qk for c in tri.TritonAttention().search_space(f32))

