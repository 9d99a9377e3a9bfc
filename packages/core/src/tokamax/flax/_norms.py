"""`RMSNorm` and `LayerNorm`: Flax NNX's modules computed by `tokamax.layer_norm`."""

from __future__ import annotations

from flax import nnx

from tokamax._src import dispatch
from tokamax._src.ops.layer_norm import layer_norm


def check_norm_supported(module, mask) -> None:
  """What the tokamax op does not do of Flax's norms (NNX or Linen, which share
  these attribute names): refused, not ignored."""
  for name in ("reduction_axes", "feature_axes"):
    axes = getattr(module, name)
    if axes not in (-1, (-1,), [-1]):
      raise NotImplementedError(f"tokamax normalizes the last axis only; got {name}={axes!r}")
  if module.axis_name is not None:
    raise NotImplementedError(
        f"cross-device statistics (axis_name={module.axis_name!r}) are not supported: "
        "shard the rows instead, or use Flax's own module")
  if mask is not None:
    raise NotImplementedError("a mask over the normalized axis is not supported")


def _normalize(module, x, mask, *, subtract_mean: bool):
  check_norm_supported(module, mask)
  scale = module.scale[...] if module.scale else None
  offset = module.bias[...] if getattr(module, "bias", None) else None
  x, scale, offset = module.promote_dtype((x, scale, offset), dtype=module.dtype)
  return layer_norm(x, scale, offset, epsilon=module.epsilon, subtract_mean=subtract_mean,
                    implementation=module.implementation)


def as_static(implementation):
  """A sequence of names as a tuple (a module attribute that is not state)."""
  if isinstance(implementation, (list, tuple)):
    return tuple(implementation)
  return implementation


class RMSNorm(nnx.RMSNorm):
  """`flax.nnx.RMSNorm` through `tokamax.rms_norm` (``implementation=``: as the op
  takes it). Same arguments and parameters as Flax's module."""

  def __init__(self, *args, implementation: dispatch.Implementation = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.implementation = as_static(implementation)

  def __call__(self, x, mask=None):
    return _normalize(self, x, mask, subtract_mean=False)


class LayerNorm(nnx.LayerNorm):
  """`flax.nnx.LayerNorm` through `tokamax.layer_norm` (``implementation=``: as the
  op takes it). Same arguments and parameters as Flax's module."""

  def __init__(self, *args, implementation: dispatch.Implementation = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.implementation = as_static(implementation)

  def __call__(self, x, mask=None):
    return _normalize(self, x, mask, subtract_mean=True)
