"""The GLU forward keeps its projections for a backward, which then skips the
projection matmul (the plain-JAX program's three matmuls, not four)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing

HIGHEST = jax.lax.Precision.HIGHEST


def _inputs(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  return x, w, dy


def _loss(x, w, dy, activation, implementation="xla", precision=None):
  y = tokamax.gated_linear_unit(x, w, activation=activation, precision=precision,
                                implementation=implementation)
  return jnp.sum(y.astype(jnp.float32) * dy)


def _dots(fn, *args):
  return jax.jit(fn).lower(*args).as_text().count("dot_general")


def test_training_step_has_three_matmuls():
  x, w, dy = _inputs(64, 32, 48, jnp.float32)
  grad = jax.grad(lambda x, w: _loss(x, w, dy, jax.nn.silu), argnums=(0, 1))
  assert _dots(grad, x, w) == 3
  # Inference keeps no projections: the forward alone, one matmul.
  assert _dots(lambda x, w: _loss(x, w, dy, jax.nn.silu), x, w) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("activation", [jax.nn.silu, None, jax.nn.gelu, jnp.tanh])
@pytest.mark.parametrize("shape", [(37, 40, 24), (1, 8, 3), (130, 64, 257)])
def test_gradients_from_projections_match_the_reference(dtype, activation, shape):
  x, w, dy = _inputs(*shape, dtype, seed=sum(shape))
  dx, dw = jax.jit(jax.grad(lambda x, w: _loss(x, w, dy, activation),
                            argnums=(0, 1)))(x, w)
  up = lambda a: a.astype(jnp.float32)
  rx, rw = jax.grad(lambda x, w: _loss(x, w, dy, activation, "xla", HIGHEST),
                    argnums=(0, 1))(up(x), up(w))
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  testing.assert_close(dx, rx, dtype, what="dx", scale=2)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2)


def test_projections_are_laid_out_like_the_output_under_leading_dims():
  x, w, dy = _inputs(24, 16, 8, jnp.float32, seed=3)
  x3, dy3 = x.reshape(2, 3, 4, 16), dy.reshape(2, 3, 4, 8)
  g3 = jax.grad(lambda x, w: _loss(x, w, dy3, jax.nn.silu), argnums=(0, 1))(x3, w)
  g2 = jax.grad(lambda x, w: _loss(x, w, dy, jax.nn.silu), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(g3[0].reshape(24, 16), g2[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(g3[1], g2[1], rtol=1e-6, atol=1e-6)
