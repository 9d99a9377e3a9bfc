"""Tests of the Pallas Triton gated linear unit.

Native kernels when a GPU is present, Pallas interpret mode on the CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax import testing
import tokamax_xla_reference
from tokamax._src import op as op_lib
from tokamax._src.ops.gated_linear_unit import GatedLinearUnitArgs
from tokamax_gpu_triton import gated_linear_unit as glu


def _forward(op, args):
  """`op`'s forward with the config dispatch would resolve for it."""
  return op.forward(args, dispatch.resolve_config(op, args))


def _backward(op, args, residuals, out, dout):
  """`op`'s backward with the config dispatch would resolve for it."""
  return op.backward(args, residuals, out, dout, dispatch.resolve_config(op, args))

_HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
_INTERPRET = jax.default_backend() == "cpu"
gpu_only = pytest.mark.skipif(not _HAS_GPU, reason="needs a GPU")
@jax.custom_vjp
def _custom_vjp_silu(g):
  return g * jax.nn.sigmoid(g)


def _custom_vjp_silu_fwd(g):
  return _custom_vjp_silu(g), g


def _custom_vjp_silu_bwd(g, ct):
  s = jax.nn.sigmoid(g)
  return (ct * s * (1.0 + g * (1.0 - s)),)


_custom_vjp_silu.defvjp(_custom_vjp_silu_fwd, _custom_vjp_silu_bwd)
# A scalar JAX array the activation closes over: the kernel inlines it as a
# literal (`pallas_call` refuses captured arrays).
_CLOSED_SCALE = jnp.float32(1.7)

_ACTIVATIONS = {
    "none": None,
    "silu": jax.nn.silu,
    "gelu_tanh": jax.nn.gelu,
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "quick_gelu": lambda g: g * jax.nn.sigmoid(1.702 * g),
    "leaky_relu": lambda g: jnp.where(g > 0, g, 0.1 * g),
    "custom_vjp": _custom_vjp_silu,
    "scalar_closure": lambda g: jnp.tanh(g) * _CLOSED_SCALE,
    # The same inside `jax.jit`, whose jaxpr holds the constant.
    "jit_scalar_closure": jax.jit(lambda g: jnp.tanh(g) * _CLOSED_SCALE),
}
_seed = iter(range(10_000))


def _key():
  return jax.random.key(next(_seed))


def _assert_close(name, got, want, dtype):
  testing.assert_close(got, want, dtype, what=name, gpu=not _INTERPRET)


def _inputs(m, k, n, dtype):
  ks = jax.random.split(_key(), 3)
  x = jax.random.normal(ks[0], (m, k)).astype(dtype)
  w = (jax.random.normal(ks[1], (k, 2, n)) * (2.0 / np.sqrt(k))).astype(dtype)
  dout = jax.random.normal(ks[2], (m, n)).astype(dtype)
  return x, w, dout


def _reference(x, w, dout, activation):
  """Output and gradients on float32 upcasts at HIGHEST precision."""
  f = functools.partial(tokamax_xla_reference.gated_linear_unit,
                        activation=activation, precision=jax.lax.Precision.HIGHEST)
  y, vjp = jax.vjp(f, x.astype(jnp.float32), w.astype(jnp.float32))
  return y, vjp(dout.astype(jnp.float32))


def _check(x, w, dout, activation, implementation="triton",
           interpret=_INTERPRET):
  dtype = x.dtype.type
  f = functools.partial(tokamax.gated_linear_unit, activation=activation,
                        implementation=implementation)
  with tokamax.interpret(interpret), tokamax.record_dispatch() as records:
    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(dout)
  y_ref, (dx_ref, dw_ref) = _reference(x, w, dout, activation)
  assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
  _assert_close("out", y, y_ref, dtype)
  _assert_close("dx", dx, dx_ref, dtype)
  _assert_close("dw", dw, dw_ref, dtype)
  return records


