"""`tokamax.dot_product_attention`: signature, validation and canonical arguments."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import dispatch
from tokamax._src import sharding
from tokamax._src.op import OpDefinition
from tokamax._src.ops import _checks
from tokamax._src.ops.attention.sharding import attention_plan

OP_NAME = "dot_product_attention"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionArgs:
  """Canonical arguments every attention implementation receives.

  Shapes (B batch, T queries, S keys, N query heads, K key/value heads, N % K == 0,
  H and Hv head dims):

  - query ``[B, T, N, H]``, key ``[B, S, K, H]``, value ``[B, S, K, Hv]``, one
    float dtype.
  - bias: None or ``[B|1, N|1, T|1, S|1]`` (size-1 dims broadcast), any float dtype;
    added to the scaled logits.
  - mask: None or bool ``[B|1, N|1, T|1, S|1]``; True means "may attend".
  - query_seq_lengths, key_value_seq_lengths: None or int32 ``[B]``; queries at or
    past the length produce 0, keys at or past it are not attended.
  - q_segment_ids ``[B, T]`` / kv_segment_ids ``[B, S]``: None or int32; a query
    attends only keys of its own segment (both given, or neither).

  Static fields:

  - scale: multiplies ``q . k``.
  - is_causal: query t attends key s only if ``s <= t`` (top-left aligned, as
    `jax.nn.dot_product_attention`).
  - local_window: None or ``(left, right)``: query t attends keys
    ``t - left <= s <= t + right``; None on a side means unbounded.
  - logits_soft_cap: None or c: logits become ``c * tanh(logits / c)`` after scale
    and bias, before masking.
  - precision: for the two matmuls, as `jax.lax.dot_general` takes it.

  Logits are ``soft_cap(scale * q.k + bias)``; masked entries are excluded from the
  softmax; a query row with no visible key outputs 0.

  Opt-in fields (an implementation that handles one lists its name in its
  ``supported_features``; dispatch refuses the others when it is set):

  - sinks: None or float ``[N]``: attention sinks (gpt-oss, StreamingLLM), one
    learnable logit per query head that joins every row's softmax denominator and
    takes no value: row t's weights are ``exp(l_ts) / (exp(sink_n) + sum_s
    exp(l_ts))`` over its visible keys. It is not scaled, capped or masked; a row
    with no visible key still outputs 0. Gets a gradient.

  - q_offset: None or an int32 scalar: query row t sits at position
    ``t + q_offset`` relative to key 0 for ``is_causal`` and ``local_window``
    (it may be negative). Nothing else moves: lengths, segment ids, bias and
    mask index rows as before. Set by the SPMD rules for a query shard and by
    `tokamax.ring_attention` for a (query block, key block) pair.

  Residuals (forward to backward): ``{"lse": float32 [B, N, T]}``, the natural
  log-sum-exp of each query row's visible logits (and its head's sink, with
  sinks), +inf for rows with no visible key (so that ``exp(logit - lse)`` is 0),
  or ``{}`` if the forward has none. With sinks the lse so defined makes
  ``exp(logit - lse)`` the probabilities and ``rowsum(dout * out)`` the softmax
  correction term as without: a backward written for that lse and output needs
  only `sinks_cotangent` besides. A forward may add ``"lse_tail"`` (float32
  ``[B, N, T]``, 0 where the lse is infinite): the lse's rounding error, so that
  ``exp((logit - lse) - lse_tail)`` stays right where the logits are huge (a
  bias of -1e9 masking a whole row, where float32's lse rounds away the log of
  the row's sum); a backward that reads it must also run without it.
  """

  query: jax.Array
  key: jax.Array
  value: jax.Array
  bias: jax.Array | None = None
  mask: jax.Array | None = None
  query_seq_lengths: jax.Array | None = None
  key_value_seq_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
  is_causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
  local_window: tuple[int | None, int | None] | None = dataclasses.field(
      default=None, metadata=dict(static=True))
  logits_soft_cap: float | None = dataclasses.field(
      default=None, metadata=dict(static=True))
  precision: Any = dataclasses.field(default=None, metadata=dict(static=True))
  q_offset: jax.Array | None = None
  sinks: jax.Array | None = None

  def opt_in_features(self) -> tuple[str, ...]:
    return tuple(name for name in ("q_offset", "sinks")
                 if getattr(self, name) is not None)

  def apply_sinks(self, out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of attention without sinks -> with ``self.sinks`` (see
    `apply_sinks`), for an implementation that leaves them to one pass after its
    kernel."""
    return (out, lse) if self.sinks is None else apply_sinks(self.sinks, out, lse)

  def sinks_cotangent(self, lse: jax.Array, out: jax.Array, dout: jax.Array,
                      lse_tail: jax.Array | None = None) -> jax.Array | None:
    """The sinks' gradient ``[N]`` (None without sinks); see `sinks_cotangent`."""
    if self.sinks is None:
      return None
    return sinks_cotangent(self.sinks, lse, out, dout, lse_tail)

  @property
  def batch(self) -> int:
    return self.query.shape[0]

  @property
  def num_heads(self) -> int:
    return self.query.shape[2]

  @property
  def num_kv_heads(self) -> int:
    return self.key.shape[2]

  @property
  def has_segments(self) -> bool:
    return self.q_segment_ids is not None

  @property
  def visible_window(self) -> tuple[int | None, int | None]:
    """``(left, right)``: query t sees keys ``t - left <= s <= t + right`` by position
    (None: unbounded), with ``is_causal`` folded in (right at most 0)."""
    left, right = self.local_window if self.local_window is not None else (None, None)
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return left, right


DIFF_FIELDS = ("query", "key", "value", "bias", "sinks")

# Everything generic code (dispatch, sharding) knows of this op. The labels name
# each dim of the operands and results for the Shardy sharding rule (operands
# sharing a letter propagate shardings to each other); the leading label is the
# dim that may be several (merged into one before implementations see it).
DEFINITION = OpDefinition(
    name=OP_NAME,
    diff_fields=DIFF_FIELDS,
    arg_labels=dict(query="btnh", key="bskh", value="bskd", bias="bnts", mask="bnts",
                    query_seq_lengths="b", key_value_seq_lengths="b", q_segment_ids="bt",
                    kv_segment_ids="bs", q_offset="", sinks="n"),
    result_labels=dict(out="btnd", lse="bnt", lse_tail="bnt"),
    leading_label="b",
    plan=attention_plan,
)


def apply_sinks(sinks: jax.Array, out: jax.Array,
                lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(out [B, T, N, Hv], lse [B, N, T])`` of attention without sinks -> with
  `sinks` ``[N]``.

  Each row's key weights shrink by ``sum / (sum + exp(sink)) = sigmoid(lse -
  sink)``, and the lse takes the sink in (``logaddexp``). Rows with no visible
  key (lse +inf, or -inf as ring attention keeps them) keep output 0 and their lse.
  """
  sink = sinks.astype(jnp.float32)[None, :, None]  # [1, N, 1] like lse
  empty = jnp.isinf(lse)
  lse_keys = jnp.where(empty, 0.0, lse)
  weight = jax.nn.sigmoid(lse_keys - sink)  # [B, N, T]
  rows = jnp.moveaxis(weight, 1, 2)[..., None]  # [B, T, N, 1] like out
  out = (out.astype(jnp.float32) * rows).astype(out.dtype)
  return out, jnp.where(empty, lse, jnp.logaddexp(lse_keys, sink))


def sinks_cotangent(sinks: jax.Array, lse: jax.Array, out: jax.Array,
                    dout: jax.Array, lse_tail: jax.Array | None = None) -> jax.Array:
  """The gradient ``[N]`` of `sinks`, from the lse (sinks included) a forward
  returned, its output and the output's cotangent.

  A sink's weight in row t is ``p_t = exp(sink - lse_t)``; it takes no value, so
  its logit's gradient is ``-p_t * rowsum(dout * out)_t``, summed over the rows
  of its head (0 for rows with no visible key: lse +-inf there, out 0).
  `lse_tail`: the lse's rounding error where the forward gave it (the chunked
  one): next to huge logits the lse alone rounds away the row's log-sum, and a
  sink near them would get weight 1. ``p_t`` is clamped at 1, as a weight is: a
  kernel's lse may lie below the sink (rounded, or the sink saturated at
  float32's maximum), and an inf weight would make NaN of a zero cotangent.
  """
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32),
                     out.astype(jnp.float32))
  lse = lse.astype(jnp.float32)
  z = sinks.astype(jnp.float32)[None, :, None] - lse
  if lse_tail is not None:
    z = z - lse_tail.astype(jnp.float32)
  p_sink = jnp.where(jnp.isinf(lse), 0.0, jnp.exp(jnp.minimum(z, 0.0)))
  return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


def _canonical_window(local_window_size: Any) -> tuple[int | None, int | None] | None:
  if local_window_size is None:
    return None
  allowed = ("an int w >= 0 or a (left, right) pair of ints >= 0 or None (None: "
             "unbounded on that side)")
  if isinstance(local_window_size, Sequence) and not isinstance(local_window_size, str):
    if len(local_window_size) != 2:
      raise ValueError(f"local_window_size must be {allowed}; got {local_window_size!r}")
    sides = tuple(local_window_size)
  else:
    sides = (local_window_size,)
  pair = []
  for side in sides:
    if side is not None:
      try:
        side = _checks.static_int("local_window_size", side, allowed)
      except TypeError:
        raise ValueError(
            f"local_window_size must be {allowed}, each a Python int or a concrete "
            "integer scalar (static: not a traced array); got "
            f"{local_window_size!r}") from None
      if side < 0:
        raise ValueError(f"local_window_size must be {allowed}; got "
                         f"{local_window_size!r}")
    elif len(sides) == 1:
      raise ValueError(f"local_window_size must be {allowed}; got {local_window_size!r}")
    pair.append(side)
  return (pair[0], pair[0]) if len(pair) == 1 else (pair[0], pair[1])


def _canonical_pairwise(name: str, x: Any, batch_shape: tuple[int, ...], n: int,
                        t: int, s: int) -> jax.Array:
  """Bias/mask: broadcastable to ``[*batch, N, T, S]`` -> ``[*batch|1, N|1, T|1, S|1]``
  (batch dims all given or all 1; `canonical_args` merges them)."""
  full = (*batch_shape, n, t, s)
  if x.ndim > len(full):
    raise ValueError(f"{name} must broadcast to {full} ([*batch, N, T, S]); got "
                     f"{_checks.describe(x)}")
  shape = (1,) * (len(full) - x.ndim) + tuple(x.shape)
  for have, want in zip(shape, full):
    if have not in (1, want):
      raise ValueError(f"{name} must broadcast to {full} ([*batch, N, T, S]); got "
                       f"{_checks.describe(x)}")
  x = x.reshape(shape)
  lead = shape[:len(batch_shape)]
  if len(batch_shape) != 1 and not all(d == 1 for d in lead):
    x = jnp.broadcast_to(x, (*batch_shape, *shape[len(batch_shape):]))
  return x


def _lengths(name: str, x: Any, batch_shape: tuple[int, ...], limit: int) -> jax.Array:
  x = _checks.as_array(name, x)
  _checks.check_int(name, x)
  if tuple(x.shape) != batch_shape:
    raise ValueError(f"{name} must have shape {batch_shape} (the batch dims); got "
                     f"{_checks.describe(x)}")
  if _checks.is_concrete(x) and x.size:
    values = np.asarray(x)
    if values.min() < 0 or values.max() > limit:
      raise ValueError(f"{name} must lie in [0, {limit}]; got values from "
                       f"{values.min()} to {values.max()}")
  # Traced values cannot be checked: clipped here, so that every implementation
  # reads the same lengths (a kernel's reads past the end are not defined).
  # Clipped before the cast: a wide or unsigned length must not wrap negative.
  return jnp.clip(x, 0, limit).astype(jnp.int32)


def _segments(name: str, x: Any, batch_shape: tuple[int, ...], length: int,
              length_name: str) -> jax.Array:
  x = _checks.as_array(name, x)
  _checks.check_int(name, x)
  if tuple(x.shape) != (*batch_shape, length):
    raise ValueError(f"{name} must have shape {(*batch_shape, length)} ([*batch, "
                     f"{length_name}]); got {_checks.describe(x)}")
  return x.astype(jnp.int32)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int | None, int | None] | None = None,
    logits_soft_cap: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
    precision: Any = None,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Scaled dot-product attention, ``softmax(q k^T * scale + bias) v``.

  Layouts follow `jax.nn.dot_product_attention`. MHA, GQA and MQA are all
  ``N % K == 0`` (query head n uses key/value head ``n // (N // K)``).

  Args:
    query: ``[*batch, T, N, H]``.
    key: ``[*batch, S, K, H]``.
    value: ``[*batch, S, K, Hv]``.
    bias: optional, broadcastable to ``[*batch, N, T, S]``; gets a gradient.
    mask: optional bool, broadcastable to ``[*batch, N, T, S]``; True attends.
    scale: logit scale; default ``1 / sqrt(H)``.
    is_causal: query t attends only keys ``s <= t``.
    query_seq_lengths: optional int ``[*batch]``; queries past it output 0.
    key_value_seq_lengths: optional int ``[*batch]``; keys past it are ignored.
      Both lengths must lie in [0, T] (resp. [0, S]): checked where the values
      are known (outside `jax.jit`); traced values are clipped into that range.
    local_window_size: optional int w (meaning ``(w, w)``) or ``(left, right)``:
      query t attends keys ``t - left <= s <= t + right``.
    logits_soft_cap: optional c > 0: logits become ``c * tanh(logits / c)``.
    q_segment_ids: optional int ``[*batch, T]`` (packed sequences).
    kv_segment_ids: optional int ``[*batch, S]``; required with q_segment_ids.
    sinks: optional float ``[N]``: attention sinks, one logit per query head that
      joins each row's softmax denominator and takes no value (gpt-oss,
      StreamingLLM); gets a gradient. Every implementation but cuDNN takes it
      (and `tokamax.ring_attention`).
    precision: matmul precision, as `jax.lax.dot_general` takes it.
    implementation: None (choose), a name (``"xla"``, ``"xla_chunked"``,
      ``"cudnn"``, ``"triton"``, ``"mosaic"``, ...), a sequence of names tried in
      order, or a `tokamax.Op` instance.

  Returns:
    ``[*batch, T, N, Hv]`` in the query dtype. Rows with no visible key are 0.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), jnp.bfloat16)
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 64), jnp.bfloat16)
    >>> out = tokamax.dot_product_attention(q, k, v, is_causal=True)
  """
  args, batch_shape = canonical_args(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sinks=sinks,
      precision=precision, merge_batch=False)
  return dispatch.call(DEFINITION, args, implementation, lead_dims=len(batch_shape))


