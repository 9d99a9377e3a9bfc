"""The GLU's optional `projections` residual: dispatch asks a forward for it only in
a training step, and `backward_from_projections` (the backward of the kernels that
keep it) matches JAX autodiff of the reference, which it shares no code with."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
import tokamax_xla_reference
from tokamax import testing
from tokamax._src.ops.gated_linear_unit import xla as glu_xla
from tokamax._src.ops.gated_linear_unit import GatedLinearUnitArgs

HIGHEST = jax.lax.Precision.HIGHEST

# float32 checks against a definition: a GPU's default float32 matmul is TF32.
pytestmark = pytest.mark.usefixtures("highest_matmul_precision")


def _inputs(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  return x, w, dy


def _reference_grads(x, w, dy, activation):
  """JAX autodiff of the reference on float32 upcasts at HIGHEST."""
  up = lambda a: a.astype(jnp.float32)
  _, vjp = jax.vjp(lambda x, w: tokamax_xla_reference.gated_linear_unit(
      x, w, activation=activation, precision=HIGHEST), up(x), up(w))
  return vjp(up(dy))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("activation", [jax.nn.silu, None, jax.nn.gelu, jnp.tanh])
@pytest.mark.parametrize("shape", [(37, 40, 24), (1, 8, 3), (130, 64, 257)])
def test_backward_from_projections_matches_autodiff_of_the_reference(
    dtype, activation, shape):
  x, w, dy = _inputs(*shape, dtype, seed=sum(shape))
  projections = jnp.einsum("mk,kpn->mpn", x, w, preferred_element_type=jnp.float32,
                           precision=HIGHEST).astype(x.dtype)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=activation)
  grads = jax.jit(args.backward_from_projections)(projections, dy)
  rx, rw = _reference_grads(x, w, dy, activation)
  assert grads["x"].dtype == x.dtype and grads["weights"].dtype == w.dtype
  testing.assert_close(grads["x"], rx, dtype, what="dx", scale=2)
  testing.assert_close(grads["weights"], rw, dtype, what="dw", scale=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", [jax.nn.silu, None])
@pytest.mark.parametrize("shape", [(37, 40, 24), (1, 8, 3), (130, 64, 257)])
def test_forward_with_projections_matches_the_reference(dtype, activation, shape):
  x, w, _ = _inputs(*shape, dtype, seed=sum(shape) + 1)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=activation, precision=HIGHEST)
  out, residuals = jax.jit(GatedLinearUnitArgs.forward_with_projections)(args)
  up = lambda a: a.astype(jnp.float32)
  ref_h = jnp.einsum("mk,kpn->mpn", up(x), up(w), precision=HIGHEST)
  ref = tokamax_xla_reference.gated_linear_unit(up(x), up(w), activation=activation,
                                                precision=HIGHEST)
  assert out.dtype == x.dtype and residuals["projections"].dtype == x.dtype
  assert residuals["projections"].shape == (shape[0], 2, shape[2])
  testing.assert_close(residuals["projections"], ref_h, dtype, what="projections")
  testing.assert_close(out, ref, dtype, what="forward")


@dataclasses.dataclass(frozen=True)
class _KeepsProjectionsVjp(glu_xla.XlaGatedLinearUnitVjp):
  name = "keeps_projections"

  def check_supported(self, args, device, residuals=None):
    if residuals is not None and "projections" not in residuals:
      raise NotImplementedError("needs the projections residual")

  def backward(self, args, residuals, out, dout, config):
    return args.backward_from_projections(residuals["projections"], dout)


@dataclasses.dataclass(frozen=True)
class _KeepsProjections(glu_xla.XlaGatedLinearUnit):
  """A forward that keeps the projections when a backward will read them, as the
  kernels do; it logs what it was asked."""

  name = "keeps_projections"
  vjp = _KeepsProjectionsVjp
  asked: list = dataclasses.field(default_factory=list, compare=False, hash=False)

  def forward(self, args, config):
    wanted = self.residuals_wanted()
    self.asked.append(wanted)
    out = tokamax_xla_reference.gated_linear_unit(
        args.x, args.weights, activation=args.activation, precision=args.precision)
    if not wanted:
      return out, {}
    return out, {"projections": jnp.einsum("mk,kpn->mpn", args.x, args.weights)}


def _loss(op, x, w, dy):
  y = tokamax.gated_linear_unit(x, w, activation=jax.nn.silu, implementation=op)
  return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))


@pytest.mark.usefixtures("highest_matmul_precision")
@pytest.mark.parametrize("transform", ["grad", "jit_grad", "grad_jit", "checkpoint"])
def test_a_training_forward_is_asked_for_residuals(transform):
  x, w, dy = _inputs(12, 8, 6, jnp.float32, seed=1)
  op = _KeepsProjections()
  loss = lambda x, w: _loss(op, x, w, dy)
  grad = {"grad": jax.grad(loss, argnums=(0, 1)),
          "jit_grad": jax.jit(jax.grad(loss, argnums=(0, 1))),
          "grad_jit": jax.grad(jax.jit(loss), argnums=(0, 1)),
          "checkpoint": jax.grad(jax.checkpoint(loss), argnums=(0, 1))}[transform]
  with tokamax.record_dispatch() as records:
    dx, dw = grad(x, w)
  assert True in op.asked
  # One forward decision and one backward, whichever way the step was traced.
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "keeps_projections"), ("backward", "keeps_projections")]
  rx, rw = _reference_grads(x, w, dy, jax.nn.silu)
  testing.assert_close(dx, rx, "float32", what="dx")
  testing.assert_close(dw, rw, "float32", what="dw")


def test_inference_keeps_no_projections():
  x, w, dy = _inputs(12, 8, 6, jnp.float32, seed=2)
  op = _KeepsProjections()
  jax.jit(lambda x, w: _loss(op, x, w, dy))(x, w)
  assert op.asked == [False]


@pytest.mark.usefixtures("highest_matmul_precision")
def test_projections_under_leading_dims_and_vmap():
  x, w, dy = _inputs(24, 16, 8, jnp.float32, seed=3)
  op = _KeepsProjections()
  g3 = jax.grad(lambda x: _loss(op, x, w, dy.reshape(2, 3, 4, 8)))(x.reshape(2, 3, 4, 16))
  gv = jax.vmap(jax.grad(lambda x, dy: _loss(op, x, w, dy)))(
      x.reshape(2, 12, 16), dy.reshape(2, 12, 8))
  rx, _ = _reference_grads(x, w, dy, jax.nn.silu)
  testing.assert_close(g3.reshape(24, 16), rx, "float32", what="dx [2, 3, 4]")
  testing.assert_close(gv.reshape(24, 16), rx, "float32", what="dx under vmap")


def _dot_operand_types(fn, *args) -> set[str]:
  """The element types of every dot_general operand in `fn`'s StableHLO."""
  text = jax.jit(fn).lower(*args).as_text()
  # `stablehlo.dot_general %a, %b, ... : (tensor<64x32xbf16>, tensor<...>) -> ...`
  operands = re.findall(r"stablehlo\.dot_general .*: \((.*)\) ->", text)
  assert operands, "no dot_general in the program"
  return {t for types in operands for t in re.findall(r"x([a-z]\w*)>", types)}


