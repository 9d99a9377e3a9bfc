"""`flax.linen`'s `RMSNorm` and `LayerNorm` computed by `tokamax.layer_norm`.

The same fields, parameter names (``scale``, ``bias``), shapes and initializers as
Flax's modules, so their variables load unchanged::

    norm = tokamax.flax.linen.RMSNorm(epsilon=1e-5)   # for nn.RMSNorm(epsilon=1e-5)
    y = norm.apply(flax_variables, x)

``implementation`` (a field) selects the op's implementation as `tokamax.layer_norm`
takes it (a sequence of names as a tuple). What the op does not do of Flax's
modules (normalizing other than the last axis, ``axis_name``, ``mask``) raises
`NotImplementedError`.
"""

from __future__ import annotations

from flax import linen
from flax.linen import dtypes
import jax

from tokamax._src import dispatch
from tokamax._src.ops.layer_norm import layer_norm
from tokamax.flax._norms import as_static
from tokamax.flax._norms import check_norm_supported


def _normalize(module, x, mask, *, subtract_mean: bool):
  """Flax's parameters, and its result dtype: the common dtype of x and the
  parameters unless ``dtype`` is set."""
  check_norm_supported(module, mask)
  features = (x.shape[-1],)
  params = [x]
  scale = offset = None
  if module.use_scale:
    scale = module.param("scale", module.scale_init, features, module.param_dtype)
    params.append(scale)
  if getattr(module, "use_bias", False):
    offset = module.param("bias", module.bias_init, features, module.param_dtype)
    params.append(offset)
  dtype = dtypes.canonicalize_dtype(*params, dtype=module.dtype)
  cast = lambda a: None if a is None else a.astype(dtype)
  return layer_norm(cast(x), cast(scale), cast(offset), epsilon=module.epsilon,
                    subtract_mean=subtract_mean,
                    implementation=as_static(module.implementation))


class RMSNorm(linen.RMSNorm):
  """`flax.linen.RMSNorm` through `tokamax.rms_norm`."""

  implementation: dispatch.Implementation = None

  @linen.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    return _normalize(self, x, mask, subtract_mean=False)


class LayerNorm(linen.LayerNorm):
  """`flax.linen.LayerNorm` through `tokamax.layer_norm`."""

  implementation: dispatch.Implementation = None

  @linen.compact
  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    return _normalize(self, x, mask, subtract_mean=True)
