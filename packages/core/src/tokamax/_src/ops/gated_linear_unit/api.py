"""`tokamax.gated_linear_unit`: signature, validation and canonical arguments."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src import quantization
from tokamax._src import qwix_ptq
from tokamax._src import sharding
from tokamax._src import vma
from tokamax._src.op import OpDefinition
from tokamax._src.ops import _checks
from tokamax._src.ops.gated_linear_unit.closure import hoist_traced_closure
from tokamax._src.ops.gated_linear_unit.sharding import gated_linear_unit_plan

OP_NAME = "gated_linear_unit"
# The opt-in features (`GatedLinearUnitArgs.opt_in_features`).
FEATURES = ("group_sizes", "activation_params")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedLinearUnitArgs:
  """Canonical arguments every gated_linear_unit implementation receives.

  - x: ``[M, K]`` (leading dims flattened).
  - weights: ``[K, 2, N]`` (``[G, K, 2, N]`` with group_sizes); ``weights[:, 0]``
    (``weights[:, :, 0]``) is the gate projection, ``weights[:, 1]`` the up
    projection. Same dtype as x.
  - activation: None (identity, bilinear GLU) or a JAX callable applied
    elementwise to the gate projection, in float32. With activation_params, the
    user's activation without the traced values it closed over (which this
    static field must not hold): a `closure.ActivationWithParams`, called as
    ``activation(gate, activation_params)``. `activation_fn` gives the callable
    of the gate alone in either case.
  - precision: for the matmuls.
  - group_sizes: None, or int32 ``[G]`` (grouped, as an MoE layer's experts):
    weights is then ``[G, K, 2, N]`` and x's rows are grouped consecutively as
    ragged_dot's lhs (group g owns rows ``[sum(group_sizes[:g]),
    sum(group_sizes[:g+1]))`` and multiplies ``weights[g]``); rows past
    ``sum(group_sizes)`` give 0. An opt-in feature ("group_sizes"): only
    implementations that declare it see such calls.
  - activation_params: None, or a 1-D float array: the traced real values the
    user's activation closes over (a learned parameter, a value of an enclosing
    `jax.jit` or `jax.grad`), hoisted out of it by `closure.hoist_traced_closure`
    and differentiated like x and the weights. An opt-in feature
    ("activation_params"): a kernel that lowers the activation itself cannot
    take a value known only at run time, nor return its gradient.

  ``out = activation(x @ w_gate) * (x @ w_up)``, accumulated in float32, in x's
  dtype. Residuals: ``{}``, or, optionally, ``{"projections": [M, 2, N]}``: the
  pre-activations ``x @ weights`` in x's dtype, which a forward returns only when
  `Op.residuals_wanted()` (a backward then needs no projection matmul: see
  `backward_from_projections`); without them a backward recomputes them.
  """

  x: jax.Array
  weights: jax.Array
  activation: Callable[[jax.Array], jax.Array] | None = dataclasses.field(
      default=None, metadata=dict(static=True))
  precision: Any = dataclasses.field(default=None, metadata=dict(static=True))
  group_sizes: jax.Array | None = None
  activation_params: jax.Array | None = None

  OPT_IN_MEANINGS: ClassVar[dict[str, str]] = {
      "activation_params": "an activation that closes over traced values, such as "
                           "a parameter being differentiated"}

  def opt_in_features(self) -> tuple[str, ...]:
    """Fields an implementation must declare in ``supported_features`` to be
    given this call: one that ignored the groups would return a wrong result, one
    that ignored the activation's params would leak JAX tracers."""
    return tuple(name for name in FEATURES if getattr(self, name) is not None)

  def activation_fn(self) -> Callable[[jax.Array], jax.Array] | None:
    """The activation as a callable of the gate alone (its params bound), or None."""
    if self.activation_params is None:
      return self.activation
    return lambda gate: self.activation(gate, self.activation_params)

  def _check_dense(self, method: str) -> None:
    if self.group_sizes is not None:
      raise ValueError(f"GatedLinearUnitArgs.{method} takes dense weights [K, 2, N]; "
                       f"this call is grouped (group_sizes, weights "
                       f"{tuple(self.weights.shape)})")

  def forward_with_projections(self) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(out, {"projections": [M, 2, N]})`` by the plain-JAX program:
    `dense_projections`, then the activation on those rounded projections
    (float32 inside), as `backward_from_projections` expects them. Dense weights
    only."""
    self._check_dense("forward_with_projections")
    projections = self.dense_projections()
    m, _, n = projections.shape
    return (self.output_from_projections(projections.reshape(m, 2 * n)),
            {"projections": projections})

  def dense_projections(self) -> jax.Array:
    """``x @ weights`` as ``[M, 2, N]`` in x's dtype: one matmul with the fused
    ``[K, 2N]`` weight (XLA: cuBLAS on NVIDIA), float32 accumulation. Dense
    weights only."""
    self._check_dense("dense_projections")
    m, k = self.x.shape
    n = self.weights.shape[2]
    h = jax.lax.dot_general(self.x, self.weights.reshape(k, 2 * n),
                            (((1,), (0,)), ((), ())), precision=self.precision,
                            preferred_element_type=self.x.dtype)
    return h.reshape(m, 2, n)

  def output_from_projections(self, h: jax.Array) -> jax.Array:
    """``activation(gate) * up`` in x's dtype (float32 inside) from the projections
    ``h [M, 2N]`` (gate columns, then up; grouped or not)."""
    n = self.weights.shape[-1]
    activation = self.activation_fn() or (lambda gate: gate)
    gate, up = h[:, :n].astype(jnp.float32), h[:, n:].astype(jnp.float32)
    return (activation(gate) * up).astype(self.x.dtype)

  def backward_from_projections(self, projections: jax.Array,
                                dout: jax.Array) -> dict[str, jax.Array]:
    """``{"x": dx, "weights": dw}`` (and ``"activation_params"`` where the call
    has them) from the forward's projections residual: `epilogue_gradients`
    then `backward_from_dh`, the work of the plain-JAX backward."""
    dh, dparams = self.epilogue_gradients(projections, dout)
    grads = self.backward_from_dh(dh)
    if dparams is not None:
      grads["activation_params"] = dparams
    return grads

  def projection_gradient(self, projections: jax.Array, dout: jax.Array) -> jax.Array:
    """``dh = [dout * up * act'(gate), dout * act(gate)]`` as ``[M, 2N]`` in x's
    dtype (XLA, float32 inside), from the ``[M, 2, N]`` projections residual
    (grouped or not); a call with activation params has their cotangent too
    (`epilogue_gradients`)."""
    dh, dparams = self.epilogue_gradients(projections, dout)
    if dparams is not None:
      raise ValueError("this call's activation has params: their cotangent comes "
                       "from epilogue_gradients, not projection_gradient")
    return dh

  def epilogue_gradients(self, projections: jax.Array,
                         dout: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``(dh, d activation_params)``: `projection_gradient`'s dh and, where the
    call has activation params, their cotangent (float32; None without), from one
    VJP of the epilogue ``activation(gate) * up``."""
    m = self.x.shape[0]
    n = self.weights.shape[-1]

    def epilogue(h, params):  # [M, 2N] (gate | up) -> [M, N], in float32
      gate, up = h[:, :n], h[:, n:]
      if params is not None:
        return self.activation(gate, params) * up
      return (gate if self.activation is None else self.activation(gate)) * up
    _, epilogue_vjp = jax.vjp(epilogue, projections.reshape(m, 2 * n).astype(jnp.float32),
                              self.activation_params)
    dh, dparams = epilogue_vjp(dout.astype(jnp.float32))
    return dh.astype(self.x.dtype), dparams

  def backward_from_dh(self, dh: jax.Array) -> dict[str, jax.Array]:
    """``{"x": dh @ w^T, "weights": x^T @ dh}`` from ``dh [M, 2N]`` (gate columns,
    then up) in x's dtype: two matmuls with float32 accumulation (XLA: cuBLAS on
    NVIDIA). Dense weights only."""
    self._check_dense("backward_from_dh")
    k = self.x.shape[1]
    n = self.weights.shape[2]
    dtype = self.x.dtype
    w2 = self.weights.reshape(k, 2 * n)
    # The products come out in x's dtype: the matmul accumulates in float32 and
    # rounds once (no float32 [M, K] / [K, 2N] through memory).
    dx = jax.lax.dot_general(dh, w2, (((1,), (1,)), ((), ())), precision=self.precision,
                             preferred_element_type=dtype)
    dw = jax.lax.dot_general(self.x, dh, (((0,), (0,)), ((), ())),
                             precision=self.precision, preferred_element_type=dtype)
    return {"x": dx, "weights": dw.reshape(k, 2, n)}


DIFF_FIELDS = ("x", "weights", "activation_params")

# Everything generic code (dispatch, sharding) knows of this op. The labels name
# each dim of the operands and results for the Shardy sharding rule (operands
# sharing a letter propagate shardings to each other); the leading label is the
# dim that may be several (merged into one before implementations see it).
DEFINITION = OpDefinition(
    name=OP_NAME,
    diff_fields=DIFF_FIELDS,
    # Grouped weights ([G, K, 2, N]) match no label (fresh dims, replicated by
    # the plan).
    arg_labels=dict(x="mk", weights="kpn", group_sizes="G"),  # params: replicated
    result_labels=dict(out="mn", projections="mpn"),
    leading_label="m",
    plan=gated_linear_unit_plan,
)


def _check_activation(activation: Any, gate_shape: tuple[int, ...]) -> None:
  """The activation must map the float32 gate ``[M, N]`` to an array of that shape
  (it is applied to the gate projection; anything else would broadcast silently)."""
  if not callable(activation):
    raise TypeError(f"activation must be a callable or None; got {activation!r}")
  gate = jax.ShapeDtypeStruct(gate_shape, jnp.float32)
  try:
    out = jax.eval_shape(activation, gate)
  except Exception as e:
    raise TypeError(f"activation {activation!r} must take one float32 array (the gate "
                    f"projection, shape {gate_shape}); calling it failed: "
                    f"{type(e).__name__}: {e}") from e
  shape = getattr(out, "shape", None)
  dtype = getattr(out, "dtype", None)
  if (not isinstance(out, jax.ShapeDtypeStruct) or tuple(shape) != gate_shape
      or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
              or dtype == jnp.bool_)):
    got = (f"shape {tuple(shape)} and dtype {jnp.dtype(dtype).name}"
           if isinstance(out, jax.ShapeDtypeStruct) else f"{type(out).__name__}")
    raise ValueError(f"activation {activation!r} must map the float32 gate projection "
                     f"of shape {gate_shape} to a real array of the same shape; got {got}")


