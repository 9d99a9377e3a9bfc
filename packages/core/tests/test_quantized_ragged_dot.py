"""Quantized operands of ragged_dot: `tokamax.quantize`, `QuantizedArray`, Qwix's
QArray / WithAux as they come, the XLA reference's numbers (checked against
numpy in float64 here), the refusal of implementations that do not apply block
scales, and the errors."""

import sys

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src import registry

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")

_RNG = np.random.default_rng(11)
_SIZES = jnp.asarray([40, 0, 50], jnp.int32)  # an empty group, and 6 rows past the end


def _operands():
  lhs = jnp.asarray(_RNG.standard_normal((96, 256)), jnp.bfloat16)
  rhs = jnp.asarray(_RNG.standard_normal((3, 256, 384)) / 16, jnp.bfloat16)
  return lhs, rhs


def _np_dequantize(q):
  values = np.asarray(q.array_values().astype(jnp.float32), np.float64)
  scales = np.asarray(q.scales, np.float64)
  for axis, t in enumerate(q.tile_shape):
    scales = np.repeat(scales, t, axis=axis)
  return values * scales


def _np_ragged_dot(lhs, rhs, sizes):
  """float64, one group at a time; rows past the groups stay 0."""
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    out[start:start + size] = lhs[start:start + size] @ rhs[g]
    start += size
  return out


@pytest.mark.parametrize("dtype,rel", [(jnp.float8_e4m3fn, 0.07), (jnp.float8_e5m2, 0.14),
                                       (jnp.int8, 0.01)])
def test_quantize_round_trips_within_the_value_type(dtype, rel):
  x = jnp.asarray(_RNG.standard_normal((4, 256, 384)), jnp.bfloat16)
  q = tokamax.quantize(x, (1, 128, 128), dtype)
  assert q.values.dtype == dtype and q.scales.shape == (4, 2, 3) and q.dtype == jnp.bfloat16
  assert q.tile_shape == (1, 128, 128)
  got, want = _np_dequantize(q), np.asarray(x, np.float64)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < rel
  # Each tile's largest magnitude lands on the value type's largest (absmax).
  largest = float(jnp.finfo(dtype).max if dtype != jnp.int8 else 127)
  np.testing.assert_allclose(np.abs(np.asarray(q.values.astype(jnp.float32))).max(), largest)


@pytest.mark.parametrize("minor_axis", [1, -2])
def test_minor_axis_stores_that_axis_last(minor_axis):
  """``minor_axis=1`` stores [G, K, N] weights as [G, N, K] values; the array
  they stand for, its tiles and scales are those of the plain quantization."""
  _, rhs = _operands()
  plain = tokamax.quantize(rhs, (1, 128, 128))
  k_major = tokamax.quantize(rhs, (1, 128, 128), minor_axis=minor_axis)
  assert k_major.values.shape == (3, 384, 256)
  assert k_major.shape == plain.shape == (3, 256, 384)
  assert k_major.tile_shape == (1, 128, 128)
  np.testing.assert_array_equal(np.asarray(k_major.values, np.float32),
                                np.asarray(plain.values, np.float32).transpose(0, 2, 1))
  np.testing.assert_array_equal(k_major.scales, plain.scales)
  np.testing.assert_array_equal(k_major.dequantize(), plain.dequantize())


def test_k_major_weights_give_the_same_result_and_gradient():
  lhs, rhs = _operands()
  lq = tokamax.quantize(lhs, (1, 128))
  plain = tokamax.quantize(rhs, (1, 128, 128))
  k_major = tokamax.quantize(rhs, (1, 128, 128), minor_axis=1)
  f = jax.jit(lambda a, b: tokamax.ragged_dot(a, b, _SIZES))
  np.testing.assert_array_equal(f(lq, k_major), f(lq, plain))
  want = _np_ragged_dot(_np_dequantize(lq), _np_dequantize(plain), _SIZES)
  testing.assert_close(f(lq, k_major), want, jnp.bfloat16)
  dy = jnp.asarray(_RNG.standard_normal((96, 384)), jnp.bfloat16)
  grad = lambda b: jax.grad(lambda x: jnp.sum(
      (tokamax.ragged_dot(x, b, _SIZES) * dy).astype(jnp.float32)))(lhs)
  np.testing.assert_array_equal(grad(k_major), grad(plain))


