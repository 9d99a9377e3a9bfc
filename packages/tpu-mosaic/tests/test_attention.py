"""Pallas Mosaic TPU flash attention vs the XLA oracle, in TPU interpret mode.

128-row tiles are forced through a config source so that every test walks several
query and key blocks: skipped, fully visible and partially masked ones. Shapes are
kept tiny: TPU interpret mode simulates every DMA on the CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.tuning import context as tuning_context
from tokamax_tpu_mosaic import attention as att
import tokamax_xla_reference as ref_attention

_ON_TPU = jax.default_backend() == "tpu"


class _SmallBlocks:
  """A config source giving 128-row tiles to both kernels' ops."""

  def lookup(self, op, args):
    del args
    if isinstance(op, att.MosaicTpuAttentionVjp):
      return att.AttentionVjpConfig(128, 128, 128, 128)
    if isinstance(op, att.MosaicTpuAttention):
      return att.AttentionConfig(128, 128)
    return None


_seed = iter(range(10**6))


def _keys(n):
  return jax.random.split(jax.random.key(next(_seed) + 4321), n)


def _qkv(b, t, s, n, k, h, hv, dtype):
  kq, kk, kv = _keys(3)
  q = jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype)
  key = jax.random.normal(kk, (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, k, hv), jnp.float32).astype(dtype)
  return q, key, v


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