@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
def test_activations(activation):
  _check(*_inputs(37, 29, 23, jnp.float32), _ACTIVATIONS[activation])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_exact"])
def test_low_precision(dtype, activation):
  _check(*_inputs(33, 48, 40, dtype), _ACTIVATIONS[activation])


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 17, 5), (19, 3, 61), (97, 80, 7)])
def test_awkward_shapes(m, k, n):
  _check(*_inputs(m, k, n, jnp.float32), jax.nn.silu)


# Explicit configs: aligned (unmasked) tiles, several K steps, ragged M/N/K,
# group_m larger and smaller than the number of row blocks.
_CONFIGS = [
    ((64, 32, 32), glu.GatedLinearUnitConfig(32, 16, 16, 2, 4, 2)),
    ((50, 70, 45), glu.GatedLinearUnitConfig(16, 16, 16, 1, 4, 3)),
    ((40, 64, 100), glu.GatedLinearUnitConfig(16, 32, 32, 8, 4, 2)),
    # The interleaved-weights path: aligned, and ragged M / K / N (padded N).
    ((64, 32, 32), glu.GatedLinearUnitConfig(32, 16, 16, 2, 4, 2, True)),
    ((50, 70, 45), glu.GatedLinearUnitConfig(16, 16, 16, 1, 4, 3, True)),
    ((40, 64, 100), glu.GatedLinearUnitConfig(16, 32, 32, 8, 4, 2, True)),
]


@pytest.mark.parametrize("shape,config", _CONFIGS)
def test_explicit_configs(shape, config):
  x, w, dout = _inputs(*shape, jnp.float32)
  args = tokamax.GatedLinearUnitArgs(x, w, jax.nn.gelu, None)
  with tokamax.interpret(_INTERPRET):
    y, residuals = _forward(glu.TritonGatedLinearUnit(config=config), args)
    grads = _backward(glu.TritonGatedLinearUnitVjp(config=config), args, residuals, y, dout)
  assert residuals == {}
  y_ref, (dx_ref, dw_ref) = _reference(x, w, dout, jax.nn.gelu)
  _assert_close("out", y, y_ref, jnp.float32)
  _assert_close("dx", grads["x"], dx_ref, jnp.float32)
  _assert_close("dw", grads["weights"], dw_ref, jnp.float32)


@pytest.mark.smoke
def test_dispatch_runs_triton_both_directions_and_weight_pair():
  x, w, dout = _inputs(6, 3, 4, jnp.bfloat16)
  records = _check(x, w, dout, jax.nn.silu)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert got == {("gated_linear_unit", "forward", "triton"),
                 ("gated_linear_unit", "backward", "triton")}
  # Leading dims are flattened and a (w_gate, w_up) pair is stacked by core.
  with tokamax.interpret(_INTERPRET):
    y = tokamax.gated_linear_unit(x.reshape(2, 3, 3), (w[:, 0], w[:, 1]),
                                  activation=jax.nn.silu, implementation="triton")
  y_ref = _reference(x, w, dout, jax.nn.silu)[0]
  _assert_close("out", y.reshape(6, 4), y_ref, jnp.bfloat16)


def test_erf_replacement():
  x = jnp.linspace(-6.0, 6.0, 4001, dtype=jnp.float32)
  np.testing.assert_allclose(glu._erf(x), jax.lax.erf(x), atol=1e-6)


_NOT_ELEMENTWISE = {
    "softmax": jax.nn.softmax,
    "mean": lambda g: g - jnp.mean(g),
    "cumsum": lambda g: jnp.cumsum(g, axis=-1),
    "transpose": lambda g: g.T.T,
    "roll": lambda g: jnp.roll(g, 1, axis=0),
    "position": lambda g: g + jnp.arange(g.shape[-1], dtype=g.dtype),
}


