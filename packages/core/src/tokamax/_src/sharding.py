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

Each op's folder holds its plan (``tokamax._src.ops.<op>.sharding``), named by
its `OpDefinition` together with the dim labels of its operands and results;
nothing here knows one op from another.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tokamax._src import batching
from tokamax._src.op import OpDefinition, differentiated_again

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


def entry(axes: tuple[str, ...]):
  axes = tuple(axes)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def axes_size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in _axes(axes))


def shard_index(mesh, axes) -> jax.Array:
  """Linear index of this device along `axes` (major to minor), int32."""
  index = jnp.int32(0)
  for a in _axes(axes):
    index = index * mesh.shape[a] + jax.lax.axis_index(a).astype(jnp.int32)
  return index


def fit(mesh, entry, dim: int, taken=()) -> tuple[str, ...]:
  """The axes of `entry` usable to split a dim of size `dim`: a prefix of them
  that divides it, not already used."""
  axes = []
  for a in _axes(entry):
    if a in taken or a in axes:
      break
    if dim % (axes_size(mesh, (*axes, a))) != 0:
      break
    axes.append(a)
  return tuple(axes)


def _spec(sds, ndim: int) -> tuple:
  sharding = getattr(sds, "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  spec = tuple(None if e is P.UNCONSTRAINED else e for e in spec)
  return spec + (None,) * (ndim - len(spec))


def fit_each(mesh, entries, dims, taken=()) -> tuple[tuple[str, ...], ...]:
  """Independent dims (rows, batch) each split on their own: per dim, the axes of
  its entry that fit it, not already used by an earlier one."""
  fitted = []
  for entry, dim in zip(entries, dims):
    axes = fit(mesh, entry, dim, taken)
    taken = (*taken, *axes)
    fitted.append(axes)
  return tuple(fitted)


def joined(axes_per_dim) -> tuple[str, ...]:
  return tuple(a for axes in axes_per_dim for a in axes)


def psum(x, axes):
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
    whole: the call runs unsplit on the operands brought whole, and under a
      mesh with explicit axes outside `shard_map` too: for a computation traced
      in the mesh's own context (a GLU activation with traced params), which
      shard_map's manual context would refuse. Every spec must then be
      replicated.
  """

  args: Any
  out: P
  residuals: dict[str, P]
  localize: Callable | None = None
  forward: Callable | None = None
  backward: Callable | None = None
  whole: bool = False

  def axes(self) -> set[str]:
    used = set()
    for spec in jax.tree_util.tree_leaves(self.args, is_leaf=lambda x: isinstance(x, P)):
      for e in spec:
        used.update(_axes(e))
    return used


def _is_spec(x):
  return isinstance(x, P)


# ----------------------------------------------------- leading dims and labels


def _leads(definition: OpDefinition, label: str | None) -> bool:
  lead = definition.leading_label
  return lead is not None and bool(label) and label[0] == lead


def _batched_fields(definition: OpDefinition, args):
  """(name, array) of the args fields that carry the leading dims."""
  table = definition.arg_labels
  for f in dataclasses.fields(args):
    x = getattr(args, f.name)
    if (x is not None and not f.metadata.get("static")
        and _leads(definition, table.get(f.name))):
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


def merge_leading(definition: OpDefinition, args, n: int, abstract: bool = False):
  """`args` with the `n` leading dims of its batched fields merged into one: the
  canonical args every implementation takes (and autotuning keys are made of).
  `abstract`: those fields as shapes only (no reshape is traced)."""
  if n == 1:
    return args
  return dataclasses.replace(args, **{
      name: _merge(_shape_of(x) if abstract else x, n)
      for name, x in _batched_fields(definition, args)})


def leading_shape(definition: OpDefinition, args, n: int) -> tuple[int, ...]:
  """The `n` leading dims of `args` (those of its first batched field)."""
  _, x = next(_batched_fields(definition, args))
  return tuple(x.shape[:n])


def split_results(definition: OpDefinition, out, residuals: dict,
                  lead: tuple[int, ...]):
  """A forward's results on merged args, split back to the leading dims `lead`;
  residuals only where documented as per row (opaque ones stay as they are)."""
  table = definition.result_labels
  residuals = {k: _split(v, lead) if _leads(definition, table.get(k)) else v
               for k, v in residuals.items()}
  return _split(out, lead), residuals


def merge_residuals(definition: OpDefinition, residuals: dict, n: int,
                    abstract: bool = False) -> dict:
  """Documented per-row residuals with their `n` leading dims merged into one."""
  if n == 1:
    return residuals
  table = definition.result_labels
  return {k: _merge(_shape_of(v) if abstract else v, n)
          if _leads(definition, table.get(k)) else v for k, v in residuals.items()}


def _expanded(definition: OpDefinition, label: str | None, n: int):
  """A label with its leading-dim letter expanded to one factor per leading dim
  (each is split on its own)."""
  if label is None or n == 1 or not _leads(definition, label):
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


def _sharding_rule(definition: OpDefinition, operands, out_shape, backward_direction,
                   lead=1):
  args_table = {k: _expanded(definition, v, lead)
                for k, v in definition.arg_labels.items()}
  out_table = {k: _expanded(definition, v, lead)
               for k, v in definition.result_labels.items()}
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


def in_shard_map() -> bool:
  """Whether the call is traced inside `jax.shard_map` (some mesh axis manual)."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


def explicit_mesh(leaves):
  """The mesh with explicit axes that some of `leaves` is typed with, or None."""
  for x in leaves:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and mesh._any_axis_explicit:
      return mesh
  return None


def active(leaves) -> bool:
  """Whether an op call on `leaves` is partitioned by the rules here."""
  if not _enabled.get() or jax.device_count() == 1 or in_shard_map():
    return False
  if differentiated_again(leaves):
    # `custom_partitioning` has no differentiation rule of its own (`jax.hessian`,
    # `jax.grad` of `jax.grad` differentiate the op's forward and backward): such a
    # call runs the XLA implementations (`HIGHER_ORDER_AUTODIFF`) unwrapped,
    # partitioned by XLA as any JAX code.
    return False
  if any(type(x).__name__ == "BatchTracer" for x in leaves):
    return _partitioned_under_vmap(leaves)
  return True


def _partitioned_under_vmap(leaves) -> bool:
  """Under `jax.vmap` a call is partitioned on a mesh with explicit axes
  (`custom_partitioning`, for auto axes, has no batching rule; `shard_map` has)
  where some operand is split on a dim vmap does not map: unpartitioned, its
  implementation would get that operand typed as split (the GLU's weight
  reshape failed). A call split on its vmapped dims alone stays unpartitioned:
  its implementation sees operands split on nothing, and JAX's batching of
  shard_map would gather such an operand (JAX 0.10) or fail under `jax.grad`
  (0.12)."""
  if explicit_mesh(leaves) is None:
    return False
  # A vmap tracer's type is one example's: its vmapped dims are not in it.
  return any(any(_spec(t, t.ndim)) for t in map(jax.typeof, leaves))


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

  definition: OpDefinition
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
    n, op = self.lead, self.definition
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
    return _plan(self.definition, mesh, args_sds, self.supports)

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
          g = psum(g, tuple(sorted(axes - own)))
        reduced[name] = g
      return reduced
    return backward_local


def _plan(definition: OpDefinition, mesh, args_sds,
          supports: Callable[[str], bool]) -> Plan:
  """The op's rule applied to its arguments' shapes and shardings."""
  specs = jax.tree.map(lambda s: _spec(s, len(s.shape)), args_sds)
  return definition.plan(mesh, args_sds, specs, supports)


def _typed(tree):
  """Shapes with the shardings their types carry (an explicit-axes mesh)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.typeof(x).sharding), tree)


def _partitioned(call: _Call, operands):
  leaves, treedef = jax.tree.flatten(operands)
  call._operands_shape = _plain(operands)
  traced, out_shape = jax.make_jaxpr(call.fn, return_shape=True)(*_plain(operands))
  if traced.consts or traced.effects:
    # Neither `custom_partitioning` nor, for arrays typed with explicit axes,
    # `shard_map` takes a function that closes over arrays (a GLU activation
    # closing over a concrete array) or one with side effects (a kernel run by
    # Pallas' TPU interpreter, whose host callbacks are ordered effects:
    # `custom_partitioning` failed to lower it with a bare KeyError): such a call
    # runs unpartitioned, placed by XLA's sharding propagation.
    return call.fn(*operands)
  mesh = explicit_mesh(leaves)
  if mesh is not None:
    return _shard_mapped(call, mesh, operands, out_shape)

  def flat_fn(*ls):
    return tuple(jax.tree.leaves(call.fn(*jax.tree.unflatten(treedef, ls))))

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

  rule = _sharding_rule(call.definition, operands, out_shape, call.backward, call.lead)
  cp = custom_partitioning(flat_fn)
  cp.def_partition(partition, infer_sharding_from_operands=infer,
                   sharding_rule=lambda *_: rule)

  # vmap has no rule for custom_partitioning: under vmap, unpartitioned.
  run = batching.vmap_fallback(cp, flat_fn)
  return jax.tree.unflatten(out_treedef, list(run(*leaves)))


def _shard_mapped(call: _Call, mesh, operands, out_shape):
  """Explicit-axes mesh: the plan from the typed shardings, then shard_map (or,
  for a plan that asks to run whole, the call on the operands brought whole: a
  function traced in this mesh's context cannot run in shard_map's manual one).
  `out_shape`: `call.fn`'s on the operands' shapes."""
  args = operands[0]
  plan = call.plan(mesh, _typed(operands)[0])
  in_specs, out_specs = call.specs(plan, out_shape)
  operands = jax.tree.map(lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)),
                          operands, in_specs)
  if plan.whole:
    results = call.fn(*operands)
  else:
    results = jax.shard_map(call.local(plan, mesh), mesh=mesh, in_specs=in_specs,
                            out_specs=out_specs, check_vma=False)(*operands)
  if not call.backward:
    return results
  # Each cotangent in its primal's sharding, which `custom_vjp` requires of its
  # type: the plan may have brought an operand whole (a replicated weight).
  return {k: _like(g, getattr(args, k)) for k, g in results.items()}


def _like(g, primal):
  """Cotangent `g` in `primal`'s typed sharding, where it has one."""
  if g is None or primal is None:
    return g
  sharding = jax.typeof(primal).sharding
  if not getattr(sharding.mesh, "axis_names", ()):
    return g
  return jax.sharding.reshard(g, sharding)


def wanted_features(definition: OpDefinition, args: Any) -> frozenset[str]:
  """Opt-in features the layout of this call would use, where that is known now.

  Only under a mesh with explicit axes are the operands' shardings part of their
  types at trace time; the op's plan is asked which features it would use (e.g.
  ``q_offset`` for attention queries split along the sequence) so that dispatch
  can prefer an implementation that takes them. Under GSPMD (auto axes) the
  shardings are decided later, when the implementation is already chosen.
  """
  leaves = jax.tree.leaves(args)
  if not active(leaves):
    return frozenset()
  mesh = explicit_mesh(leaves)
  if mesh is None:
    return frozenset()
  asked = set()

  def supports(feature: str) -> bool:
    asked.add(feature)
    return True

  _plan(definition, mesh, _typed(args), supports)
  return frozenset(asked)


def forward(definition: OpDefinition, args: Any, run: Callable, supports: Callable[[str], bool],
            lead: int = 1):
  """``run(args) -> (out, residuals)``, partitioned over the devices if useful.

  `args` may carry `lead` leading dims (see `merge_leading`); `run` always gets
  them merged into one, and its results are split back.
  """
  call = _Call(definition, False, run, supports, lead)
  if not active(jax.tree.leaves(args)):
    return call.fn(args)
  return _partitioned(call, (args,))


def backward(definition: OpDefinition, args: Any, residuals: dict, out, dout, run: Callable,
             supports: Callable[[str], bool], lead: int = 1):
  """``run(args, residuals, out, dout) -> {field: grad}``, partitioned if useful
  (leading dims as in `forward`)."""
  operands = (args, dict(residuals), out, dout)
  call = _Call(definition, True, run, supports, lead)
  if not active(jax.tree.leaves(operands)):
    return call.fn(*operands)
  return _partitioned(call, operands)
