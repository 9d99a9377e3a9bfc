"""Shared fixtures of tokamax-gpu-triton's tests."""

import contextlib

import jax
import pytest

import tokamax

# A GPU that Pallas' Triton lowering knows by name: its target when lowering
# without a GPU attached (JAX >= 0.12 asks the device for its compute capability).
_ABSTRACT_GPU = "NVIDIA H100 80GB HBM3"


def _abstract_gpu():
  """An abstract mesh naming the target GPU: JAX 0.12 needs one to lower Triton
  kernels on a machine without a GPU (older releases take it too); a JAX
  without `AbstractDevice` gets none."""
  device_type = getattr(jax.sharding, "AbstractDevice", None)
  if device_type is None:
    return contextlib.nullcontext()
  device = device_type(device_kind=_ABSTRACT_GPU, num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


@pytest.fixture
def lower_for_cuda():
  """``lower(fn, *shapes)``: the StableHLO text of ``jax.jit(fn)`` lowered for CUDA
  with the kernels (not interpret mode), on any machine."""

  def lower(fn, *shapes):
    with tokamax.interpret(False), _abstract_gpu():
      return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

  return lower
