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
    "glu_M0": lambda: (lambda x, w: tokamax.gated_linear_unit(x, w),
                       (_rand(0, 16), _rand(16, 2, 8))),
    "glu_K0": lambda: (lambda x, w: tokamax.gated_linear_unit(x, w),
                       (_rand(4, 0), _rand(0, 2, 8))),
    "layer_norm_rows0": lambda: (lambda x: tokamax.layer_norm(x, None, None),
                                 (_rand(0, 16),)),
    "ragged_dot_M0": lambda: (
        lambda a, b: tokamax.ragged_dot(a, b, jnp.zeros((2,), jnp.int32)),
        (_rand(0, 16), _rand(2, 16, 8))),
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
