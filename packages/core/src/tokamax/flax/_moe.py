"""`MoE`: a Flax NNX mixture-of-experts FFN whose experts run through tokamax's
grouped gated linear unit and `tokamax.ragged_dot`."""

from __future__ import annotations

from collections.abc import Callable
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src import quantization
from tokamax._src import qwix_ptq
from tokamax._src.ops import _checks
from tokamax._src.ops.gated_linear_unit.api import gated_linear_unit
from tokamax._src.ops.ragged_dot import moe as moe_lib
from tokamax._src.ops.ragged_dot import ragged_dot
from tokamax.flax._mlp import Initializer, default_kernel_init, matrices, promote
from tokamax.flax._norms import as_static

_SOFTMAX_OVER = ("top_k", "all")


class MoE(nnx.Module):
  """Mixture-of-experts gated FFN: router, top-k, optional capacity, grouped experts.

  Each token ``x`` (the rows of ``[..., D]``) goes to the `top_k` experts with the
  largest router logits ``x @ router.kernel`` (computed in float32); expert ``e``
  computes ``activation(x @ Wg_e) * (x @ Wu_e) @ Wd_e``, and the token's output is
  the sum of its experts' outputs times their gates. The tokens are sorted by
  expert so that each expert matmul is one grouped matmul over all experts
  (`tokamax.gated_linear_unit` with ``group_sizes`` and `tokamax.ragged_dot`).

  Parameters (the expert kernels in `flax.nnx.Linear`'s ``[in, out]`` order):

  * ``router``: `nnx.Linear` ``D -> E`` without bias.
  * ``gate_up``: ``[E, D, 2F]``: ``gate_up[e, :, :F]`` is expert e's gate kernel,
    ``gate_up[e, :, F:]`` its up kernel (``jnp.concatenate([w_gate, w_up], -1)``).
  * ``down``: ``[E, F, D]``.

  Gates (`softmax_over`): ``"top_k"`` (default, Mixtral): a softmax over the k
  chosen logits, so a token's gates sum to 1; ``"all"`` (Switch Transformer):
  the chosen experts' probabilities under a softmax over all E logits (with
  ``top_k=1`` only this one trains the router).

  Capacity (`capacity_factor`): each expert takes at most
  ``capacity = ceil(capacity_factor * tokens * top_k / E)`` assignments of a call,
  ``tokens`` being the rows of this call's input (with `expert_axis`: of this
  device's shard). The assignments are ranked token by token in row order, a
  token's choices in order of decreasing logit; an expert keeps the first
  `capacity` of those it received. A dropped assignment contributes 0 to its
  token's output, and the token's other gates are not renormalized, so a token
  whose every choice was dropped outputs 0 (the residual connection carries it).
  None: nothing is dropped.

  Expert parallelism (`expert_axis`): call the module inside `jax.shard_map`
  over that mesh axis of n devices, with the tokens split along the axis,
  ``gate_up`` and ``down`` split along their first (expert) axis, so that each
  device holds ``E / n`` experts, and the router replicated. Tokens travel to
  their experts' devices and back by `tokamax.moe_all_to_all`; the capacity
  applies on each device, to its own tokens, before they travel.

  Load-balancing losses are the model's to add; ``self.router(x)`` gives the
  logits.

  Quantized experts: ``gate_up`` and ``down`` may hold quantized arrays
  (`tokamax.quantize`, or Qwix's ``QArray`` as ``qwix.quantize`` returns it), e.g.
  ``moe.gate_up.set_value(tokamax.quantize(moe.gate_up.get_value(), (1, 128, 128)))``.
  They reach `tokamax.ragged_dot` as they are (two of them around the
  activation: no gated linear unit kernel applies scales), which picks a kernel
  that applies the scales where one takes the call, else dequantizes; the rows
  enter each in the dtype its weights stand for. Qwix's post-training
  quantization reaches them too: in ``qwix.quantize_model(model,
  qwix.PtqProvider(rules), x)`` a rule matching this module and the op name
  ``"ragged_dot"`` quantizes ``gate_up`` and ``down`` (each replaced by Qwix's
  quantized param) and, with ``act_qtype``, the rows, as Qwix's PTQ does a
  dense layer's matmul (``tile_size`` tiling the contracting axis).

  Example:
    >>> moe = tokamax.flax.MoE(512, 1024, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    >>> y = moe(x)  # [..., 512] -> [..., 512]
  """

  def __init__(self, in_features: int, hidden_features: int, num_experts: int, *,
               top_k: int = 2, capacity_factor: float | None = None,
               softmax_over: str = "top_k",
               activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
               expert_axis: str | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Initializer = default_kernel_init,
               implementation: dispatch.Implementation = None, rngs: nnx.Rngs):
    """Args:
      in_features: D, the input's (and output's) last axis.
      hidden_features: F, each expert's hidden width.
      num_experts: E.
      top_k: experts per token, in ``[1, E]``.
      capacity_factor: None (no token dropped) or > 0; see the class docstring.
      softmax_over: ``"top_k"`` or ``"all"``; see the class docstring.
      activation: applied to the gate projection (silu: SwiGLU experts).
      expert_axis: None (every expert on this device) or the mesh axis the
        experts are sharded over; see the class docstring.
      dtype: the computation dtype (None: the common dtype of input and params).
        Quantized expert weights take their matmul's rows in the dtype they
        stand for (`ragged_dot` needs both operands to stand for one).
      param_dtype: the parameters' dtype.
      precision: of the matmuls, as `jax.lax.dot_general` takes it.
      kernel_init: an initializer of one ``[in, out]`` kernel, as `nnx.Linear`'s
        (default: lecun normal); each expert's gate, up and down kernels and the
        router get one draw each.
      implementation: None: the experts' gate and up projections and their
        activation run as one grouped `tokamax.gated_linear_unit`, the down
        projection as `tokamax.ragged_dot`, each chosen by dispatch (with a
        quantized ``gate_up``: two ragged_dots, as below); a name (or
        names) of `tokamax.ragged_dot`'s implementations: two ragged_dots of it
        around the activation (in the computation dtype).
      rngs: the ``params`` stream initializes the kernels.
    """
    in_features, hidden_features, num_experts, top_k = _check_arguments(
        in_features, hidden_features, num_experts, top_k, capacity_factor, softmax_over)
    d, f, e = in_features, hidden_features, num_experts
    self.router = nnx.Linear(d, e, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                             precision=precision, kernel_init=kernel_init, rngs=rngs)
    gate_up = matrices(kernel_init, rngs.params(), 2 * e, (d, f), param_dtype)
    # [E * 2, D, F] -> [E, D, 2, F] -> [E, D, 2F]: gate columns first, then up.
    gate_up = gate_up.reshape(e, 2, d, f).transpose(0, 2, 1, 3).reshape(e, d, 2 * f)
    self.gate_up = nnx.Param(gate_up)
    self.down = nnx.Param(matrices(kernel_init, rngs.params(), e, (f, d), param_dtype))
    self.num_experts = e
    self.top_k = top_k
    self.capacity_factor = capacity_factor
    self.softmax_over = softmax_over
    self.activation = activation
    self.expert_axis = expert_axis
    self.dtype = dtype
    self.precision = precision
    self.implementation = as_static(implementation)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., D] -> [..., D]``."""
    if x.ndim < 1 or x.shape[-1] != self.router.in_features:
      raise ValueError(f"x must be [..., {self.router.in_features}]; got shape {x.shape}")
    tokens = x.reshape(-1, x.shape[-1])
    router = self.router.kernel[...]
    gate_up, down = _expert_weight(self.gate_up), _expert_weight(self.down)
    # Quantized expert weights stay as they are (class docstring); the dtype
    # they stand for joins the promotion.
    dtype = self.dtype if self.dtype is not None else jnp.result_type(
        tokens, router, *(quantization.stands_for(w)[1] for w in (gate_up, down)))
    tokens, router = promote(tokens, router, dtype=dtype)
    gate_up, down = (w if quantization.is_quantized(w) else w.astype(dtype)
                     for w in (gate_up, down))
    expert_ids, gates = self.route(tokens, router)
    if self.capacity_factor is not None:
      capacity = math.ceil(self.capacity_factor * expert_ids.size / self.num_experts)
      expert_ids = drop_over_capacity(expert_ids, self.num_experts, capacity)
    else:
      capacity = None
    experts = lambda rows, group_sizes: self._experts(rows, group_sizes, gate_up, down)
    if self.expert_axis is None:
      out = sorted_by_expert(tokens, expert_ids, gates, experts, self.num_experts)
    else:
      num_local = quantization.stands_for(gate_up)[0][0]
      out = self._all_to_all(tokens, expert_ids, gates, experts, num_local, capacity)
    return out.reshape(x.shape[:-1] + out.shape[-1:])

  def route(self, tokens, router) -> tuple[jax.Array, jax.Array]:
    """``(expert_ids [m, k] int32, gates [m, k] float32)``, best expert first."""
    # Float32 logits: bf16 would tie experts that differ in the 3rd digit.
    logits = jnp.dot(tokens, router, precision=self.precision,
                     preferred_element_type=jnp.float32)
    top_logits, expert_ids = jax.lax.top_k(logits, self.top_k)
    if self.softmax_over == "top_k":
      gates = jax.nn.softmax(top_logits, axis=-1)
    else:
      probs = jax.nn.softmax(logits, axis=-1)
      gates = jnp.take_along_axis(probs, expert_ids, axis=-1)
    return expert_ids.astype(jnp.int32), gates

  def _experts(self, rows, group_sizes, gate_up, down):
    """Rows sorted by expert (``group_sizes[e]`` rows of expert e, then padding)
    through their experts: with ``implementation=None`` a grouped gated linear
    unit (on Hopper its mosaic_gpu implementation keeps the projections for the
    backward and computes the activation's gradient in one pass) then the down
    ragged_dot; with a named implementation, two ragged_dots of it around the
    gated activation."""
    (e, f, _), _ = quantization.stands_for(down)
    d = quantization.stands_for(gate_up)[0][1]
    ptq = qwix_ptq.current_rule("ragged_dot") is not None
    if not ptq and qwix_ptq.current_rule("gated_linear_unit") is not None:
      raise NotImplementedError(
          "a Qwix rule for 'gated_linear_unit' matched tokamax.flax.MoE: its expert "
          "matmuls follow rules for 'ragged_dot' (two ragged_dots around the "
          "activation); name that op in the rule's op_names")
    quantized = quantization.is_quantized(gate_up) or ptq
    if self.implementation is None and not quantized:
      hidden = gated_linear_unit(rows, gate_up.reshape(e, d, 2, f),
                                 activation=self.activation, precision=self.precision,
                                 group_sizes=group_sizes)
      return self._matmul(hidden, down, group_sizes)
    h = self._matmul(rows, gate_up, group_sizes)
    hidden = h[:, :f] if self.activation is None else self.activation(h[:, :f])
    return self._matmul(hidden * h[:, f:], down, group_sizes)

  def _matmul(self, rows, weights, group_sizes):
    """`tokamax.ragged_dot` of the rows and one expert kernel; quantized weights
    take the rows in the dtype they stand for, the result back in the rows'."""
    dtype = rows.dtype
    if quantization.is_quantized(weights):
      rows = rows.astype(quantization.stands_for(weights)[1])
    out = ragged_dot(rows, weights, group_sizes, precision=self.precision,
                     implementation=self.implementation)
    return out.astype(dtype)

  def _all_to_all(self, tokens, expert_ids, gates, experts, num_local, capacity):
    """The tokens to their experts' devices and back (inside shard_map)."""
    axis = self.expert_axis
    try:
      devices = jax.lax.axis_size(axis)
    except NameError as e:
      raise ValueError(f"MoE(expert_axis={axis!r}) must be called inside jax.shard_map "
                       f"over mesh axis {axis!r} ({e})") from e
    if devices * num_local != self.num_experts:
      raise ValueError(
          f"MoE(expert_axis={axis!r}): each of the {devices} devices holds "
          f"{num_local} experts of gate_up, not num_experts / {devices} = "
          f"{self.num_experts} / {devices}: split gate_up and down along their "
          f"first axis over {axis!r} (P({axis!r})) and replicate the router")
    # Past the per-expert capacity nothing is left to drop, and a device receives
    # at most num_local * capacity rows from each other: its buffers' size.
    pair_capacity = None if capacity is None else num_local * capacity
    return moe_lib.moe_all_to_all(tokens, expert_ids, experts, axis_name=axis,
                                  num_local_experts=num_local, capacity=pair_capacity,
                                  combine_weights=gates)


def _expert_weight(held: Any) -> Any:
  """An expert kernel's value: an array or a quantized array held by its
  `nnx.Param`, or Qwix's PTQ ``WithAux``, which replaces the param itself
  (`tokamax._src.qwix_ptq`; its ``value``: the quantized array unboxed)."""
  return held.get_value() if isinstance(held, nnx.Variable) else held.value


def _check_arguments(in_features, hidden_features, num_experts, top_k, capacity_factor,
                     softmax_over) -> tuple[int, int, int, int]:
  """The constructor's checks; returns the four sizes as Python ints (a concrete
  0-d integer array is taken by value: `_checks.static_int`)."""
  sizes = []
  for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                      ("num_experts", num_experts), ("top_k", top_k)):
    sizes.append(_checks.static_int(name, value, "an int >= 1"))
    if sizes[-1] < 1:
      raise ValueError(f"{name} must be >= 1; got {value}")
  in_features, hidden_features, num_experts, top_k = sizes
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k must be in [1, num_experts={num_experts}]; got {top_k}")
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"capacity_factor must be None or > 0; got {capacity_factor}")
  if softmax_over not in _SOFTMAX_OVER:
    raise ValueError(f"softmax_over must be one of {_SOFTMAX_OVER}; got {softmax_over!r}")
  return in_features, hidden_features, num_experts, top_k


