"""Tests of the Mosaic TPU layer / RMS norm in TPU interpret mode (CPU).

Interpret mode fills uninitialized memory with NaN, so rows of a partial last
block that leak into the statistics or the dscale / doffset sums fail the
comparison.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax import testing
import tokamax_xla_reference
from tokamax_tpu_mosaic import layer_norm as ln


def _forward(op, args):
  """`op`'s forward with the config dispatch would resolve for it."""
  return op.forward(args, dispatch.resolve_config(op, args))


def _backward(op, args, residuals, out, dout):
  """`op`'s backward with the config dispatch would resolve for it."""
  return op.backward(args, residuals, out, dout, dispatch.resolve_config(op, args))

_seed = iter(range(10_000))
_INTERPRET = jax.default_backend() != "tpu"


def _key():
  return jax.random.key(next(_seed))


def _inputs(r, d, dtype, with_scale=True, with_offset=True):
  ks = jax.random.split(_key(), 4)
  x = (jax.random.normal(ks[0], (r, d)) * 1.5 + 0.7).astype(dtype)
  scale = (1.0 + 0.5 * jax.random.normal(ks[1], (d,))).astype(dtype) if with_scale \
      else None
  offset = jax.random.normal(ks[2], (d,)).astype(dtype) if with_offset else None
  dy = jax.random.normal(ks[3], (r, d)).astype(dtype)
  return x, scale, offset, dy


def _f32(a):
  return None if a is None else a.astype(jnp.float32)


def _check(x, scale, offset, dy, subtract_mean, config=None, eps=1e-6):
  """Forward and gradients vs the XLA reference on f32 upcasts; returns records."""
  dtype = x.dtype.type
  impl = ln.MosaicTpuLayerNorm(config) if config else "mosaic_tpu"

  def f(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean,
                              epsilon=eps, implementation=impl)

  with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
    y, vjp = jax.vjp(f, x, scale, offset)
    grads = vjp(dy)

  def ref(x, scale, offset):
    return tokamax_xla_reference.layer_norm(x, scale, offset, epsilon=eps,
                                            subtract_mean=subtract_mean)[0]

  y_ref, vjp_ref = jax.vjp(ref, _f32(x), _f32(scale), _f32(offset))
  grads_ref = vjp_ref(_f32(dy))
  assert y.dtype == x.dtype
  testing.assert_close(y, y_ref, dtype, what="y")
  for name, g, g_ref in zip(("dx", "dscale", "doffset"), grads, grads_ref):
    if g_ref is None:
      assert g is None
    else:
      testing.assert_close(g, g_ref, dtype, what=name)
  return records


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtypes_and_modes(dtype, subtract_mean):
  # 37 rows over 16-row blocks: a partial last block; D=96 is not a lane multiple.
  _check(*_inputs(37, 96, dtype), subtract_mean, config=ln.LayerNormConfig(16))


@pytest.mark.parametrize("r,d,with_scale,with_offset", [
    (1, 1, True, True), (5, 130, False, False), (17, 33, True, False),
    (33, 256, False, True)])
def test_awkward_shapes_and_optional_params(r, d, with_scale, with_offset):
  _check(*_inputs(r, d, jnp.float32, with_scale, with_offset), subtract_mean=True,
         config=ln.LayerNormConfig(16))


@pytest.mark.smoke
def test_dispatch_runs_mosaic_tpu_both_directions():
  records = _check(*_inputs(20, 128, jnp.bfloat16), subtract_mean=False)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert got == {("layer_norm", "forward", "mosaic_tpu"),
                 ("layer_norm", "backward", "mosaic_tpu")}


def test_residuals():
  x, scale, offset, _ = _inputs(19, 40, jnp.float32)
  args = tokamax.LayerNormArgs(x, scale, offset, 1e-5, True)
  with tokamax.interpret(_INTERPRET):
    y, res = _forward(ln.MosaicTpuLayerNorm(ln.LayerNormConfig(16)), args)
  _, mean, rstd = tokamax_xla_reference.layer_norm(x, scale, offset, epsilon=1e-5,
                                                   subtract_mean=True)
  testing.assert_close(res["mean"], mean, jnp.float32, what="mean")
  testing.assert_close(res["rstd"], rstd, jnp.float32, what="rstd")


def test_check_supported_refuses():
  x = jnp.ones((4, 8))
  cpu = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=False)
  interp = dataclasses.replace(cpu, interpret=True)
  tpu = tokamax.DeviceInfo(platform="tpu", device_kind="TPU v5e")
  for op in (ln.MosaicTpuLayerNorm(), ln.MosaicTpuLayerNormVjp()):
    op.check_supported(tokamax.LayerNormArgs(x), interp)
    op.check_supported(tokamax.LayerNormArgs(x), tpu)
    with pytest.raises(NotImplementedError, match="TPU"):
      op.check_supported(tokamax.LayerNormArgs(x), cpu)
    with pytest.raises(NotImplementedError, match="float16"):
      op.check_supported(tokamax.LayerNormArgs(x.astype(jnp.float16)), interp)
    with pytest.raises(NotImplementedError, match=r"x must be non-empty \[R, D\] rows"):
      op.check_supported(tokamax.LayerNormArgs(jnp.ones((0, 8))), interp)
    with pytest.raises(NotImplementedError, match="VMEM"):
      op.check_supported(
          tokamax.LayerNormArgs(jax.ShapeDtypeStruct((16, 40000), jnp.float32)), interp)
  if jax.default_backend() != "tpu":
    with tokamax.interpret(False), pytest.raises(NotImplementedError, match="TPU"):
      tokamax.layer_norm(x, None, None, implementation="mosaic_tpu")


def test_configs():
  for r, d in [(32768, 8192), (7, 3), (4096, 128)]:
    args = tokamax.LayerNormArgs(jax.ShapeDtypeStruct((r, d), jnp.bfloat16))
    config = ln.MosaicTpuLayerNorm().heuristic_config(args)
    assert config in ln.MosaicTpuLayerNorm().search_space(args)
    assert config.block_rows % 16 == 0
    assert config.block_rows * d * 4 <= 2 << 20


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_tpu(dtype):
  """Forward and backward lower through Pallas' Mosaic TPU path (no TPU needed)."""
  for r, d in [(1000, 8192), (37, 96)]:
    x = jax.ShapeDtypeStruct((r, d), dtype)
    p = jax.ShapeDtypeStruct((d,), dtype)

    def fwd_bwd(x, s, o, dy):
      args = tokamax.LayerNormArgs(x, s, o, 1e-6, True)
      y, res = _forward(ln.MosaicTpuLayerNorm(), args)
      return y, _backward(ln.MosaicTpuLayerNormVjp(), args, res, y, dy)

    with tokamax.interpret(False):
      text = jax.jit(fwd_bwd).trace(x, p, p, x).lower(
          lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
