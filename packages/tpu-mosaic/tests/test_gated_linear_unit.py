"""Tests of the Mosaic TPU gated linear unit in TPU interpret mode (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax import testing
import tokamax_xla_reference as xla_ref
from tokamax_tpu_mosaic import gated_linear_unit as glu


def _forward(op, args):
  """`op`'s forward with the config dispatch would resolve for it."""
  return op.forward(args, dispatch.resolve_config(op, args))


def _backward(op, args, residuals, out, dout):
  """`op`'s backward with the config dispatch would resolve for it."""
  return op.backward(args, residuals, out, dout, dispatch.resolve_config(op, args))

HIGHEST = jax.lax.Precision.HIGHEST
_INTERPRET = jax.default_backend() != "tpu"
_SMALL = glu.GatedLinearUnitConfig(block_m=16, block_n=128, block_k=128)
_seed = iter(range(10_000))


def _key():
  return jax.random.key(next(_seed))


def _check(m, k, n, activation, dtype, config=_SMALL):
  """Forward and gradients (random cotangent) vs the XLA reference, one jit."""
  k1, k2, k3 = jax.random.split(_key(), 3)
  x = jax.random.normal(k1, (m, k)).astype(dtype)
  w = (jax.random.normal(k2, (k, 2, n)) / k ** 0.5).astype(dtype)
  cot = jax.random.normal(k3, (m, n))
  impl = glu.MosaicTpuGatedLinearUnit(config) if config else "mosaic_tpu"

  def run(fn, x, w):
    out, vjp = jax.vjp(fn, x, w)
    return (out, *vjp(cot.astype(out.dtype)))

  def ours(x, w):
    return tokamax.gated_linear_unit(x, w, activation=activation, implementation=impl)

  def reference(x, w):
    return xla_ref.gated_linear_unit(x, w, activation=activation, precision=HIGHEST)

  with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
    got = jax.jit(lambda x, w: run(ours, x, w))(x, w)
  want = run(reference, x.astype(jnp.float32), w.astype(jnp.float32))
  assert got[0].dtype == x.dtype and got[1].dtype == x.dtype and got[2].dtype == w.dtype
  for name, g, e in zip(("out", "dx", "dw"), got, want):
    testing.assert_close(g, e, dtype, what=name)
  return records


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu, None])
def test_activations_and_dtypes(activation, dtype):
  _check(37, 20, 24, activation, dtype)  # odd rows, N and K not lane multiples


@pytest.mark.parametrize("m,k,n", [
    (37, 300, 200),   # padded K (3 K steps), padded N (2 N tiles)
    (20, 256, 256),   # aligned, several K and N steps
    (1, 1, 1),
])
def test_awkward_shapes(m, k, n):
  _check(m, k, n, lambda g: jnp.tanh(g) * 2.0 + g, jnp.float32)


@pytest.mark.smoke
def test_dispatch_runs_mosaic_tpu_both_directions():
  records = _check(24, 64, 40, jax.nn.silu, jnp.bfloat16, config=None)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert got == {("gated_linear_unit", "forward", "mosaic_tpu"),
                 ("gated_linear_unit", "backward", "mosaic_tpu")}


def test_check_supported_refuses():
  x = jnp.ones((4, 8))
  w = jnp.ones((8, 2, 16))
  args = tokamax.GatedLinearUnitArgs(x, w, jax.nn.silu)
  interp = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=True)
  cpu = dataclasses.replace(interp, interpret=False)
  for op in (glu.MosaicTpuGatedLinearUnit(), glu.MosaicTpuGatedLinearUnitVjp()):
    op.check_supported(args, interp)
    with pytest.raises(NotImplementedError, match="TPU"):
      op.check_supported(args, cpu)
    for activation in (jax.nn.softmax, lambda g: g - jnp.mean(g),
                       lambda g: jnp.sum(g, axis=-1)):
      with pytest.raises(NotImplementedError, match="elementwise"):
        op.check_supported(dataclasses.replace(args, activation=activation), interp)
    with pytest.raises(NotImplementedError, match="float16"):
      op.check_supported(dataclasses.replace(
          args, x=x.astype(jnp.float16), weights=w.astype(jnp.float16)), interp)
    with pytest.raises(NotImplementedError, match="empty"):
      op.check_supported(dataclasses.replace(args, x=x[:0]), interp)
  # Refusal also holds under jit (the check runs at trace time).
  with tokamax.interpret(True), pytest.raises(NotImplementedError, match="elementwise"):
    jax.jit(lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=jax.nn.softmax, implementation="mosaic_tpu"))(x, w)


_CLOSED_SCALE = jnp.float32(1.7)  # a JAX array an activation below closes over


@pytest.mark.parametrize("activation,reason", [
    (lambda g: jnp.tanh(g) * _CLOSED_SCALE, "closes over arrays"),
    (jax.jit(lambda g: jnp.tanh(g) * _CLOSED_SCALE), "closes over arrays"),
    (lambda g: g > 0, "float result"),
    (lambda g: (g > 0).astype(jnp.int32), "float result"),
])
def test_refuses_what_the_kernel_body_cannot_take(activation, reason):
  """A closed-over array (`pallas_call` refuses captured arrays, scalars too,
  and the Mosaic TPU lowering a jaxpr with constants) and a non-float activation
  (float0 derivative) are refused; `None` then gives a right answer."""
  k1, k2 = jax.random.split(_key())
  x = jax.random.normal(k1, (16, 128))
  w = jax.random.normal(k2, (128, 2, 128)) / 128 ** 0.5
  args = tokamax.GatedLinearUnitArgs(x, w, activation)
  interp = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=True)
  for op in (glu.MosaicTpuGatedLinearUnit(), glu.MosaicTpuGatedLinearUnitVjp()):
    with pytest.raises(NotImplementedError, match=reason):
      op.check_supported(args, interp)
  with tokamax.interpret(True), tokamax.record_dispatch() as records:
    got = tokamax.gated_linear_unit(x, w, activation=activation)
  assert all(r.implementation != "mosaic_tpu" for r in records)
  want = xla_ref.gated_linear_unit(x, w, activation=activation, precision=HIGHEST)
  testing.assert_close(got, want, jnp.float32, what="out")


def test_configs():
  args = tokamax.GatedLinearUnitArgs(
      jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
      jax.ShapeDtypeStruct((4096, 2, 14336), jnp.bfloat16), jax.nn.silu)
  config = glu.MosaicTpuGatedLinearUnit().heuristic_config(args)
  assert config in glu.MosaicTpuGatedLinearUnit().search_space(args)
  with pytest.raises(ValueError):
    glu.GatedLinearUnitConfig(block_n=100)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_tpu(dtype):
  """Forward and backward lower through Pallas' Mosaic TPU path (no TPU needed)."""
  for m, k, n in [(2048, 1024, 2048), (37, 300, 200)]:
    s = jax.ShapeDtypeStruct

    def fwd_bwd(x, w, dout):
      args = tokamax.GatedLinearUnitArgs(x, w, jax.nn.silu)
      out, _ = _forward(glu.MosaicTpuGatedLinearUnit(), args)
      return out, _backward(glu.MosaicTpuGatedLinearUnitVjp(), args, {}, out, dout)

    with tokamax.interpret(False):
      text = jax.jit(fwd_bwd).trace(
          s((m, k), dtype), s((k, 2, n), dtype), s((m, n), dtype)).lower(
              lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 2
