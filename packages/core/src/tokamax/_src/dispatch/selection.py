"""Choosing an implementation: one selection loop for every kind of call.

`select` walks candidates in order and returns the first whose op is built and
takes the call. Each kind of choice is that loop with its own acceptance test:

- the forward of an inference call (`choose_forward`): preferring one that takes
  the opt-in features the operands' sharding would use; under automatic choice
  one that declines is passed over;
- the forward of a training step (`training_choice`): the inference choice,
  unless its own backward refuses the call (or declines it, and no other
  backward takes its residuals without declining);
- the backward (`choose_backward`): the forward's own first, else the best
  usable one; under automatic choice one that declines is passed over;
- a forward whose residuals include given names, and a backward that computes
  from given residuals (`with_residuals`: ring attention's blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from tokamax._src import registry
from tokamax._src.dispatch import configs
from tokamax._src.dispatch.candidates import (Candidate, Implementation, build_checked,
                                              describe, failure_message,
                                              no_implementation_message,
                                              platform_matches, raises_import,
                                              supported_features,
                                              tuned_order)
from tokamax._src.op import (DeviceInfo, Op, VjpOp, allow_opaque_residuals,
                             forward_for_backward)
from tokamax._src.tuning import sources


@dataclasses.dataclass(frozen=True)
class Choice:
  """The candidate chosen, its op (checked for the call), and the candidates
  passed over before it with the reason for each."""

  candidate: Candidate
  op: Op
  rejected: tuple[tuple[Candidate, str], ...] = ()

  def rejected_labels(self) -> tuple[tuple[str, str], ...]:
    return tuple((c.label, reason) for c, reason in self.rejected)


class NoChoice(NotImplementedError):
  """No candidate took the call; `rejected` says why each did not."""

  def __init__(self, rejected: list[tuple[Candidate, str]]):
    super().__init__("no candidate takes the call")
    self.rejected = rejected


def select(candidates: Sequence[Candidate], args: Any, device: DeviceInfo, *,
           part: Callable[[Candidate], Callable[[], Any]],
           residuals: tuple = (),
           accept: Callable[[Op], str | None] | None = None,
           honor_declines: bool = False,
           raise_refusal: Callable[[Candidate], bool] = lambda c: False) -> Choice:
  """The first candidate whose op (`part(candidate)()`) takes the call.

  Args:
    candidates: in priority order.
    args: the call's canonical args (shapes are enough).
    device: where it runs.
    part: which op of a candidate: its forward or its backward maker.
    residuals: passed on to a backward's check_supported.
    accept: a further test of a built op: a reason to pass it over, or None.
    honor_declines: pass over an op that declines the call (`Op.declines`)
      where the candidate is not one the user named, unless every other
      candidate refuses: then the first that declined runs.
    raise_refusal: candidates whose refusal is raised rather than passed over
      (an implementation the user named for this direction).

  Raises:
    NoChoice: no candidate took the call (its `rejected` lists why).
  """
  rejected: list[tuple[Candidate, str]] = []
  declined: tuple[Candidate, Op] | None = None
  for cand in candidates:
    try:
      op = build_checked(part(cand), raises_import(cand), args, device, *residuals,
                         platforms=cand.platforms)
      reason = accept(op) if accept is not None else None
      if reason is not None:
        raise NotImplementedError(reason)
    except NotImplementedError as e:
      if raise_refusal(cand):
        raise
      rejected.append((cand, describe(e)))
      continue
    why = op.declines(args) if honor_declines and not cand.explicit else None
    if why is not None:
      rejected.append((cand, f"declines: {why}"))
      declined = declined or (cand, op)
      continue
    return Choice(cand, op, tuple(rejected))
  if declined is not None:
    return Choice(*declined, tuple(rejected))  # a slower one beats none
  raise NoChoice(rejected)


def _forward_part(cand: Candidate) -> Callable[[], Any]:
  return cand.make_forward


def _backward_part(cand: Candidate) -> Callable[[], Any]:
  return cand.backward


def choose_forward(op_name: str, args: Any, device: DeviceInfo,
                   candidates: Sequence[Candidate],
                   prefer: frozenset[str] = frozenset()) -> Choice:
  """The first candidate that runs the call (under automatic choice, passing over
  one that declines it); with `prefer`, first the first one that also declares
  those opt-in features (which the call's sharding would use)."""
  def takes_preferred(op):
    missing = prefer - supported_features(op)
    if missing:
      return (f"does not take {', '.join(sorted(missing))}, which the operands' "
              "sharding uses")
    return None
  try:
    return select(candidates, args, device, part=_forward_part, accept=takes_preferred,
                  honor_declines=True)
  except NoChoice as e:
    if prefer:
      # None takes them: the first that runs the call (its layout then gathers).
      return choose_forward(op_name, args, device, candidates)
    raise NotImplementedError(failure_message(op_name, "forward", e.rejected)) from None


@dataclasses.dataclass(frozen=True)
class _OwnBackward:
  """What a forward's own backward says of a call: `refusal`, why it cannot run
  it; `decline`, why automatic choice should pass it on although it runs it
  (`Op.declines`); both None: it takes the call (or the forward has none of its
  own, and dispatch chooses one)."""

  refusal: str | None = None
  decline: str | None = None


def _own_backward(cand: Candidate, args: Any, device: DeviceInfo) -> _OwnBackward:
  """`cand`'s own backward's answer to the call. Advisory: any failure of the
  check is a refusal here; the backward's own dispatch reports it if it matters."""
  try:
    own = cand.backward()
    if own is None:
      return _OwnBackward()
    build_checked(lambda: own, False, args, device, None)
  except Exception as e:  # advisory: every failure is a reason to look further
    return _OwnBackward(refusal=describe(e))
  return _OwnBackward(decline=None if cand.explicit else own.declines(args))


def _forward_residuals(op: Op, args: Any, *, training: bool) -> dict:
  """The residuals (shapes) `op`'s forward returns: in a training step
  (`training`: a backward will read them), or run alone."""
  config = configs.resolve(op, args)
  forward = lambda a: dict(op.forward(a, config)[1])
  if not training:
    return jax.eval_shape(forward, args)
  with forward_for_backward(True), allow_opaque_residuals(True):
    return jax.eval_shape(forward, args)


def _other_backward_for(op_name: str, args: Any, device: DeviceInfo,
                        cand: Candidate, forward: Op) -> str | None:
  """The backward automatic choice runs after `forward` (`cand`'s) when that
  forward's own backward declines the call: the first other one that takes the
  forward's residuals and does not decline (None: there is none)."""
  residuals = _forward_residuals(forward, args, training=True)
  others = [c for c in _backward_candidates(op_name, args, device, cand, None, residuals)
            if c.label != cand.label]
  try:
    choice = select(others, args, device, part=_backward_part, residuals=(residuals,),
                    honor_declines=True)
  except NoChoice:
    return None
  return None if choice.op.declines(args) is not None else choice.candidate.label


def _why_not_for_training(op_name: str, args: Any, device: DeviceInfo,
                          cand: Candidate, forward: Op | None = None) -> str | None:
  """Why a training step should not take `cand`'s forward (None: take it).

  Its own backward refusing the call: the forward's residuals may then be of no
  use to the fast backwards (cuDNN's forward leaves no log-sum-exp, and only the
  dense XLA backward, which builds the [T, S] scores, would run). Its own
  backward only declining (a measured "another backward is faster here"): the
  forward stays when another backward takes its residuals and does not decline
  (the norms' mean and rstd are every norm backward's), so that the forward's
  own speed is not given up for its backward's.
  """
  own = _own_backward(cand, args, device)
  if own.refusal is not None:
    return f"its backward refuses this call: {own.refusal}"
  if own.decline is None:
    return None
  try:
    if forward is None:
      forward = build_checked(cand.make_forward, False, args, device,
                              platforms=cand.platforms)
    if _other_backward_for(op_name, args, device, cand, forward) is not None:
      return None
  except Exception as e:  # advisory, as `_own_backward`: said in the record
    return (f"its backward declines this call ({own.decline}); looking for "
            f"another backward failed: {describe(e)}")
  return (f"its backward declines this call ({own.decline}) and no other backward "
          "takes its residuals")


def training_choice(op_name: str, args: Any, device: DeviceInfo,
                    candidates: Sequence[Candidate], prefer: frozenset[str],
                    inference: Choice) -> Choice:
  """The forward of a training step, where dispatch chooses among several.

  The inference choice, unless `_why_not_for_training` says otherwise; then the
  first later candidate that it does not reject (preferring, as the inference
  choice does, one with the opt-in features the operands' sharding uses).
  """
  why = _why_not_for_training(op_name, args, device, inference.candidate, inference.op)
  if why is None:
    return inference
  rejected = [*inference.rejected, (inference.candidate, why)]
  eligible = []
  later = list(candidates)[list(candidates).index(inference.candidate) + 1:]
  for other in later:
    reason = _why_not_for_training(op_name, args, device, other)
    if reason is None:
      eligible.append(other)
    else:
      rejected.append((other, reason))
  try:
    choice = choose_forward(op_name, args, device, eligible, prefer)
  except NotImplementedError:
    return inference
  return Choice(choice.candidate, choice.op, (*rejected, *choice.rejected))


def _backward_candidates(op_name: str, args: Any, device: DeviceInfo,
                         forward: Candidate, implementation: Implementation,
                         residuals: Mapping[str, Any]) -> list[Candidate]:
  """The backwards to try after `forward`, whose residuals are `residuals`, in
  order."""
  own = forward.backward()

  def backward_of(label, make, explicit):
    return Candidate(label, None, make, explicit, alone=explicit)
  options = []
  if own is not None:
    options.append(backward_of(forward.label, lambda: own, forward.explicit))
  if own is not None and forward.explicit:
    return options
  # No backward of its own, or its own refuses under automatic choice: the best
  # usable backward (the XLA reference accepts any residuals), the one measured
  # fastest first.
  entries = [e for e in registry.entries(op_name)
             if e.spec.backward is not None and platform_matches(e, device)]
  auto = [backward_of(e.name, lambda e=e: registry.backward_class(e)(), False)
          for e in entries]
  if implementation is None:
    if own is not None:
      # Its own first, where the registry has it: then only a backward that
      # tuned data measured faster (and that is here) goes ahead of it.
      options = []
      auto = [backward_of(forward.label, lambda: own, False)] + [
          a for a in auto if a.label != forward.label]
    # Behind another implementation's forward, a backward that reruns its own
    # there (`VjpOp.reruns_forward_without_own_residuals`, or its
    # `recomputes_without` a residual this forward left out) costs that forward
    # too.
    times = sources.measured_times(op_name, "backward", args)
    rerunning = [e.name for e in entries if e.name != forward.label and e.name in times
                 and reruns_forward(lambda e=e: registry.backward_class(e), residuals)]
    times = with_forward_reruns(op_name, args, times, rerunning)
    auto = tuned_order(auto, [a.label for a in auto], times)
  return options + auto


def with_forward_reruns(op_name: str, args: Any, times: dict[str, float],
                        rerunning: Sequence[str]) -> dict[str, float]:
  """`times` (a step's or a backward's, by implementation) with the tuned
  forward time added for each implementation in `rerunning`, whose backward
  runs its forward again there (+inf where the forward was not measured: it
  then goes after the measured ones)."""
  times = dict(times)
  if rerunning:
    forward = sources.measured_times(op_name, "forward", args)
    for label in rerunning:
      times[label] += forward.get(label, float("inf"))
  return times


def reruns_forward(backward: Callable[[], Any],
                   residuals: Mapping[str, Any] | None = None) -> bool:
  """Whether the backward that `backward()` returns (an op or its class) reruns
  its forward without its own forward's opaque residuals, or (given another
  forward's `residuals`) without one of them it recomputes from
  (`VjpOp.recomputes_without`); False where there is none or it fails to import
  (`select` reports that as a refusal, if it gets there)."""
  try:
    vjp = backward()
  except ImportError:
    return False
  if getattr(vjp, "reruns_forward_without_own_residuals", False):
    return True
  needed = getattr(vjp, "recomputes_without", frozenset())
  if isinstance(needed, str):  # one name written bare: not its characters
    needed = (needed,)
  return residuals is not None and any(name not in residuals for name in needed)


def choose_backward(op_name: str, args: Any, residuals: Any, device: DeviceInfo,
                    forward: Candidate, implementation: Implementation) -> VjpOp:
  """The backward of a call whose forward was `forward`."""
  candidates = _backward_candidates(op_name, args, device, forward, implementation,
                                    residuals)

  def named(cand):  # a backward the user named refuses: say so, do not fall back
    return cand.explicit and implementation is not None
  try:
    return select(candidates, args, device, part=_backward_part, residuals=(residuals,),
                  honor_declines=implementation is None, raise_refusal=named).op
  except NoChoice as e:
    raise NotImplementedError(no_implementation_message(
        op_name, "backward", [(c.label, r) for c, r in e.rejected])) from None
  except NotImplementedError as e:
    label = next(c.label for c in candidates if named(c))
    raise NotImplementedError(
        f"{op_name} backward: implementation {label!r} cannot run this call: "
        f"{describe(e)}") from e


def forward_with_residuals(op_name: str, args: Any, device: DeviceInfo,
                           candidates: Sequence[Candidate],
                           needed: tuple[str, ...]) -> Choice:
  """The first candidate whose forward runs the call and returns every residual
  in `needed`."""
  def returns_needed(op):
    names = _forward_residuals(op, args, training=False)
    if not set(needed) <= set(names):
      return f"returns no {', '.join(needed)} residual"
    return None
  try:
    return select(candidates, args, device, part=_forward_part, accept=returns_needed)
  except NoChoice as e:
    raise NotImplementedError(failure_message(op_name, "forward", e.rejected)) from None


def backward_from_residuals(op_name: str, args: Any, residuals: dict, device: DeviceInfo,
                            candidates: Sequence[Candidate],
                            consumes: tuple[str, ...]) -> Choice:
  """The first candidate whose own backward computes from the residuals in
  `consumes` (refuses a call without them): a backward that would recompute them
  (autodiff through a forward) gives another result and is passed over."""
  def consumes_given(op):
    rest = {k: v for k, v in residuals.items() if k not in consumes}
    try:
      op.check_supported(args, device, rest)
    except NotImplementedError:
      return None
    return f"does not compute from the given {', '.join(consumes)}"
  try:
    return select(candidates, args, device, part=_backward_part, residuals=(residuals,),
                  accept=consumes_given)
  except NoChoice as e:
    raise NotImplementedError(failure_message(op_name, "backward", e.rejected)) from None