def _straight_through(x, w, dy):
  """float64 gradients of ``sum(ragged_dot(x, w) * dy)`` with respect to x and w
  (the arrays quantized operands stand for: straight-through)."""
  dy = np.asarray(dy, np.float64)
  dx = _np_ragged_dot(dy, w.transpose(0, 2, 1), _SIZES)
  dw = np.zeros_like(w)
  start = 0
  for g, size in enumerate(np.asarray(_SIZES)):
    dw[g] = x[start:start + size].T @ dy[start:start + size]
    start += size
  return dx, dw


@pytest.mark.parametrize("dy_scale", [1.0, 1e-3])
def test_gradients_reach_the_sources_straight_through(dy_scale):
  """Quantized inside the differentiated function (fp8 training): the gradients
  with respect to x and w are those with respect to the arrays the quantized
  operands stand for. Through the float8 values they would be rounded to
  float8, and vanish at small magnitudes."""
  lhs, rhs = _operands()
  x, w = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  dy = jnp.asarray(_RNG.standard_normal((96, 384)) * dy_scale, jnp.float32)

  def loss(x, w):
    xq = tokamax.quantize(x, (1, 128))
    wq = tokamax.quantize(w, (1, 128, 128), minor_axis=1)
    out = tokamax.ragged_dot(xq, wq, _SIZES, preferred_element_type=jnp.float32)
    return jnp.sum(out * dy)

  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  want_dx, want_dw = _straight_through(
      _np_dequantize(tokamax.quantize(x, (1, 128))),
      _np_dequantize(tokamax.quantize(w, (1, 128, 128))), dy)
  testing.assert_close(dx, want_dx, jnp.float32, what="dx")
  testing.assert_close(dw, want_dw, jnp.float32, what="dw")


@pytest.mark.parametrize("minor_axis", [None, 1])
def test_quantized_lhs_gradient_is_the_product_of_the_quantized_operands(minor_axis):
  """Opt-in fp8 backward: dx is the product of the cotangent quantized 1x128 and
  the weights' own quantized values (transposed), both dequantized, in float64;
  dw stays straight-through; rows past the groups get 0."""
  lhs, rhs = _operands()
  x, w = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  dy = jnp.asarray(_RNG.standard_normal((96, 384)), jnp.float32)
  spec = tokamax.GradientQuantization((1, 128))

  def loss(x, w, spec):
    wq = tokamax.quantize(w, (1, 128, 128), minor_axis=minor_axis)
    out = tokamax.ragged_dot(tokamax.quantize(x, (1, 128)), wq, _SIZES,
                             preferred_element_type=jnp.float32,
                             quantized_lhs_gradient=spec)
    return jnp.sum(out * dy)

  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, spec)
  w_deq = _np_dequantize(tokamax.quantize(w, (1, 128, 128)))
  dy_deq = _np_dequantize(tokamax.quantize(dy, (1, 128)))
  want_dx = _np_ragged_dot(dy_deq, w_deq.transpose(0, 2, 1), _SIZES)
  # On a GPU the fp8 kernel computes dx: Hopper's float8 wgmma accumulates with
  # fewer mantissa bits than float32 within each 128-deep scale block (measured
  # 1.3e-4 relative L2 on the H200), hence the GPU float32 tolerance there.
  testing.assert_close(dx, want_dx, jnp.float32, what="dx",
                       gpu=jax.default_backend() == "gpu")
  _, want_dw = _straight_through(_np_dequantize(tokamax.quantize(x, (1, 128))),
                                 w_deq, dy)
  testing.assert_close(dw, want_dw, jnp.float32, what="dw")
  assert not np.asarray(dx[90:]).any()
  # It is another gradient than the straight-through one: the cotangent was
  # rounded to float8 (e4m3: about 2-3% in relative L2 here).
  straight, _ = _straight_through(x, w_deq, dy)
  rel = np.linalg.norm(np.asarray(dx) - straight) / np.linalg.norm(straight)
  assert 0.005 < rel < 0.1, rel