def test_the_composed_glu_trains_with_matmuls_in_the_inputs_dtype():
  """The composed implementation is the plain program: for bf16 operands every
  matmul of its forward and backward takes bf16, where autodiff of the reference's
  float32 projections multiplies float32 cotangents (about 2x the time on an
  H200)."""
  x, w, dy = _inputs(64, 32, 48, jnp.bfloat16, seed=4)
  grads = {op: jax.grad(lambda x, w, op=op: _loss(op, x, w, dy), argnums=(0, 1))
           for op in ("composed", "xla")}
  assert _dot_operand_types(grads["composed"], x, w) == {"bf16"}
  assert "f32" in _dot_operand_types(grads["xla"], x, w)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="kernels take it elsewhere")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_none_trains_a_dense_glu_on_a_cpu_as_the_plain_program(dtype):
  x, w, dy = _inputs(40, 24, 20, dtype, seed=5)
  with tokamax.record_dispatch() as records:
    dx, dw = jax.jit(jax.grad(lambda x, w: _loss(None, x, w, dy), argnums=(0, 1)))(x, w)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "composed"), ("backward", "composed")}
  rx, rw = _reference_grads(x, w, dy, jax.nn.silu)
  testing.assert_close(dx, rx, dtype, what="dx", scale=2)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2)
