"""`activation.rows_independent`: whether a GLU activation may be applied to a
shard of the gate's rows (the sharding layer splits rows only where it holds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src import activation

N = 12
_MASK = jax.random.bernoulli(jax.random.key(0), 0.5, (N,))
_WHOLE_GATE_ARRAY = jnp.ones((64, N))


@pytest.mark.parametrize("fn", [
    jax.nn.silu,
    lambda g: g - jnp.mean(g, axis=-1, keepdims=True),  # mixes a row's columns only
    lambda g: jax.nn.softmax(g, axis=-1),
    lambda g: g * _MASK,  # a per-channel constant
], ids=["silu", "centre_over_n", "softmax_over_n", "per_channel_mask"])
def test_rows_that_compute_alone(fn):
  assert activation.rows_independent(fn, N)


@pytest.mark.parametrize("fn", [
    lambda g: g - jnp.mean(g, axis=0, keepdims=True),  # a column mean
    lambda g: g * jax.random.bernoulli(jax.random.key(1), 0.5, g.shape),  # mask at g.shape
    lambda g: jnp.cumsum(g, axis=0),
    lambda g: g * _WHOLE_GATE_ARRAY,  # runs on 64 rows only
    lambda g: jnp.log(g),  # NaN on the random gate: proves nothing
    # Shows only past 5 rows (a check of 4 rows passed it).
    lambda g: jnp.where(jnp.arange(g.shape[0])[:, None] < 5, g, 0.0),
], ids=["column_mean", "mask_at_gate_shape", "cumsum_over_rows", "whole_gate_array",
        "non_finite", "first_five_rows"])
def test_rows_that_mix_or_cannot_be_shown(fn):
  assert not activation.rows_independent(fn, N)


def test_runs_inside_a_trace():
  # The sharding layer calls it while tracing the user's program.
  seen = []

  @jax.jit
  def f(x):
    seen.append(activation.rows_independent(lambda g: g * jnp.tanh(g), N))
    return x

  np.asarray(f(jnp.ones(3)))
  assert seen == [True]
