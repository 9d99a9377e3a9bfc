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
        api_version=tokamax.plugin.PLUGIN_API_VERSION,
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
"""

from __future__ import annotations

import dataclasses

# Helpers for backends' kernels, re-exported here as tokamax.plugin.*.
from tokamax._src.activation import check_elementwise_activation  # noqa: F401
from tokamax._src.groups import held_row_ranges  # noqa: F401
from tokamax._src.vma import varying_out_shape  # noqa: F401

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
    api_version: the ``PLUGIN_API_VERSION`` the package was written against.
    implementations: the implementations it provides.
    tuned_data: a package holding tuned configs as
      ``<device_kind_slug>/<op>.json`` (see ``python -m tokamax autotune``), or None.
  """

  name: str
  api_version: int
  implementations: tuple[Implementation, ...] = ()
  tuned_data: str | None = None