def drop_over_capacity(expert_ids: jax.Array, num_experts: int,
                       capacity: int) -> jax.Array:
  """`expert_ids` ``[m, k]`` with each expert's assignments past its first
  `capacity` (in row-major order: token by token) replaced by `num_experts`, an
  out-of-range id, which the routing (local or `moe_all_to_all`) drops."""
  # moe_all_to_all's routing with one destination per expert ranks the
  # assignments of each expert in exactly this order and drops those past
  # `capacity`: its slot of a dropped assignment is out of range.
  m, k = expert_ids.shape
  route = moe_lib.route(expert_ids.reshape(-1), num_experts, 1, capacity, k)
  kept = route.slot_of_assignment < num_experts * capacity
  return jnp.where(kept.reshape(m, k), expert_ids, num_experts)


def sorted_by_expert(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     experts: moe_lib.ExpertFn, num_experts: int) -> jax.Array:
  """The single-device case of `tokamax.moe_all_to_all`: ``[m, D]`` tokens'
  gated sum of their experts' outputs, the experts run once on all rows sorted
  by expert. Out-of-range ids contribute 0."""
  m, k = expert_ids.shape
  take = moe_lib.take_rows
  route = moe_lib.route(expert_ids.reshape(-1), 1, num_experts, m * k, k)
  rows = take(tokens, route.token_of_slot, route.slot_of_assignment, k)
  out = experts(rows, route.sent_counts[0])
  out = take(out, route.slot_of_assignment, route.assignment_of_slot, 1)
  out = out.reshape(m, k, out.shape[-1])  # (not -1: m may be 0)
  combined = jnp.sum(out.astype(jnp.float32) * gates[..., None].astype(jnp.float32), axis=1)
  return combined.astype(out.dtype)
