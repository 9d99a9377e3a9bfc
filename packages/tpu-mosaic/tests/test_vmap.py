"""mosaic_tpu's four ops under `jax.vmap`, forward and gradients, against the XLA
reference under the same vmap.

In TPU interpret mode (CPU) a batched pallas_call fails in JAX's interpreter
(the grid dimension vmap adds), so the kernels run a batch's elements one by
one there (`KernelPlan.call`, `tokamax.plugin.sequential_under_vmap`); on a TPU
they batch as Pallas does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax

_INTERPRET = jax.default_backend() != "tpu"
_keys = iter(jax.random.split(jax.random.key(7), 32))


def _normal(*shape):
  return jax.random.normal(next(_keys), shape, jnp.float32)


def _attention(impl):
  return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation=impl)


def _ragged_dot(impl):
  sizes = jnp.asarray([100, 0, 156], jnp.int32)
  return lambda x, w: tokamax.ragged_dot(x, w, sizes, implementation=impl)


def _layer_norm(impl):
  return lambda x, scale: tokamax.layer_norm(x, scale, None, implementation=impl)


def _glu(impl):
  return lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                                implementation=impl)


# (the op, its operands with a leading batch of 2 or 3 on the first, the vmap's
# in_axes: the second operand shared where None; ragged_dot's [G, K, N] weights
# of 3 groups, one empty)
_CASES = {
    "attention": (_attention, lambda: (_normal(2, 1, 128, 2, 128), _normal(2, 1, 128, 1, 128),
                                       _normal(2, 1, 128, 1, 128)), 0),
    "ragged_dot": (_ragged_dot, lambda: (_normal(3, 256, 128), _normal(3, 128, 128)),
                   (0, None)),
    "layer_norm": (_layer_norm, lambda: (_normal(3, 16, 256), _normal(256)), (0, None)),
    "gated_linear_unit": (_glu, lambda: (_normal(2, 64, 128), _normal(128, 2, 128)),
                          (0, None)),
}


@pytest.mark.parametrize("name", _CASES)
def test_vmap_matches_the_reference(name):
  make, operands, in_axes = _CASES[name]
  operands = operands()

  def loss(impl):
    batched = jax.vmap(make(impl), in_axes=in_axes)
    return lambda *ops: jnp.sum(jnp.sin(batched(*ops)))
  with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
    got = jax.value_and_grad(loss("mosaic_tpu"), argnums=(0, 1))(*operands)
  assert {r.implementation for r in records} == {"mosaic_tpu"}, records
  want = jax.value_and_grad(loss("xla"), argnums=(0, 1))(*operands)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4,
                               atol=2e-4 * float(np.abs(np.asarray(w)).max()))
