"""What is installed and why each implementation is or isn't usable here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src import plugin
from tokamax._src import registry


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


def _probe_args(op: str):
  """A typical bf16 call of `op`, as shapes only, to ask `check_supported` about."""
  from tokamax._src.ops import attention, gated_linear_unit, layer_norm, ragged_dot  # pylint: disable=g-import-not-at-top,g-multiple-import
  s = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  if op == "dot_product_attention":
    return attention.AttentionArgs(
        query=s((2, 1024, 8, 128), bf16), key=s((2, 1024, 8, 128), bf16),
        value=s((2, 1024, 8, 128), bf16), scale=128**-0.5, is_causal=True)
  if op == "layer_norm":
    return layer_norm.LayerNormArgs(x=s((4096, 4096), bf16), scale=s((4096,), bf16),
                                    offset=s((4096,), bf16))
  if op == "gated_linear_unit":
    return gated_linear_unit.GatedLinearUnitArgs(
        x=s((4096, 1024), bf16), weights=s((1024, 2, 4096), bf16),
        activation=jax.nn.silu)
  return ragged_dot.RaggedDotArgs(lhs=s((4096, 1024), bf16), rhs=s((8, 1024, 1024), bf16),
                                  group_sizes=s((8,), jnp.int32))


def implementations(op: str | None = None) -> list[ImplementationStatus]:
  """Every registered implementation (of `op`, or of all ops) and whether it can
  run a typical bfloat16 call on this machine's default device, with the reason.

  Example:
    >>> for s in tokamax.implementations("dot_product_attention"):
    ...   print(s.name, s.usable, s.reason)
  """
  if op is not None and op not in plugin.OP_NAMES:
    raise ValueError(f"op must be one of {plugin.OP_NAMES}; got {op!r}")
  device = dispatch.current_device([])
  statuses = []
  for op_name in ([op] if op else plugin.OP_NAMES):
    reg = registry.get()
    for entry in reg.entries[op_name]:
      name = entry.name if reg.by_name.get((op_name, entry.name)) is entry else (
          entry.qualified_name)
      reason = ""
      if not dispatch._platform_matches(entry, device):  # pylint: disable=protected-access
        reason = (f"runs on {', '.join(entry.spec.platforms)}; this device is "
                  f"{device.platform}")
      else:
        try:
          registry.forward_class(entry)().check_supported(_probe_args(op_name), device)
        except NotImplementedError as e:
          reason = str(e) or "not supported"
        except Exception as e:  # pylint: disable=broad-except
          reason = f"failed to load: {type(e).__name__}: {e}"
      statuses.append(ImplementationStatus(
          op=op_name, name=name, backend=entry.backend,
          distribution=entry.distribution, version=entry.version,
          priority=entry.spec.priority, has_backward=entry.spec.backward is not None,
          usable=not reason, reason=reason))
  return statuses
