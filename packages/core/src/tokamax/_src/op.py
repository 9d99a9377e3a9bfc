"""What an operation is (`OpDefinition`) and what one implementation of it is
(`Op`, `VjpOp`).

Every implementation, built in or from a plugin or written by a user, subclasses
:class:`Op` (forward) and optionally :class:`VjpOp` (backward). Core does the rest:
validation (each op's folder in `tokamax._src.ops`), dispatch, `jax.custom_vjp`
wiring and config resolution (`tokamax._src.dispatch`).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax

from tokamax._src import settings

# Whether the forward being traced may return residuals outside its op's
# documented set, read only by its own backward (e.g. the cuDNN forward keeps
# jax.vjp's residuals so that its backward does not rerun it). Dispatch allows
# them only for calls it does not partition: partitioning lays out each residual
# by its documented name.
_OPAQUE_RESIDUALS = contextvars.ContextVar("tokamax_opaque_residuals", default=False)


def opaque_residuals_allowed() -> bool:
  """True while dispatch runs a forward whose residuals no one else lays out."""
  return _OPAQUE_RESIDUALS.get()


# Whether the forward being traced feeds a backward (a `jax.grad`/`jax.vjp` trace).
# Residuals an op documents as optional (the GLU's projections) cost memory
# traffic and are worth writing only then.
_FOR_BACKWARD = contextvars.ContextVar("tokamax_for_backward", default=False)


def for_backward() -> bool:
  """True while dispatch traces a forward whose residuals a backward will read."""
  return _FOR_BACKWARD.get()


@contextlib.contextmanager
def forward_for_backward(value: bool = True):
  """Sets `for_backward()` to `value` inside (False too: a forward nested in
  another op's forward is asked for what its own call needs)."""
  token = _FOR_BACKWARD.set(value)
  try:
    yield
  finally:
    _FOR_BACKWARD.reset(token)


@contextlib.contextmanager
def allow_opaque_residuals(value: bool = True):
  """Sets `opaque_residuals_allowed()` to `value` inside (False too: a forward
  nested in another op's, e.g. the composed grouped GLU's ragged_dot, returns
  what its own call's backward lays out)."""
  token = _OPAQUE_RESIDUALS.set(value)
  try:
    yield
  finally:
    _OPAQUE_RESIDUALS.reset(token)


# The opt-in feature of a call whose sizes are symbolic (`jax.export` with a
# symbolic shape): dispatch adds it to every such call, and only implementations
# that list it in `Op.supported_features` are given one. Kernels size their
# grids and tiles from the sizes, so they leave it out and the XLA ones run.
SYMBOLIC_SHAPES = "symbolic_shapes"
# The opt-in feature of a call whose own forward and backward are
# differentiated: `jax.hessian` (forward over reverse) and `jax.grad` of
# `jax.grad` differentiate the forward and backward that the inner `jax.grad`
# runs. Only implementations that list it are given such a call: kernels have
# no differentiation rule (Pallas raises a bare error there).
HIGHER_ORDER_AUTODIFF = "higher_order_autodiff"
# JAX's tracers of differentiation, by name (`jax.interpreters.ad` exports only
# the first): forward mode's, and reverse mode's (`jax.grad` linearizes; with
# `jax_use_direct_linearize` off it traces JVPs).
_AUTODIFF_TRACERS = frozenset({"JVPTracer", "LinearizeTracer"})


# How many of the differentiations tracing an op's operands its `custom_vjp`
# takes: one where the op is called; none inside its forward and backward rules,
# which see primal values (a differentiation there is an outer one, of the rules).
_DIFFERENTIATIONS_TAKEN = contextvars.ContextVar("tokamax_differentiations_taken",
                                                 default=1)


@contextlib.contextmanager
def differentiations_taken(count: int):
  """Sets how many differentiations `differentiated_again` leaves to the op's
  `custom_vjp` inside: 1 at an op's call, 0 in its forward and backward rules."""
  token = _DIFFERENTIATIONS_TAKEN.set(count)
  try:
    yield
  finally:
    _DIFFERENTIATIONS_TAKEN.reset(token)


def differentiated_again(leaves: Sequence[Any]) -> bool:
  """Whether a call on `leaves` is traced by more differentiations than the
  op's `custom_vjp` takes (`differentiations_taken`): a further one (an outer
  `jax.grad`, or `jax.hessian`'s JVP) differentiates the op's forward and
  backward themselves. Counted over all leaves, each differentiation once: a
  gradient penalty's outer `jax.grad` may trace only the scale while the inner
  one traces x. JAX's tracers hold the outer transformation's value as
  `primal` or `val`."""
  traces = set()
  for leaf in leaves:
    depth = 0
    while isinstance(leaf, jax.core.Tracer):
      if type(leaf).__name__ in _AUTODIFF_TRACERS:
        # A tracer's trace (where JAX names it), else its depth in the chain.
        trace = getattr(leaf, "_trace", None)
        traces.add(("depth", depth) if trace is None else id(trace))
        depth += 1
      leaf = getattr(leaf, "primal", getattr(leaf, "val", None))
  return len(traces) > _DIFFERENTIATIONS_TAKEN.get()


# The device of the op call whose decisions are being made (`deciding_for`):
# tuned-data lookups and op calls nested in its rules see no operand of their
# own that says where they run, and must decide as the call did.
_CALL_DEVICE = contextvars.ContextVar("tokamax_call_device", default=None)


@contextlib.contextmanager
def deciding_for(device: DeviceInfo):
  """`DeviceInfo.of` without a committed operand answers `device` inside."""
  token = _CALL_DEVICE.set(device)
  try:
    yield
  finally:
    _CALL_DEVICE.reset(token)


_WARNED_PLATFORMS: set[tuple[str, str]] = set()


def _default_device() -> jax.Device:
  """The device JAX places a computation on when its operands do not say: the
  one `jax.default_device` names (a device or a platform), else the first.
  Under `jit`, operands are tracers, and a program meant for the host CPU of a
  GPU machine is named so; taking the GPU there picked a kernel whose lowering
  then failed on the CPU. The other way round, a jitted program whose operands
  sit on the GPU under a default device naming the CPU runs on the GPU with the
  CPU's choices: that is warned about, once."""
  named = jax.config.jax_default_device
  first = jax.devices()[0]
  if named is None:
    return first
  device = jax.devices(named)[0] if isinstance(named, str) else named
  pair = (device.platform, first.platform)
  if pair[0] != pair[1] and pair not in _WARNED_PLATFORMS:
    _WARNED_PLATFORMS.add(pair)
    warnings.warn(
        f"tokamax: a call whose operands do not say where it runs (under jax.jit "
        f"they are tracers) is dispatched for {pair[0]!r}, the platform "
        f"jax.default_device names, although this machine's first device is "
        f"{pair[1]!r}. If the program runs on the {pair[1]} (its operands placed "
        f"there), it gets the {pair[0]}'s implementations: set jax.default_device "
        f"to the device it runs on around the jit call", stacklevel=4)
  return device


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What an implementation may ask about the device a call will run on.

  Attributes:
    platform: "cpu", "gpu" or "tpu" (JAX's platform name).
    device_kind: e.g. "NVIDIA H200" or "cpu".
    interpret: True when Pallas kernels run in interpret mode (see
      ``tokamax.interpret``); kernels then run on any platform.
    compute_capability: "9.0" on an H100/H200, None where not a CUDA GPU.
  """

  platform: str
  device_kind: str
  interpret: bool = False
  compute_capability: str | None = None

  @property
  def is_nvidia_gpu(self) -> bool:
    return self.platform == "gpu" and self.compute_capability is not None

  @classmethod
  def of(cls, arrays: Sequence[Any] = ()) -> DeviceInfo:
    """The device a call on `arrays` runs on: that of the first committed one
    (placed on a device by `jax.device_put(x, device)`, or computed from such
    arrays), else the device of the op call being decided (`deciding_for`),
    else the default device (`jax.default_device`'s where set). An uncommitted
    array, such as a constant a jitted function closes over, follows the
    computation, as in JAX."""
    device = None
    for x in arrays:
      if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
          and getattr(x, "committed", True)):
        try:
          device = next(iter(x.devices()))
          break
        except Exception:  # a deleted or odd array: use the default device
          pass
    if device is None:
      if (deciding := _CALL_DEVICE.get()) is not None:
        return dataclasses.replace(deciding, interpret=settings.interpret_mode())
      device = _default_device()
    capability = getattr(device, "compute_capability", None)
    return cls(platform=device.platform, device_kind=device.device_kind,
               interpret=settings.interpret_mode(),
               compute_capability=str(capability) if capability is not None else None)


@dataclasses.dataclass(frozen=True)
class OpDefinition:
  """One operation as generic code sees it; each op's folder in
  `tokamax._src.ops` declares one, and dispatch and sharding read nothing else
  about the op.

  Attributes:
    name: one of ``tokamax.plugin.OP_NAMES`` (the name implementations register
      under).
    diff_fields: the fields of the op's args dataclass that receive gradients.
    arg_labels: a dim label per args field (one letter per dim) for the Shardy
      sharding rule: operands that share a letter propagate shardings to each
      other.
    result_labels: the same for ``"out"`` and each documented residual.
    leading_label: the letter of the leading (row / batch) dim that may be
      several dims (merged into one before implementations see the args), or
      None where the op has no such dim.
    plan: the op's partitioning rule, ``(mesh, shapes, specs, supports) ->
      sharding.Plan`` (see `tokamax._src.sharding`).
  """

  name: str
  diff_fields: tuple[str, ...]
  arg_labels: Mapping[str, str]
  result_labels: Mapping[str, str]
  leading_label: str | None
  plan: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Op(abc.ABC):
  """Base class of a forward implementation of an op.

  Subclasses are frozen dataclasses; the only field here is ``config`` (the
  kernel config: tiling, stages...): None means "resolve a config for me"
  (dispatch asks the tuned-config sources, then autotunes on a miss if asked to,
  then takes :meth:`heuristic_config`).

  A subclass sets the class attributes ``op_name`` (one of
  ``tokamax.plugin.OP_NAMES``) and ``name`` (the implementation name), and
  implements :meth:`forward`. It overrides :meth:`check_supported` to refuse calls
  it cannot handle, :meth:`heuristic_config` and :meth:`search_space` when it has a
  config.

  Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class MyRmsNorm(tokamax.Op):
    ...   op_name = "layer_norm"
    ...   name = "my_rms_norm"
    ...   def check_supported(self, args, device):
    ...     if args.subtract_mean:
    ...       raise NotImplementedError("only RMS normalization")
    ...   def forward(self, args, config):
    ...     ...
    ...     return y, {"mean": mean, "rstd": rstd}
    >>> tokamax.layer_norm(x, scale, None, subtract_mean=False,
    ...                    implementation=MyRmsNorm())
  """

  config: Any = None

  op_name: ClassVar[str] = ""
  name: ClassVar[str] = ""
  # The config dataclass type (frozen, JSON-serializable fields), if any.
  config_cls: ClassVar[type | None] = None
  # The backward to use with this forward when the user passes an instance of
  # this class; None lets dispatch choose the backward.
  vjp: ClassVar[type[VjpOp] | None] = None
  # Opt-in argument fields this implementation handles (e.g. attention's
  # "q_offset"); dispatch refuses it for calls that set any other one. Also
  # `SYMBOLIC_SHAPES` and `HIGHER_ORDER_AUTODIFF`, for one that runs calls
  # whose sizes are symbolic or whose forward and backward are differentiated.
  supported_features: ClassVar[tuple[str, ...]] = ()

  @property
  def implementation_name(self) -> str:
    return self.name or type(self).__name__

  def check_supported(self, args: Any, device: DeviceInfo) -> None:
    """Raises `NotImplementedError` with the reason if this call can't run here."""
    del args, device

  def declines(self, args: Any) -> str | None:
    """Why automatic choice should pass this call on although it runs it: a
    measured reason (another implementation, the XLA reference say, is faster
    for these args), or that the kernel for these args has not been timed
    against the others yet; None to take it. Only ``implementation=None`` listens:
    a forward declining passes the call to the next forward; a backward
    declining passes it to the next backward that takes its forward's
    residuals, or, where none does without declining, moves a training step to
    a forward whose own backward takes it. A user who names this
    implementation still gets it."""
    del args
    return None

  def heuristic_config(self, args: Any) -> Any:
    """A good config for `args` without measuring anything."""
    del args
    return None

  def search_space(self, args: Any) -> Sequence[Any]:
    """Configs worth measuring for `args` (autotuning)."""
    config = self.heuristic_config(args)
    return () if config is None else (config,)

  @abc.abstractmethod
  def forward(self, args: Any, config: Any) -> tuple[jax.Array, Mapping[str, jax.Array]]:
    """Computes the op.

    Returns:
      ``(output, residuals)``: residuals are the op's documented residual arrays
      (e.g. the attention log-sum-exp) for a backward implementation, or ``{}``.
    """

  @staticmethod
  def residuals_wanted() -> bool:
    """Whether a backward will read this forward's residuals: an op's optional
    residuals (see its Args docstring) should be returned only then."""
    return for_backward()


@dataclasses.dataclass(frozen=True)
class VjpOp(Op):
  """Base class of a backward implementation of an op.

  It receives the forward's arguments, the forward's residuals (which may come
  from another implementation: only the op's documented residuals are passed),
  the forward output and its cotangent, and returns the cotangents of the
  differentiable arguments as a dict keyed by argument field name (missing or None
  entries mean zero).
  """

  # True for a backward that always runs its own forward again when its own
  # forward's opaque residuals are missing, as behind another implementation's
  # forward: its measured time (taken after its own forward) then misses that
  # forward, which dispatch adds when it ranks this backward behind another
  # forward (cuDNN's, whose own residuals are jax.vjp's). A backward whose
  # rerun depends on which documented residuals it is given: `recomputes_without`.
  reruns_forward_without_own_residuals: ClassVar[bool] = False
  # The op's documented residuals without which this backward runs its
  # forward's work again (the GLU backwards recompute the projections ``x @ w``
  # where a forward kept none, as XLA's and Mosaic TPU's keep none): its
  # measured time (taken after its own forward, which kept them) then misses
  # that work, and dispatch adds this implementation's forward time when it
  # ranks it behind a forward that left one of them out.
  recomputes_without: ClassVar[frozenset[str]] = frozenset()

  def check_supported(self, args: Any, device: DeviceInfo,
                      residuals: Mapping[str, jax.Array] | None = None) -> None:
    del args, device, residuals

  def forward(self, args, config):
    raise TypeError(f"{type(self).__name__} is a backward implementation")

  @abc.abstractmethod
  def backward(self, args: Any, residuals: Mapping[str, jax.Array], out: jax.Array,
               dout: jax.Array, config: Any) -> Mapping[str, jax.Array | None]:
    """Returns ``{field_name: cotangent}`` for the differentiable fields of args."""

