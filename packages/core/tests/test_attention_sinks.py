"""Attention sinks: a per-head logit in each row's softmax denominator that takes
no value. The XLA implementations against an oracle written here (the sink as an
extra key column whose value is 0, softmax by jax.nn), forward and gradients; the
limits (a sink at -inf is no sink, a huge sink empties every row); refusals.
The kernels are checked against the XLA reference by the conformance suite's
``sinks*`` cases (tokamax.testing) and the GPU sweep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing

_RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """These tests check a definition in float32; a GPU's default float32 matmuls
  (TF32-class) would miss their tolerance by design, not by a bug."""
  with jax.default_matmul_precision("highest"):
    yield


def _rand(*shape):
  return jnp.asarray(_RNG.standard_normal(shape), jnp.float32)


def _oracle(q, k, v, sinks, *, causal):
  """Sinks as a key column of logit ``sink`` and value 0 (gpt-oss's definition)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k,
                      precision=jax.lax.Precision.HIGHEST) / np.sqrt(h)
  if causal:
    logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits,
                       -jnp.inf)
  column = jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))
  p = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :s]
  return jnp.einsum("bnts,bsnh->btnh", p, v, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", None])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_extra_column_definition(implementation, causal):
  q, k, v = _rand(2, 19, 4, 16), _rand(2, 23, 2, 16), _rand(2, 23, 2, 16)
  sinks = _rand(4) * 3
  dout = _rand(2, 19, 4, 16)

  def loss(fn, *a):
    return jnp.sum(fn(*a) * dout)

  ours = lambda q, k, v, s: tokamax.dot_product_attention(
      q, k, v, is_causal=causal, sinks=s, implementation=implementation)
  oracle = lambda q, k, v, s: _oracle(q, k, v, s, causal=causal)
  testing.assert_close(ours(q, k, v, sinks), oracle(q, k, v, sinks), jnp.float32)
  got = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  want = jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
    testing.assert_close(g, w, jnp.float32, what=name)


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_limits(implementation):
  q, k, v = _rand(1, 8, 2, 8), _rand(1, 8, 2, 8), _rand(1, 8, 2, 8)
  att = lambda s: tokamax.dot_product_attention(q, k, v, is_causal=True, sinks=s,
                                                implementation=implementation)
  plain = tokamax.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=implementation)
  # A sink far below every logit takes nothing from the keys.
  np.testing.assert_allclose(att(jnp.full((2,), -1e4)), plain, rtol=1e-6, atol=1e-6)
  # One far above takes everything: rows output 0, finite, and so are gradients.
  huge = jnp.full((2,), 1e4)
  np.testing.assert_allclose(att(huge), 0.0, atol=1e-30)
  grads = jax.grad(lambda s: jnp.sum(att(s)))(huge)
  assert np.all(np.isfinite(grads))


@pytest.mark.parametrize("sinks", [[-2.0, 3.0], [100.0, 0.0]])
def test_rows_with_no_visible_key_stay_zero(sinks):
  q, k, v = _rand(2, 6, 2, 8), _rand(2, 6, 2, 8), _rand(2, 6, 2, 8)
  sinks = jnp.asarray(sinks)  # 100: exp(sink) overflows float32
  for implementation in ("xla", "xla_chunked"):
    out = tokamax.dot_product_attention(
        q, k, v, sinks=sinks, key_value_seq_lengths=jnp.asarray([0, 6]),
        query_seq_lengths=jnp.asarray([6, 2]), implementation=implementation)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[1, 2:]) == 0)
    g = jax.grad(lambda s: jnp.sum(tokamax.dot_product_attention(
        q, k, v, sinks=s, key_value_seq_lengths=jnp.asarray([0, 6]),
        implementation=implementation)))(sinks)
    assert np.all(np.isfinite(g))


def test_cudnn_refuses_sinks():
  q = k = v = _rand(1, 8, 2, 8)
  with pytest.raises(NotImplementedError, match="sinks"):
    tokamax.dot_product_attention(q, k, v, sinks=jnp.zeros((2,)),
                                  implementation="cudnn")


@pytest.mark.parametrize("sinks,error,text", [
    (jnp.zeros((3,)), ValueError, r"sinks must have shape \(2,\)"),
    (jnp.zeros((1, 2)), ValueError, r"sinks must have shape \(2,\)"),
    (jnp.zeros((2,), jnp.int32), TypeError, "sinks"),
])
def test_bad_sinks_say_what_was_wrong(sinks, error, text):
  q = k = v = _rand(1, 8, 2, 8)
  with pytest.raises(error, match=text):
    tokamax.dot_product_attention(q, k, v, sinks=sinks)


def test_sinks_under_vmap_jit_and_export():
  q, k, v = _rand(3, 1, 8, 2, 8), _rand(3, 1, 8, 2, 8), _rand(3, 1, 8, 2, 8)
  sinks = _rand(2)
  f = jax.jit(jax.vmap(lambda q, k, v: tokamax.dot_product_attention(
      q, k, v, is_causal=True, sinks=sinks, implementation="xla_chunked")))
  want = jnp.stack([_oracle(q[i], k[i], v[i], sinks, causal=True) for i in range(3)])
  testing.assert_close(f(q, k, v), want, jnp.float32)
  # As README.md exports: a GPU's None may pick a kernel (a custom call).
  exported = jax.export.export(
      jax.jit(lambda q, k, v, s: tokamax.dot_product_attention(q, k, v, sinks=s)),
      disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(q[0], k[0], v[0], sinks)
  testing.assert_close(exported.call(q[0], k[0], v[0], sinks),
                       _oracle(q[0], k[0], v[0], sinks, causal=False), jnp.float32)
