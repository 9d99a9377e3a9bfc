"""`tokamax.layer_norm` / `tokamax.rms_norm`: signature, validation, canonical args."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src.op import OpDefinition
from tokamax._src.ops import _checks
from tokamax._src.ops.layer_norm.sharding import layer_norm_plan

OP_NAME = "layer_norm"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerNormArgs:
  """Canonical arguments every layer_norm implementation receives.

  - x: ``[R, D]``, rows to normalize independently (core moves the normalized axis
    last and flattens the others).
  - scale, offset: None or ``[D]``, float.
  - epsilon: added to the variance (or mean square) before the square root.
  - subtract_mean: True for LayerNorm, False for RMSNorm.

  ``y = (x - mean) * rsqrt(var + eps) * scale + offset`` with statistics in
  float32 (mean is 0 for RMSNorm and var is then the mean square); y has x's dtype.

  Residuals: ``{"mean": float32 [R], "rstd": float32 [R]}`` or ``{}``.
  """

  x: jax.Array
  scale: jax.Array | None = None
  offset: jax.Array | None = None
  epsilon: float = dataclasses.field(default=1e-6, metadata=dict(static=True))
  subtract_mean: bool = dataclasses.field(default=True, metadata=dict(static=True))


DIFF_FIELDS = ("x", "scale", "offset")

# Everything generic code (dispatch, sharding) knows of this op. The labels name
# each dim of the operands and results for the Shardy sharding rule (operands
# sharing a letter propagate shardings to each other); the leading label is the
# dim that may be several (merged into one before implementations see it).
DEFINITION = OpDefinition(
    name=OP_NAME,
    diff_fields=DIFF_FIELDS,
    arg_labels=dict(x="rd", scale="d", offset="d"),
    result_labels=dict(out="rd", mean="r", rstd="r"),
    leading_label="r",
    plan=layer_norm_plan,
)


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    *,
    axis: int = -1,
    epsilon: float = 1e-6,
    subtract_mean: bool = True,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Layer normalization (or RMS normalization with ``subtract_mean=False``).

  Args:
    x: input of any rank >= 1, float.
    scale: None or ``[x.shape[axis]]``, multiplies the normalized x.
    offset: None or ``[x.shape[axis]]``, added after scaling.
    axis: the axis to normalize over.
    epsilon: added to the variance before the reciprocal square root.
    subtract_mean: False gives RMSNorm (no centering).
    implementation: None, a name, a sequence of names or a `tokamax.Op`.

  Returns:
    The normalized x, same shape and dtype. Statistics are computed in float32.

  Example:
    >>> y = tokamax.layer_norm(x, scale, offset)            # LayerNorm
    >>> y = tokamax.layer_norm(x, scale, None, subtract_mean=False)  # RMSNorm
  """
  x = _checks.as_array("x", x)
  _checks.check_float("x", x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1; got {_checks.describe(x)}")
  allowed = f"an int in [{-x.ndim}, {x.ndim}) for x of {_checks.describe(x)}"
  axis = _checks.static_int("axis", axis, allowed)
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis must be {allowed}; got {axis!r}")
  axis = axis % x.ndim
  d = x.shape[axis]
  params = {}
  for name, p in (("scale", scale), ("offset", offset)):
    if p is not None:
      p = _checks.as_array(name, p)
      _checks.check_float(name, p)
      if tuple(p.shape) != (d,):
        raise ValueError(f"{name} must have shape ({d},) (x.shape[axis]); got "
                         f"{_checks.describe(p)}")
    params[name] = p
  epsilon = _checks.static_float("epsilon", epsilon, "a finite float >= 0")
  if epsilon < 0:
    raise ValueError(f"epsilon must be a finite float >= 0; got {epsilon!r}")
  subtract_mean = _checks.static_bool("subtract_mean", subtract_mean)

  moved = jnp.moveaxis(x, axis, -1)
  # The row dims stay separate here: dispatch merges them into R (after
  # partitioning, so that a sharded non-leading row dim stays split).
  args = LayerNormArgs(
      x=moved, scale=params["scale"], offset=params["offset"],
      epsilon=float(epsilon), subtract_mean=bool(subtract_mean))
  y = dispatch.call(DEFINITION, args, implementation, lead_dims=moved.ndim - 1)
  return jnp.moveaxis(y, -1, axis)


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None,
    *,
    axis: int = -1,
    epsilon: float = 1e-6,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """RMS normalization: `layer_norm` with ``subtract_mean=False`` and no offset."""
  try:
    return layer_norm(x, scale, None, axis=axis, epsilon=epsilon, subtract_mean=False,
                      implementation=implementation)
  except (ValueError, NotImplementedError) as e:
    # Dispatch's messages name the op it runs; say which call that was (a note:
    # the exception itself, its type and message, stays as raised).
    if OP_NAME in str(e):
      e.add_note(f"in rms_norm (run as {OP_NAME} with subtract_mean=False)")
    raise
