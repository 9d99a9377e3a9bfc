"""gated_linear_unit's XLA implementation as an `Op` (the reference; tokamax-xla-reference
holds the function)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import tokamax_xla_reference as xla_ref

from tokamax._src.op import HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, Op, VjpOp
from tokamax._src.ops import _autodiff
from tokamax._src.ops.gated_linear_unit.api import DIFF_FIELDS, FEATURES


def _glu(args):
  if args.group_sizes is not None:
    return _grouped_glu(args)
  return xla_ref.gated_linear_unit(args.x, args.weights, activation=args.activation_fn(),
                                  precision=args.precision)


def _grouped_glu(args):
  """The grouped GLU: ragged_dot's reference with the fused ``[G, K, 2N]`` weight
  in float32, then the activation, as the dense reference computes it."""
  g, k, _, n = args.weights.shape
  h = xla_ref.ragged_dot(args.x, args.weights.reshape(g, k, 2 * n), args.group_sizes,
                         precision=args.precision, preferred_element_type=jnp.float32)
  gate, up = h[:, :n], h[:, n:]
  if args.activation is not None:
    gate = args.activation_fn()(gate)
  return (gate * up).astype(args.x.dtype)


@dataclasses.dataclass(frozen=True)
class XlaGatedLinearUnit(Op):
  op_name = "gated_linear_unit"
  name = "xla"
  # Autodiff covers the params too.
  supported_features = (*FEATURES, SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def forward(self, args, config):
    return _glu(args), {}


@dataclasses.dataclass(frozen=True)
class XlaGatedLinearUnitVjp(VjpOp):
  """The oracle's backward: JAX autodiff of the reference (it recomputes the
  projections, and ignores a kernel forward's `projections` residual), so that
  the kernels' backwards, which use that residual, are checked against code
  they do not share."""

  op_name = "gated_linear_unit"
  name = "xla"
  # Autodiff covers the params too.
  supported_features = (*FEATURES, SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def backward(self, args, residuals, out, dout, config):
    return _autodiff.backward(_glu, args, DIFF_FIELDS, dout)