def canonical_args(query, key, value, bias=None, mask=None, *, scale=None,
                   is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                   local_window_size=None, logits_soft_cap=None, q_segment_ids=None,
                   kv_segment_ids=None, sinks=None, precision=None,
                   merge_batch=True) -> tuple[AttentionArgs, tuple[int, ...]]:
  """Validates `dot_product_attention`'s arguments (same names and meaning).

  `merge_batch=False` keeps the batch dims apart (dispatch merges them, after
  partitioning: a sharded non-leading batch dim then stays split).

  Returns:
    The canonical `AttentionArgs` (one flat batch dim) and the original batch dims.
  """
  query = _checks.as_array("query", query)
  key = _checks.as_array("key", key)
  value = _checks.as_array("value", value)
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.check_float(name, x)
    if x.ndim < 4:
      raise ValueError(f"{name} must have rank >= 4 ([*batch, seq, heads, head_dim]); "
                       f"got {_checks.describe(x)}")
  _checks.check_same_dtype(("query", "key", "value"), (query, key, value))
  if not (query.ndim == key.ndim == value.ndim):
    raise ValueError(f"query, key and value must have the same rank; got query "
                     f"{_checks.describe(query)}; key {_checks.describe(key)}; "
                     f"value {_checks.describe(value)}")
  batch_shape = tuple(query.shape[:-3])
  t, n, h = query.shape[-3:]
  s, k, hk = key.shape[-3:]
  if tuple(key.shape[:-3]) != batch_shape or tuple(value.shape[:-3]) != batch_shape:
    raise ValueError(f"query, key and value must share batch dims; got "
                     f"{query.shape[:-3]}, {key.shape[:-3]} and {value.shape[:-3]}")
  if hk != h:
    raise ValueError(f"key head dim must equal query head dim {h}; got key "
                     f"{_checks.describe(key)}")
  if tuple(value.shape[-3:-1]) != (s, k):
    raise ValueError(f"value must have shape [*batch, {s}, {k}, Hv] to match key; got "
                     f"{_checks.describe(value)}")
  if k == 0 or n % k:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={k} "
                     f"(and K > 0); got query {_checks.describe(query)}; key "
                     f"{_checks.describe(key)}")
  if scale is None:
    scale = 1.0 / math.sqrt(h) if h else 1.0
  else:
    scale = _checks.static_float("scale", scale)
  if logits_soft_cap is not None:
    allowed = "None or a finite float > 0"
    if isinstance(logits_soft_cap, (bool, np.bool_)):
      raise ValueError(f"logits_soft_cap must be {allowed}; got {logits_soft_cap!r}")
    logits_soft_cap = _checks.static_float("logits_soft_cap", logits_soft_cap, allowed)
    if logits_soft_cap <= 0:
      raise ValueError(f"logits_soft_cap must be {allowed}; got {logits_soft_cap!r}")
  is_causal = _checks.static_bool("is_causal", is_causal)

  if bias is not None:
    bias = _checks.as_array("bias", bias)
    _checks.check_float("bias", bias)
    bias = _canonical_pairwise("bias", bias, batch_shape, n, t, s)
  if mask is not None:
    mask = _checks.as_array("mask", mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be a bool array; got {_checks.describe(mask)}")
    mask = _canonical_pairwise("mask", mask, batch_shape, n, t, s)
  if query_seq_lengths is not None:
    query_seq_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch_shape, t)
  if key_value_seq_lengths is not None:
    key_value_seq_lengths = _lengths("key_value_seq_lengths", key_value_seq_lengths,
                                     batch_shape, s)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None:
    q_segment_ids = _segments("q_segment_ids", q_segment_ids, batch_shape, t, "T")
    kv_segment_ids = _segments("kv_segment_ids", kv_segment_ids, batch_shape, s, "S")
  if sinks is not None:
    sinks = _checks.as_array("sinks", sinks)
    _checks.check_float("sinks", sinks)
    if tuple(sinks.shape) != (n,):
      raise ValueError(f"sinks must have shape ({n},) (one logit per query head, "
                       f"N={n}); got {_checks.describe(sinks)}")

  args = AttentionArgs(
      query=query,
      key=key,
      value=value,
      bias=bias,
      mask=mask,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      scale=float(scale),
      is_causal=is_causal,
      local_window=_canonical_window(local_window_size),
      logits_soft_cap=logits_soft_cap,
      precision=_checks.canonical_precision(precision),
      sinks=sinks,
  )
  if merge_batch:
    # One flat batch dim (sized explicitly: -1 cannot be inferred when another
    # dim is 0, an empty sequence).
    args = sharding.merge_leading(DEFINITION, args, len(batch_shape))
  return args, batch_shape
