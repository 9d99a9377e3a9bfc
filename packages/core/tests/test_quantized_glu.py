"""gated_linear_unit on quantized operands: no GLU kernel applies block scales, so
they are dequantized at the API (the "dequantize, then run" fallback), with
straight-through gradients to a `tokamax.QuantizedArray`'s source."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing

_RNG = np.random.default_rng(5)


def _operands():
  x = jnp.asarray(_RNG.standard_normal((48, 256)), jnp.float32)
  w = jnp.asarray(_RNG.standard_normal((256, 2, 128)) / 16, jnp.float32)
  return x, w


def _glu(x, w):
  return tokamax.gated_linear_unit(x, w, activation=jax.nn.silu)


def test_quantized_weights_are_the_arrays_they_stand_for():
  x, w = _operands()
  wq = tokamax.quantize(w, (128, 1, 128))
  xq = tokamax.quantize(x, (1, 128))
  want = _glu(xq.dequantize(), wq.dequantize())
  np.testing.assert_array_equal(_glu(xq, wq), want)
  # The pair form, each matrix quantized on its own.
  gate, up = (tokamax.quantize(w[:, i], (128, 128)) for i in (0, 1))
  pair_want = _glu(x, jnp.stack([gate.dequantize(), up.dequantize()], axis=1))
  np.testing.assert_array_equal(_glu(x, (gate, up)), pair_want)


def test_gradients_go_straight_through_to_the_sources():
  x, w = _operands()
  dy = jnp.asarray(_RNG.standard_normal((48, 128)), jnp.float32)
  loss = lambda x, w: jnp.sum(_glu(x, w) * dy)
  quantize = lambda x, w: (tokamax.quantize(x, (1, 128)),
                           tokamax.quantize(w, (128, 1, 128)))
  dx, dw = jax.jit(jax.grad(lambda x, w: loss(*quantize(x, w)), argnums=(0, 1)))(x, w)
  xq, wq = quantize(x, w)
  want_dx, want_dw = jax.grad(loss, argnums=(0, 1))(xq.dequantize(), wq.dequantize())
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(dw).max()) > 0
  # Without a source (frozen quantized weights) no gradient reaches w.
  frozen = jax.grad(lambda w: loss(x, tokamax.quantize(w, (128, 1, 128),
                                                       keep_source=False)))(w)
  assert not np.asarray(frozen).any()


def test_with_qwix():
  qwix = pytest.importorskip("qwix")
  x, w = _operands()
  wq = qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=[1],
                     tiled_axes={0: 128, 2: 128})
  np.testing.assert_array_equal(_glu(x, wq), _glu(x, qwix.dequantize(wq)))


def test_errors_name_the_operand():
  x, w = _operands()
  wq = tokamax.quantize(w, (128, 1, 128))
  with pytest.raises(ValueError, match=r"weights: scales must have the values' rank"):
    _glu(x, tokamax.QuantizedArray(wq.values, jnp.ones((2, 2))))


@pytest.mark.parametrize("pair,op_names,act_qtype", [
    (False, ("gated_linear_unit",), None), (True, ("gated_linear_unit",), None),
    (False, (), jnp.int8),  # (): a rule for every op, rows quantized too
    (False, ("gated_linear_unit",), jnp.int4)])  # rows of a scheme no kernel takes
def test_qwix_ptq_quantizes_the_weights(pair, op_names, act_qtype):
  """`qwix.quantize_model` with a PTQ rule for ``gated_linear_unit`` (int8
  weights, per column with 128-deep K tiles; rows unquantized, or int8 per
  row and 128 of K, or int4, which no kernel takes): the weights become Qwix's
  quantized params, and the output is the GLU of the operands they stand for
  (float64), each quantized once (with a rule for every op, Qwix intercepts
  nothing inside the op); the gradient goes straight through quantized rows."""
  qwix = pytest.importorskip("qwix")
  nnx = pytest.importorskip("flax.nnx")
  x, w = _operands()

  class Mlp(nnx.Module):
    def __init__(self):
      if pair:
        self.w_gate, self.w_up = nnx.Param(w[:, 0]), nnx.Param(w[:, 1])
      else:
        self.w = nnx.Param(w)

    def __call__(self, x):
      weights = (self.w_gate[...], self.w_up[...]) if pair else self.w[...]
      return _glu(x, weights)

  rule = qwix.QuantizationRule(op_names=op_names, weight_qtype=jnp.int8,
                               act_qtype=act_qtype, tile_size=128)
  model = qwix.quantize_model(Mlp(), qwix.PtqProvider([rule]), x)
  state = jax.tree.map(lambda a: (a.shape, a.dtype.name),
                       nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  names = ("w_gate", "w_up") if pair else ("w",)
  shapes = ((256, 128),) * 2 if pair else ((256, 2, 128),)
  for name, shape in zip(names, shapes):
    scales = (2,) + shape[1:]  # 128-deep K tiles, each column its own
    assert state[name] == {"array": {"qvalue": (shape, "int8"),
                                     "scale": (scales, "float32")}}, state
  quantized = [qwix.dequantize(getattr(model, n).value.array) for n in names]
  w64 = np.asarray(jnp.stack(quantized, axis=1) if pair else quantized[0], np.float64)
  rows = x if act_qtype is None else qwix.dequantize(
      qwix.quantize(x, act_qtype, channelwise_axes=[0], tiled_axes={1: 128}))
  x64 = np.asarray(rows, np.float64)
  gate, up = x64 @ w64[:, 0], x64 @ w64[:, 1]
  want = gate / (1 + np.exp(-gate)) * up
  assert not np.allclose(w64, np.asarray(w, np.float64))  # int8 rounds the weights
  testing.assert_close(model(x), want, jnp.float32, what="PTQ GLU")
  if act_qtype is not None:
    # Straight through the quantized rows: the gradient at the rows they
    # stand for, with the quantized weights.
    dy = jnp.asarray(_RNG.standard_normal(want.shape), jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(model(x) * dy))(x)
    w_q = jnp.asarray(w64, jnp.float32)
    want_dx = jax.grad(lambda r: jnp.sum(_glu(r, w_q) * dy))(rows)
    testing.assert_close(dx, want_dx, jnp.float32, what="PTQ GLU dx")


def test_qwix_ptq_refuses_weights_it_cannot_trace_to_a_param():
  """Two weights of one shape, both cast before the call: Qwix cannot tell which
  param each is, and a weight-only rule would leave them unquantized; it
  raises, naming what to do."""
  qwix = pytest.importorskip("qwix")
  nnx = pytest.importorskip("flax.nnx")
  x, w = _operands()

  class Mlp(nnx.Module):
    def __init__(self):
      self.w_gate, self.w_up = (nnx.Param(w[:, i].astype(jnp.bfloat16)) for i in (0, 1))

    def __call__(self, x):
      return _glu(x, (self.w_gate[...].astype(x.dtype), self.w_up[...].astype(x.dtype)))

  rule = qwix.QuantizationRule(op_names=("gated_linear_unit",), weight_qtype=jnp.int8)
  with pytest.raises(NotImplementedError, match=r"no param Qwix can trace back"):
    qwix.quantize_model(Mlp(), qwix.PtqProvider([rule]), x)
