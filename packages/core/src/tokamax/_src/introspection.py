"""What is installed and why each implementation is or isn't usable here."""

from __future__ import annotations

import dataclasses

from tokamax._src import plugin
from tokamax._src import registry
from tokamax._src.dispatch.candidates import platform_matches, platform_refusal
from tokamax._src.op import DeviceInfo
from tokamax._src.ops import catalog


@dataclasses.dataclass(frozen=True)
class ImplementationStatus:
  """One (op, implementation) cell of ``tokamax.implementations()``."""

  op: str
  name: str
  backend: str
  distribution: str | None
  version: str | None
  priority: int
  has_backward: bool
  usable: bool
  reason: str  # why not usable ("" when usable)
  platforms: tuple[str, ...] = ()  # the JAX platforms it runs on ("gpu", "tpu", ...)


def implementations(op: str | None = None) -> list[ImplementationStatus]:
  """Every registered implementation (of `op`, or of all ops) and whether it can
  run a typical bfloat16 call on this machine's default device, with the reason.

  Example:
    >>> for s in tokamax.implementations("dot_product_attention"):
    ...   print(s.name, s.usable, s.reason)
  """
  if op is not None and op not in plugin.OP_NAMES:
    raise ValueError(f"op must be one of {plugin.OP_NAMES}; got {op!r}")
  device = DeviceInfo.of()
  statuses = []
  for op_name in ([op] if op else plugin.OP_NAMES):
    reg = registry.get()
    for entry in reg.entries[op_name]:
      name = registry.label(entry)
      reason = ""
      if not platform_matches(entry, device):
        reason = platform_refusal(entry.spec.platforms, device)
      else:
        try:
          probe = catalog.PROBLEMS[op_name].probe_args()
          registry.forward_class(entry)().check_supported(probe, device)
        except NotImplementedError as e:
          reason = str(e) or "not supported"
        except Exception as e:  # a plugin that fails to load: its reason, not a crash
          reason = f"failed to load: {type(e).__name__}: {e}"
      statuses.append(ImplementationStatus(
          op=op_name, name=name, backend=entry.backend,
          distribution=entry.distribution, version=entry.version,
          priority=entry.spec.priority, platforms=tuple(entry.spec.platforms),
          has_backward=entry.spec.backward is not None,
          usable=not reason, reason=reason))
  return statuses
