"""The candidates for one op call: what ``implementation=`` names, in order.

`expand` turns ``implementation=`` (None, a name, an alias such as "mosaic", an
`Op` instance or a sequence of these) into `Candidate`s; `build_checked` makes
one candidate's op and asks it whether it takes the call; `failure_message` says
why none did, in the terms the user wrote ``implementation=`` in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tokamax._src import registry
from tokamax._src.op import (HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, DeviceInfo, Op,
                              VjpOp, differentiated_again)

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


def tuned_order(options: list, labels: list[str], times: dict[str, float]) -> list:
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


def platform_matches(entry: registry.Entry, device: DeviceInfo) -> bool:
  return runs_on(entry.spec.platforms, device)


def runs_on(platforms: Sequence[str], device: DeviceInfo) -> bool:
  """Whether an implementation declared for `platforms` runs on `device`."""
  if device.interpret:
    return True  # Pallas interpret mode runs anywhere; check_supported decides.
  return device.platform in {"gpu" if p in ("cuda", "rocm") else p for p in platforms}


def platform_refusal(platforms: Sequence[str], device: DeviceInfo) -> str:
  """Why an implementation declared for `platforms` does not run on `device`."""
  return f"runs on {', '.join(platforms)}; this device is {device.platform}"


@dataclasses.dataclass(frozen=True)
class Candidate:
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
  # The platforms a named entry declares (`plugin.Implementation.platforms`),
  # checked after its own check_supported (`build_checked`); None: any. Under
  # automatic choice entries of other platforms are not candidates at all.
  platforms: tuple[str, ...] | None = None


def _entry_candidate(entry: registry.Entry, explicit: bool,
                     given: str | None = None) -> Candidate:
  def make_backward():
    cls = registry.backward_class(entry)
    return None if cls is None else cls()
  return Candidate(entry.name, lambda: registry.forward_class(entry)(),
                    make_backward, explicit, given,
                    platforms=tuple(entry.spec.platforms) if explicit else None)


def _unavailable_candidate(missing: registry.Unavailable, given: str) -> Candidate:
  """An entry of a sequence that cannot run here (not installed, disabled, not an
  implementation of this op): it refuses every call, so that it is skipped in
  order and its reason is listed if nothing runs."""
  def refuse():
    raise NotImplementedError(missing.reason)
  return Candidate(missing.name, refuse, refuse, explicit=True, given=given)


def _op_candidate(op: Op, op_name: str) -> Candidate:
  if not isinstance(op, Op) or isinstance(op, VjpOp):
    raise TypeError(f"implementation must be None, a name, a sequence of names or a "
                    f"tokamax.Op instance; got {op!r}")
  if op.op_name != op_name:
    raise ValueError(f"implementation {type(op).__name__} implements "
                     f"{op.op_name!r}, not {op_name!r}")
  vjp_cls = type(op).vjp
  return Candidate(op.implementation_name, lambda: op,
                    lambda: None if vjp_cls is None else vjp_cls(), explicit=True,
                    given=op.implementation_name)


def _alias_candidates(op_name: str, alias: str, device: DeviceInfo,
                      alone: bool) -> list[Candidate]:
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


def expand(op_name: str, implementation: Implementation,
            device: DeviceInfo) -> list[Candidate]:
  """The candidates for `implementation`, in order.

  A sequence means "the first of these that can run": an entry that is not
  installed, is disabled or does not implement this op is kept as a candidate
  that refuses (with the reason), so it is skipped in order. A single name that
  cannot be found raises (ImplementationNotInstalledError, ImportError or
  ValueError), as does an unknown name anywhere: that is likely a typo.
  """
  if implementation is None:
    return [_entry_candidate(e, explicit=False) for e in registry.entries(op_name)
            if platform_matches(e, device)]
  given_sequence = not isinstance(implementation, (str, Op))
  if not given_sequence:
    implementation = (implementation,)
  if (not isinstance(implementation, Sequence) or not implementation or
      isinstance(implementation, (bytes, bytearray))):
    raise TypeError(f"implementation must be None, a name, a non-empty sequence of "
                    f"names or a tokamax.Op instance; got {implementation!r}")
  alone = len(implementation) == 1
  candidates = []
  for index, item in enumerate(implementation):
    if given_sequence and not isinstance(item, (str, Op)):
      raise TypeError(
          f"implementation[{index}] must be a name or a tokamax.Op instance (None "
          f"only as the whole argument: automatic choice); got {item!r} in "
          f"{list(implementation)!r}")
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


def describe(e: BaseException) -> str:
  return str(e) or type(e).__name__


def _opt_in_features(args: Any) -> frozenset[str]:
  features = getattr(args, "opt_in_features", None)
  features = set(features()) if callable(features) else set()
  leaves = _array_leaves(args)
  if any(_has_symbolic_size(leaf) for leaf in leaves):
    features.add(SYMBOLIC_SHAPES)
  if differentiated_again(leaves):
    features.add(HIGHER_ORDER_AUTODIFF)
  return frozenset(features)


def _array_leaves(args: Any) -> list[Any]:
  fields = ([getattr(args, f.name) for f in dataclasses.fields(args)]
            if dataclasses.is_dataclass(args) else [args])
  return jax.tree_util.tree_leaves(fields)


def _has_symbolic_size(leaf: Any) -> bool:
  return any(not isinstance(dim, (int, np.integer)) for dim in getattr(leaf, "shape", ()))


def supported_features(op: Op) -> frozenset[str]:
  """The opt-in features `op` declares (`Op.supported_features`)."""
  return frozenset(getattr(op, "supported_features", ()))


def check_opt_in(op: Op, args: Any) -> None:
  """Refuses an implementation that does not declare every opt-in feature the
  args use (e.g. attention's ``q_offset``): such a field would be ignored."""
  missing = _opt_in_features(args) - supported_features(op)
  if missing:
    # What a feature means to a user, where the args say (a field's name alone
    # may not tell them what in their call it is).
    meanings = {SYMBOLIC_SHAPES: "sizes that are symbolic, as under jax.export with "
                "a symbolic shape",
                HIGHER_ORDER_AUTODIFF: "derivatives of second order or higher, as by "
                "jax.hessian or jax.grad of jax.grad",
                **getattr(args, "OPT_IN_MEANINGS", {})}
    named = [f"{f} ({meanings[f]})" if f in meanings else f for f in sorted(missing)]
    raise NotImplementedError(
        f"does not support {', '.join(named)}; implementation=None runs one that "
        f"does (an Op takes a feature by listing it in its supported_features)")


def build_checked(make: Callable[[], Any], raise_import: bool, args: Any,
                   device: DeviceInfo, *residuals,
                   platforms: Sequence[str] | None = None) -> Any:
  """The op `make()` builds, checked for this call (opt-in fields, then its own
  check_supported, given `residuals` for a backward, then the `platforms` its
  registration declares: a plugin's check_supported need not check them).

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
    if platforms is not None and not runs_on(platforms, device):
      raise NotImplementedError(platform_refusal(platforms, device))
  except ImportError as e:
    if raise_import:
      raise
    raise NotImplementedError(f"failed to import: {describe(e)}") from e
  return op


def raises_import(cand: Candidate) -> bool:
  return cand.explicit and cand.alone


def failure_message(op_name: str, direction: str,
                     failures: list[tuple[Candidate, str]]) -> str:
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


def no_implementation_message(op_name: str, direction: str, rejected: list) -> str:
  return failure_message(op_name, direction, [
      (Candidate(label, None, None, explicit=False), reason)
      for label, reason in rejected])
