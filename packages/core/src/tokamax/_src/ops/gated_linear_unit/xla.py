"""gated_linear_unit's XLA implementation as an `Op` (the reference; tokamax-xla-reference
holds the function)."""

from __future__ import annotations

import dataclasses

import tokamax_xla_reference as xla_ref

from tokamax._src.op import Op, VjpOp
from tokamax._src.ops import _autodiff


def _glu(args):
  return xla_ref.gated_linear_unit(args.x, args.weights, activation=args.activation,
                                  precision=args.precision)


@dataclasses.dataclass(frozen=True)
class XlaGatedLinearUnit(Op):
  op_name = "gated_linear_unit"
  name = "xla"

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

  def backward(self, args, residuals, out, dout, config):
    return _autodiff.backward(_glu, args, ("x", "weights"), dout)
