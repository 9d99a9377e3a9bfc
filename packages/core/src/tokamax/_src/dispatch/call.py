"""`call`: one op call, its forward and backward each run by the implementation
dispatch chooses for it.

The path of a call: an op's public function (``tokamax._src.ops.<op>.api``)
validates and canonicalizes its arguments into the op's args dataclass and calls
`call` with the op's `OpDefinition`. `call` chooses the forward (`selection`),
wraps the computation in a `jax.custom_vjp`, and hands each direction's local
computation to `sharding`, the layer that partitions it over the devices when
the program runs on several (and otherwise runs it as it is). At grad time the
backward is chosen the same way, given the forward's residuals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokamax._src import qwix_ptq
from tokamax._src import sharding
from tokamax._src import vma
from tokamax._src.dispatch import configs
from tokamax._src.dispatch import records
from tokamax._src.dispatch import selection
from tokamax._src.dispatch.candidates import (Implementation, check_opt_in, expand,
                                              supported_features, tuned_order)
from tokamax._src.dispatch.records import DispatchRecord
from tokamax._src.op import (HIGHER_ORDER_AUTODIFF, DeviceInfo, OpDefinition,
                             allow_opaque_residuals, deciding_for,
                             differentiations_taken, forward_for_backward)
from tokamax._src.tuning import sources


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
    if g is None or not jnp.issubdtype(primal.dtype, jnp.floating):
      # No cotangent, or a primal that takes none (int8 values of a quantized
      # operand): None is a zero cotangent to custom_vjp.
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


def _forward_record(op_name: str, args: Any, choice: selection.Choice) -> DispatchRecord:
  return DispatchRecord(op_name, "forward", choice.candidate.label,
                        configs.resolve(choice.op, args), choice.rejected_labels())


@dataclasses.dataclass
class _Dispatch:
  """The decisions of one op call, made at trace time on the merged shapes
  (`merged`: what implementations, tuned data and observers see)."""

  definition: OpDefinition
  merged: Any
  implementation: Implementation
  device: DeviceInfo
  lead_dims: int
  candidates: list
  # A choice among several (None, or a sequence of names) prefers one that keeps
  # the operands' explicit sharding (e.g. attention queries split along the
  # sequence need q_offset); a single named implementation is used as it is.
  choosing: bool
  prefer: frozenset[str]
  inference: selection.Choice
  inference_record: DispatchRecord

  @classmethod
  def start(cls, definition: OpDefinition, args: Any, implementation: Implementation,
            lead_dims: int) -> _Dispatch:
    name = definition.name
    merged = sharding.merge_leading(definition, args, lead_dims, abstract=True)
    for observer in records.observers():
      observer(name, merged, implementation)
    device = DeviceInfo.of(jax.tree_util.tree_leaves(args))
    with deciding_for(device):  # tuned data is read for the call's device
      candidates = expand(name, implementation, device)
      if implementation is None:
        candidates = tuned_order(candidates, [c.label for c in candidates],
                                 sources.measured_times(name, "forward", merged))
      choosing = implementation is None or (
          isinstance(implementation, (list, tuple)) and len(implementation) > 1)
      prefer = sharding.wanted_features(definition, args) if choosing else frozenset()
      inference = selection.choose_forward(name, merged, device, candidates, prefer)
      inference_record = _forward_record(name, merged, inference)
    records.record(inference_record)
    return cls(definition, merged, implementation, device, lead_dims, candidates,
               choosing, prefer, inference, inference_record)

  @functools.cached_property
  def training(self) -> selection.Choice:
    """The forward of a training step (traced by `run_fwd` instead of `run`): it
    must also leave its backward something fast to run (see
    `selection.training_choice`). Its decision takes the inference one's place in
    the records (under `grad(jit(f))` both are traced, and only this one runs).
    Decided on the call's args (`merged`) wherever it is first asked for, as at
    the call: the op's `custom_vjp` takes one differentiation of them."""
    with differentiations_taken(1), deciding_for(self.device):
      return self._training()

  def _training(self) -> selection.Choice:
    if not self.choosing or set(self.definition.result_labels) == {"out"}:
      # An op that documents no residuals (ragged_dot): every backward computes
      # from the operands alone, whichever forward ran.
      return self.inference
    name, candidates, inference = self.definition.name, self.candidates, self.inference
    step = sources.step_times(name, self.merged) if self.implementation is None else {}
    if step and sharding.active(jax.tree_util.tree_leaves(self.merged)):
      # Partitioned, a forward leaves no opaque residuals (`forward`): a backward
      # that reruns its forward without them (cuDNN's) pays it after its own.
      rerunning = [c.label for c in candidates if c.label in step
                   and c.backward is not None and selection.reruns_forward(c.backward)]
      step = selection.with_forward_reruns(name, self.merged, step, rerunning)
    if step:
      # A training step runs the forward and then (first choice) its own backward:
      # order by their measured sum, not by the forward's time alone (mosaic_gpu's
      # GQA causal attention forward beats cuDNN's, its forward+backward does not).
      candidates = tuned_order(candidates, [c.label for c in candidates], step)
      inference = selection.choose_forward(name, self.merged, self.device, candidates,
                                           self.prefer)
    choice = selection.training_choice(name, self.merged, self.device, candidates,
                                       self.prefer, inference)
    if choice.candidate != self.inference.candidate:
      records.replace_record(self.inference_record,
                             _forward_record(self.definition.name, self.merged, choice))
    return choice

  def _supports(self, choice: selection.Choice):
    """Whether the chosen forward takes an opt-in field: layouts that need one (a
    split query sequence needs q_offset) are used only then."""
    features = supported_features(choice.op)
    return lambda feature: feature in features

  def forward(self, args: Any, choice: selection.Choice, for_backward: bool):
    """``(out, residuals)`` of the chosen forward, partitioned if useful."""
    op = choice.op
    global_config = configs.resolve(op, self.merged)
    global_shapes = _shapes(self.merged)

    # The contexts are entered in `local`, not around the call below: a
    # partitioned call traces it again later, at compile time, when they are gone.
    @deciding_for(self.device)  # a context manager as a decorator
    def local(local_args):
      config = global_config
      if _shapes(local_args) != global_shapes:
        # A shard (or a shard's adjusted args): check it again on its own shapes.
        check_opt_in(op, local_args)
        op.check_supported(local_args, self.device)
        config = configs.resolve(op, local_args)
      with forward_for_backward(for_backward):
        out, residuals = op.forward(local_args, config)
      return out, dict(residuals)

    supports = self._supports(choice)
    # `sharding.forward` also runs the unpartitioned call (under vmap the answer
    # can differ from the one above, given JVP tracers): it merges the leading dims.
    # Set either way: a forward nested in another op's inherits no permission.
    opaque = for_backward and not sharding.active(jax.tree_util.tree_leaves(args))
    run = functools.partial(sharding.forward, self.definition, run=local,
                            supports=supports, lead=self.lead_dims)
    with allow_opaque_residuals(opaque):
      out, residuals = _refusing_differentiation(
          op, f"{self.definition.name} forward", run)(args)
    return vma.outputs_like_inputs(out, args), residuals

  def backward(self, args: Any, residuals: dict, out: jax.Array, dout: jax.Array):
    """The cotangent pytree of `args` from the chosen backward."""
    name = self.definition.name
    choice = self.training
    merged = sharding.merge_leading(self.definition, args, self.lead_dims,
                                    abstract=True)
    merged_residuals = sharding.merge_residuals(self.definition, residuals,
                                                self.lead_dims, abstract=True)
    op = selection.choose_backward(name, merged, merged_residuals, self.device,
                                   choice.candidate, self.implementation)
    global_config = configs.resolve(op, merged)
    records.record(DispatchRecord(name, "backward", op.implementation_name,
                                  global_config))
    global_shapes = _shapes(merged)

    @deciding_for(self.device)  # a context manager as a decorator
    def local(a, r, o, do):
      config = global_config
      if _shapes(a) != global_shapes:
        check_opt_in(op, a)
        op.check_supported(a, self.device, r)
        config = configs.resolve(op, a)
      return dict(op.backward(a, r, o, do, config))

    run = functools.partial(sharding.backward, self.definition, run=local,
                            supports=self._supports(choice), lead=self.lead_dims)
    grads = _refusing_differentiation(op, f"{name} backward", run)(
        args, residuals, out, dout)
    return _cotangents(args, dict(grads), self.definition.diff_fields)


