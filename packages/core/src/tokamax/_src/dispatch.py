"""Dispatch: choose an implementation per call, forward and backward separately.

This is the one place that turns ``implementation=`` into a running kernel; the op
functions in `tokamax._src.ops` only validate and canonicalize their arguments,
then call :func:`call`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tokamax._src import config
from tokamax._src import config_sources
from tokamax._src import op as op_lib
from tokamax._src import registry
from tokamax._src import sharding
from tokamax._src import vma
from tokamax._src.op import DeviceInfo, Op, VjpOp

Implementation = None | str | Op | Sequence[str | Op]

# "mosaic" names the Mosaic backend of the platform at hand. In interpret mode,
# or on a platform that has none of them (a CPU), it means all of them: each
# one's check_supported then says whether it runs here and, if not, why.
_ALIASES = {
    "mosaic": {"gpu": "mosaic_gpu", "tpu": "mosaic_tpu"},
}


def _alias_members(alias: str, device: DeviceInfo) -> tuple[str, ...]:
  members = _ALIASES[alias]
  if device.platform in members and not device.interpret:
    return (members[device.platform],)
  return tuple(members.values())


def _alias_meaning(alias: str) -> str:
  return " / ".join(f"{name} on {platform.upper()}"
                    for platform, name in _ALIASES[alias].items())


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
  """Which implementation ran one direction of one op call (at trace time)."""

  op: str
  direction: str  # "forward" or "backward"
  implementation: str
  config: Any
  rejected: tuple[tuple[str, str], ...] = ()  # (implementation, reason) skipped


_records: contextvars.ContextVar[list[DispatchRecord] | None] = contextvars.ContextVar(
    "tokamax_dispatch_records", default=None)


@contextlib.contextmanager
def record_dispatch():
  """Collects a `DispatchRecord` for every dispatch decision made inside.

  Decisions are made when a function is traced: under `jax.jit`, a cached
  function records nothing on later calls.

  Example:
    >>> with tokamax.record_dispatch() as records:
    ...   jax.grad(loss)(params)
    >>> [(r.op, r.direction, r.implementation) for r in records]
  """
  records: list[DispatchRecord] = []
  token = _records.set(records)
  try:
    yield records
  finally:
    _records.reset(token)


_observers: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "tokamax_dispatch_observers", default=())


@contextlib.contextmanager
def observe(observer):
  """Calls ``observer(op_name, args, implementation)`` for each op call dispatched
  inside (autotuning uses it to find the calls a function makes). `args` has the
  shapes implementations see; its arrays may be tracers or, for a partitioned call
  with several leading dims, `jax.ShapeDtypeStruct`s: observers use shapes only."""
  token = _observers.set(_observers.get() + (observer,))
  try:
    yield observer
  finally:
    _observers.reset(token)


def _tuned_order(options: list, labels: list[str], times: dict[str, float]) -> list:
  """`options` (in priority order) with the measured ones (tuned data's `times`)
  sorted by time among the places they hold; the others keep theirs.

  Tuned data orders only what it measured: data measured before a faster
  backend was installed (or without it) must not put its fastest ahead of an
  implementation it never timed.
  """
  places = [i for i, label in enumerate(labels) if label in times]
  ordered = sorted(places, key=lambda i: times[labels[i]])
  out = list(options)
  for place, i in zip(places, ordered):
    out[place] = options[i]
  return out


def _record(record: DispatchRecord) -> None:
  records = _records.get()
  if records is not None:
    records.append(record)


def current_device(arrays: Sequence[Any]) -> DeviceInfo:
  """The device a call on `arrays` runs on (their device if concrete, else default)."""
  device = None
  for x in arrays:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      try:
        device = next(iter(x.devices()))
        break
      except Exception:  # pylint: disable=broad-except
        pass
  if device is None:
    device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  return DeviceInfo(
      platform=device.platform,
      device_kind=device.device_kind,
      interpret=config.interpret_mode(),
      compute_capability=str(capability) if capability is not None else None)


def _platform_matches(entry: registry.Entry, device: DeviceInfo) -> bool:
  if device.interpret:
    return True  # Pallas interpret mode runs anywhere; check_supported decides.
  platforms = {"gpu" if p in ("cuda", "rocm") else p for p in entry.spec.platforms}
  return device.platform in platforms


@dataclasses.dataclass(frozen=True)
class _Candidate:
  label: str
  make_forward: Any  # () -> Op
  backward: Any  # () -> VjpOp | None ; None: choose automatically
  explicit: bool
  # The entry of `implementation=` this came from as the user typed it (an alias
  # such as "mosaic" gives several); None under automatic choice.
  given: str | None = None
  # The user named this one implementation and nothing else: a failure to import
  # it is raised as such rather than being a refusal among others.
  alone: bool = False


def _entry_candidate(entry: registry.Entry, explicit: bool,
                     given: str | None = None) -> _Candidate:
  def make_backward():
    cls = registry.backward_class(entry)
    return None if cls is None else cls()
  return _Candidate(entry.name, lambda: registry.forward_class(entry)(),
                    make_backward, explicit, given)


def _unavailable_candidate(missing: registry.Unavailable, given: str) -> _Candidate:
  """An entry of a sequence that cannot run here (not installed, disabled, not an
  implementation of this op): it refuses every call, so that it is skipped in
  order and its reason is listed if nothing runs."""
  def refuse():
    raise NotImplementedError(missing.reason)
  return _Candidate(missing.name, refuse, refuse, explicit=True, given=given)


def _op_candidate(op: Op, op_name: str) -> _Candidate:
  if not isinstance(op, Op) or isinstance(op, VjpOp):
    raise TypeError(f"implementation must be None, a name, a sequence of names or a "
                    f"tokamax.Op instance; got {op!r}")
  if op.op_name != op_name:
    raise ValueError(f"implementation {type(op).__name__} implements "
                     f"{op.op_name!r}, not {op_name!r}")
  vjp_cls = type(op).vjp
  return _Candidate(op.implementation_name, lambda: op,
                    lambda: None if vjp_cls is None else vjp_cls(), explicit=True,
                    given=op.implementation_name)


def _alias_candidates(op_name: str, alias: str, device: DeviceInfo,
                      alone: bool) -> list[_Candidate]:
  found = [registry.lookup(op_name, m) for m in _alias_members(alias, device)]
  if alone and not any(isinstance(f, registry.Entry) for f in found):
    errors = [f.error for f in found]
    error = next((e for e in (registry.ImplementationNotInstalledError, ImportError)
                  if e in errors), ValueError)
    reasons = "; ".join(f"{f.name}: {f.reason}" for f in found)
    raise error(
        f"implementation={alias!r} ({_alias_meaning(alias)}) has no implementation "
        f"of {op_name} here (platform {device.platform}"
        f"{', interpret mode' if device.interpret else ''}): {reasons}")
  return [_entry_candidate(f, True, given=alias) if isinstance(f, registry.Entry)
          else _unavailable_candidate(f, alias) for f in found]


def _expand(op_name: str, implementation: Implementation,
            device: DeviceInfo) -> list[_Candidate]:
  """The candidates for `implementation`, in order.

  A sequence means "the first of these that can run": an entry that is not
  installed, is disabled or does not implement this op is kept as a candidate
  that refuses (with the reason), so it is skipped in order. A single name that
  cannot be found raises (ImplementationNotInstalledError, ImportError or
  ValueError), as does an unknown name anywhere: that is likely a typo.
  """
  if implementation is None:
    return [_entry_candidate(e, explicit=False) for e in registry.entries(op_name)
            if _platform_matches(e, device)]
  if isinstance(implementation, (str, Op)):
    implementation = (implementation,)
  if (not isinstance(implementation, Sequence) or not implementation or
      isinstance(implementation, (bytes, bytearray))):
    raise TypeError(f"implementation must be None, a name, a non-empty sequence of "
                    f"names or a tokamax.Op instance; got {implementation!r}")
  alone = len(implementation) == 1
  candidates = []
  for item in implementation:
    if not isinstance(item, str):
      candidates.append(_op_candidate(item, op_name))
    elif item in _ALIASES:
      candidates += _alias_candidates(op_name, item, device, alone)
    else:
      found = registry.lookup(op_name, item)
      if isinstance(found, registry.Entry):
        candidates.append(_entry_candidate(found, True, given=item))
      elif alone or not found.known:
        found.raise_error()
      else:
        candidates.append(_unavailable_candidate(found, item))
  if alone and len(candidates) == 1:
    candidates = [dataclasses.replace(candidates[0], alone=True)]
  return candidates


def _describe(e: BaseException) -> str:
  return str(e) or type(e).__name__


def _opt_in_features(args: Any) -> frozenset[str]:
  features = getattr(args, "opt_in_features", None)
  return frozenset(features()) if callable(features) else frozenset()


def check_opt_in(op: Op, args: Any) -> None:
  """Refuses an implementation that does not declare every opt-in feature the
  args use (e.g. attention's ``q_offset``): such a field would be ignored."""
  missing = _opt_in_features(args) - frozenset(getattr(op, "supported_features", ()))
  if missing:
    raise NotImplementedError(
        f"does not support {', '.join(sorted(missing))} (add it to the Op's "
        f"supported_features once handled)")


def _build_checked(make: Callable[[], Any], raise_import: bool, args: Any,
                   device: DeviceInfo, *residuals) -> Any:
  """The op `make()` builds, checked for this call (opt-in fields, then its own
  check_supported, given `residuals` for a backward).

  Raises:
    NotImplementedError: the op refuses the call (or there is none); its reason.
    ImportError: only with `raise_import` (an implementation the user named on its
      own); otherwise a failure to import is a refusal.
  """
  try:
    op = make()
    if op is None:
      raise NotImplementedError("has no backward of its own")
    check_opt_in(op, args)
    op.check_supported(args, device, *residuals)
  except ImportError as e:
    if raise_import:
      raise
    raise NotImplementedError(f"failed to import: {_describe(e)}") from e
  return op


def _raises_import(cand: _Candidate) -> bool:
  return cand.explicit and cand.alone


def _choose_forward(op_name: str, args: Any, device: DeviceInfo,
                    candidates: list[_Candidate], prefer: frozenset[str] = frozenset()
                    ) -> tuple[_Candidate, Op, list]:
  """The first candidate that runs the call; with `prefer`, first the first one
  that also declares those opt-in features (which the call's sharding would use)."""
  failures = []
  for cand in candidates:
    try:
      op = _build_checked(cand.make_forward, _raises_import(cand), args, device)
    except NotImplementedError as e:
      failures.append((cand, _describe(e)))
      continue
    missing = prefer - frozenset(getattr(op, "supported_features", ()))
    if missing:
      failures.append((cand, f"does not take {', '.join(sorted(missing))}, "
                             "which the operands' sharding uses"))
      continue
    return cand, op, [(c.label, reason) for c, reason in failures]
  if prefer:
    # None takes them: the first that runs the call (its layout then gathers).
    return _choose_forward(op_name, args, device, candidates)
  raise NotImplementedError(_failure_message(op_name, "forward", failures))


def _training_choice(op_name: str, args: Any, device: DeviceInfo,
                     candidates: list[_Candidate], prefer: frozenset[str],
                     inference: tuple[_Candidate, Op, list]
                     ) -> tuple[_Candidate, Op, list]:
  """The forward of a training step, where dispatch chooses among several.

  The inference choice, unless its own backward refuses the call: its residuals
  may then be of no use to the fast backwards (cuDNN's forward leaves no
  log-sum-exp, and only the dense XLA backward, which builds the [T, S] scores,
  would run). Then the first later candidate whose forward and own backward both
  take the call (preferring, as the inference choice does, one with the opt-in
  features the operands' sharding uses).
  """
  cand, _, rejected = inference
  why = _own_backward_refusal(cand, args, device)
  if why is None:
    return inference
  rejected = [*rejected, (cand.label, f"its backward refuses this call: {why}")]
  eligible = []
  for other in candidates[candidates.index(cand) + 1:]:
    refusal = _own_backward_refusal(other, args, device)
    if refusal is None:
      eligible.append(other)
    else:
      rejected.append((other.label, f"its backward refuses this call: {refusal}"))
  try:
    chosen, op, more = _choose_forward(op_name, args, device, eligible, prefer)
  except NotImplementedError:
    return inference
  return chosen, op, [*rejected, *more]


def _feature_check(fwd_op: Op) -> Callable[[str], bool]:
  """Whether the chosen forward takes an opt-in field: layouts that need one (a
  split query sequence needs q_offset) are used only then."""
  features = frozenset(getattr(fwd_op, "supported_features", ()))
  return lambda feature: feature in features


def _own_backward_refusal(cand: _Candidate, args: Any, device: DeviceInfo) -> str | None:
  """Why `cand`'s own backward cannot run the call (None: it can, or it has none
  of its own and dispatch will choose one). Advisory: any failure of the check is
  a refusal here; the backward's own dispatch reports it if it matters."""
  try:
    own = cand.backward()
    if own is None:
      return None
    _build_checked(lambda: own, False, args, device, None)
    return None if cand.explicit else own.declines(args)
  except Exception as e:  # pylint: disable=broad-except
    return _describe(e)


def _forward_record(op_name: str, args: Any, choice) -> DispatchRecord:
  cand, op, rejected = choice
  return DispatchRecord(op_name, "forward", cand.label, op.resolve_config(args),
                        tuple(rejected))


def _replace_record(old: DispatchRecord, new: DispatchRecord) -> None:
  """`new` in `old`'s place in the active records (appended if `old` is not there)."""
  records = _records.get()
  if records is None:
    return
  for i, record in enumerate(records):
    if record is old:
      records[i] = new
      return
  records.append(new)


def _failure_message(op_name: str, direction: str,
                     failures: list[tuple[_Candidate, str]]) -> str:
  """Why no candidate ran, in the terms the user wrote `implementation=` in."""
  if not failures:
    return f"{op_name} {direction}: no implementation is registered for this platform"
  givens = {c.given or c.label for c, _ in failures}
  if len(givens) == 1:
    (given,) = givens
    if given in _ALIASES:
      # Named as typed, then why each of its members refuses.
      members = " or ".join(c.label for c, _ in failures)
      reasons = "; ".join(f"{c.label!r}: {reason}" for c, reason in failures)
      return (f"{op_name} {direction}: implementation {given!r} ({members} here) "
              f"cannot run this call: {reasons}")
    if len(failures) == 1:
      return (f"{op_name} {direction}: implementation {given!r} cannot run this "
              f"call: {failures[0][1]}")

  def entry(cand, reason):
    given = cand.given or cand.label
    name = f"{given!r} ({cand.label})" if given in _ALIASES else repr(given)
    return f"{name}: {reason}"
  lines = "; ".join(entry(c, r) for c, r in failures)
  return f"{op_name} {direction}: no implementation can run this call ({lines})"


def _no_implementation_message(op_name: str, direction: str, rejected: list) -> str:
  return _failure_message(op_name, direction, [
      (_Candidate(label, None, None, explicit=False), reason)
      for label, reason in rejected])


def _choose_backward(op_name: str, args: Any, residuals: Any, device: DeviceInfo,
                     forward: _Candidate, implementation: Implementation) -> VjpOp:
  rejected = []
  own = forward.backward()
  options = []
  if own is not None:
    options.append((forward.label, lambda: own, forward.explicit))
  if own is None or not forward.explicit:
    # No backward of its own, or its own refuses under automatic choice: the best
    # usable backward (the XLA reference accepts any residuals), the one measured
    # fastest first.
    auto = [(e.name, lambda e=e: registry.backward_class(e)(), False)
            for e in registry.entries(op_name)
            if e.spec.backward is not None and _platform_matches(e, device)]
    if implementation is None:
      if own is not None:
        # Its own first, where the registry has it: then only a backward that
        # tuned data measured faster (and that is here) goes ahead of it.
        options = []
        auto = [(forward.label, lambda: own, False)] + [
            a for a in auto if a[0] != forward.label]
      times = config_sources.measured_times(op_name, "backward", args)
      auto = _tuned_order(auto, [a[0] for a in auto], times)
    options += auto
  declined = None  # the first that runs the call but declines it (Op.declines)
  for label, make, explicit in options:
    try:
      op = _build_checked(make, explicit, args, device, residuals)
    except NotImplementedError as e:
      if explicit and implementation is not None:
        raise NotImplementedError(
            f"{op_name} backward: implementation {label!r} cannot run this call: "
            f"{_describe(e)}") from e
      rejected.append((label, _describe(e)))
      continue
    reason = op.declines(args) if implementation is None else None
    if reason is not None:
      rejected.append((label, f"declines: {reason}"))
      declined = declined or op
      continue
    return op
  if declined is not None:
    return declined  # every other refused: a slower backward beats none
  raise NotImplementedError(_no_implementation_message(op_name, "backward", rejected))


def _cotangents(args: Any, grads: dict, diff_fields: tuple[str, ...]) -> Any:
  """Turns a backward's ``{field: cotangent}`` into a cotangent pytree for args."""
  unknown = set(grads) - set(diff_fields)
  if unknown:
    raise ValueError(f"backward returned cotangents for non-differentiable "
                     f"fields {sorted(unknown)}")
  updates = {}
  for field in dataclasses.fields(args):
    primal = getattr(args, field.name)
    if not isinstance(primal, jax.Array | jax.core.Tracer | jnp.ndarray):
      continue
    g = grads.get(field.name) if field.name in diff_fields else None
    if g is None:
      updates[field.name] = None
      continue
    if g.shape != primal.shape:
      raise ValueError(f"backward returned a cotangent of shape {g.shape} for "
                       f"{field.name} of shape {primal.shape}")
    # Inside shard_map a cotangent must vary over the mesh axes its primal does.
    updates[field.name] = vma.match_varying(g.astype(primal.dtype),
                                            vma.varying_axes(primal))
  return dataclasses.replace(args, **updates)


def _shapes(args: Any) -> tuple:
  return tuple((tuple(x.shape), jnp.dtype(x.dtype))
               for x in jax.tree_util.tree_leaves(args))


def call(op_name: str, args: Any, implementation: Implementation,
         diff_fields: tuple[str, ...], lead_dims: int = 1) -> jax.Array:
  """Runs `op_name` on canonical `args` with the chosen implementations.

  Args:
    op_name: one of `tokamax.plugin.OP_NAMES`.
    args: the op's canonical argument dataclass (a registered pytree), except
      that its batched fields may have `lead_dims` leading dims in place of one.
    implementation: as the public op functions take it.
    diff_fields: names of the args fields that receive gradients.
    lead_dims: the number of leading (row / batch) dims of the batched fields
      (`sharding.merge_leading`). Implementations, tuned data and observers
      always see them merged into one.

  Returns:
    The op's output, with the leading dims of `args`.
  """
  # Merging dims keeps a sharding only when it is on the major one, so a
  # partitioned call keeps the leading dims apart up to the local computation;
  # otherwise they are merged here, before anything else sees the args.
  if lead_dims != 1 and not sharding.active(jax.tree_util.tree_leaves(args)):
    lead = sharding.leading_shape(op_name, args, lead_dims)
    out = call(op_name, sharding.merge_leading(op_name, args, lead_dims),
               implementation, diff_fields)
    return out.reshape(*lead, *out.shape[1:])
  # What the implementations are chosen and configured for: the merged shapes.
  merged = sharding.merge_leading(op_name, args, lead_dims, abstract=True)
  for observer in _observers.get():
    observer(op_name, merged, implementation)
  device = current_device(jax.tree_util.tree_leaves(args))
  candidates = _expand(op_name, implementation, device)
  if implementation is None:
    candidates = _tuned_order(
        candidates, [c.label for c in candidates],
        config_sources.measured_times(op_name, "forward", merged))
  # A choice among several (None, or a sequence of names) prefers one that keeps
  # the operands' explicit sharding (e.g. attention queries split along the
  # sequence need q_offset); a single named implementation is used as it is.
  choosing = implementation is None or (
      isinstance(implementation, (list, tuple)) and len(implementation) > 1)
  prefer = sharding.wanted_features(op_name, args) if choosing else frozenset()
  inference = _choose_forward(op_name, merged, device, candidates, prefer)
  inference_record = _forward_record(op_name, merged, inference)
  _record(inference_record)
  global_shapes = _shapes(merged)

  @functools.cache
  def training():
    # A training step traces `run_fwd` instead of `run`: there the forward must also
    # leave its backward something fast to run (see `_training_choice`). Its
    # decision takes the inference one's place in the records (under
    # `grad(jit(f))` both are traced, and only the training forward runs).
    if not choosing:
      return inference
    choice = _training_choice(op_name, merged, device, candidates, prefer, inference)
    if choice[0] != inference[0]:
      _replace_record(inference_record, _forward_record(op_name, merged, choice))
    return choice

  def partitioned_forward(args, choice, for_backward: bool):
    _, fwd_op, _ = choice
    fwd_config = fwd_op.resolve_config(merged)
    supports = _feature_check(fwd_op)

    def forward_local(args):
      config_ = fwd_config
      if _shapes(args) != global_shapes:
        # A shard (or a shard's adjusted args): check it again on its own shapes.
        check_opt_in(fwd_op, args)
        fwd_op.check_supported(args, device)
        config_ = fwd_op.resolve_config(args)
      # Entered here, not around the call below: a partitioned call traces this
      # function again later, at compile time, when that context is gone.
      with op_lib.forward_for_backward(for_backward):
        out, residuals = fwd_op.forward(args, config_)
      return out, dict(residuals)

    # `sharding.forward` also runs the unpartitioned call (under vmap the answer
    # can differ from the one above, given JVP tracers): it merges the leading dims.
    if for_backward and not sharding.active(jax.tree_util.tree_leaves(args)):
      with op_lib.allow_opaque_residuals():
        out, residuals = sharding.forward(op_name, args, forward_local, supports,
                                          lead_dims)
    else:
      out, residuals = sharding.forward(op_name, args, forward_local, supports,
                                        lead_dims)
    return vma.outputs_like_inputs(out, args), residuals

  @jax.custom_vjp
  def run(args):
    return partitioned_forward(args, inference, for_backward=False)[0]

  def run_fwd(args):
    out, residuals = partitioned_forward(args, training(), for_backward=True)
    return out, (args, dict(residuals), out)

  def run_bwd(saved, dout):
    args, residuals, out = saved
    forward, fwd_op, _ = training()
    merged_args = sharding.merge_leading(op_name, args, lead_dims, abstract=True)
    merged_residuals = sharding.merge_residuals(op_name, residuals, lead_dims,
                                                abstract=True)
    bwd_op = _choose_backward(op_name, merged_args, merged_residuals, device, forward,
                              implementation)
    bwd_config = bwd_op.resolve_config(merged_args)
    _record(DispatchRecord(op_name, "backward", bwd_op.implementation_name, bwd_config))

    supports = _feature_check(fwd_op)

    def backward_local(a, r, o, do):
      config_ = bwd_config
      if _shapes(a) != global_shapes:
        check_opt_in(bwd_op, a)
        bwd_op.check_supported(a, device, r)
        config_ = bwd_op.resolve_config(a)
      return dict(bwd_op.backward(a, r, o, do, config_))

    grads = sharding.backward(op_name, args, residuals, out, dout, backward_local,
                              supports, lead_dims)
    return (_cotangents(args, dict(grads), diff_fields),)

  run.defvjp(run_fwd, run_bwd)
  return run(args)


def forward_with_residuals(op_name: str, args: Any, implementation: Implementation,
                           needed: tuple[str, ...] = ()) -> tuple[jax.Array, dict]:
  """Runs only the forward of `op_name` and returns ``(out, residuals)``.

  For building blocks that combine op calls themselves (ring attention merges
  per-block outputs by their log-sum-exp): the first usable implementation whose
  residuals include every name in `needed`. Not differentiable.
  """
  device = current_device(jax.tree_util.tree_leaves(args))
  candidates = _expand(op_name, implementation, device)
  failures = []
  for cand in candidates:
    try:
      op = _build_checked(cand.make_forward, _raises_import(cand), args, device)
    except NotImplementedError as e:
      failures.append((cand, _describe(e)))
      continue
    config_ = op.resolve_config(args)
    residual_names = jax.eval_shape(lambda a: dict(op.forward(a, config_)[1]), args)
    if not set(needed) <= set(residual_names):
      failures.append((cand, f"returns no {', '.join(needed)} residual"))
      continue
    _record(DispatchRecord(op_name, "forward", cand.label, config_,
                           tuple((c.label, r) for c, r in failures)))
    out, residuals = op.forward(args, config_)
    return out, dict(residuals)
  if implementation is None:
    return forward_with_residuals(op_name, args, "xla_chunked", needed)
  raise NotImplementedError(_failure_message(op_name, "forward", failures))


def _consumes(op: VjpOp, args: Any, device: DeviceInfo, residuals: dict,
              names: tuple[str, ...]) -> bool:
  """Whether backward `op` needs the residuals `names` (refuses a call without
  them): then it uses the values given rather than recomputing its own."""
  rest = {k: v for k, v in residuals.items() if k not in names}
  try:
    op.check_supported(args, device, rest)
  except NotImplementedError:
    return True
  return False


def backward_with_residuals(op_name: str, args: Any, residuals: dict, out: jax.Array,
                            dout: jax.Array, implementation: Implementation,
                            consumes: tuple[str, ...]) -> dict:
  """Runs only a backward of `op_name` that computes from the given residuals.

  For building blocks that combine op calls themselves (ring attention: each
  block pair's gradients come from the global log-sum-exp and output, not from
  the block's own softmax). The first usable backward among the implementations'
  own that needs every residual in `consumes` (a backward that would recompute
  them, like autodiff through a forward, gives a different result and is
  skipped); with `implementation=None`, the XLA chunked one when none does.
  """
  device = current_device(jax.tree_util.tree_leaves(args))
  failures = []
  for cand in _expand(op_name, implementation, device):
    try:
      op = _build_checked(cand.backward, _raises_import(cand), args, device, residuals)
      if not _consumes(op, args, device, residuals, consumes):
        raise NotImplementedError(f"does not compute from the given "
                                  f"{', '.join(consumes)}")
    except NotImplementedError as e:
      failures.append((cand, _describe(e)))
      continue
    config_ = op.resolve_config(args)
    _record(DispatchRecord(op_name, "backward", cand.label, config_,
                           tuple((c.label, r) for c, r in failures)))
    return dict(op.backward(args, residuals, out, dout, config_))
  if implementation is None:
    return backward_with_residuals(op_name, args, residuals, out, dout, "xla_chunked",
                                   consumes)
  raise NotImplementedError(_failure_message(op_name, "backward", failures))