def test_quantized_lhs_gradient_with_bfloat16_weights_and_a_float32_output():
  """The cotangent (float32 here) and the weights (bfloat16) stand for different
  dtypes; dx comes back in x's dtype."""
  lhs, rhs = _operands()
  dy = jnp.asarray(_RNG.standard_normal((96, 384)), jnp.float32)
  loss = lambda x: jnp.sum(tokamax.ragged_dot(
      tokamax.quantize(x, (1, 128)), tokamax.quantize(rhs, (1, 128, 128)), _SIZES,
      preferred_element_type=jnp.float32,
      quantized_lhs_gradient=tokamax.GradientQuantization()) * dy)
  dx = jax.grad(loss)(lhs)
  want = _np_ragged_dot(_np_dequantize(tokamax.quantize(dy, (1, 128))),
                        _np_dequantize(tokamax.quantize(rhs, (1, 128, 128)))
                        .transpose(0, 2, 1), _SIZES)
  assert dx.dtype == jnp.bfloat16
  testing.assert_close(dx, want, jnp.bfloat16, what="dx")


def test_quantized_lhs_gradient_errors_name_the_argument():
  lhs, rhs = _operands()
  wq = tokamax.quantize(rhs, (1, 128, 128))
  with pytest.raises(ValueError, match="quantized_lhs_gradient needs a quantized rhs"):
    tokamax.ragged_dot(lhs, rhs, _SIZES,
                       quantized_lhs_gradient=tokamax.GradientQuantization())
  with pytest.raises(TypeError, match="quantized_lhs_gradient must be None or a"):
    tokamax.ragged_dot(lhs, wq, _SIZES, quantized_lhs_gradient=(1, 128))
  with pytest.raises(ValueError, match=r"quantized_lhs_gradient.tile_shape must be two "
                                       r"ints dividing the cotangent's shape \(96, 384\)"):
    tokamax.ragged_dot(lhs, wq, _SIZES,
                       quantized_lhs_gradient=tokamax.GradientQuantization((1, 256)))
  with pytest.raises(TypeError, match="quantized_lhs_gradient.dtype must be"):
    tokamax.ragged_dot(lhs, wq, _SIZES, quantized_lhs_gradient=tokamax.GradientQuantization(
        dtype=jnp.bfloat16))


def test_operands_without_a_source_get_no_gradient():
  """Frozen quantized weights (stored without their source) and a quantized
  operand's own values and scales take zero cotangents, never float8-rounded
  ones; a plain operand beside them takes its gradient."""
  lhs, rhs = _operands()
  x = lhs.astype(jnp.float32)
  wq = tokamax.quantize(rhs.astype(jnp.float32), (1, 128, 128), keep_source=False)
  assert wq.source is None and tokamax.quantize(rhs, (1, 128, 128)).without_source().source is None
  dy = jnp.asarray(_RNG.standard_normal((96, 384)), jnp.float32)
  f = lambda x, wq: jnp.sum(tokamax.ragged_dot(
      x, wq, _SIZES, preferred_element_type=jnp.float32) * dy)
  dx, dwq = jax.grad(f, argnums=(0, 1))(x, wq)
  want_dx, _ = _straight_through(np.asarray(x, np.float64), _np_dequantize(wq), dy)
  testing.assert_close(dx, want_dx, jnp.float32, what="dx")
  assert not np.asarray(dwq.values, np.float32).any()
  assert not np.asarray(dwq.scales).any()
  xq = tokamax.quantize(x, (1, 128), keep_source=False)
  dx_frozen = jax.grad(lambda x: jnp.sum(tokamax.ragged_dot(
      tokamax.quantize(x, (1, 128), keep_source=False), wq, _SIZES,
      preferred_element_type=jnp.float32) * dy))(x)
  assert xq.source is None and not np.asarray(dx_frozen).any()


def _declared_features(implementation: str) -> tuple[str, ...]:
  entry = next(e for e in registry.entries("ragged_dot") if e.name == implementation)
  return registry.forward_class(entry).supported_features


