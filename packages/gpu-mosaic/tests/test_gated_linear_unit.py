"""Tests of the Mosaic GPU gated_linear_unit forward.

Numerical tests run natively on a Hopper GPU only (JAX's Mosaic GPU interpreter does
not run warp-specialized pipelines); on the CPU the registration, the refusals and
the lowering to Mosaic GPU IR for "cuda" are checked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops.gated_linear_unit import GatedLinearUnitArgs
from tokamax_gpu_mosaic import gated_linear_unit as glu

HIGHEST = jax.lax.Precision.HIGHEST
_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))
gpu = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
_seed = iter(range(1_000_000))


def _inputs(m, k, n, dtype):
  rng = np.random.default_rng(next(_seed))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), dtype)
  return x, w


def _check(m, k, n, activation, dtype=jnp.bfloat16, config=None, grads=True):
  x, w = _inputs(m, k, n, dtype)
  impl = glu.MosaicGpuGatedLinearUnit(config) if config else "mosaic_gpu"
  with tokamax.record_dispatch() as records:
    out = jax.jit(lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=activation, implementation=impl))(x, w)
  assert any(r.implementation == "mosaic_gpu" for r in records)
  ref = tokamax.gated_linear_unit(x.astype(jnp.float32), w.astype(jnp.float32),
                                  activation=activation, precision=HIGHEST,
                                  implementation="xla")
  assert out.dtype == dtype
  testing.assert_close(out, ref, dtype, what="forward", gpu=True)
  if grads:
    cot = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal(out.shape),
                      jnp.float32)

    def loss(x, w, impl):
      y = tokamax.gated_linear_unit(x, w, activation=activation, implementation=impl)
      return jnp.sum(y.astype(jnp.float32) * cot)
    with tokamax.record_dispatch() as records:
      dx, dw = jax.grad(loss, argnums=(0, 1))(x, w, None)
    assert any(r.implementation == "mosaic_gpu" and r.direction == "forward"
               for r in records), records
    rx, rw = jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float32),
                                            w.astype(jnp.float32), "xla")
    testing.assert_close(dx, rx, dtype, what="dx", scale=2, gpu=True)
    testing.assert_close(dw, rw, dtype, what="dw", scale=2, gpu=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", [jax.nn.silu, None, jax.nn.gelu, jax.nn.relu])
def test_forward(dtype, activation):
  _check(1000, 384, 520, activation, dtype)


@gpu
def test_odd_shapes():
  _check(37, 40, 24, jax.nn.silu, grads=False)
  _check(300, 200, 136, jax.nn.silu, grads=False)


@gpu
@pytest.mark.parametrize("config", [
    glu.GatedLinearUnitConfig(block_m=128, block_n=64, block_k=32, num_stages=3,
                              grid_tile_width=3),
    glu.GatedLinearUnitConfig(block_m=256, block_n=64, block_k=64, num_stages=3),
])
def test_configs(config):
  _check(1100, 512, 640, jax.nn.silu, config=config, grads=False)


def test_registered():
  names = {(s.op, s.name) for s in tokamax.implementations()}
  assert ("gated_linear_unit", "mosaic_gpu") in names


def test_refusals():
  x, w = _inputs(16, 16, 16, jnp.bfloat16)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=jax.nn.silu)
  for device in (tokamax.DeviceInfo("cpu", "cpu"),
                 tokamax.DeviceInfo("cpu", "cpu", interpret=True)):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      glu.MosaicGpuGatedLinearUnit().check_supported(args, device)
  h200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
  glu.MosaicGpuGatedLinearUnit().check_supported(args, h200)
  x32, w32 = _inputs(16, 16, 16, jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x32, weights=w32), h200)
  with pytest.raises(NotImplementedError, match="not elementwise"):
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x, weights=w, activation=jnp.sort), h200)
  with pytest.raises(NotImplementedError, match="cannot lower"):  # elementwise
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x, weights=w, activation=jax.lax.lgamma), h200)
  with pytest.raises(NotImplementedError, match="backward is not written"):
    glu.MosaicGpuGatedLinearUnitVjp().check_supported(args, h200)


@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.relu])
def test_lowers_for_cuda(activation):
  pytest.importorskip("absl")
  config = glu.GatedLinearUnitConfig(block_n=64, num_stages=2)
  exported = jax.export.export(
      jax.jit(lambda x, w: glu.fused_glu(x, w, activation, config)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((300, 200), jnp.bfloat16),
                          jax.ShapeDtypeStruct((200, 2, 136), jnp.bfloat16))
  assert "mosaic_gpu" in exported.mlir_module()
