"""`tokamax.ragged_dot`: signature, validation and canonical arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_xla_reference as xla_ref

from tokamax._src import dispatch
from tokamax._src import quantization
from tokamax._src import qwix_ptq
from tokamax._src.op import Op, OpDefinition
from tokamax._src.ops import _checks
from tokamax._src.ops.ragged_dot.sharding import ragged_dot_plan

OP_NAME = "ragged_dot"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedDotArgs:
  """Canonical arguments every ragged_dot implementation receives.

  - lhs: ``[M, K]``; rows are grouped consecutively: group g owns rows
    ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))``.
  - rhs: ``[G_rhs, K, N]``, same dtype as lhs.
  - group_sizes: int32 ``[G]``, non-negative, summing to at most M.
  - group_offset: None (then ``G == G_rhs``) or an int32 scalar: rhs holds groups
    ``[group_offset, group_offset + G_rhs)`` of the G groups (expert parallelism).
  - preferred_element_type: the output dtype.
  - precision: for the matmuls.
  - lhs_scales, rhs_scales: None, or the block scales of a quantized operand
    (float32, one per tile, as `tokamax.QuantizedArray`): lhs or rhs then holds
    its values (float8 or int8) and stands for ``values * scales``. An opt-in
    feature ("block_scales"): only implementations that declare it see such calls.

  ``out[i] = lhs[i] @ rhs[g(i) - group_offset]`` for rows of groups held by rhs,
  0 for every other row (other groups' rows, and rows past ``sum(group_sizes)``).
  Residuals: ``{}``.
  """

  lhs: jax.Array
  rhs: jax.Array
  group_sizes: jax.Array
  group_offset: jax.Array | None = None
  preferred_element_type: Any = dataclasses.field(
      default=None, metadata=dict(static=True))
  precision: Any = dataclasses.field(default=None, metadata=dict(static=True))
  lhs_scales: jax.Array | None = None
  rhs_scales: jax.Array | None = None

  @property
  def num_groups(self) -> int:
    return self.group_sizes.shape[0]

  def opt_in_features(self) -> tuple[str, ...]:
    """Fields an implementation must declare in ``supported_features`` to be
    given this call: one that ignored the scales would return a wrong result."""
    quantized = self.lhs_scales is not None or self.rhs_scales is not None
    return ("block_scales",) if quantized else ()


DIFF_FIELDS = ("lhs", "rhs")

# Everything generic code (dispatch, sharding) knows of this op. The labels name
# each dim of the operands and results for the Shardy sharding rule (operands
# sharing a letter propagate shardings to each other); the leading label is the
# dim that may be several (merged into one before implementations see it).
DEFINITION = OpDefinition(
    name=OP_NAME,
    diff_fields=DIFF_FIELDS,
    # Scales take labels of their own: a tile count is not its operand's size.
    arg_labels=dict(lhs="mk", rhs="gkn", group_sizes="G", group_offset="",
                    lhs_scales="ab", rhs_scales="cde"),
    result_labels=dict(out="mn"),
    leading_label=None,
    plan=ragged_dot_plan,
)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | int | None = None,
    implementation: dispatch.Implementation = None,
    quantized_lhs_gradient: quantization.GradientQuantization | None = None,
) -> jax.Array:
  """Grouped matmul with the semantics of `jax.lax.ragged_dot` (the MoE matmul).

  Either operand may be quantized: a `tokamax.QuantizedArray` (float8 or int8
  values with float32 block scales, e.g. from `tokamax.quantize`), or a Qwix
  ``QArray`` / PTQ ``WithAux`` as Qwix hands it over. The result is then that of
  the operands they stand for (``values * scales``), computed by an
  implementation that applies the scales in its kernel where one takes the call,
  else by the XLA reference; a Qwix scheme with zero points or sub-byte types is
  dequantized first.

  Inside a model quantized by Qwix's post-training quantization
  (``qwix.quantize_model(model, qwix.PtqProvider(rules), ...)``), a rule that
  matches the module quantizes the call as Qwix's PTQ does its matmuls (rhs, a
  param of the module, replaced by its quantized form; lhs quantized on the fly
  where the rule sets ``act_qtype``): `tokamax._src.qwix_ptq`.

  Args:
    lhs: ``[M, K]``, rows sorted by group (or a quantized operand, above).
    rhs: ``[G_rhs, K, N]``, one weight matrix per group (or a quantized operand).
    group_sizes: int ``[G]``, rows per group, non-negative, summing to at
      most M. Checked where the values are known (outside `jax.jit`); traced
      values are not, and a negative one gives an undefined result (it
      differs between implementations).
    precision: matmul precision, as `jax.lax.dot_general` takes it.
    preferred_element_type: output dtype (default: lhs dtype; for a quantized
      lhs, the dtype it stands for).
    group_offset: optional int scalar: rhs holds groups ``[group_offset,
      group_offset + G_rhs)`` of the G in group_sizes; rows of other groups give 0.
    implementation: None, a name, a sequence of names or a `tokamax.Op`.
    quantized_lhs_gradient: with a quantized rhs, an opt-in
      `tokamax.GradientQuantization`: the gradient with respect to lhs is then
      the quantized ragged_dot of the quantized output cotangent and rhs's
      values transposed (fp8 training's backward), not the straight-through
      plain product.

  Returns:
    ``[M, N]``; rows past ``sum(group_sizes)`` (and of groups rhs does not hold)
    are 0.

  Example:
    >>> out = tokamax.ragged_dot(tokens, expert_weights, tokens_per_expert)
  """
  lhs, rhs = qwix_ptq.quantize_operands("ragged_dot", lhs, rhs, lhs_contracting=1,
                                        rhs_contracting=1)
  lhs, lhs_scales, lhs_dtype, lhs_source = quantization.split("lhs", lhs)
  rhs, rhs_scales, rhs_dtype, rhs_source = quantization.split("rhs", rhs)
  lhs = _checks.as_array("lhs", lhs)
  rhs = _checks.as_array("rhs", rhs)
  group_sizes = _checks.as_array("group_sizes", group_sizes)
  if lhs_scales is None:
    _checks.check_float("lhs", lhs)
  if rhs_scales is None:
    _checks.check_float("rhs", rhs)
  _checks.check_rank("lhs", lhs, 2, "[M, K]")
  _checks.check_rank("rhs", rhs, 3, "[G, K, N]")
  _checks.check_rank("group_sizes", group_sizes, 1, "[G]")
  _checks.check_int("group_sizes", group_sizes)
  if lhs_scales is None and rhs_scales is None:
    _checks.check_same_dtype(("lhs", "rhs"), (lhs, rhs))
  else:
    # A quantized operand stands for its `dtype`; a plain one for its own.
    lhs_dtype = jnp.dtype(lhs.dtype if lhs_scales is None else lhs_dtype)
    rhs_dtype = jnp.dtype(rhs.dtype if rhs_scales is None else rhs_dtype)
    if lhs_dtype != rhs_dtype:
      raise TypeError(f"lhs, rhs must stand for the same dtype; got lhs: "
                      f"{lhs_dtype.name}, rhs: {rhs_dtype.name} (a quantized "
                      "operand stands for its `dtype`)")
    if preferred_element_type is None:
      preferred_element_type = lhs_dtype
  m, k = lhs.shape
  if rhs.shape[1] != k:
    raise ValueError(f"rhs must have K={k} (lhs.shape[1]) on axis 1; got "
                     f"{_checks.describe(rhs)}")
  g = group_sizes.shape[0]
  if group_offset is None:
    if g != rhs.shape[0]:
      raise ValueError(f"group_sizes must have {rhs.shape[0]} entries (rhs.shape[0]) "
                       f"when group_offset is None; got {_checks.describe(group_sizes)}")
  else:
    group_offset = _checks.as_array("group_offset", jnp.asarray(group_offset))
    _checks.check_int("group_offset", group_offset)
    if group_offset.ndim != 0:
      raise ValueError(f"group_offset must be a scalar; got "
                       f"{_checks.describe(group_offset)}")
    if rhs.shape[0] > g:
      raise ValueError(f"rhs holds {rhs.shape[0]} groups, more than the {g} in "
                       "group_sizes")
    if _checks.is_concrete(group_offset) and not 0 <= int(group_offset) <= g - rhs.shape[0]:
      raise ValueError(f"group_offset must lie in [0, {g - rhs.shape[0]}] (G - "
                       f"rhs.shape[0]); got {int(group_offset)}")
    group_offset = group_offset.astype(jnp.int32)
  _checks.check_group_size_values(group_sizes, m, "lhs")
  if preferred_element_type is not None:
    allowed = "None or a float dtype: float32, bfloat16 or float16"
    try:
      preferred_element_type = jnp.dtype(preferred_element_type)
    except TypeError:
      raise TypeError(f"preferred_element_type must be {allowed}; got "
                      f"{preferred_element_type!r}") from None
    if preferred_element_type not in [jnp.dtype(d) for d in _checks.FLOAT_DTYPES]:
      raise TypeError(f"preferred_element_type must be {allowed}; got "
                      f"{preferred_element_type.name}")
  args = RaggedDotArgs(
      lhs=lhs, rhs=rhs, group_sizes=_checks.group_sizes_as_int32(group_sizes, m),
      group_offset=group_offset, preferred_element_type=preferred_element_type,
      precision=_checks.canonical_precision(precision),
      lhs_scales=lhs_scales, rhs_scales=rhs_scales)
  if quantized_lhs_gradient is not None:
    if not isinstance(quantized_lhs_gradient, quantization.GradientQuantization):
      raise TypeError(f"quantized_lhs_gradient must be None or a "
                      f"tokamax.GradientQuantization; got {quantized_lhs_gradient!r}")
    if rhs_scales is None:
      raise ValueError("quantized_lhs_gradient needs a quantized rhs (its values "
                       "and scales enter the gradient's matmul); rhs is a plain "
                       f"{_checks.describe(rhs)}")
    quantized_lhs_gradient.check("quantized_lhs_gradient", (m, rhs.shape[2]))
  if lhs_scales is None and rhs_scales is None:
    return dispatch.call(DEFINITION, args, implementation)
  return _quantized_call(args, (lhs_source, rhs_source), (lhs_dtype, rhs_dtype),
                         implementation, quantized_lhs_gradient)


def _quantized_call(args: RaggedDotArgs, sources, dtypes, implementation,
                    quantized_lhs_gradient=None):
  """The call on quantized operands, differentiable as a straight-through
  estimator (`tokamax._src.quantization`): the gradient with respect to an
  operand's source is the plain ragged_dot's gradient with respect to the array
  the operand stands for (its values times its scales, in `dtypes`), computed by
  whichever implementation dispatch picks for that plain call; values and scales
  get zero cotangents, and a plain operand its gradient. With
  `quantized_lhs_gradient`, lhs's gradient is a quantized call itself
  (`_quantized_lhs_gradient`). The forward runs the quantized call as it is."""

  @jax.custom_vjp
  def call(sources, args):
    del sources  # only the gradients' destination
    return dispatch.call(DEFINITION, args, implementation)

  def forward(sources, args):
    return call(sources, args), args

  def backward(args, dout):
    def operand(values, scales, dtype):
      if scales is None:
        return values
      return xla_ref.dequantize(values, scales).astype(dtype)

    lhs = operand(args.lhs, args.lhs_scales, dtypes[0])
    rhs = operand(args.rhs, args.rhs_scales, dtypes[1])
    # An `Op` instance was configured for the quantized call; the plain one
    # chooses its own.
    plain_impl = None if isinstance(implementation, Op) else implementation
    dout = dout.astype(args.preferred_element_type)
    plain = lambda lhs, rhs: ragged_dot(
        lhs, rhs, args.group_sizes, precision=args.precision,
        preferred_element_type=args.preferred_element_type,
        group_offset=args.group_offset, implementation=plain_impl)
    if quantized_lhs_gradient is None:
      _, vjp = jax.vjp(plain, lhs, rhs)
      dlhs, drhs = vjp(dout)
    else:
      _, vjp = jax.vjp(lambda rhs: plain(lhs, rhs), rhs)
      (drhs,) = vjp(dout)
      dlhs = _quantized_lhs_gradient(args, dout, dtypes, quantized_lhs_gradient,
                                     plain_impl)
    d_sources = tuple(
        None if source is None else grad.astype(source.dtype)
        for source, grad in zip(sources, (dlhs, drhs)))
    # A plain operand takes its gradient itself.
    d_args = dataclasses.replace(
        quantization.zero_cotangents(args),
        **{name: grad for name, grad, scales in (
            ("lhs", dlhs, args.lhs_scales), ("rhs", drhs, args.rhs_scales))
           if scales is None})
    return d_sources, d_args

  call.defvjp(forward, backward)
  return call(sources, args)


def _quantized_lhs_gradient(args: RaggedDotArgs, dout, dtypes,
                            spec: quantization.GradientQuantization, implementation):
  """``dout @ rhs^T`` per group as a quantized ragged_dot: `dout` quantized per
  `spec`, rhs's values and block scales with K and N swapped (no new rounding of
  rhs). Rows of groups rhs does not hold get 0, as in the forward."""
  # Labelled as standing for rhs's dtype (the call needs one dtype for both), the
  # values quantized from the cotangent as it came (e.g. float32).
  dout_q = dataclasses.replace(
      quantization.quantize(dout, spec.tile_shape, spec.dtype, keep_source=False),
      dtype=dtypes[1])
  rhs_t = quantization.QuantizedArray(
      jnp.swapaxes(args.rhs, 1, 2), jnp.swapaxes(args.rhs_scales, 1, 2), dtypes[1])
  return ragged_dot(dout_q, rhs_t, args.group_sizes, precision=args.precision,
                    preferred_element_type=dtypes[0], group_offset=args.group_offset,
                    implementation=implementation)