def _refusing_differentiation(op: Any, what: str, fn: Callable) -> Callable:
  """`fn`, which runs `op`, as it is where `op` may be differentiated
  (`HIGHER_ORDER_AUTODIFF`); else differentiating it raises NotImplementedError
  with the reason and the way out, not a kernel's bare error. Dispatch gives such
  calls to other implementations when it sees the outer differentiation's
  tracers, but not in a function traced before it (`jax.hessian(jax.jit(f))`)
  nor where only the cotangent of the op's VJP is differentiated."""
  if HIGHER_ORDER_AUTODIFF in supported_features(op):
    return fn
  why = (f"{what}: implementation {op.implementation_name!r} has no derivative "
         f"of its own, and this call is differentiated again where dispatch could "
         f"not see it coming: in a function traced before that differentiation "
         f"(jax.hessian, or an outer jax.grad, of a jax.jit, lax.scan, lax.cond or "
         f"jax.checkpoint body), or through the cotangent of its VJP alone. Put "
         f"jax.jit outside the differentiation, or pass implementation='xla' to "
         f"this op (on one device: on several, only the first way works)")

  def guarded(*args):
    leaves, treedef = jax.tree_util.tree_flatten(args)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    @jax.custom_jvp
    def run(*arrays):
      full = list(leaves)
      for i, x in zip(where, arrays):
        full[i] = x
      return fn(*jax.tree_util.tree_unflatten(treedef, full))

    @run.defjvp
    def _(primals, tangents):
      raise NotImplementedError(why)

    return run(*[leaves[i] for i in where])

  return guarded


