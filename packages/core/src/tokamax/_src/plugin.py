"""The plugin contract: what a backend package declares to tokamax.

A backend package (ours or a third party's) declares one entry point in the group
``tokamax.backends`` that points at a :class:`Backend` object, or at a callable
returning one. The declaration names implementations by ``"module:attr"`` strings,
so discovering a backend never imports its kernel modules; they are imported the
first time an implementation is used.

Example ``pyproject.toml`` of a backend package::

    [project.entry-points."tokamax.backends"]
    my_backend = "my_backend._plugin:BACKEND"

and ``my_backend/_plugin.py``::

    import tokamax

    BACKEND = tokamax.plugin.Backend(
        name="my_backend",
        api_version=1,
        implementations=(
            tokamax.plugin.Implementation(
                op="layer_norm",
                name="my_impl",
                forward="my_backend.layer_norm:MyLayerNorm",
                backward="my_backend.layer_norm:MyLayerNormVjp",
                platforms=("gpu",),
                priority=50,
            ),
        ),
    )

A backend with one implementation name for several ops declares them together
with :func:`implementations`. Besides the contract, this module holds the
helpers that several backends' kernels share (re-exported as
``tokamax.plugin.*``): activation checks, group row ranges, the config an Op
runs with (`resolve_config`: its own, else tuned data's, else its heuristic's;
for an implementation that runs another op's Op inside), shard_map output
types, a call's stand-in under `jax.vmap` (`vmap_fallback`; `sequential_under_vmap`
for a call nothing batches),
:class:`OpFunctions` (an Op / VjpOp pair that delegates to module
functions) and the attention kernels' common layout and checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
from jax import lax

# Helpers for backends' kernels, re-exported here as tokamax.plugin.*.
from tokamax._src.activation import check_elementwise_activation  # noqa: F401
from tokamax._src.activation import closed_over_arrays  # noqa: F401
from tokamax._src.batching import sequential_under_vmap, vmap_fallback  # noqa: F401
from tokamax._src.groups import held_row_ranges  # noqa: F401
from tokamax._src.op import VjpOp
from tokamax._src.sharding import in_shard_map  # noqa: F401
from tokamax._src.vma import checks_varying_axes, varying_out_shape  # noqa: F401

# Bumped when the contract below changes incompatibly. Core refuses plugins that
# declare another major version, with a warning naming both versions.
PLUGIN_API_VERSION = 1

OP_NAMES = (
    "dot_product_attention",
    "gated_linear_unit",
    "layer_norm",
    "ragged_dot",
)

# Platform names as `jax.default_backend()` spells them, plus "gpu" for either GPU kind.
KNOWN_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of one op, declared without importing it.

  Attributes:
    op: the op it implements, one of ``OP_NAMES``.
    name: the implementation name users pass as ``implementation=`` (e.g. "triton").
    forward: ``"module:attr"`` of the forward ``tokamax.Op`` subclass.
    backward: ``"module:attr"`` of the backward ``tokamax.VjpOp`` subclass, or None
      when the implementation has no backward of its own (the backward is then
      chosen automatically).
    platforms: JAX platforms it can run on ("cpu", "gpu", "cuda", "rocm", "tpu").
    priority: higher is tried first by ``implementation=None``. The XLA reference
      has priority 0; our kernels use 100-200.
  """

  op: str
  name: str
  forward: str
  backward: str | None = None
  platforms: tuple[str, ...] = ("gpu",)
  priority: int = 100

  def __post_init__(self):
    if self.op not in OP_NAMES:
      raise ValueError(f"Implementation.op must be one of {OP_NAMES}, got {self.op!r}")
    if not self.name or not self.name.replace("_", "").isalnum():
      raise ValueError(
          f"Implementation.name must be a non-empty identifier, got {self.name!r}")
    for ref in (self.forward, self.backward):
      if ref is not None and ref.count(":") != 1:
        raise ValueError(f"expected 'module:attr', got {ref!r}")
    unknown = set(self.platforms) - set(KNOWN_PLATFORMS)
    if unknown:
      raise ValueError(
          f"Implementation.platforms has unknown {sorted(unknown)}; "
          f"allowed: {KNOWN_PLATFORMS}")


