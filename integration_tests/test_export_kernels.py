"""jax.export of functions using tokamax kernels (forward and gradient) round-trips.

On a GPU the Triton kernels lower to custom calls that `jax.export` accepts only with
`tokamax.DISABLE_JAX_EXPORT_CHECKS`; on the CPU the same functions export the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import tokamax

_IMPL = "triton" if jax.default_backend() == "gpu" else None


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _functions(rng):
  sizes = jnp.asarray([40, 0, 24], jnp.int32)
  return {
      "attention": (lambda q, k: tokamax.dot_product_attention(
          q, k, k, is_causal=True, implementation=_IMPL),
                    (_rand(rng, 2, 64, 4, 64), _rand(rng, 2, 64, 2, 64))),
      "layer_norm": (lambda x, s: tokamax.layer_norm(x, s, s, implementation=_IMPL),
                     (_rand(rng, 64, 256), _rand(rng, 256))),
      "gated_linear_unit": (lambda x, w: tokamax.gated_linear_unit(
          x, w, activation=jax.nn.silu, implementation=_IMPL),
                            (_rand(rng, 64, 128), _rand(rng, 128, 2, 128) * 0.1)),
      "ragged_dot": (lambda x, r: tokamax.ragged_dot(x, r, sizes, implementation=_IMPL),
                     (_rand(rng, 64, 128), _rand(rng, 3, 128, 64) * 0.1)),
  }


@pytest.mark.parametrize("name", ["attention", "layer_norm", "gated_linear_unit",
                                  "ragged_dot"])
def test_export_forward_and_gradient(name):
  fn, args = _functions(np.random.default_rng(41))[name]
  both = jax.jit(lambda *a: (fn(*a), jax.grad(
      lambda *b: jnp.sum(fn(*b).astype(jnp.float32) ** 2), argnums=tuple(range(len(a))))(*a)))
  exported = export.export(both, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)
  restored = export.deserialize(exported.serialize())
  want, got = both(*args), restored.call(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  if _IMPL == "triton":
    text = exported.mlir_module()
    assert "xla.gpu.triton" in text or "triton_kernel_call" in text, (
        "the Triton kernels are in the exported module")