def call(definition: OpDefinition, args: Any, implementation: Implementation,
         lead_dims: int = 1) -> jax.Array:
  """Runs the op `definition` describes on canonical `args` with the chosen
  implementations.

  Args:
    definition: the op (its name, differentiable fields, sharding rule...).
    args: the op's canonical argument dataclass (a registered pytree), except
      that its batched fields may have `lead_dims` leading dims in place of one.
    implementation: as the public op functions take it.
    lead_dims: the number of leading (row / batch) dims of the batched fields
      (`sharding.merge_leading`). Implementations, tuned data and observers
      always see them merged into one.

  Returns:
    The op's output, with the leading dims of `args`.
  """
  # Here the op's `custom_vjp` takes one differentiation of `args` (a call
  # nested in another op's rules is checked as a call of its own).
  with differentiations_taken(1):
    # Merging dims keeps a sharding only when it is on the major one, so a
    # partitioned call keeps the leading dims apart up to the local computation;
    # otherwise they are merged here, before anything else sees the args.
    if lead_dims != 1 and not sharding.active(jax.tree_util.tree_leaves(args)):
      lead = sharding.leading_shape(definition, args, lead_dims)
      out = call(definition, sharding.merge_leading(definition, args, lead_dims),
                 implementation)
      return out.reshape(*lead, *out.shape[1:])
    decisions = _Dispatch.start(definition, args, implementation, lead_dims)
  # Qwix's rules apply to the op's call (`qwix_ptq`), not inside it.
  outside = qwix_ptq.outside_interception
  # The rules see primal values: a differentiation of their operands is an outer
  # one, of the rules themselves (`jax.hessian`, `jax.grad` of `jax.grad`); their
  # tuned-data lookups and nested op calls decide for the call's device.
  @contextlib.contextmanager
  def in_rules():
    with differentiations_taken(0), deciding_for(decisions.device):
      yield

  @jax.custom_vjp
  @outside
  def run(args):
    with in_rules():
      return decisions.forward(args, decisions.inference, for_backward=False)[0]

  @outside
  def run_fwd(args):
    with in_rules():
      out, residuals = decisions.forward(args, decisions.training, for_backward=True)
    return out, (args, dict(residuals), out)

  @outside
  def run_bwd(saved, dout):
    args, residuals, out = saved
    with in_rules():
      return (decisions.backward(args, residuals, out, dout),)

  run.defvjp(run_fwd, run_bwd)
  return run(args)


def forward_with_residuals(op_name: str, args: Any, implementation: Implementation,
                           needed: tuple[str, ...] = (),
                           fallback: str | None = None) -> tuple[jax.Array, dict]:
  """Runs only the forward of `op_name` and returns ``(out, residuals)``.

  For building blocks that combine op calls themselves (ring attention merges
  per-block outputs by their log-sum-exp): the first usable implementation whose
  residuals include every name in `needed`; with ``implementation=None`` and none
  such, `fallback`. Not differentiable.
  """
  device = DeviceInfo.of(jax.tree_util.tree_leaves(args))
  try:
    choice = selection.forward_with_residuals(
        op_name, args, device, expand(op_name, implementation, device), needed)
  except NotImplementedError:
    if implementation is None and fallback is not None:
      return forward_with_residuals(op_name, args, fallback, needed)
    raise
  with deciding_for(device):
    config = configs.resolve(choice.op, args)
    records.record(DispatchRecord(op_name, "forward", choice.candidate.label, config,
                                  choice.rejected_labels()))
    out, residuals = choice.op.forward(args, config)
  return out, dict(residuals)


def backward_with_residuals(op_name: str, args: Any, residuals: dict, out: jax.Array,
                            dout: jax.Array, implementation: Implementation,
                            consumes: tuple[str, ...],
                            fallback: str | None = None) -> dict:
  """Runs only a backward of `op_name` that computes from the given residuals.

  For building blocks that combine op calls themselves (ring attention: each
  block pair's gradients come from the global log-sum-exp and output, not from
  the block's own softmax). The first usable backward among the implementations'
  own that needs every residual in `consumes`; with ``implementation=None`` and
  none such, `fallback`'s.
  """
  device = DeviceInfo.of(jax.tree_util.tree_leaves(args))
  try:
    choice = selection.backward_from_residuals(
        op_name, args, residuals, device, expand(op_name, implementation, device),
        consumes)
  except NotImplementedError:
    if implementation is None and fallback is not None:
      return backward_with_residuals(op_name, args, residuals, out, dout, fallback,
                                     consumes)
    raise
  with deciding_for(device):
    config = configs.resolve(choice.op, args)
    records.record(DispatchRecord(op_name, "backward", choice.candidate.label, config,
                                  choice.rejected_labels()))
    return dict(choice.op.backward(args, residuals, out, dout, config))