@dataclasses.dataclass(frozen=True)
class Backend:
  """What one backend package registers.

  Attributes:
    name: the backend's name (e.g. "gpu_triton"); used in messages and in
      ``TOKAMAX_DISABLED_BACKENDS``.
    api_version: the ``PLUGIN_API_VERSION`` the package was written against,
      written as a literal: read from ``tokamax.plugin.PLUGIN_API_VERSION`` it
      would always match the installed core, and a core that changed the API
      could not refuse the package (its ``tokamax-core`` version range says the
      same to pip).
    implementations: the implementations it provides.
    tuned_data: a package holding tuned configs as
      ``<device_kind_slug>/<op>.json`` (see ``python -m tokamax autotune``), or None.
  """

  name: str
  api_version: int
  implementations: tuple[Implementation, ...] = ()
  tuned_data: str | None = None

  def __post_init__(self):
    given = self.implementations
    try:
      specs = None if isinstance(given, Implementation) else tuple(given)
    except TypeError:  # not iterable (None, a number)
      specs = None
    if specs is None or not all(isinstance(i, Implementation) for i in specs):
      raise TypeError(
          f"Backend {self.name!r}: implementations must be a tuple of "
          f"tokamax.plugin.Implementation (one of them: (Implementation(...),)); "
          f"got {given!r}")
    # A list is kept as a tuple: the backend is frozen, as registered.
    object.__setattr__(self, "implementations", specs)


def implementations(*, name: str, platforms: tuple[str, ...], priority: int,
                    ops: Mapping[str, tuple[str, str | None]]
                    ) -> tuple[Implementation, ...]:
  """One :class:`Implementation` per op, all with the same name, platforms and priority.

  Args:
    name: the implementation name users pass as ``implementation=``.
    platforms: the JAX platforms every one of them runs on.
    priority: their priority (see :class:`Implementation`).
    ops: op name -> ``("module:attr" of the forward, "module:attr" of the backward
      or None)``.
  """
  return tuple(
      Implementation(op=op, name=name, forward=forward, backward=backward,
                     platforms=platforms, priority=priority)
      for op, (forward, backward) in ops.items())


# ----------------------------------------------------------------------------
# Helpers for backends' Op classes.
# ----------------------------------------------------------------------------


class OpFunctions:
  """Mixin: ``check_supported``, ``heuristic_config`` and ``search_space`` of a
  backend's ``tokamax.Op`` or ``tokamax.VjpOp`` from module functions.

  A kernel module's forward Op and its VjpOp usually run the same argument checks
  and size their configs with the same functions, told which pass they serve.
  List the mixin first (``class MyNorm(plugin.OpFunctions, tokamax.Op)``) and set,
  as ``staticmethod``s, the ones the class does not implement as methods itself:

  - ``check_args(args, device)``: raises NotImplementedError for what the kernels
    do not support;
  - ``heuristic(args, backward=...)``: the config without autotuning;
  - ``configs(args, backward=...)``: the configs autotuning tries.

  ``backward`` is True in a VjpOp. ``needed_residuals`` maps the residuals a VjpOp
  cannot run without to what they are ("lse": "log-sum-exp"); check_supported
  refuses forward residuals that lack one.

  A kernel module usually declares what its two ops share once, in a base of
  both::

      class _NormFunctions(plugin.OpFunctions):
        op_name = "layer_norm"
        name = "my_impl"
        check_args = staticmethod(_check_args)
        heuristic = staticmethod(_heuristic)
        configs = staticmethod(_search_space)

      @dataclasses.dataclass(frozen=True)
      class MyNorm(_NormFunctions, tokamax.Op): ...

      @dataclasses.dataclass(frozen=True)
      class MyNormVjp(_NormFunctions, tokamax.VjpOp): ...
  """

  check_args: ClassVar[Callable[[Any, Any], None]]
  heuristic: ClassVar[Callable[[Any, bool], Any]]
  configs: ClassVar[Callable[[Any, bool], Sequence[Any]]]
  needed_residuals: ClassVar[Mapping[str, str]] = {}

  @property
  def _backward(self) -> bool:
    return isinstance(self, VjpOp)

  def check_supported(self, args, device, residuals=None) -> None:
    self.check_args(args, device)
    for key, what in self.needed_residuals.items():
      if residuals is not None and key not in residuals:
        raise NotImplementedError(f"needs the forward's {what} residual ({key!r})")

  def heuristic_config(self, args):
    return self.heuristic(args, backward=self._backward)

  def search_space(self, args):
    return self.configs(args, backward=self._backward)