def _compare(q, k, v, *, grads=True, **kw):
  """Forward and gradients (random cotangent) vs the float32 oracle."""
  dtype = q.dtype

  def fn(q, k, v):
    return tokamax.dot_product_attention(q, k, v, implementation=att.MosaicTpuAttention(),
                                         **kw)

  rkw = _ref_kwargs(kw, q.shape[-1])

  def ref_fn(q, k, v):
    return ref_attention.attention(q, k, v, None, None, **rkw)[0]

  up = lambda x: x.astype(jnp.float32)
  with tokamax.interpret(not _ON_TPU), tuning_context.use(_SmallBlocks()):
    out, vjp = jax.vjp(fn, q, k, v)
    want, ref_vjp = jax.vjp(ref_fn, up(q), up(k), up(v))
    testing.assert_close(out, want, dtype, what="out")
    assert out.dtype == dtype
    if not grads:
      return
    ct = jax.random.normal(_keys(1)[0], out.shape, jnp.float32).astype(dtype)
    got_g = vjp(ct)
    want_g = ref_vjp(up(ct))
  for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
    assert g.dtype == dtype, name
    testing.assert_close(g, w, dtype, what=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_gqa(dtype):
  _compare(*_qkv(1, 256, 256, 4, 2, 128, 128, dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_unaligned_t_ne_s(dtype):
  # T, S not block multiples; T > S (rows past S see every key).
  _compare(*_qkv(1, 200, 136, 2, 1, 128, 128, dtype), is_causal=True)


def test_local_window_head_dim_64():
  _compare(*_qkv(1, 256, 256, 2, 1, 64, 64, jnp.float32), local_window_size=(40, 10))


def test_causal_window_empty_rows_head_dim_80():
  # Window (None, 0) on top of causal; T > S + window: later rows see nothing.
  _compare(*_qkv(1, 300, 100, 2, 1, 80, 80, jnp.float32), is_causal=True,
           local_window_size=(30, None))


def test_lengths_soft_cap_mqa():
  q, k, v = _qkv(2, 256, 200, 2, 1, 128, 128, jnp.float32)
  _compare(q, k, v, logits_soft_cap=3.0, is_causal=True,
           query_seq_lengths=jnp.array([256, 0], jnp.int32),
           key_value_seq_lengths=jnp.array([77, 200], jnp.int32))


def test_segments_head_dims_differ():
  q, k, v = _qkv(2, 256, 256, 2, 1, 128, 96, jnp.float32)
  q_seg = jnp.array([[0] * 128 + [1] * 128, [0] * 40 + [1] * 200 + [2] * 16], jnp.int32)
  kv_seg = jnp.array([[0] * 128 + [1] * 128, [0] * 40 + [1] * 200 + [3] * 16], jnp.int32)
  _compare(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def test_segments_soft_cap_bf16():
  q, k, v = _qkv(1, 256, 256, 2, 2, 128, 128, jnp.bfloat16)
  seg = jnp.sort(jax.random.randint(_keys(1)[0], (1, 256), 0, 3), axis=-1)
  _compare(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, logits_soft_cap=5.0,
           is_causal=True)


def test_lse_residual_contract():
  """lse matches the oracle's; +inf (and output 0) for rows with no visible key."""
  q, k, v = _qkv(1, 256, 128, 2, 1, 128, 128, jnp.float32)
  args = tokamax.AttentionArgs(q, k, v, scale=0.1, is_causal=True, local_window=(20, 0),
                               key_value_seq_lengths=jnp.array([100], jnp.int32))
  with tokamax.interpret(not _ON_TPU):
    out, res = att.MosaicTpuAttention().forward(args, att.AttentionConfig(128, 128))
  want, want_lse = ref_attention.attention(
      q, k, v, None, None, scale=0.1, is_causal=True, local_window=(20, 0),
      key_value_seq_lengths=args.key_value_seq_lengths,
      precision=jax.lax.Precision.HIGHEST)
  lse = np.asarray(res["lse"])
  assert lse.shape == (1, 2, 256) and lse.dtype == np.float32
  empty = np.isinf(np.asarray(want_lse))
  assert empty.any() and (~empty).any()
  assert np.all(lse[empty] == np.inf)
  np.testing.assert_allclose(lse[~empty], np.asarray(want_lse)[~empty], rtol=1e-5,
                             atol=1e-5)
  assert np.all(np.asarray(out)[0, 120:] == 0.0)  # rows >= 100 + 20 see no key
  testing.assert_close(out, want, jnp.float32, what="out")


def test_block_lists_skip_masked_blocks():
  """Causal 4x4 blocks: q block i visits kv blocks 0..i, only the diagonal masked."""
  q, k, v = _qkv(1, 512, 512, 1, 1, 128, 128, jnp.float32)
  args = tokamax.AttentionArgs(q, k, v, is_causal=True)
  lay = att._layout(args)
  (_, _, idx, kind, count), extent = att._block_lists(args, lay, 128, 128, 512, 512,
                                                      transpose=False)
  assert extent == 4
  np.testing.assert_array_equal(count, [1, 2, 3, 4])
  idx, kind = np.asarray(idx).reshape(4, 4), np.asarray(kind).reshape(4, 4)
  for i in range(4):
    np.testing.assert_array_equal(idx[i], [min(j, i) for j in range(4)])
    np.testing.assert_array_equal(kind[i, :i + 1], [0] * i + [1])
  # Transposed (dK/dV): kv block j is visited by q blocks j..3.
  (_, _, idx_t, _, count_t), _ = att._block_lists(args, lay, 128, 128, 512, 512,
                                                  transpose=True)
  np.testing.assert_array_equal(count_t, [4, 3, 2, 1])
  np.testing.assert_array_equal(np.asarray(idx_t).reshape(4, 4)[3], [3, 3, 3, 3])
  # Segments: blocks of different segments are skipped, same-segment blocks full.
  seg = jnp.array([[0] * 256 + [1] * 256], jnp.int32)
  args = tokamax.AttentionArgs(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)
  lay = att._layout(args)
  (_, _, idx, kind, count), extent = att._block_lists(args, lay, 128, 128, 512, 512,
                                                      transpose=False)
  np.testing.assert_array_equal(count, [2, 2, 2, 2])
  np.testing.assert_array_equal(np.asarray(idx).reshape(4, 4)[:, :2],
                                [[0, 1], [0, 1], [2, 3], [2, 3]])
  np.testing.assert_array_equal(np.asarray(kind).reshape(4, 4)[:, :2], 0)


_WINDOWS = [  # (is_causal, local_window)
    (True, None), (False, (100, 30)), (True, (150, None)), (False, (60, None)),
    (False, (None, 40)), (False, (0, 0)),
]


@pytest.mark.parametrize("causal,window", _WINDOWS)
def test_block_lists_with_q_offset_match_positions(causal, window):
  """With a traced q_offset, the lists hold exactly the blocks with a visible pair.

  Checked against the XLA reference's elementwise visibility for many offsets
  (negative, unaligned, past either end), both orientations, bq != bk, with
  sequence lengths; ``kind`` 0 exactly for the fully visible blocks.
  """
  t, s, bq, bk = 300, 420, 128, 256
  tp, sp = 384, 512
  q, k, v = (jnp.zeros((2, length, 1, 128), jnp.float32) for length in (t, s, s))
  qlen, kvlen = jnp.array([300, 170], jnp.int32), jnp.array([420, 300], jnp.int32)
  args = tokamax.AttentionArgs(q, k, v, is_causal=causal, local_window=window,
                               query_seq_lengths=qlen, key_value_seq_lengths=kvlen,
                               q_offset=jnp.int32(0))
  lay = att._layout(args)
  assert lay.has_q_offset

  @jax.jit
  def lists(off):
    a = dataclasses.replace(args, q_offset=off)
    return [att._block_lists(a, lay, bq, bk, tp, sp, transpose=tr)[0][2:5]
            for tr in (False, True)]

  extents = [att._block_lists(args, lay, bq, bk, tp, sp, transpose=tr)[1]
             for tr in (False, True)]
  for off in (-500, -333, -128, -37, 0, 1, 77, 128, 200, 255, 390, 1000):
    vis = ref_attention.visibility(
        jnp.arange(tp), jnp.arange(sp), is_causal=causal, local_window=window,
        query_seq_lengths=qlen, key_value_seq_lengths=kvlen, q_offset=off)
    vis = np.asarray(vis)[:, 0].reshape(2, tp // bq, bq, sp // bk, bk)
    any_, full = vis.any(axis=(2, 4)), vis.all(axis=(2, 4))
    for (idx, kind, count), extent, tr in zip(lists(jnp.int32(off)), extents,
                                               (False, True)):
      want_any, want_full = ((any_, full) if not tr
                             else (any_.transpose(0, 2, 1), full.transpose(0, 2, 1)))
      rows, cols = want_any.shape[1:]
      idx, kind = np.asarray(idx).reshape(2, rows, extent), np.asarray(kind).reshape(
          2, rows, extent)
      count = np.asarray(count).reshape(2, rows)
      np.testing.assert_array_equal(count, want_any.sum(-1), err_msg=f"{off} {tr}")
      for b in range(2):
        for r in range(rows):
          c = count[b, r]
          np.testing.assert_array_equal(idx[b, r, :c], np.flatnonzero(want_any[b, r]))
          np.testing.assert_array_equal(kind[b, r, :c] == 0,
                                        want_full[b, r, idx[b, r, :c]])
          assert np.all(idx[b, r, c:] == (idx[b, r, c - 1] if c else idx[b, r, 0]))


def _scaled(case, f):
  """``case`` with every position (lengths, window, offset) times ``f``."""
  sh = dict(case.shapes, t=case.shapes["t"] * f, s=case.shapes["s"] * f)
  opts = dict(case.options)
  for key in ("q_offset", "query_seq_lengths", "key_value_seq_lengths",
              "local_window_size"):
    if opts.get(key) is not None:
      value = opts[key]
      opts[key] = (tuple(None if x is None else x * f for x in value)
                   if isinstance(value, tuple) else value * f)
  return dataclasses.replace(case, shapes=sh, options=opts)


@pytest.mark.parametrize(
    "case", [c for c in testing.all_cases("dot_product_attention")
             if c.name.startswith("q_offset") and c.name != "q_offset_no_window"],
    ids=str)
def test_q_offset_small_blocks(case):
  """The q_offset conformance cases, positions scaled x8 so that the 128-row tiles
  make several query and key blocks (skipped, full and partially masked ones,
  offsets not block-aligned), forward and gradients, through dispatch."""
  with tokamax.interpret(not _ON_TPU), tuning_context.use(_SmallBlocks()):
    testing.check_case(_scaled(case, 8), "mosaic_tpu", "float32")


def test_q_offset_without_window_changes_nothing():
  """(The conformance case q_offset_no_window, without its kernel runs.) No window:
  the offset is dropped, the kernels get exactly the no-offset inputs."""
  q, k, v = _qkv(1, 256, 384, 1, 1, 128, 128, jnp.float32)
  lens = dict(key_value_seq_lengths=jnp.array([300], jnp.int32))
  plain = tokamax.AttentionArgs(q, k, v, **lens)
  shifted = dataclasses.replace(plain, q_offset=jnp.int32(100))
  assert not att._layout(shifted).has_q_offset
  for kind in ("fwd", "dkdv", "dq"):
    (plan, pre), (want_plan, want_pre) = (att.kernel_plan(a, kind, 128, 128)
                                          for a in (shifted, plain))
    assert plan.grid == want_plan.grid and len(pre) == len(want_pre) == 5
    for got, want in zip(pre, want_pre):
      np.testing.assert_array_equal(got, want)
  assert att._layout(dataclasses.replace(shifted, is_causal=True)).has_q_offset


@pytest.mark.smoke
def test_dispatch_records_mosaic_tpu_both_directions():
  q, k, v = _qkv(1, 128, 128, 2, 1, 128, 128, jnp.float32)
  # By name: this also checks the plugin registration points at these classes.
  loss = lambda q: jnp.sum(tokamax.dot_product_attention(
      q, k, v, is_causal=True, implementation="mosaic_tpu") * v[..., :1, :])
  with tokamax.interpret(not _ON_TPU), tokamax.record_dispatch() as records:
    jax.grad(loss)(q)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert ("dot_product_attention", "forward", "mosaic_tpu") in got
  assert ("dot_product_attention", "backward", "mosaic_tpu") in got


@pytest.mark.smoke
def test_check_supported_refuses():
  q, k, v = _qkv(1, 16, 16, 1, 1, 32, 32, jnp.float32)
  args = tokamax.AttentionArgs(q, k, v, scale=0.1)
  interp = tokamax.DeviceInfo("cpu", "cpu", interpret=True)
  fwd, bwd = att.MosaicTpuAttention(), att.MosaicTpuAttentionVjp()
  fwd.check_supported(args, interp)
  fwd.check_supported(args, tokamax.DeviceInfo("tpu", "TPU v5e"))
  with pytest.raises(NotImplementedError, match="TPU"):
    fwd.check_supported(args, tokamax.DeviceInfo("cpu", "cpu"))
  with pytest.raises(NotImplementedError, match="TPU"):
    fwd.check_supported(args, tokamax.DeviceInfo("gpu", "NVIDIA H200",
                                                 compute_capability="9.0"))
  with pytest.raises(NotImplementedError, match="lse"):
    bwd.check_supported(args, interp, residuals={})
  with pytest.raises(NotImplementedError, match="bias"):
    fwd.check_supported(tokamax.AttentionArgs(q, k, v, bias=jnp.zeros((1, 1, 16, 16))),
                        interp)
  with pytest.raises(NotImplementedError, match="mask"):
    fwd.check_supported(tokamax.AttentionArgs(q, k, v, mask=jnp.ones((1, 1, 16, 16),
                                                                     bool)), interp)
  f16 = tokamax.AttentionArgs(*(x.astype(jnp.float16) for x in (q, k, v)))
  with pytest.raises(NotImplementedError, match="float16"):
    fwd.check_supported(f16, interp)
  big = tokamax.AttentionArgs(*_qkv(1, 4, 4, 1, 1, 512, 512, jnp.float32))
  with pytest.raises(NotImplementedError, match="head dim"):
    fwd.check_supported(big, interp)


def test_heuristic_configs_fit_vmem():
  for h, dtype in ((64, jnp.bfloat16), (128, jnp.bfloat16), (256, jnp.float32)):
    q, k, v = (jax.ShapeDtypeStruct(s, dtype)
               for s in ((1, 8192, 2, h), (1, 8192, 1, h), (1, 8192, 1, h)))
    args = tokamax.AttentionArgs(q, k, v)
    c = att.MosaicTpuAttention().heuristic_config(args)
    assert c.block_q % 128 == 0 and c.block_k % 128 == 0
    plan, _ = att.kernel_plan(args, "fwd", c.block_q, c.block_k, with_prefetch=False)
    assert plan.vmem_bytes() <= 12 * 2**20
    c = att.MosaicTpuAttentionVjp().heuristic_config(args)
    for kind, bq, bk in (("dkdv", c.block_q_dkv, c.block_k_dkv),
                         ("dq", c.block_q_dq, c.block_k_dq)):
      plan, _ = att.kernel_plan(args, kind, bq, bk, with_prefetch=False)
      assert plan.vmem_bytes() <= 12 * 2**20
