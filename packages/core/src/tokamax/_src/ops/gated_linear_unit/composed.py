"""The grouped GLU as `tokamax.ragged_dot` (dispatched) around the activation.

Where no kernel of this op takes a grouped call (TPUs, GPUs before Hopper, CPUs),
`implementation=None` would otherwise reach the XLA reference, which runs one
masked matmul per group: G times the FLOPs. This implementation runs the
projections as one `tokamax.ragged_dot` with the fused ``[G, K, 2N]`` weight,
whose own dispatch picks the platform's grouped-matmul kernel, and the
activation in XLA: the program an MoE layer would write with two ragged_dots.
A kernel implementation with groups (priority 100 and up) comes first; the
reference (priority 0) after.
"""

from __future__ import annotations

import dataclasses

import jax

from tokamax._src.op import Op, VjpOp
from tokamax._src.ops.ragged_dot import api as ragged_dot_api


def _check_grouped(args) -> None:
  if args.group_sizes is None:
    raise NotImplementedError(
        "the composed implementation takes grouped calls only (group_sizes); a "
        "dense GLU runs as one fused kernel or XLA's matmul")


def _fused_weight(args) -> jax.Array:
  g, k, _, n = args.weights.shape
  return args.weights.reshape(g, k, 2 * n)


def _projections(args) -> jax.Array:
  """``h = x @ w[g]`` per group, ``[M, 2N]`` (gate columns, then up) in x's dtype,
  0 past the groups."""
  return ragged_dot_api.ragged_dot(args.x, _fused_weight(args), args.group_sizes,
                                   precision=args.precision)


@dataclasses.dataclass(frozen=True)
class ComposedGatedLinearUnit(Op):
  """Forward: the projections by ragged_dot, the activation in XLA; a training
  forward keeps the projections for the backward."""

  op_name = "gated_linear_unit"
  name = "composed"
  supported_features = ("group_sizes",)

  def check_supported(self, args, device):
    del device  # ragged_dot's dispatch picks what runs on it
    _check_grouped(args)

  def forward(self, args, config):
    h = _projections(args)
    out = args.output_from_projections(h)
    if not self.residuals_wanted():
      return out, {}
    m, n = args.x.shape[0], args.weights.shape[3]
    return out, {"projections": h.reshape(m, 2, n)}


@dataclasses.dataclass(frozen=True)
class ComposedGatedLinearUnitVjp(VjpOp):
  """Backward: dh from the projections (recomputed where the forward kept none),
  then ``dx`` and ``dw`` by ragged_dot's backward (through `jax.vjp`, whose
  forward matmul, unused, XLA removes under jit). Rows past the groups have
  projections 0 and a dh ragged_dot's backward never reads."""

  op_name = "gated_linear_unit"
  name = "composed"
  supported_features = ("group_sizes",)

  def check_supported(self, args, device, residuals=None):
    del device, residuals
    _check_grouped(args)

  def backward(self, args, residuals, out, dout, config):
    del out
    projections = residuals.get("projections")
    if projections is None:
      m, n = args.x.shape[0], args.weights.shape[3]
      projections = _projections(args).reshape(m, 2, n)
    dh = args.projection_gradient(projections, dout)
    _, ragged_vjp = jax.vjp(
        lambda x, w: ragged_dot_api.ragged_dot(x, w, args.group_sizes,
                                               precision=args.precision),
        args.x, _fused_weight(args))
    dx, dw = ragged_vjp(dh)
    return {"x": dx, "weights": dw.reshape(args.weights.shape)}
