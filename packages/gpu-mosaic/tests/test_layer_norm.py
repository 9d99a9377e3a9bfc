"""The Mosaic GPU layer / RMS norm forward: natively on a Hopper GPU against the
XLA reference (the gradients through whichever backward `None` picks, reading
this forward's residuals), its refusals, configs and CUDA lowering on any
machine. The Mosaic GPU interpreter runs it in tests/test_interpret.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops.layer_norm import LayerNormArgs
from tokamax_gpu_mosaic import layer_norm as mln

_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))
gpu = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
H200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
_seed = iter(range(1_000_000))


def _normal(shape, dtype, scale=1.0, shift=0.0):
  rng = np.random.default_rng(next(_seed))
  return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype)


def _args(r, d, dtype=jnp.bfloat16, **kwargs):
  return LayerNormArgs(x=jax.ShapeDtypeStruct((r, d), dtype), **kwargs)


def test_registered_forward_only():
  """Forward only, so that `None` pairs this forward with any backward: a
  backward of its own that refused or declined a call would move a training
  step to another forward (notes/MEASUREMENTS.md, session 26, item 10)."""
  specs = {(s.op, s.name): s for s in tokamax.implementations()}
  assert not specs["layer_norm", "mosaic_gpu"].has_backward


def test_refusals():
  op = mln.MosaicGpuLayerNorm()
  op.check_supported(_args(4, 1024), H200)
  with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
    op.check_supported(_args(4, 1024), tokamax.DeviceInfo("cpu", "cpu"))
  for d in (1000, 1536, 2 * mln.MAX_BLOCK_ELEMENTS):
    with pytest.raises(NotImplementedError, match=f"multiple of 1024 .*got {d}"):
      op.check_supported(_args(4, d), H200)
  with pytest.raises(NotImplementedError, match="float64"):
    op.check_supported(_args(4, 1024, scale=jax.ShapeDtypeStruct((1024,), "float64")),
                       H200)
  with pytest.raises(NotImplementedError, match="2\\*\\*31"):
    op.check_supported(_args(2**18, 8192), H200)
  with pytest.raises(ValueError, match="power of 2"):
    op.forward(LayerNormArgs(x=jnp.zeros((6, 1024), jnp.bfloat16)),
               mln.LayerNormConfig(rows_per_block=3))
  with pytest.raises(ValueError, match="at most 16384 fit registers"):
    op.forward(LayerNormArgs(x=jnp.zeros((8, 4096), jnp.bfloat16)),
               mln.LayerNormConfig(rows_per_block=8))


def test_declines_only_the_measured_rms_loss():
  op = mln.MosaicGpuLayerNorm()
  assert "Triton" in op.declines(_args(4096, 8192, subtract_mean=False))
  for args in (_args(4096, 8192), _args(8192, 8192, subtract_mean=False),
               _args(4096, 4096, subtract_mean=False)):
    assert op.declines(args) is None


@pytest.mark.parametrize("r,d,rows", [(4096, 1024, 4), (4096, 2048, 4), (6, 1024, 2),
                                      (7, 1024, 1), (65536, 16384, 1)])
def test_heuristic_divides_the_rows_and_fits_registers(r, d, rows):
  config = mln.heuristic_config(_args(r, d))
  assert config.rows_per_block == rows
  assert config in mln.search_space(_args(r, d))
  assert all(r % c.rows_per_block == 0
             and c.rows_per_block * d <= mln.MAX_BLOCK_ELEMENTS
             for c in mln.search_space(_args(r, d)))


@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_lowers_for_cuda(subtract_mean, with_stats):
  args = LayerNormArgs(x=jax.ShapeDtypeStruct((4096, 3072), jnp.bfloat16),
                       scale=jax.ShapeDtypeStruct((3072,), jnp.float32),
                       offset=jax.ShapeDtypeStruct((3072,), jnp.bfloat16),
                       subtract_mean=subtract_mean)
  config = mln.LayerNormConfig(rows_per_block=4)

  def forward(x, scale, offset):
    a = LayerNormArgs(x=x, scale=scale, offset=offset, subtract_mean=subtract_mean)
    return mln.layer_norm_forward(a, config, with_stats=with_stats)

  exported = jax.export.export(jax.jit(forward), platforms=["cuda"])(
      args.x, args.scale, args.offset)
  assert "mosaic_gpu" in exported.mlir_module()
  shapes = [a.shape for a in exported.out_avals]
  assert shapes == [(4096, 3072)] + [(4096,)] * (2 if with_stats else 0)


def _check(r, d, dtype, subtract_mean, *, scale=True, offset=True, config=None,
           lead=None):
  """Forward and gradients (random cotangent) against the float32 XLA reference;
  the forward must be this kernel, the residuals its mean and rstd."""
  shape = lead + (r // int(np.prod(lead)), d) if lead else (r, d)
  # A shifted x with one outlier channel: two-pass statistics keep it exact.
  x = _normal(shape, dtype, 2.0, 0.5).at[..., 3].add(40.0)
  s = _normal((d,), jnp.float32) if scale else None
  o = _normal((d,), dtype) if offset else None
  impl = mln.MosaicGpuLayerNorm(config) if config else "mosaic_gpu"

  def call(implementation, x, s, o):
    return tokamax.layer_norm(x, s, o, subtract_mean=subtract_mean,
                              implementation=implementation)

  with tokamax.record_dispatch() as records:
    out, vjp = jax.vjp(jax.jit(lambda *a: call(impl, *a)), x, s, o)
    dy = _normal(out.shape, dtype)
    grads = vjp(dy)
  assert ("forward", "mosaic_gpu") in {(r.direction, r.implementation) for r in records}
  upcast = lambda a: None if a is None else a.astype(jnp.float32)
  ref, ref_vjp = jax.vjp(lambda *a: call("xla", *a), upcast(x), upcast(s), upcast(o))
  assert out.dtype == dtype
  testing.assert_close(out, ref, dtype, what="forward", gpu=True)
  for name, g, rg in zip(("x", "scale", "offset"), grads, ref_vjp(upcast(dy))):
    if rg is not None:
      testing.assert_close(g, rg, dtype, what=f"d{name}", scale=2.0, gpu=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("r,d", [(4096, 1024), (1031, 3072), (512, 7168), (96, 16384)])
def test_forward_and_gradients(r, d, dtype, subtract_mean):
  _check(r, d, dtype, subtract_mean)


@gpu
@pytest.mark.parametrize("rows_per_block", [1, 2, 4, 8])
def test_configs(rows_per_block):
  _check(520, 2048, jnp.bfloat16, True, config=mln.LayerNormConfig(rows_per_block))


@gpu
@pytest.mark.parametrize("scale,offset", [(False, False), (True, False), (False, True)])
def test_without_params_and_leading_dims(scale, offset):
  _check(2 * 3 * 40, 1024, jnp.bfloat16, True, scale=scale, offset=offset, lead=(2, 3))

