"""Zero-size inputs (an empty sequence, a shard without tokens) give empty or zero
results and gradients, whichever implementation dispatch picks (kernels that cannot
take them refuse, and dispatch falls back)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax


def _rand(*shape):
  return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


CASES = {
    "attention_T0": lambda: (lambda q, k, v: tokamax.dot_product_attention(q, k, v),
                             (_rand(2, 0, 2, 16), _rand(2, 8, 2, 16), _rand(2, 8, 2, 16))),
    "attention_S0": lambda: (lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=False), (_rand(2, 8, 2, 16), _rand(2, 0, 2, 16),
                                    _rand(2, 0, 2, 16))),
    # Bias / mask with an empty dim: the XLA reference inferred a -1 reshape dim
    # next to a 0 and raised ZeroDivisionError.
    "attention_T0_bias": lambda: (
        lambda q, k, v, b: tokamax.dot_product_attention(q, k, v, b),
        (_rand(2, 0, 4, 16), _rand(2, 8, 2, 16), _rand(2, 8, 2, 16), _rand(2, 4, 0, 8))),
    "attention_S0_mask": lambda: (
        lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, mask=jnp.ones((2, 4, 8, 0), bool)),
        (_rand(2, 8, 4, 16), _rand(2, 0, 2, 16), _rand(2, 0, 2, 16))),
    "attention_B0_bias": lambda: (
        lambda q, k, v, b: tokamax.dot_product_attention(q, k, v, b),
        (_rand(0, 8, 4, 16), _rand(0, 8, 2, 16), _rand(0, 8, 2, 16), _rand(0, 4, 8, 8))),
    "attention_batch_2x0_bias": lambda: (
        lambda q, k, v, b: tokamax.dot_product_attention(q, k, v, b),
        (_rand(2, 0, 8, 4, 16), _rand(2, 0, 8, 2, 16), _rand(2, 0, 8, 2, 16),
         _rand(2, 1, 4, 8, 8))),
    "glu_M0": lambda: (lambda x, w: tokamax.gated_linear_unit(x, w),
                       (_rand(0, 16), _rand(16, 2, 8))),
    "glu_K0": lambda: (lambda x, w: tokamax.gated_linear_unit(x, w),
                       (_rand(4, 0), _rand(0, 2, 8))),
    "layer_norm_rows0": lambda: (lambda x: tokamax.layer_norm(x, None, None),
                                 (_rand(0, 16),)),
    "ragged_dot_M0": lambda: (
        lambda a, b: tokamax.ragged_dot(a, b, jnp.zeros((2,), jnp.int32)),
        (_rand(0, 16), _rand(2, 16, 8))),
    # No groups at all: the reference's scan traced rhs[g] on an empty rhs.
    "ragged_dot_G0": lambda: (
        lambda a, b: tokamax.ragged_dot(a, b, jnp.zeros((0,), jnp.int32)),
        (_rand(3, 16), _rand(0, 16, 8))),
    # Quantized operands with an empty axis, as `tokamax.quantize` makes them
    # (no scales along it): refused before as scales not dividing the values.
    "ragged_dot_M0_quantized": lambda: (
        lambda a, b: tokamax.ragged_dot(tokamax.quantize(a, (1, 16)),
                                        tokamax.quantize(b, (1, 16, 8)),
                                        jnp.zeros((2,), jnp.int32)),
        (_rand(0, 16), _rand(2, 16, 8))),
    "ragged_dot_G0_quantized": lambda: (
        lambda a, b: tokamax.ragged_dot(a, tokamax.quantize(b, (1, 16, 8)),
                                        jnp.zeros((0,), jnp.int32)),
        (_rand(3, 16), _rand(0, 16, 8))),
}


@pytest.mark.parametrize("interpret", [False, True], ids=["default", "interpret"])
@pytest.mark.parametrize("case", CASES)
def test_empty_inputs(case, interpret):
  fn, args = CASES[case]()
  with tokamax.interpret(interpret):
    out = fn(*args)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=tuple(range(len(args))))(*args)
  want = jax.eval_shape(fn, *args)
  assert out.shape == want.shape
  assert not np.any(np.asarray(out)), "an empty reduction must give zeros"
  for g, a in zip(grads, args):
    assert g.shape == a.shape and np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("case", ["H0", "Hv0", "T0_bias", "S0_bias", "S0_mask"])
def test_empty_attention_dims_in_each_xla_implementation(case, implementation):
  b, t, s, n, k = 2, 3, 4, 4, 2
  h, hv, bias, mask = 8, 8, None, None
  if case == "H0":
    h = 0
  elif case == "Hv0":
    hv = 0
  elif case == "T0_bias":
    t, bias = 0, _rand(b, n, 0, s)
  elif case == "S0_bias":
    s, bias = 0, _rand(b, n, t, 0)
  else:
    s, mask = 0, jnp.ones((b, n, t, 0), bool)
  q, key, v = _rand(b, t, n, h), _rand(b, s, k, h), _rand(b, s, k, hv)

  def fn(q, key, v, bias):
    return tokamax.dot_product_attention(q, key, v, bias, mask,
                                         implementation=implementation)
  out = fn(q, key, v, bias)
  # No head dim: every logit is 0, so each query averages the values of its group.
  want = (np.broadcast_to(np.repeat(np.asarray(v).mean(1, keepdims=True), n // k, 2),
                          (b, t, n, hv)) if s else np.zeros((b, t, n, hv)))
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) * jnp.arange(hv, dtype=jnp.float32)),
                   argnums=argnums)(q, key, v, bias)
  for g, a in zip(grads, (q, key, v, bias)):
    assert g.shape == a.shape and np.all(np.isfinite(np.asarray(g)))
