"""The jax-triton example (examples/jax_triton_rms_norm.py) as a tokamax Op."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing

pytest.importorskip("triton")
pytest.importorskip("jax_triton")

_PATH = pathlib.Path(__file__).parents[1] / "examples" / "jax_triton_rms_norm.py"
_spec = importlib.util.spec_from_file_location("jax_triton_rms_norm", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_refuses_without_a_gpu_or_for_layer_norm():
  x = jnp.ones((4, 32))
  if jax.default_backend() != "gpu":
    with pytest.raises(NotImplementedError, match="NVIDIA GPUs"):
      tokamax.rms_norm(x, jnp.ones(32), implementation=example.JaxTritonRmsNorm())
  with pytest.raises(NotImplementedError, match="only RMSNorm"):
    tokamax.layer_norm(x, jnp.ones(32), None, implementation=[example.JaxTritonRmsNorm()])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(7, 100), (129, 4096)])
def test_matches_reference_forward_and_gradients(shape, dtype):
  rng = np.random.default_rng(37)
  x = jnp.asarray(rng.standard_normal(shape), dtype)
  scale = jnp.asarray(rng.standard_normal(shape[-1]), dtype)
  dy = jnp.asarray(rng.standard_normal(shape), jnp.float32)

  def loss(x, scale, impl):
    return jnp.sum(tokamax.rms_norm(x, scale, implementation=impl).astype(jnp.float32) * dy)

  op = example.JaxTritonRmsNorm()
  with tokamax.record_dispatch() as records:
    y = tokamax.rms_norm(x, scale, implementation=op)
    grads = jax.grad(loss, argnums=(0, 1))(x, scale, op)
  assert records[0].implementation == "jax_triton_rms_norm"
  up = lambda a: a.astype(jnp.float32)
  ref = tokamax.rms_norm(up(x), up(scale), implementation="xla")
  testing.assert_close(y, ref, dtype, what="y", gpu=True)
  ref_grads = jax.grad(loss, argnums=(0, 1))(up(x), up(scale), "xla")
  for g, r, name in zip(grads, ref_grads, ("dx", "dscale")):
    testing.assert_close(g, r, dtype, what=name, gpu=True, scale=2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_autotunes_like_any_op():
  x = jnp.asarray(np.random.default_rng(61).standard_normal((256, 2048)), jnp.bfloat16)
  scale = jnp.ones(2048, jnp.bfloat16)
  result = tokamax.autotune(
      lambda x: tokamax.rms_norm(x, scale, implementation=example.JaxTritonRmsNorm()), x,
      backward=False, progress=False)
  configs = {m.config["num_warps"] for m in result.measurements}
  assert configs <= {4, 8, 16} and len(result.measurements) == 1
