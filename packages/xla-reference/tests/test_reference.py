"""The XLA reference against independent NumPy float64 implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_xla_reference as ref


def _np_attention(q, k, v, bias, visible, scale, soft_cap):
  b, t, n, h = q.shape
  group = n // k.shape[2]
  out = np.zeros((b, t, n, v.shape[-1]))
  for bi in range(b):
    for ni in range(n):
      kv = ni // group
      logits = scale * q[bi, :, ni] @ k[bi, :, kv].T
      if bias is not None:
        logits = logits + bias[bi, ni]
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      for ti in range(t):
        vis = visible[bi, ni, ti]
        if not vis.any():
          continue
        w = np.exp(logits[ti, vis] - logits[ti, vis].max())
        out[bi, ti, ni] = (w / w.sum()) @ v[bi, vis, kv]
  return out


def _np_visible(b, n, t, s, causal, window, q_len, kv_len, q_seg, kv_seg):
  vis = np.ones((b, n, t, s), bool)
  ti, si = np.arange(t)[:, None], np.arange(s)[None, :]
  if causal:
    vis &= si <= ti
  if window is not None:
    vis &= (si >= ti - window[0]) & (si <= ti + window[1])
  for bi in range(b):
    if q_len is not None:
      vis[bi, :, q_len[bi]:] = False
    if kv_len is not None:
      vis[bi, :, :, kv_len[bi]:] = False
    if q_seg is not None:
      vis[bi] &= q_seg[bi][:, None] == kv_seg[bi][None, :]
  return vis


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("features", [
    dict(), dict(causal=True), dict(window=(3, 2)), dict(soft_cap=2.0, bias=True),
    dict(lengths=True), dict(segments=True, causal=True),
])
def test_attention_matches_numpy(features, chunked):
  rng = np.random.default_rng(55)
  b, t, s, n, kh, h = 2, 11, 13, 4, 2, 8
  q, k, v = (rng.standard_normal(shape) for shape in
             [(b, t, n, h), (b, s, kh, h), (b, s, kh, h + 2)])
  bias = rng.standard_normal((b, n, t, s)) if features.get("bias") else None
  q_len = np.array([7, 0]) if features.get("lengths") else None
  kv_len = np.array([13, 4]) if features.get("lengths") else None
  q_seg = np.sort(rng.integers(0, 3, (b, t))) if features.get("segments") else None
  kv_seg = np.sort(rng.integers(0, 3, (b, s))) if features.get("segments") else None
  vis = _np_visible(b, n, t, s, features.get("causal", False), features.get("window"),
                    q_len, kv_len, q_seg, kv_seg)
  want = _np_attention(q, k, v, bias, vis, 0.4, features.get("soft_cap"))
  fn = ref.attention_chunked if chunked else ref.attention
  kw = dict(chunk_size=4) if chunked else {}
  j = lambda x: None if x is None else jnp.asarray(x)
  got, lse = fn(j(q), j(k), j(v), j(bias), None, scale=0.4,
                is_causal=features.get("causal", False), local_window=features.get("window"),
                logits_soft_cap=features.get("soft_cap"), query_seq_lengths=j(q_len),
                key_value_seq_lengths=j(kv_len), q_segment_ids=j(q_seg),
                kv_segment_ids=j(kv_seg), precision=jax.lax.Precision.HIGHEST, **kw)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  empty = ~vis.any(-1)
  assert np.all(np.isinf(np.asarray(lse)[empty])) and np.all(np.isfinite(np.asarray(lse)[~empty]))


def test_layer_norm_matches_numpy():
  rng = np.random.default_rng(81)
  x, scale, offset = rng.standard_normal((5, 33)) * 3 + 1, rng.standard_normal(33), rng.standard_normal(33)
  for subtract_mean in (True, False):
    centered = x - x.mean(-1, keepdims=True) if subtract_mean else x
    want = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + 1e-5) * scale + offset
    got, _, _ = ref.layer_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32),
                               jnp.asarray(offset, jnp.float32), epsilon=1e-5,
                               subtract_mean=subtract_mean)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_glu_matches_numpy():
  rng = np.random.default_rng(93)
  x, w = rng.standard_normal((7, 12)), rng.standard_normal((12, 2, 5))
  gate, up = x @ w[:, 0], x @ w[:, 1]
  want = gate / (1 + np.exp(-gate)) * up
  got = ref.gated_linear_unit(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                              activation=jax.nn.silu, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes,offset,g_rhs", [((3, 0, 4), None, 3), ((2, 5, 1, 3), 1, 2)])
def test_ragged_dot_matches_numpy(sizes, offset, g_rhs):
  rng = np.random.default_rng(104)
  m = sum(sizes) + 2  # two rows past the total
  lhs, rhs = rng.standard_normal((m, 6)), rng.standard_normal((g_rhs, 6, 4))
  want = np.zeros((m, 4))
  row = 0
  for g, size in enumerate(sizes):
    local = g - (offset or 0)
    if 0 <= local < g_rhs:
      want[row:row + size] = lhs[row:row + size] @ rhs[local]
    row += size
  got = ref.ragged_dot(jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32),
                       jnp.asarray(sizes, jnp.int32),
                       group_offset=None if offset is None else jnp.int32(offset),
                       precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_chunked_attention_runs_long_sequences_in_bounded_memory():
  """B=1 T=S=32768 N=8 H=128 float32 on a CPU: the dense logits would be 32 GiB."""
  q = jnp.asarray(np.random.default_rng(124).standard_normal((1, 32768, 8, 128)), jnp.float32)
  out, lse = jax.jit(lambda q: ref.attention_chunked(q, q, q, scale=128**-0.5,
                                                     is_causal=True, chunk_size=512))(q)
  assert out.shape == q.shape and bool(jnp.isfinite(lse).all())


@pytest.mark.parametrize("t,s", [(7, 7), (5, 9), (9, 4)])
def test_cudnn_window_rewrite_keeps_visibility(t, s):
  # Every window cuDNN is given must see exactly the keys of the call it stands for:
  # cuDNN's form is causal narrowed to the last `sliding_window_length` keys.
  q_pos, k_pos = jnp.arange(t), jnp.arange(s)
  sides = (None, -1, 0, 1, 3, 20)
  for is_causal in (False, True):
    for window in [None] + [(left, right) for left in sides for right in sides]:
      rewritten = ref.cudnn_window(is_causal, window)
      if isinstance(rewritten, str):
        continue
      cudnn_causal, length = rewritten
      want = ref.visibility(q_pos, k_pos, is_causal=is_causal, local_window=window)
      got = ref.visibility(q_pos, k_pos, is_causal=cudnn_causal,
                           local_window=None if length is None else (length - 1, None))
      np.testing.assert_array_equal(got, want, err_msg=f"{is_causal=} {window=}")


def test_cudnn_window_refusals_say_why():
  assert ref.cudnn_window(False, (4, 0)) == (True, 5)  # the form cuDNN got wrong
  assert ref.cudnn_window(True, (4, 2)) == (True, 5)
  assert ref.cudnn_window(True, (None, 3)) == (True, None)
  assert ref.cudnn_window(False, None) == (False, None)
  for is_causal, window in ((False, (4, 2)), (False, (None, 3)), (False, (4, None)),
                            (True, (4, -1)), (True, (-1, 0))):
    reason = ref.cudnn_window(is_causal, window)
    assert isinstance(reason, str) and str(window) in reason


def test_cudnn_refuses_a_window_with_more_queries_than_keys():
  def reason(t, s, **kw):
    q = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.bfloat16)
    return ref.cudnn_unsupported_reason(q, k, k, logits_soft_cap=None,
                                        q_segment_ids=None, platform="gpu", **kw)
  assert "T <= S" in reason(4097, 3001, is_causal=True, local_window=(8, 0))
  assert reason(3001, 4097, is_causal=True, local_window=(8, 0)) is None
  assert reason(4097, 3001, is_causal=True) is None  # causal alone runs
  assert reason(64, 64) is None


@pytest.mark.parametrize("t,s", [(37, 37), (45, 17), (17, 45)])
def test_zeroed_rows_are_exactly_those_without_a_visible_key(t, s):
  """The cuDNN wrapper's row zeroing (positions and lengths in O(T), the mask in
  O(T * S)) against the dense visibility's rows, over windows, causal, lengths
  and a mask."""
  rng = np.random.default_rng(3)
  out = jnp.asarray(rng.standard_normal((2, t, 3, 4)), jnp.float32) + 10.0
  qlen = jnp.asarray([t // 2, t], jnp.int32)
  kvlen = jnp.asarray([0, s // 3], jnp.int32)
  mask = jnp.asarray(rng.random((2, 1, t, s)) < 0.3)
  windows = [None, (0, 0), (5, 0), (0, 4), (3, 7), (6, None), (None, 2), (40, 0)]
  calls = 0
  for window in windows:
    for causal in (False, True):
      for lengths in ({}, {"query_seq_lengths": qlen},
                      {"key_value_seq_lengths": kvlen},
                      {"query_seq_lengths": qlen, "key_value_seq_lengths": kvlen}):
        for m in (None, mask):
          got = ref.zero_rows_without_keys(out, s, is_causal=causal,
                                           local_window=window, mask=m, **lengths)
          vis = ref.visibility(jnp.arange(t), jnp.arange(s), is_causal=causal,
                               local_window=window, mask=m, **lengths)
          rows = jnp.moveaxis(jnp.any(vis, -1), 1, 2)[..., None]
          want = jnp.where(rows, out, 0.0)
          np.testing.assert_array_equal(got, want, err_msg=f"{window} {causal} "
                                        f"{sorted(lengths)} mask={m is not None}")
          calls += 1
  assert calls == len(windows) * 2 * 4 * 2
