"""Sequence lengths out of range: an error where the values are known, the
lengths clipped into range where they are traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax


def _qkv():
  ks = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, (2, 8, 2, 16), jnp.float32) for k in ks]


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
@pytest.mark.parametrize("bad", [[9, 4], [-1, 4]])
def test_known_lengths_out_of_range_are_an_error(name, bad):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=rf"{name} must lie in \[0, 8\]"):
    tokamax.dot_product_attention(q, k, v, **{name: jnp.array(bad)})


# mosaic_tpu (interpreted) read past the keys' end at key_value_seq_lengths 99
# before the API clipped traced lengths: 1.1 off at the largest.
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_traced_lengths_out_of_range_are_clipped(implementation, name):
  package = {"triton": "tokamax_gpu_triton", "mosaic_tpu": "tokamax_tpu_mosaic"}
  if implementation in package:
    pytest.importorskip(package[implementation])
  q, k, v = _qkv()

  @jax.jit
  def attend(lengths):
    return tokamax.dot_product_attention(q, k, v, implementation=implementation,
                                         **{name: lengths})
  # The same program at the in-range lengths is the expected value; those
  # lengths are right where known (eager, checked), within float rounding.
  for traced, in_range in (([99, 5], [8, 5]), ([-3, 5], [0, 5])):
    with tokamax.interpret():  # the kernels on the CPU
      want = attend(jnp.array(in_range))
      got = attend(jnp.array(traced))
      eager = tokamax.dot_product_attention(q, k, v, implementation=implementation,
                                            **{name: jnp.array(in_range)})
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(want, eager, rtol=1e-5, atol=1e-6)