@pytest.mark.parametrize("quantized", ["both", "rhs", "lhs"])
def test_matches_float64_on_the_dequantized_operands(quantized):
  lhs, rhs = _operands()
  lq, rq = tokamax.quantize(lhs, (1, 128)), tokamax.quantize(rhs, (1, 128, 128))
  a = lq if quantized in ("both", "lhs") else lhs
  b = rq if quantized in ("both", "rhs") else rhs
  with tokamax.record_dispatch() as records:
    out = jax.jit(lambda a, b: tokamax.ragged_dot(a, b, _SIZES))(a, b)
  assert out.dtype == jnp.bfloat16 and out.shape == (96, 384)
  # Only an implementation that applies block scales runs (the reference, or
  # mosaic_gpu's fp8 kernel on Hopper).
  assert "block_scales" in _declared_features(records[0].implementation)
  as_f64 = lambda x: _np_dequantize(x) if isinstance(x, tokamax.QuantizedArray) else (
      np.asarray(x, np.float64))
  want = _np_ragged_dot(as_f64(a), as_f64(b), _SIZES)
  testing.assert_close(out, want, jnp.bfloat16)
  assert not np.asarray(out[90:]).any()  # rows past the groups


def test_float32_output_and_gradient_of_a_plain_lhs():
  lhs, rhs = _operands()
  rq = tokamax.quantize(rhs, (1, 128, 128))
  out = tokamax.ragged_dot(lhs, rq, _SIZES, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  dy = jnp.asarray(_RNG.standard_normal((96, 384)), jnp.float32)
  grad = jax.grad(lambda x: jnp.sum(tokamax.ragged_dot(
      x, rq, _SIZES, preferred_element_type=jnp.float32) * dy))(lhs)
  # d lhs = dy @ rhs^T per group, rhs being what rq stands for.
  rhs64 = _np_dequantize(rq)
  want = np.zeros((96, 256))
  for g, (start, size) in enumerate(((0, 40), (40, 0), (40, 50))):
    want[start:start + size] = np.asarray(dy, np.float64)[start:start + size] @ rhs64[g].T
  testing.assert_close(grad, want, jnp.bfloat16)


def test_kernels_without_block_scales_are_passed_over_with_the_reason():
  lhs, rhs = _operands()
  rq = tokamax.quantize(rhs, (1, 128, 128))
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    tokamax.ragged_dot(lhs, rq, _SIZES)
  assert records[0].implementation == "xla"
  reasons = dict(records[0].rejected)
  # Those that do not declare the feature are refused for it (one that declares
  # it, mosaic_gpu's fp8 kernel, is refused off Hopper for its own reason).
  undeclared = {name: r for name, r in reasons.items()
                if "block_scales" not in _declared_features(name)}
  assert undeclared and all("block_scales" in r for r in undeclared.values()), reasons
  with tokamax.interpret(), pytest.raises(NotImplementedError, match="block_scales"):
    tokamax.ragged_dot(lhs, rq, _SIZES, implementation="triton")


class _QArrayLike:
  """What Qwix's QArray carries (the attributes tokamax reads)."""

  def __init__(self, qvalue, scale, zero_point=None, qtype=None):
    self.qvalue, self.scale, self.zero_point, self.qtype = qvalue, scale, zero_point, qtype


class _WithAuxLike:
  def __init__(self, array):
    self.array, self.how = array, None


def test_qwix_style_operands_are_taken_as_they_come():
  lhs, rhs = _operands()
  rq = tokamax.quantize(rhs, (1, 128, 128))
  # Qwix keeps scales in the dtype the array stands for (here bfloat16).
  scale = rq.scales.astype(jnp.bfloat16)
  ours = tokamax.ragged_dot(lhs, tokamax.QuantizedArray(
      rq.values, scale.astype(jnp.float32), jnp.bfloat16), _SIZES)
  qarray = _QArrayLike(rq.values, scale, qtype=jnp.float8_e4m3fn)
  np.testing.assert_array_equal(tokamax.ragged_dot(lhs, qarray, _SIZES), ours)
  np.testing.assert_array_equal(tokamax.ragged_dot(lhs, _WithAuxLike(qarray), _SIZES), ours)


def test_a_zero_point_scheme_is_dequantized_first():
  lhs, _ = _operands()
  values = jnp.asarray(_RNG.integers(-100, 100, (3, 256, 384)), jnp.int8)
  scale = jnp.asarray(_RNG.uniform(0.001, 0.01, (3, 2, 384)), jnp.float32)
  zero = jnp.asarray(_RNG.integers(-5, 5, (3, 2, 384)), jnp.float32)
  out = tokamax.ragged_dot(lhs.astype(jnp.float32), _QArrayLike(values, scale, zero),
                           _SIZES)
  rhs64 = (np.asarray(values, np.float64) - np.repeat(np.asarray(zero), 128, 1)) * (
      np.repeat(np.asarray(scale, np.float64), 128, 1))
  want = _np_ragged_dot(np.asarray(lhs, np.float64), rhs64, _SIZES)
  testing.assert_close(out, want, jnp.float32, scale=4)


def test_with_qwix():
  qwix = pytest.importorskip("qwix")
  ptq = pytest.importorskip("qwix._src.providers.ptq")
  lhs, rhs = _operands()
  q = qwix.quantize(rhs, jnp.float8_e4m3fn, channelwise_axes=[0], tiled_axes={1: 128, 2: 128})
  want = tokamax.ragged_dot(lhs, tokamax.QuantizedArray(
      q.qvalue, q.scale.astype(jnp.float32), jnp.bfloat16), _SIZES)
  for operand in (q, ptq.WithAux(q, None)):
    np.testing.assert_array_equal(tokamax.ragged_dot(lhs, operand, _SIZES), want)
  # int4 has no kernel: Qwix's own dequantization, then the plain call.
  q4 = qwix.quantize(rhs, jnp.int4, channelwise_axes=[0, 2], tiled_axes={1: 128})
  np.testing.assert_array_equal(tokamax.ragged_dot(lhs, q4, _SIZES),
                                tokamax.ragged_dot(lhs, qwix.dequantize(q4), _SIZES))
  # nf4 (a 4-bit code JAX has no dtype for): decoded by Qwix, then the plain call.
  qnf4 = qwix.quantize(rhs, "nf4", channelwise_axes=[0, 2], tiled_axes={1: 128})
  want = tokamax.ragged_dot(lhs, qwix.dequantize(qnf4), _SIZES)
  np.testing.assert_array_equal(tokamax.ragged_dot(lhs, qnf4, _SIZES), want)
  assert float(jnp.abs(want).max()) > 0


def test_a_logical_qtype_without_qwix_is_refused(monkeypatch):
  lhs, _ = _operands()
  codes = jnp.zeros((3, 256, 384), jnp.uint4)
  nf4 = _QArrayLike(codes, jnp.ones((3, 2, 384), jnp.float32), qtype="nf4")
  monkeypatch.delitem(sys.modules, "qwix", raising=False)  # as if not imported
  with pytest.raises(NotImplementedError, match="rhs: quantized values of logical "
                     "type 'nf4' are decoded by Qwix"):
    tokamax.ragged_dot(lhs, nf4, _SIZES)


def test_export_serializes_quantized_operands():
  """`jax.export` of a function taking a quantized operand round-trips through
  serialization and gives the same result (K-major weights: `minor_axis`)."""
  lhs, rhs = _operands()
  lq = tokamax.quantize(lhs, (1, 128), keep_source=False)
  fn = jax.jit(lambda a, b: tokamax.ragged_dot(a, b, _SIZES))
  for a, b in ((lhs, tokamax.quantize(rhs, (1, 128, 128), keep_source=False)),
               (lq, tokamax.quantize(rhs, (1, 128, 128), minor_axis=1, keep_source=False))):
    restored = export.deserialize(export.export(fn)(a, b).serialize())
    np.testing.assert_array_equal(restored.call(a, b), fn(a, b))


def test_errors_name_the_argument():
  lhs, rhs = _operands()
  rq = tokamax.quantize(rhs, (1, 128, 128))
  with pytest.raises(TypeError, match="rhs: quantized values must be float8_e4m3fn"):
    tokamax.ragged_dot(lhs, tokamax.QuantizedArray(rhs, rq.scales), _SIZES)
  with pytest.raises(ValueError, match=r"rhs: scales must have the values' rank.*\(3, 3, 3\)"):
    tokamax.ragged_dot(lhs, tokamax.QuantizedArray(rq.values, jnp.ones((3, 3, 3))), _SIZES)
  with pytest.raises(TypeError, match="lhs, rhs must stand for the same dtype.*float32"):
    tokamax.ragged_dot(lhs, tokamax.QuantizedArray(rq.values, rq.scales, jnp.float32), _SIZES)
  # The dtype a quantized operand stands for is named as its own (a bad one was
  # reported as preferred_element_type, which the call did not pass).
  lq = tokamax.quantize(lhs, (1, 128))
  with pytest.raises(TypeError, match=r"lhs: a quantized operand must stand for "
                     r"float32, bfloat16 or float16 \(its `dtype`\); got int8"):
    tokamax.ragged_dot(tokamax.QuantizedArray(lq.values, lq.scales, jnp.int8), rq, _SIZES)
  with pytest.raises(ValueError, match=r"tile_shape must .* \(1, 100\)"):
    tokamax.quantize(lhs, (1, 100))
  with pytest.raises(TypeError, match="dtype must be float8_e4m3fn"):
    tokamax.quantize(lhs, (1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"minor_axis must be None or an axis of the "
                     r"2-d array \(an int in \[-2, 2\)\); got 2"):
    tokamax.quantize(lhs, (1, 128), minor_axis=2)
  with pytest.raises(ValueError, match=r"rhs: minor_axis must .* 3-d array .*; got 3"):
    tokamax.ragged_dot(lhs, tokamax.QuantizedArray(rq.values, rq.scales, minor_axis=3),
                       _SIZES)
  # quantize's own arguments: each refused by name (they gave attribute, iteration
  # or comparison errors, or an int32 "quantized" array that failed later).
  for args, kw, error, says in [
      (([[1.0, 2.0]], (1, 2)), {}, TypeError, "x must be an array, got list"),
      ((lhs.astype(jnp.int32), (1, 128)), {}, TypeError, "x must have dtype float32"),
      ((lhs, None), {}, ValueError, r"tile_shape must be a tuple of 2 ints.*got None"),
      ((lhs, (1.0, 128)), {}, ValueError, r"tile_shape must be .*got \(1.0, 128\)"),
      ((lhs, (True, True)), {}, ValueError, r"tile_shape must be .*got \(True, True\)"),
      ((lhs, (1, 128)), dict(dtype="nope"), TypeError, "dtype must be .* got 'nope'"),
      ((lhs, (1, 128)), dict(keep_source=0), TypeError, "keep_source must be a bool"),
  ]:
    with pytest.raises(error, match=says):
      tokamax.quantize(*args, **kw)
  assert tokamax.quantize(lhs, (1, 128), minor_axis=np.int64(0)).minor_axis == 0


def test_quantized_in_the_same_program_computes_with_the_quantized_values():
  """XLA on a GPU drops a float32 -> float8 -> float32 round trip unless stopped;
  the reference must compute with the quantized values wherever they are made."""
  lhs, rhs = _operands()
  rq = tokamax.quantize(rhs, (1, 128, 128))
  inside = jax.jit(lambda x: tokamax.ragged_dot(tokamax.quantize(x, (1, 128)), rq, _SIZES,
                                                implementation="xla"))(lhs)
  outside = tokamax.ragged_dot(tokamax.quantize(lhs, (1, 128)), rq, _SIZES,
                               implementation="xla")
  testing.assert_close(inside, outside, jnp.float32, what="quantized inside jit")
  unquantized = tokamax.ragged_dot(lhs, rq, _SIZES, implementation="xla")
  assert float(jnp.linalg.norm((inside - unquantized).astype(jnp.float32))) > 0
