"""layer_norm's XLA implementation as an `Op` (the reference; tokamax-xla-reference
holds the function)."""

from __future__ import annotations

import dataclasses

import tokamax_xla_reference as xla_ref

from tokamax._src.op import HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, Op, VjpOp
from tokamax._src.ops import _autodiff


def _layer_norm(args):
  return xla_ref.layer_norm(args.x, args.scale, args.offset, epsilon=args.epsilon,
                           subtract_mean=args.subtract_mean)


@dataclasses.dataclass(frozen=True)
class XlaLayerNorm(Op):
  op_name = "layer_norm"
  name = "xla"
  supported_features = (SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def forward(self, args, config):
    y, mean, rstd = _layer_norm(args)
    return y, {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class XlaLayerNormVjp(VjpOp):
  op_name = "layer_norm"
  name = "xla"
  supported_features = (SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def backward(self, args, residuals, out, dout, config):
    return _autodiff.backward(lambda a: _layer_norm(a)[0], args,
                              ("x", "scale", "offset"), dout)