def _check_group_sizes(group_sizes: Any, num_groups: int, m: int) -> jax.Array:
  """group_sizes as int32 ``[G]`` (G = the weights' groups), non-negative and
  summing to at most M where they are concrete."""
  group_sizes = _checks.as_array("group_sizes", group_sizes)
  _checks.check_rank("group_sizes", group_sizes, 1, "[G]")
  _checks.check_int("group_sizes", group_sizes)
  if group_sizes.shape[0] != num_groups:
    raise ValueError(f"group_sizes must have {num_groups} entries (weights.shape[0]); "
                     f"got {_checks.describe(group_sizes)}")
  _checks.check_group_size_values(group_sizes, m, "x's")
  return _checks.group_sizes_as_int32(group_sizes, m)


def gated_linear_unit(
    x: jax.Array,
    weights: jax.Array | Sequence[jax.Array],
    *,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    group_sizes: jax.Array | None = None,
    precision: Any = None,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Gated linear unit: ``activation(x @ w_gate) * (x @ w_up)``.

  SwiGLU is ``activation=jax.nn.silu``, GeGLU ``jax.nn.gelu``, bilinear ``None``.

  Args:
    x: ``[..., K]``.
    weights: ``[K, 2, N]`` (gate, up stacked on axis 1; ``[G, K, 2, N]`` with
      group_sizes) or a pair
      ``(w_gate [K, N], w_up [K, N])``. x and the weights may be quantized
      (`tokamax.QuantizedArray`, a Qwix ``QArray`` / ``WithAux``): they are
      dequantized to the arrays they stand for (no GLU kernel applies scales),
      with straight-through gradients to a `QuantizedArray`'s source. Inside a
      model quantized by Qwix's post-training quantization, a rule matching the
      module and ``"gated_linear_unit"`` quantizes them as Qwix's PTQ does a
      dense matmul's (`tokamax.ragged_dot` says how).
    activation: any elementwise JAX callable, or None.
    group_sizes: None, or int ``[G]``: a grouped GLU (an MoE layer's experts,
      rows sorted by expert as for `tokamax.ragged_dot`): x is then ``[M, K]``,
      the weights ``[G, K, 2, N]`` (or a pair of ``[G, K, N]``), group g's rows
      use ``weights[g]``, and rows past ``sum(group_sizes)`` give 0.
    precision: matmul precision, as `jax.lax.dot_general` takes it.
    implementation: None, a name, a sequence of names or a `tokamax.Op`.

  Returns:
    ``[..., N]`` in x's dtype.

  Example:
    >>> y = tokamax.gated_linear_unit(x, w, activation=jax.nn.silu)  # SwiGLU
    >>> y = tokamax.gated_linear_unit(tokens, experts_w, activation=jax.nn.silu,
    ...                               group_sizes=tokens_per_expert)  # MoE
  """
  # Under Qwix's post-training quantization, as its PTQ does a dense matmul (the
  # weights contract along K: axis 0, after G where grouped).
  x, weights = qwix_ptq.quantize_operands(
      "gated_linear_unit", x, weights, lhs_contracting=-1,
      rhs_contracting=0 if group_sizes is None else 1)
  # Quantized operands (no GLU kernel takes scales): the arrays they stand for.
  x = _checks.as_array("x", quantization.dequantized("x", x))
  _checks.check_float("x", x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1 ([..., K]); got {_checks.describe(x)}")
  grouped = group_sizes is not None
  if grouped and x.ndim != 2:
    raise ValueError(f"x must be [M, K] with group_sizes (rows sorted by group); got "
                     f"{_checks.describe(x)}")
  lead, lead_text = ((1, "G, ") if grouped else (0, ""))
  if isinstance(weights, (tuple, list)):
    if len(weights) != 2:
      raise ValueError(f"weights as a sequence must be a pair (w_gate, w_up); got "
                       f"{len(weights)} arrays")
    w_gate = _checks.as_array("weights[0]", quantization.dequantized("weights[0]", weights[0]))
    w_up = _checks.as_array("weights[1]", quantization.dequantized("weights[1]", weights[1]))
    for name, w in (("weights[0]", w_gate), ("weights[1]", w_up)):
      _checks.check_float(name, w)
      _checks.check_rank(name, w, 2 + lead, f"[{lead_text}K, N]")
    if w_gate.shape != w_up.shape:
      raise ValueError(f"weights[0] and weights[1] must have the same shape; got "
                       f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    _checks.check_same_dtype(("weights[0]", "weights[1]"), (w_gate, w_up))
    weights = jnp.stack([w_gate, w_up], axis=1 + lead)
  else:
    weights = _checks.as_array("weights", quantization.dequantized("weights", weights))
    _checks.check_float("weights", weights)
    _checks.check_rank("weights", weights, 3 + lead, f"[{lead_text}K, 2, N]")
    if weights.shape[1 + lead] != 2:
      raise ValueError(f"weights must have shape [{lead_text}K, 2, N]; got "
                       f"{_checks.describe(weights)}")
  k = x.shape[-1]
  if weights.shape[lead] != k:
    raise ValueError(f"weights must have K={k} rows to match x's last dim; got "
                     f"{_checks.describe(weights)} for x of {_checks.describe(x)}")
  _checks.check_same_dtype(("x", "weights"), (x, weights))
  if grouped:
    group_sizes = _check_group_sizes(group_sizes, weights.shape[0], x.shape[0])
  with_params, activation_params = None, None
  if activation is not None:
    gate_shape = (math.prod(x.shape[:-1]), weights.shape[-1])
    _check_activation(activation, gate_shape)
    leaves = (x, weights)
    with_params, activation_params = hoist_traced_closure(
        activation, gate_shape, vma.varying_axes(leaves),
        rows_may_split=(sharding.active(leaves) and sharding.explicit_mesh(leaves) is None))
    activation = with_params or activation

  # The row dims stay separate here: dispatch merges them into M (after
  # partitioning, so that a sharded non-leading row dim stays split).
  args = GatedLinearUnitArgs(
      x=x, weights=weights, activation=activation,
      precision=_checks.canonical_precision(precision), group_sizes=group_sizes,
      activation_params=activation_params)
  return dispatch.call(DEFINITION, args, implementation, lead_dims=x.ndim - 1)

