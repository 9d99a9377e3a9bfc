"""The GLU as the program a user writes: the projections by one matmul, the
activation in XLA, the projections kept for the backward.

- Dense calls: XLA's matmul with the fused ``[K, 2N]`` weight in x's dtype
  (`GatedLinearUnitArgs.forward_with_projections` and
  `backward_from_projections`): the plain-JAX program, as a candidate of
  `implementation=None`. Where no kernel of this op is installed (a core-only
  install), `None` would otherwise reach the XLA reference, whose float32
  projections make its autodiff backward run float32 matmuls (about 2x the
  plain program's time on an H200); where kernels are installed they come first
  (priority 100 and up), and tuned data ranks this one among them where it was
  measured.
- Grouped calls: one `tokamax.ragged_dot` with the fused ``[G, K, 2N]`` weight,
  whose own dispatch picks the platform's grouped-matmul kernel; otherwise
  `None` would reach the reference, which runs one masked matmul per group (G
  times the FLOPs).
- An activation with traced params (a learned parameter inside it): the
  activation runs in XLA here, so the params come with the epilogue's VJP; the
  kernels, which lower the activation themselves, refuse such calls.

The reference (priority 0) comes after it: it stays the oracle, autodiff of
float32 projections.
"""

from __future__ import annotations

import dataclasses

import jax

from tokamax._src.op import (HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, Op, VjpOp,
                             differentiated_again)
from tokamax._src.ops.gated_linear_unit.api import FEATURES
from tokamax._src.ops.ragged_dot import api as ragged_dot_api


def _fused_weight(args) -> jax.Array:
  g, k, _, n = args.weights.shape
  return args.weights.reshape(g, k, 2 * n)


def _projections(args) -> jax.Array:
  """``[M, 2, N]`` pre-activations in x's dtype, as the forward keeps them: one
  matmul (dense), or ``x @ w[g]`` per group by ragged_dot, 0 past the groups."""
  if args.group_sizes is None:
    return args.dense_projections()
  h = ragged_dot_api.ragged_dot(args.x, _fused_weight(args), args.group_sizes,
                                precision=args.precision)
  return h.reshape(args.x.shape[0], 2, args.weights.shape[3])


# Dense calls are plain JAX, which JAX differentiates again (`jax.hessian`,
# `jax.grad` of `jax.grad`); grouped ones call ragged_dot's `custom_vjp`, which
# has no forward-mode rule: they leave such calls to the reference.
_SUPPORTED = (*FEATURES, SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)


def _check_differentiated_again(args) -> None:
  if args.group_sizes is not None and differentiated_again(
      jax.tree_util.tree_leaves(args)):
    raise NotImplementedError(
        f"does not support {HIGHER_ORDER_AUTODIFF} for grouped calls (its rules call "
        "ragged_dot, whose own dispatch cannot see this differentiation)")


@dataclasses.dataclass(frozen=True)
class ComposedGatedLinearUnit(Op):
  """Forward: the projections by one matmul, the activation in XLA; a training
  forward keeps the projections for the backward."""

  op_name = "gated_linear_unit"
  name = "composed"
  supported_features = _SUPPORTED

  def check_supported(self, args, device):
    _check_differentiated_again(args)

  def forward(self, args, config):
    projections = _projections(args)
    m, _, n = projections.shape
    out = args.output_from_projections(projections.reshape(m, 2 * n))
    return out, ({"projections": projections} if self.residuals_wanted() else {})


@dataclasses.dataclass(frozen=True)
class ComposedGatedLinearUnitVjp(VjpOp):
  """Backward: dh from the projections (recomputed where the forward kept none),
  then ``dx`` and ``dw``: two matmuls in x's dtype (dense), or ragged_dot's
  backward (grouped, through `jax.vjp`, whose forward matmul, unused, XLA
  removes under jit; rows past the groups have projections 0 and a dh
  ragged_dot's backward never reads)."""

  op_name = "gated_linear_unit"
  name = "composed"
  supported_features = _SUPPORTED
  recomputes_without = frozenset({"projections"})

  def check_supported(self, args, device, residuals=None):
    _check_differentiated_again(args)

  def backward(self, args, residuals, out, dout, config):
    del out
    projections = residuals.get("projections")
    if projections is None:
      projections = _projections(args)
    if args.group_sizes is None:
      return args.backward_from_projections(projections, dout)
    dh, dparams = args.epilogue_gradients(projections, dout)
    _, ragged_vjp = jax.vjp(
        lambda x, w: ragged_dot_api.ragged_dot(x, w, args.group_sizes,
                                               precision=args.precision),
        args.x, _fused_weight(args))
    dx, dw = ragged_vjp(dh)
    grads = {"x": dx, "weights": dw.reshape(args.weights.shape)}
    if dparams is not None:
      grads["activation_params"] = dparams
    return grads
