"""ragged_dot's XLA implementation as an `Op` (the reference; tokamax-xla-reference
holds the function)."""

from __future__ import annotations

import dataclasses

import tokamax_xla_reference as xla_ref

from tokamax._src.op import HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, Op, VjpOp
from tokamax._src.ops import _autodiff


def _ragged_dot(args):
  return xla_ref.ragged_dot(args.lhs, args.rhs, args.group_sizes,
                           group_offset=args.group_offset,
                           preferred_element_type=args.preferred_element_type,
                           precision=args.precision, lhs_scales=args.lhs_scales,
                           rhs_scales=args.rhs_scales)


@dataclasses.dataclass(frozen=True)
class XlaRaggedDot(Op):
  op_name = "ragged_dot"
  name = "xla"
  supported_features = ("block_scales", SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def forward(self, args, config):
    return _ragged_dot(args), {}


@dataclasses.dataclass(frozen=True)
class XlaRaggedDotVjp(VjpOp):
  op_name = "ragged_dot"
  name = "xla"
  supported_features = ("block_scales", SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def backward(self, args, residuals, out, dout, config):
    return _autodiff.backward(_ragged_dot, args, ("lhs", "rhs"), dout)
