"""SPMD partitioning of every op: one mechanism, per-op rules, all implementations.

`dispatch.call` hands each direction of an op call (the forward, and the backward
at grad time) to :func:`forward` / :func:`backward` here. When the program runs
on more than one device, the per-shard computation is wrapped so that, whatever
the shardings of the arguments:

- on a mesh with Auto axes (GSPMD / Shardy), a
  `jax.experimental.custom_partitioning` whose `partition` callback reads the
  operands' shardings at compile time, asks the op's rule for a `Plan`, and
  lowers the same implementation on the local shapes;
- on a mesh with Explicit axes (shardings in the types), the same `Plan` is
  computed at trace time and the computation runs under `jax.shard_map`;
- inside `shard_map` (all axes manual) nothing is wrapped: ops see local shards.

Leading dims (the rows of layer_norm and gated_linear_unit, the batch of
attention) reach the partitioned call unflattened (``x [*rows, D]``): a merge of
dims keeps a sharding only when it is on the major one, so a flattened
``[B, T(sharded), D]`` would be gathered. The plans split each leading dim on its
own, and inside the partitioned region the local shards are flattened to the one
leading dim every implementation takes (and the results split back).

A `Plan` says which layout each operand is brought to (dims the op cannot split
are replicated, dims it can split keep their sharding), the layout of the output
and of the residuals, and the local computation, which may use collectives over
the mesh axes (a psum of the statistics of feature-sharded layer_norm, of the
partial outputs of expert-parallel ragged_dot). Backward: the same plan; the
cotangent of an operand that is replicated over a mesh axis the computation is
split over is psum'd over that axis.

One function per op decides its plan: `attention_plan`, `layer_norm_plan`,
`gated_linear_unit_plan`, `ragged_dot_plan`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tokamax._src import activation as activation_lib

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tokamax_spmd_partitioning", default=True)


@contextlib.contextmanager
def spmd_partitioning(enabled: bool = True):
  """Turns the per-op SPMD partitioning rules on or off inside the context.

  Off, ops under `jax.jit` with sharded inputs are partitioned by XLA's default
  propagation (which may all-gather them). Turn it off to `jax.export` a
  multi-device program (the custom partitioning call is not serializable).
  """
  token = _enabled.set(enabled)
  try:
    yield
  finally:
    _enabled.reset(token)


# ------------------------------------------------------------------- helpers


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _entry(axes: tuple[str, ...]):
  axes = tuple(axes)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in _axes(axes))


def shard_index(mesh, axes) -> jax.Array:
  """Linear index of this device along `axes` (major to minor), int32."""
  index = jnp.int32(0)
  for a in _axes(axes):
    index = index * mesh.shape[a] + jax.lax.axis_index(a).astype(jnp.int32)
  return index


def _fit(mesh, entry, dim: int, taken=()) -> tuple[str, ...]:
  """The axes of `entry` usable to split a dim of size `dim`: a prefix of them
  that divides it, not already used."""
  axes = []
  for a in _axes(entry):
    if a in taken or a in axes:
      break
    if dim % (_size(mesh, (*axes, a))) != 0:
      break
    axes.append(a)
  return tuple(axes)


def _spec(sds, ndim: int) -> tuple:
  sharding = getattr(sds, "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  spec = tuple(None if e is P.UNCONSTRAINED else e for e in spec)
  return spec + (None,) * (ndim - len(spec))


def _fit_each(mesh, entries, dims, taken=()) -> tuple[tuple[str, ...], ...]:
  """Independent dims (rows, batch) each split on their own: per dim, the axes of
  its entry that fit it, not already used by an earlier one."""
  fitted = []
  for entry, dim in zip(entries, dims):
    axes = _fit(mesh, entry, dim, taken)
    taken = (*taken, *axes)
    fitted.append(axes)
  return tuple(fitted)


def _joined(axes_per_dim) -> tuple[str, ...]:
  return tuple(a for axes in axes_per_dim for a in axes)


def _psum(x, axes):
  axes = _axes(axes)
  return jax.lax.psum(x, axes) if axes and x is not None else x


@dataclasses.dataclass
class Plan:
  """How one op call is split over a mesh.

  Attributes:
    args: the op's args dataclass with a `PartitionSpec` per array field (the
      layout each operand is brought to).
    out: the output's `PartitionSpec`.
    residuals: ``{residual name: PartitionSpec}`` for the documented residuals.
    localize: ``(mesh, local_args) -> local_args``: per-shard adjustments of the
      arguments (offsets, local group sizes...); traced inside the partitioned
      computation, may use `shard_index`.
    forward: optional ``(mesh, local_args, run) -> (out, residuals)`` replacing
      ``run(local_args)`` (e.g. to psum partial outputs).
    backward: optional ``(mesh, local_args, residuals, out, dout, run) -> grads``
      replacing ``run(...)``; grads are psum'd afterwards over the plan's axes
      each operand is not split over.
  """

  args: Any
  out: P
  residuals: dict[str, P]
  localize: Callable | None = None
  forward: Callable | None = None
  backward: Callable | None = None

  def axes(self) -> set[str]:
    used = set()
    for spec in jax.tree_util.tree_leaves(self.args, is_leaf=lambda x: isinstance(x, P)):
      for e in spec:
        used.update(_axes(e))
    return used


def _is_spec(x):
  return isinstance(x, P)


# ------------------------------------------------------------------ op rules


def attention_plan(mesh, shapes, specs, supports) -> Plan:
  """Attention: batch, query heads (and kv heads when they divide evenly) and the
  query sequence are split; keys/values are never split along the sequence here
  (sequence-sharded keys: `tokamax.ring_attention`). A split query sequence
  gives each shard its ``q_offset`` (needs an implementation that takes it)."""
  q = shapes.query
  nb = q.ndim - 3  # leading batch dims
  *batch, t, n, _ = q.shape
  kh = shapes.key.shape[-2]
  qs = specs.query
  bx = _fit_each(mesh, qs[:nb], batch)
  nx = _fit(mesh, qs[nb + 1], n, _joined(bx))
  tx = _fit(mesh, qs[nb], t, (*_joined(bx), *nx))
  needs_offset = shapes.is_causal or shapes.local_window is not None
  if tx and needs_offset and not supports("q_offset"):
    warnings.warn(
        f"dot_product_attention: the query sequence (T={t}) is sharded over mesh "
        f"axes {tx}, but the chosen implementation does not take q_offset (needed "
        "for causal/local_window on a query shard), so the queries are gathered. "
        "Pass an implementation that takes it (e.g. implementation='triton' on a "
        "GPU), or use a mesh with explicit axes (then dispatch prefers one), to "
        "keep the split.", stacklevel=2)
    tx = ()
  # Key/value heads follow the query heads when they split as evenly; when each
  # shard's query heads all share one kv head (MQA, or more shards than kv
  # heads) the kv are split over the longest prefix of the head axes that divides
  # K (none: whole) and each shard slices its head from its local kv heads.
  while nx and kh % _size(mesh, nx) and _size(mesh, nx) % kh:
    nx = nx[:-1]
  slice_kv = bool(nx) and kh % _size(mesh, nx) != 0
  kx = nx
  if slice_kv:
    kx = ()
    for a in nx:
      if kh % _size(mesh, (*kx, a)):
        break
      kx = (*kx, a)
  rest = nx[len(kx):]  # the head axes each shard slices its kv head along
  B = tuple(_entry(axes) for axes in bx)
  N, T = _entry(nx), _entry(tx)

  def pairwise(x):
    if x is None:
      return None
    return P(*(e if d != 1 else None for e, d in zip((*B, N, T, None), x.shape)))

  def per_batch(x, *rest_spec):
    return None if x is None else P(*B, *rest_spec)

  arg_specs = dataclasses.replace(
      shapes, query=P(*B, T, N, None), key=P(*B, None, _entry(kx), None),
      value=P(*B, None, _entry(kx), None), bias=pairwise(shapes.bias),
      mask=pairwise(shapes.mask),
      query_seq_lengths=per_batch(shapes.query_seq_lengths),
      key_value_seq_lengths=per_batch(shapes.key_value_seq_lengths),
      q_segment_ids=per_batch(shapes.q_segment_ids, T),
      kv_segment_ids=per_batch(shapes.kv_segment_ids, None),
      q_offset=None if shapes.q_offset is None else P(),
      sinks=None if shapes.sinks is None else P(N))

  # localize and backward see the local shards flattened to one batch dim.
  def localize(mesh, a):
    updates = {}
    if slice_kv:
      # Global kv head shard_index(nx) // (size(nx) / K); the local kv hold
      # K / size(kx) of them, from shard_index(kx) * K / size(kx) on.
      head = shard_index(mesh, rest) // (_size(mesh, nx) // kh)
      updates["key"] = jax.lax.dynamic_slice_in_dim(a.key, head, 1, axis=2)
      updates["value"] = jax.lax.dynamic_slice_in_dim(a.value, head, 1, axis=2)
    if not tx:
      return dataclasses.replace(a, **updates)
    t_local = a.query.shape[1]
    start = shard_index(mesh, tx) * t_local
    if needs_offset or a.q_offset is not None:
      base = jnp.int32(0) if a.q_offset is None else a.q_offset
      updates["q_offset"] = base + start
    if a.query_seq_lengths is not None:
      updates["query_seq_lengths"] = jnp.clip(a.query_seq_lengths - start, 0, t_local)
    return dataclasses.replace(a, **updates)

  def backward(mesh, a, residuals, out, dout, run):
    grads = dict(run(a, residuals, out, dout))
    head = shard_index(mesh, rest) // (_size(mesh, nx) // kh)
    local_kh = kh // _size(mesh, kx)
    # Back to the local kv heads; then psum'd over every plan axis the kv are not
    # split on (`rest` and the query-sequence axes).
    for name in ("key", "value"):
      g = grads.get(name)
      if g is not None:
        full = jnp.zeros((*g.shape[:2], local_kh, g.shape[3]), g.dtype)
        grads[name] = jax.lax.dynamic_update_slice_in_dim(full, g, head, axis=2)
    return grads

  return Plan(args=arg_specs, out=P(*B, T, N, None), residuals={"lse": P(*B, N, T)},
              localize=localize, backward=backward if slice_kv else None)


def layer_norm_plan(mesh, shapes, specs, supports) -> Plan:
  """Layer/RMS norm: each row dim split freely; a split feature axis runs a jnp
  path whose statistics (sum and sum of squares) are psum'd across feature
  shards (it sees the local rows flattened, ``[R, D]``)."""
  del supports
  *rows, d = shapes.x.shape
  rx = _fit_each(mesh, specs.x[:-1], rows)
  fx = _fit(mesh, specs.x[-1], d, _joined(rx))
  R = tuple(_entry(axes) for axes in rx)
  F = _entry(fx)
  arg_specs = dataclasses.replace(
      shapes, x=P(*R, F), scale=None if shapes.scale is None else P(F),
      offset=None if shapes.offset is None else P(F))
  plan = Plan(args=arg_specs, out=P(*R, F),
              residuals={"mean": P(*R), "rstd": P(*R)})
  if fx:
    plan.forward = lambda mesh, a, run: _feature_sharded_layer_norm(a, fx, d)
    plan.backward = (lambda mesh, a, res, out, dout, run:
                     _feature_sharded_layer_norm_grad(a, dout, fx, d))
  return plan


def _norm_stats(a, fx, d):
  xf = a.x.astype(jnp.float32)
  if a.subtract_mean:
    mean = _psum(jnp.sum(xf, axis=-1), fx) / d
  else:
    mean = jnp.zeros(xf.shape[:-1], jnp.float32)
  centered = xf - mean[:, None]
  var = _psum(jnp.sum(jnp.square(centered), axis=-1), fx) / d
  rstd = jax.lax.rsqrt(var + a.epsilon)
  return centered * rstd[:, None], mean, rstd


def _feature_sharded_layer_norm(a, fx, d):
  xhat, mean, rstd = _norm_stats(a, fx, d)
  y = xhat
  if a.scale is not None:
    y = y * a.scale.astype(jnp.float32)
  if a.offset is not None:
    y = y + a.offset.astype(jnp.float32)
  return y.astype(a.x.dtype), {"mean": mean, "rstd": rstd}


def _feature_sharded_layer_norm_grad(a, dout, fx, d):
  xhat, _, rstd = _norm_stats(a, fx, d)
  dy = dout.astype(jnp.float32)
  g = dy if a.scale is None else dy * a.scale.astype(jnp.float32)
  proj = _psum(jnp.sum(g * xhat, axis=-1, keepdims=True), fx) / d
  dx = g - xhat * proj
  if a.subtract_mean:
    dx = dx - _psum(jnp.sum(g, axis=-1, keepdims=True), fx) / d
  grads = {"x": (dx * rstd[:, None]).astype(a.x.dtype)}
  if a.scale is not None:
    grads["scale"] = jnp.sum(dy * xhat, axis=0).astype(a.scale.dtype)
  if a.offset is not None:
    grads["offset"] = jnp.sum(dy, axis=0).astype(a.offset.dtype)
  return grads


def gated_linear_unit_plan(mesh, shapes, specs, supports) -> Plan:
  """GLU: each row dim of x split; weights split on N (tensor parallel: the
  output is split on N). The contraction dim K is never split (replicated)."""
  del supports
  *rows, _ = shapes.x.shape
  n = shapes.weights.shape[2]
  mx = _fit_each(mesh, specs.x[:-1], rows)
  nx = _fit(mesh, specs.weights[2], n, _joined(mx))
  if nx and not _elementwise(shapes.activation):
    nx = ()  # an activation that mixes a row's N columns needs whole rows
  M = tuple(_entry(axes) for axes in mx)
  N = _entry(nx)
  arg_specs = dataclasses.replace(shapes, x=P(*M, None), weights=P(None, None, N))
  return Plan(args=arg_specs, out=P(*M, N), residuals={"projections": P(*M, None, N)})


def _elementwise(activation) -> bool:
  try:
    activation_lib.check_elementwise_activation(activation)
  except NotImplementedError:
    return False
  return True


def ragged_dot_plan(mesh, shapes, specs, supports) -> Plan:
  """ragged_dot: token (row) sharding with group_sizes replicated (each shard
  derives its local group sizes), expert parallelism with rhs split over groups
  (each shard runs its groups with ``group_offset`` and the partial outputs are
  psum'd), and rhs split on N (output split on N)."""
  del supports
  m, _ = shapes.lhs.shape
  g_rhs, _, n = shapes.rhs.shape
  mx = _fit(mesh, specs.lhs[0], m)
  ex = _fit(mesh, specs.rhs[0], g_rhs, mx)
  nx = _fit(mesh, specs.rhs[2], n, (*mx, *ex))
  M, E, N = _entry(mx), _entry(ex), _entry(nx)
  arg_specs = dataclasses.replace(
      shapes, lhs=P(M, None), rhs=P(E, None, N), group_sizes=P(None),
      group_offset=None if shapes.group_offset is None else P())

  def localize(mesh, a):
    updates = {}
    if mx:
      m_local = a.lhs.shape[0]
      start = shard_index(mesh, mx) * m_local
      ends = jnp.cumsum(a.group_sizes)
      begins = ends - a.group_sizes
      updates["group_sizes"] = (jnp.clip(ends - start, 0, m_local)
                                - jnp.clip(begins - start, 0, m_local)).astype(jnp.int32)
    if ex:
      base = jnp.int32(0) if a.group_offset is None else a.group_offset
      updates["group_offset"] = base + shard_index(mesh, ex) * a.rhs.shape[0]
    return dataclasses.replace(a, **updates)

  plan = Plan(args=arg_specs, out=P(M, N), residuals={}, localize=localize)
  if ex:
    def forward(mesh, a, run):
      out, residuals = run(a)
      return _psum(out, ex), residuals
    plan.forward = forward
  return plan


RULES: dict[str, Callable[..., Plan]] = {
    "dot_product_attention": attention_plan,
    "layer_norm": layer_norm_plan,
    "gated_linear_unit": gated_linear_unit_plan,
    "ragged_dot": ragged_dot_plan,
}


# Dimension labels for the Shardy sharding rule: operands sharing a label
# propagate shardings to each other; the partition callback decides the layout.
_LABELS = {
    "dot_product_attention": (
        dict(query="btnh", key="bskh", value="bskd", bias="bnts", mask="bnts",
             query_seq_lengths="b", key_value_seq_lengths="b", q_segment_ids="bt",
             kv_segment_ids="bs", q_offset="", sinks="n"),
        dict(out="btnd", lse="bnt")),
    "layer_norm": (dict(x="rd", scale="d", offset="d"),
                   dict(out="rd", mean="r", rstd="r")),
    "gated_linear_unit": (dict(x="mk", weights="kpn"),
                          dict(out="mn", projections="mpn")),
    "ragged_dot": (dict(lhs="mk", rhs="gkn", group_sizes="G", group_offset=""),
                   dict(out="mn")),
}


# The label of the leading (row / batch) dim of the ops whose leading dims may
# be several (`dispatch.call`'s ``lead_dims``): each operand and result whose
# label starts with it carries all of them.
_LEADING = {"dot_product_attention": "b", "layer_norm": "r", "gated_linear_unit": "m"}


def _leads(op_name: str, label: str | None) -> bool:
  lead = _LEADING.get(op_name)
  return lead is not None and bool(label) and label[0] == lead


def _batched_fields(op_name: str, args):
  """(name, array) of the args fields that carry the leading dims."""
  table = _LABELS[op_name][0]
  for f in dataclasses.fields(args):
    x = getattr(args, f.name)
    if (x is not None and not f.metadata.get("static")
        and _leads(op_name, table.get(f.name))):
      yield f.name, x


def _merge(x, n: int):
  """``[*lead (n dims), *rest] -> [prod(lead), *rest]`` (n = 0 adds a dim of 1)."""
  shape = (math.prod(x.shape[:n]), *x.shape[n:])
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return x.reshape(shape)


def _split(x, lead: tuple[int, ...]):
  return x.reshape(*lead, *x.shape[1:])


def _shape_of(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def merge_leading(op_name: str, args, n: int, abstract: bool = False):
  """`args` with the `n` leading dims of its batched fields merged into one: the
  canonical args every implementation takes (and autotuning keys are made of).
  `abstract`: those fields as shapes only (no reshape is traced)."""
  if n == 1:
    return args
  return dataclasses.replace(args, **{
      name: _merge(_shape_of(x) if abstract else x, n)
      for name, x in _batched_fields(op_name, args)})


def leading_shape(op_name: str, args, n: int) -> tuple[int, ...]:
  """The `n` leading dims of `args` (those of its first batched field)."""
  _, x = next(_batched_fields(op_name, args))
  return tuple(x.shape[:n])


def split_results(op_name: str, out, residuals: dict, lead: tuple[int, ...]):
  """A forward's results on merged args, split back to the leading dims `lead`;
  residuals only where documented as per row (opaque ones stay as they are)."""
  table = _LABELS[op_name][1]
  residuals = {k: _split(v, lead) if _leads(op_name, table.get(k)) else v
               for k, v in residuals.items()}
  return _split(out, lead), residuals


def merge_residuals(op_name: str, residuals: dict, n: int,
                    abstract: bool = False) -> dict:
  """Documented per-row residuals with their `n` leading dims merged into one."""
  if n == 1:
    return residuals
  table = _LABELS[op_name][1]
  return {k: _merge(_shape_of(v) if abstract else v, n)
          if _leads(op_name, table.get(k)) else v for k, v in residuals.items()}


def _expanded(op_name: str, label: str | None, n: int):
  """A label with its leading-dim letter expanded to one factor per leading dim
  (each is split on its own)."""
  if label is None or n == 1 or not _leads(op_name, label):
    return label
  return (*(f"{label[0]}{i}" for i in range(n)), *label[1:])


class _Labeller:
  """Per-dim factor names; size-1 dims (broadcast) and unknown arrays get fresh ones."""

  def __init__(self):
    self._count = 0

  def fresh(self):
    self._count += 1
    return f"f{self._count}"

  def __call__(self, x, names):
    if names is None or len(names) != len(x.shape):
      return tuple(self.fresh() for _ in x.shape)
    return tuple(nm if d != 1 else self.fresh() for nm, d in zip(names, x.shape))


def _sharding_rule(op_name, operands, out_shape, backward_direction, lead=1):
  args_table, out_table = _LABELS[op_name]
  args_table = {k: _expanded(op_name, v, lead) for k, v in args_table.items()}
  out_table = {k: _expanded(op_name, v, lead) for k, v in out_table.items()}
  lab = _Labeller()
  args = operands[0]
  # The array fields, as the args flatten: static fields are not operands even
  # when their value has a `shape` (a numpy dtype as preferred_element_type).
  operand_labels = [lab(getattr(args, f.name), args_table.get(f.name))
                    for f in dataclasses.fields(args)
                    if not f.metadata.get("static")
                    and getattr(args, f.name) is not None]
  if backward_direction:
    _, residuals, out, dout = operands
    operand_labels += [lab(residuals[k], out_table.get(k)) for k in sorted(residuals)]
    operand_labels += [lab(out, out_table["out"]), lab(dout, out_table["out"])]
    result_labels = [lab(g, args_table.get(k)) for k, g in sorted(out_shape.items())
                     if g is not None]
  else:
    out, residuals = out_shape
    result_labels = [lab(out, out_table["out"])]
    result_labels += [lab(residuals[k], out_table.get(k)) for k in sorted(residuals)]
  return SdyShardingRule(tuple(ArrayMapping(*x) for x in operand_labels),
                         tuple(ArrayMapping(*x) for x in result_labels))


# --------------------------------------------------------------- the drivers


def _manual_context() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


def _explicit_mesh(leaves):
  for x in leaves:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and mesh._any_axis_explicit:
      return mesh
  return None


def active(leaves) -> bool:
  """Whether an op call on `leaves` is partitioned by the rules here."""
  if not _enabled.get() or jax.device_count() == 1 or _manual_context():
    return False
  return not any(type(x).__name__ == "BatchTracer" for x in leaves)


def _plain(tree):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tree)


def _residual_specs(plan: Plan, residuals) -> dict:
  unknown = set(residuals) - set(plan.residuals)
  if unknown:
    raise NotImplementedError(
        f"cannot partition undocumented residuals {sorted(unknown)}")
  return {k: plan.residuals[k] for k in residuals}


@dataclasses.dataclass
class _Call:
  """One direction of one op call, as the drivers see it."""

  op_name: str
  backward: bool
  run: Callable  # forward: run(args) -> (out, residuals); backward: run(a, r, o, do)
  supports: Callable[[str], bool]
  lead: int = 1  # leading dims of the operands (merged into one for `run`)
  _operands_shape: Any = None

  def fn(self, *operands):
    return self._merged(self._direct)(*operands)

  def _direct(self, *operands):
    return dict(self.run(*operands)) if self.backward else self.run(*operands)

  def _merged(self, body: Callable) -> Callable:
    """`body` on the operands with their leading dims merged into one (the shapes
    implementations take), its results split back to the operands' leading dims.
    Inside the partitioned region the operands are the local shards."""
    n, op = self.lead, self.op_name
    if n == 1:
      return body

    def merged(*operands):
      args = operands[0]
      flat = merge_leading(op, args, n)
      if not self.backward:
        out, residuals = body(flat)
        return split_results(op, out, dict(residuals), leading_shape(op, args, n))
      _, residuals, out, dout = operands
      grads = body(flat, merge_residuals(op, residuals, n), _merge(out, n),
                   _merge(dout, n))
      return {k: None if g is None else g.reshape(getattr(args, k).shape)
              for k, g in grads.items()}
    return merged

  def plan(self, mesh, args_sds) -> Plan:
    return _plan(self.op_name, mesh, args_sds, self.supports)

  def specs(self, plan: Plan, out_shape):
    """(operand specs, result specs), pytrees like the operands and the result."""
    if self.backward:
      _, residuals, _, _ = self._operands_shape
      grads = {k: None if g is None else getattr(plan.args, k)
               for k, g in out_shape.items()}
      return ((plan.args, _residual_specs(plan, residuals), plan.out, plan.out), grads)
    _, residuals = out_shape
    return (plan.args,), (plan.out, _residual_specs(plan, residuals))

  def local(self, plan: Plan, mesh):
    return self._merged(self._local(plan, mesh))

  def _local(self, plan: Plan, mesh):
    if not self.backward:
      def forward_local(args):
        args = plan.localize(mesh, args) if plan.localize else args
        if plan.forward is not None:
          return plan.forward(mesh, args, self.run)
        return self.run(args)
      return forward_local

    axes = plan.axes()

    def backward_local(args, residuals, out, dout):
      args = plan.localize(mesh, args) if plan.localize else args
      if plan.backward is not None:
        grads = plan.backward(mesh, args, residuals, out, dout, self.run)
      else:
        grads = dict(self.run(args, residuals, out, dout))
      reduced = {}
      for name, g in grads.items():
        spec = getattr(plan.args, name, None)
        if g is not None and spec is not None:
          own = {a for e in spec for a in _axes(e)}
          g = _psum(g, tuple(sorted(axes - own)))
        reduced[name] = g
      return reduced
    return backward_local


def _plan(op_name: str, mesh, args_sds, supports: Callable[[str], bool]) -> Plan:
  """The op's rule applied to its arguments' shapes and shardings."""
  specs = jax.tree.map(lambda s: _spec(s, len(s.shape)), args_sds)
  return RULES[op_name](mesh, args_sds, specs, supports)


def _typed(tree):
  """Shapes with the shardings their types carry (an explicit-axes mesh)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.typeof(x).sharding), tree)


def _partitioned(call: _Call, operands):
  leaves, treedef = jax.tree.flatten(operands)
  call._operands_shape = _plain(operands)
  mesh = _explicit_mesh(leaves)
  if mesh is not None:
    return _shard_mapped(call, mesh, operands)

  def flat_fn(*ls):
    return tuple(jax.tree.leaves(call.fn(*jax.tree.unflatten(treedef, ls))))

  out_shape = jax.eval_shape(call.fn, *_plain(operands))
  out_treedef = jax.tree.structure(out_shape)

  def decide(mesh, arg_shapes):
    ops_sds = jax.tree.unflatten(treedef, list(arg_shapes))
    plan = call.plan(mesh, ops_sds[0])
    in_specs, out_specs = call.specs(plan, out_shape)
    in_sh = tuple(NamedSharding(mesh, s)
                  for s in jax.tree.leaves(in_specs, is_leaf=_is_spec))
    out_sh = tuple(NamedSharding(mesh, s)
                   for s in jax.tree.leaves(out_specs, is_leaf=_is_spec))
    return plan, in_sh, out_sh

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    plan, in_sh, out_sh = decide(mesh, arg_shapes)
    local = call.local(plan, mesh)

    def lower(*local_leaves):
      return tuple(jax.tree.leaves(local(*jax.tree.unflatten(treedef, local_leaves))))

    return mesh, lower, out_sh, in_sh

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return decide(mesh, arg_shapes)[2]

  rule = _sharding_rule(call.op_name, operands, out_shape, call.backward, call.lead)
  cp = custom_partitioning(flat_fn)
  cp.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=lambda *_: rule)

  @jax.custom_batching.custom_vmap
  def run(*ls):
    return cp(*ls)

  @run.def_vmap
  def _(axis_size, in_batched, *ls):  # under vmap: unpartitioned
    del axis_size
    out = jax.vmap(flat_fn, in_axes=[0 if b else None for b in in_batched])(*ls)
    return out, (True,) * len(out)  # the same structure as `out` (a tuple)

  return jax.tree.unflatten(out_treedef, list(run(*leaves)))


def _shard_mapped(call: _Call, mesh, operands):
  """Explicit-axes mesh: the plan from the typed shardings, then shard_map."""
  plan = call.plan(mesh, _typed(operands)[0])
  out_shape = jax.eval_shape(call.fn, *_plain(operands))
  in_specs, out_specs = call.specs(plan, out_shape)
  operands = jax.tree.map(lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)),
                          operands, in_specs)
  return jax.shard_map(call.local(plan, mesh), mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)(*operands)


def wanted_features(op_name: str, args: Any) -> frozenset[str]:
  """Opt-in features the layout of this call would use, where that is known now.

  Only under a mesh with explicit axes are the operands' shardings part of their
  types at trace time; the op's plan is asked which features it would use (e.g.
  ``q_offset`` for attention queries split along the sequence) so that dispatch
  can prefer an implementation that takes them. Under GSPMD (auto axes) the
  shardings are decided later, when the implementation is already chosen.
  """
  leaves = jax.tree.leaves(args)
  if op_name not in RULES or not active(leaves):
    return frozenset()
  mesh = _explicit_mesh(leaves)
  if mesh is None:
    return frozenset()
  asked = set()

  def supports(feature: str) -> bool:
    asked.add(feature)
    return True

  _plan(op_name, mesh, _typed(args), supports)
  return frozenset(asked)


def forward(op_name: str, args: Any, run: Callable, supports: Callable[[str], bool],
            lead: int = 1):
  """``run(args) -> (out, residuals)``, partitioned over the devices if useful.

  `args` may carry `lead` leading dims (see `merge_leading`); `run` always gets
  them merged into one, and its results are split back.
  """
  call = _Call(op_name, False, run, supports, lead)
  if not active(jax.tree.leaves(args)):
    return call.fn(args)
  return _partitioned(call, (args,))


def backward(op_name: str, args: Any, residuals: dict, out, dout, run: Callable,
             supports: Callable[[str], bool], lead: int = 1):
  """``run(args, residuals, out, dout) -> {field: grad}``, partitioned if useful
  (leading dims as in `forward`)."""
  operands = (args, dict(residuals), out, dout)
  call = _Call(op_name, True, run, supports, lead)
  if not active(jax.tree.leaves(operands)):
    return call.fn(*operands)
  return _partitioned(call, operands)
