"""cuDNN's backward with per-batch sequence lengths.

jax.nn's cuDNN backward can leave non-zero values in dk and dv rows past a batch
row's key length, where the gradient is 0 (H200, JAX 0.11.2; found by the GPU
attention sweep's drawn cases, session 72: B1 T128 S8192 H256 float16 with a key
length of 0, dk off by up to 5.5 and dv by up to 512, max abs; dv was right
in two of three repeat runs). The cudnn
implementation now sets to 0 the gradients of every position the lengths leave
out (`_zero_grads_past_lengths`). The tests of that function run anywhere; the
others need cuDNN: lengths with a 0 among them against the reference (at these shapes a separate probe
found no wrong row before the fix either: the call that failed is kept in
integration_tests/test_gpu_attention_sweep.py, which failed 3 of 3 runs
without the fix).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops.attention import xla as attention_xla

_ON_GPU = jax.default_backend() == "gpu"


def _garbage(shapes):
  rng = np.random.default_rng(0)
  return {name: jnp.asarray(rng.standard_normal(shape) + 100, jnp.bfloat16)
          for name, shape in shapes.items()}


@pytest.mark.parametrize("bias_batch", [3, 1])
def test_grads_outside_the_lengths_are_set_to_zero(bias_batch):
  b, t, s, n, h = 3, 5, 7, 2, 4
  q_lengths, kv_lengths = [5, 0, 2], [0, 7, 3]
  garbage = _garbage({"query": (b, t, n, h), "key": (b, s, 1, h),
                      "value": (b, s, 1, h), "bias": (bias_batch, n, t, s)})
  args = types.SimpleNamespace(query_seq_lengths=jnp.asarray(q_lengths),
                               key_value_seq_lengths=jnp.asarray(kv_lengths))
  grads = attention_xla._zero_grads_past_lengths(args, garbage)
  # Written out per batch row: row 0 has no key (no dq anywhere), row 1 no
  # query (no dk, dv anywhere), row 2 both partly.
  q_live = np.zeros((b, t), bool)
  q_live[2, :2] = True
  kv_live = np.zeros((b, s), bool)
  kv_live[2, :3] = True
  pair_live = q_live[:, None, :, None] & kv_live[:, None, None, :]
  if bias_batch == 1:
    pair_live = pair_live.any(axis=0, keepdims=True)
  for name, live in (("query", q_live[:, :, None, None]), ("key", kv_live[:, :, None, None]),
                     ("value", kv_live[:, :, None, None]), ("bias", pair_live)):
    assert grads[name].dtype == garbage[name].dtype
    want = np.where(live, np.asarray(garbage[name], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(grads[name], np.float32), want, err_msg=name)


def test_grads_without_lengths_are_kept():
  garbage = _garbage({"query": (1, 3, 2, 4), "key": (1, 3, 2, 4),
                      "value": (1, 3, 2, 4), "bias": (1, 2, 3, 3)})
  no_lengths = types.SimpleNamespace(query_seq_lengths=None, key_value_seq_lengths=None)
  kept = attention_xla._zero_grads_past_lengths(no_lengths, garbage)
  assert all(kept[name] is garbage[name] for name in garbage)
  only_kv = types.SimpleNamespace(query_seq_lengths=None,
                                  key_value_seq_lengths=jnp.asarray([2]))
  grads = attention_xla._zero_grads_past_lengths(only_kv, dict(garbage, bias=None))
  np.testing.assert_array_equal(grads["query"], garbage["query"])
  np.testing.assert_array_equal(grads["key"][:, 2:], 0)
  np.testing.assert_array_equal(grads["key"][:, :2], garbage["key"][:, :2])
  assert grads["bias"] is None


@pytest.mark.skipif(not _ON_GPU, reason="cuDNN runs on NVIDIA GPUs only")
@pytest.mark.parametrize("shape", [(3, 1024, 4096, 4, 2, 128, "bfloat16"),
                                   (1, 128, 8192, 2, 2, 256, "float16")])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cudnn_grads_past_the_lengths_are_zero(shape, is_causal):
  b, t, s, n, k, h, dtype = shape
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  key = jax.random.normal(ks[1], (b, s, k, h), dtype)
  value = jax.random.normal(ks[2], (b, s, k, h), dtype)
  ct = jax.random.normal(ks[3], (b, t, n, h), dtype)
  # Row 0 sees no key, row 2 (where b is 3) has no query.
  q_lengths = jnp.asarray([t // 2, t, 0][:b], jnp.int32)
  kv_lengths = jnp.asarray([0, s // 3, s][:b], jnp.int32)

  @jax.jit
  def grads(q, key, value):
    def f(q, key, value):
      return tokamax.dot_product_attention(
          q, key, value, is_causal=is_causal, query_seq_lengths=q_lengths,
          key_value_seq_lengths=kv_lengths, implementation="cudnn")
    out, vjp = jax.vjp(f, q, key, value)
    return out, vjp(ct)

  # Fill the allocator's memory with non-zeros first: an unwritten row shows.
  for _ in range(3):
    jnp.full((1 << 28,), 7.0, jnp.float32).block_until_ready()
  out, (dq, dk, dv) = grads(q, key, value)
  for row in range(b):
    assert not jnp.any(out[row, int(q_lengths[row]):])
    assert not jnp.any(dq[row, int(q_lengths[row]):])
    assert not jnp.any(dk[row, int(kv_lengths[row]):])
    assert not jnp.any(dv[row, int(kv_lengths[row]):])
    if not kv_lengths[row]:
      assert not jnp.any(dq[row])
    if not q_lengths[row]:
      assert not jnp.any(dk[row]) and not jnp.any(dv[row])
  with jax.default_matmul_precision("highest"):
    def reference(q, key, value):
      return tokamax.dot_product_attention(
          q, key, value, is_causal=is_causal, query_seq_lengths=q_lengths,
          key_value_seq_lengths=kv_lengths, implementation="xla_chunked")
    f32 = [x.astype(jnp.float32) for x in (q, key, value, ct)]
    _, vjp = jax.vjp(reference, *f32[:3])
    want = vjp(f32[3])
  for got, expected, name in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
    testing.assert_close(got, expected, jnp.dtype(dtype), what=name, scale=2.0,
                         gpu=True)
