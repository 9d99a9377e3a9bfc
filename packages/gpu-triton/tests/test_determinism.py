"""Every Triton kernel gives bitwise-equal outputs and gradients on repeated runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax

_ON_CPU = jax.default_backend() == "cpu"


def _rand(rng, *shape, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _calls(rng):
  q, k = _rand(rng, 1, 40, 4, 32), _rand(rng, 1, 37, 2, 32)
  x, s, o = _rand(rng, 9, 48), _rand(rng, 48), _rand(rng, 48)
  w = _rand(rng, 48, 2, 24) * 0.1
  rhs = _rand(rng, 3, 48, 16) * 0.1
  sizes = jnp.asarray([4, 0, 5], jnp.int32)
  return {
      "attention": (lambda q, k: tokamax.dot_product_attention(
          q, k, k, is_causal=True, implementation="triton"), (q, k)),
      "layer_norm": (lambda x, s, o: tokamax.layer_norm(x, s, o, implementation="triton"),
                     (x, s, o)),
      "gated_linear_unit": (lambda x, w: tokamax.gated_linear_unit(
          x, w, activation=jax.nn.silu, implementation="triton"), (x, w)),
      "ragged_dot": (lambda x, r: tokamax.ragged_dot(x, r, sizes, implementation="triton"),
                     (x, rhs)),
  }


@pytest.mark.parametrize("name", ["attention", "layer_norm", "gated_linear_unit",
                                  "ragged_dot"])
def test_bitwise_deterministic(name):
  rng = np.random.default_rng(38)
  fn, args = _calls(rng)[name]
  with tokamax.interpret(_ON_CPU):
    out = jax.eval_shape(fn, *args)
    dy = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
    run = jax.jit(lambda *a: jax.vjp(fn, *a)[1](dy) + (fn(*a),))
    first = jax.block_until_ready(run(*args))
    # A second compilation as well as a second run.
    second = jax.block_until_ready(jax.jit(lambda *a: jax.vjp(fn, *a)[1](dy) + (fn(*a),))(
        *args))
    third = jax.block_until_ready(run(*args))
  for a, b, c in zip(first, second, third):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    assert np.isfinite(np.asarray(a, np.float32)).all()