@pytest.mark.parametrize("activation", list(_NOT_ELEMENTWISE))
def test_refuses_non_elementwise_activation(activation):
  act = _NOT_ELEMENTWISE[activation]
  x, w, _ = _inputs(4, 8, 8, jnp.float32)
  interp = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=True)
  args = tokamax.GatedLinearUnitArgs(x, w, act, None)
  with pytest.raises(NotImplementedError, match="elementwise"):
    glu.TritonGatedLinearUnit().check_supported(args, interp)
  with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
    y = tokamax.gated_linear_unit(x, w, activation=act)  # Falls back to XLA.
  assert records[0].implementation != "triton"
  with tokamax.interpret(_INTERPRET), pytest.raises(NotImplementedError):
    tokamax.gated_linear_unit(x, w, activation=act, implementation="triton")
  del y


def test_check_supported_refuses_device_and_empty():
  x, w, _ = _inputs(4, 8, 8, jnp.float32)
  cpu = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=False)
  with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
    glu.TritonGatedLinearUnit().check_supported(
        tokamax.GatedLinearUnitArgs(x, w), cpu)
  interp = dataclasses.replace(cpu, interpret=True)
  glu.TritonGatedLinearUnitVjp().check_supported(
      tokamax.GatedLinearUnitArgs(x, w), interp)
  with pytest.raises(NotImplementedError, match="empty"):
    glu.TritonGatedLinearUnit().check_supported(
        tokamax.GatedLinearUnitArgs(x[:0], w), interp)


def test_configs_are_sane():
  for (m, k, n), dtype in [((16384, 4096, 14336), jnp.bfloat16),
                           ((5, 3, 7), jnp.float32)]:
    args = tokamax.GatedLinearUnitArgs(jax.ShapeDtypeStruct((m, k), dtype),
                                       jax.ShapeDtypeStruct((k, 2, n), dtype))
    configs = glu.TritonGatedLinearUnit().search_space(args)
    assert configs[0] == glu.TritonGatedLinearUnit().heuristic_config(args)
    for c in configs:
      for v in (c.block_m, c.block_n, c.block_k, c.num_warps):
        assert v >= 16 or v == c.num_warps, c
        assert v & (v - 1) == 0, c
  big = tokamax.GatedLinearUnitArgs(
      jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16),
      jax.ShapeDtypeStruct((4096, 2, 14336), jnp.bfloat16))
  assert glu.TritonGatedLinearUnit().heuristic_config(big) == \
      glu.GatedLinearUnitConfig(128, 128, 64, 8, 8, 3, fuse_weights=True)


@pytest.mark.smoke
@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
def test_lowers_to_triton(activation, lower_for_cuda):
  """The kernels lower through Pallas' Triton path (no GPU needed to lower)."""
  act = _ACTIVATIONS[activation]
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 2, 384), jnp.bfloat16)
  dout = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)

  def fwd_bwd(x, w, dout):
    args = tokamax.GatedLinearUnitArgs(x, w, act, None)
    y, res = _forward(glu.TritonGatedLinearUnit(), args)
    return y, _backward(glu.TritonGatedLinearUnitVjp(), args, res, y, dout)

  assert "triton" in lower_for_cuda(fwd_bwd, x, w, dout)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("activation", ["none", "silu", "gelu_exact"])
def test_gpu_matches_reference(activation):
  for shape in [(1000, 512, 700), (256, 1024, 1024)]:
    _check(*_inputs(*shape, jnp.bfloat16), _ACTIVATIONS[activation],
           interpret=False)


@pytest.mark.gpu
@gpu_only
def test_gpu_search_space_configs():
  """Every config the tuner may pick compiles and is right (fused and not)."""
  x, w, dout = _inputs(320, 256, 640, jnp.bfloat16)
  args = tokamax.GatedLinearUnitArgs(x, w, jax.nn.silu, None)
  y_ref, (dx_ref, dw_ref) = _reference(x, w, dout, jax.nn.silu)
  for config in glu.TritonGatedLinearUnit().search_space(args):
    y, res = _forward(glu.TritonGatedLinearUnit(config=config), args)
    grads = _backward(glu.TritonGatedLinearUnitVjp(config=config), args, res, y, dout)
    _assert_close(f"out {config}", y, y_ref, jnp.bfloat16)
    _assert_close(f"dx {config}", grads["x"], dx_ref, jnp.bfloat16)
    _assert_close(f"dw {config}", grads["weights"], dw_ref, jnp.bfloat16)