# ----------------------------------------------------------------------------
# Helpers for attention kernels.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
  """What an attention kernel specializes on, from ``AttentionArgs``: static sizes,
  the visible window and which optional inputs are present.

  Kernels subclass it (a frozen dataclass) with their own fields and properties
  and build it with :meth:`from_args`.
  """

  t: int
  s: int
  num_heads: int
  num_kv_heads: int
  h: int
  hv: int
  scale: float
  left: int | None  # key s visible to query t needs s >= t - left
  right: int | None  # ... and s <= t + right (causal: right = 0)
  soft_cap: float | None
  has_q_len: bool
  has_kv_len: bool
  has_segments: bool
  has_q_offset: bool  # query row t sits at position t + q_offset (window/causal)
  precision: Any

  @property
  def group(self) -> int:
    """Query heads per kv head (GQA/MQA)."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def from_args(cls, args, precision, **fields):
    """The layout of `args`; `precision` is the kernel's for its in-kernel dots.

    A float32 call without one gets ``Precision.HIGHEST``, XLA's float32 accuracy
    (the accelerators' default float32 dots are TF32 on GPUs, bf16 passes on TPUs).
    `fields` are the subclass's own.
    """
    left, right = args.visible_window
    if precision is None and args.query.dtype == jnp.float32:
      precision = lax.Precision.HIGHEST
    return cls(
        t=args.query.shape[1], s=args.key.shape[1], num_heads=args.query.shape[2],
        num_kv_heads=args.key.shape[2], h=args.query.shape[3], hv=args.value.shape[3],
        scale=args.scale, left=left, right=right, soft_cap=args.logits_soft_cap,
        has_q_len=args.query_seq_lengths is not None,
        has_kv_len=args.key_value_seq_lengths is not None,
        has_segments=args.q_segment_ids is not None,
        # The offset moves only the window; without one it changes nothing.
        has_q_offset=args.q_offset is not None and (left, right) != (None, None),
        precision=precision, **fields)


def resolve_config(op: Any, args: Any) -> Any:
  """The config `op` runs `args` with, as dispatch resolves it: the Op's own, else
  tuned data's for this call, else its heuristic's. For an implementation that
  runs another op's Op inside (e.g. a grouped GLU on ragged_dot's kernels)."""
  from tokamax._src.dispatch import configs  # here: dispatch imports this module
  return configs.resolve(op, args)


def check_attention_shapes(args, max_head_dim: int) -> None:
  """Refuses head dims above `max_head_dim` and empty inputs (NotImplementedError)."""
  h, hv = args.query.shape[-1], args.value.shape[-1]
  if max(h, hv) > max_head_dim:
    raise NotImplementedError(f"head dims up to {max_head_dim} are supported; got "
                              f"H={h}, Hv={hv}")
  if min(args.query.shape[1], args.key.shape[1], h, hv, args.query.shape[0],
         args.query.shape[2]) == 0:
    raise NotImplementedError(
        f"empty (zero-size) inputs: query {tuple(args.query.shape)}, key "
        f"{tuple(args.key.shape)}, value {tuple(args.value.shape)}")


def attention_delta(out, dout):
  """``rowsum(dout * out)`` in float32, ``[B, N, T]``: the softmax backward's
  correction term, from ``[B, T, N, Hv]`` outputs and their cotangents."""
  return jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32),
                    out.astype(jnp.float32))


def guard_large_logits(args, dout, backward, lse=None):
  """``backward()``, an attention backward that recomputes its weights as
  ``exp(logit - lse)`` from a float32 lse, where that is right; where some query
  row's logits are huge (a bias of -1e9 masking the whole row, whose lse
  float32 rounds), the XLA chunked backward, which is exact there. Decided at
  run time from `lse` (the forward's ``[B, N, T]``, free to read) where given,
  else from the bias (one read of it); both branches compiled, one runs. Rows
  whose cotangent is zero need nothing (they add no gradient); calls without a
  bias, or with a soft cap below 2**14, run `backward()` unchecked."""
  from tokamax._src.ops.attention import large_logits  # pylint: disable=g-import-not-at-top
  return large_logits.guard(args, dout, backward, lse)