def test_training_forward_keeps_projections_and_backward_skips_the_recompute():
  x, w, dout = _inputs(40, 24, 36, jnp.float32)
  loss = lambda x, w: jnp.sum(tokamax.gated_linear_unit(
      x, w, activation=jax.nn.silu, implementation="triton") * dout)
  with tokamax.interpret(_INTERPRET):
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
  # One kernel: the forward, which also writes the projections.
  assert jaxpr.count("pallas_call[") == 1, jaxpr.count("pallas_call[")
  records = _check(x, w, dout, jax.nn.silu)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "triton"), ("backward", "triton")}


@pytest.mark.parametrize("activation", ["silu", "none", "gelu_exact",
                                        "jit_scalar_closure"])
def test_backward_without_projections_recomputes_them(activation):
  # The recompute kernel: what a forward that kept no projections gets.
  activation = _ACTIVATIONS[activation]
  x, w, dout = _inputs(37, 24, 20, jnp.float32)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=activation)
  vjp = glu.TritonGatedLinearUnitVjp()
  with tokamax.interpret(_INTERPRET):
    grads = vjp.backward(args, {}, None, dout, vjp.heuristic_config(args))
  _, (dx_ref, dw_ref) = _reference(x, w, dout, activation)
  _assert_close("dx", grads["x"], dx_ref, jnp.float32)
  _assert_close("dw", grads["weights"], dw_ref, jnp.float32)


@pytest.mark.parametrize("shape,config", _CONFIGS)
def test_explicit_configs_in_a_training_forward(shape, config):
  # The forward that writes the projections, at every tiling above (interleaved
  # weights included), and the backward that reads them.
  x, w, dout = _inputs(*shape, jnp.float32)
  args = tokamax.GatedLinearUnitArgs(x, w, jax.nn.gelu, None)
  with tokamax.interpret(_INTERPRET), op_lib.forward_for_backward():
    y, residuals = _forward(glu.TritonGatedLinearUnit(config=config), args)
  with tokamax.interpret(_INTERPRET):
    grads = _backward(glu.TritonGatedLinearUnitVjp(config=config), args, residuals, y, dout)
  projections = jnp.einsum("mk,kpn->mpn", x, w, precision=jax.lax.Precision.HIGHEST)
  y_ref, (dx_ref, dw_ref) = _reference(x, w, dout, jax.nn.gelu)
  _assert_close("projections", residuals["projections"], projections, jnp.float32)
  _assert_close("out", y, y_ref, jnp.float32)
  _assert_close("dx", grads["x"], dx_ref, jnp.float32)
  _assert_close("dw", grads["weights"], dw_ref, jnp.float32)


@pytest.mark.skipif(not hasattr(jax.lax, "polynomial_p"),
                    reason="lax.polynomial is new in JAX 0.12")
def test_polynomial_replacement_matches_lax():
  """The in-kernel stand-in for `lax.polynomial` (0.12's exact GELU derivative
  uses it): coefficients lowest degree first, as lax defines them."""
  x = jnp.linspace(-3.0, 3.0, 37, dtype=jnp.float32)
  coeffs = (1.0, -0.5, 0.25, 2.0)
  want = jax.lax.polynomial(x, coeffs)
  got = glu._REPLACEMENTS[jax.lax.polynomial_p](x, *coeffs)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got, 1.0 - 0.5 * x + 0.25 * x**2 + 2.0 * x**3, rtol=1e-5)
