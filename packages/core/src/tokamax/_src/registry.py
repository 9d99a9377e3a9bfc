"""Discovers backend plugins and resolves implementation names to `Op` classes.

Discovery runs once per process (thread-safe), at the first dispatch or
introspection call. Backends register through the entry-point group
``tokamax.backends``; the XLA reference backend is built into core and registered
the same way, first. Kernel modules are imported only when an implementation is
first used.

Name clashes: the first registration of an ``(op, name)`` pair keeps the plain
name. Order: the built-in XLA reference, then our own ``tokamax-*`` distributions,
then other distributions, each group sorted by entry-point name then distribution
name. A later registration of the same pair is not dropped: it stays reachable by
its qualified name ``"<backend>:<name>"`` and a warning says so; only where that
qualified name is taken too (two backends of one name) is it not registered, with
a warning.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import threading
import warnings
from typing import Any

from tokamax._src import settings
from tokamax._src import plugin
from tokamax._src import xla_backend
from tokamax._src.op import Op, VjpOp

ENTRY_POINT_GROUP = "tokamax.backends"

# Implementation names of our own backends, so that asking for one that is not
# installed says what to install.
FIRST_PARTY_DISTRIBUTIONS = {
    "triton": "tokamax-gpu-triton",
    "mosaic_gpu": "tokamax-gpu-mosaic",
    "mosaic_tpu": "tokamax-tpu-mosaic",
}
EXTRA_FOR_DISTRIBUTION = {
    "tokamax-gpu-triton": "gpu",
    "tokamax-gpu-mosaic": "gpu",
    "tokamax-tpu-mosaic": "tpu",
}


class PluginWarning(UserWarning):
  """A backend plugin could not be used (broken, incompatible or shadowed)."""


class ImplementationNotInstalledError(ValueError):
  """The named implementation belongs to a distribution that is not installed."""


@dataclasses.dataclass(frozen=True)
class BackendInfo:
  """An installed backend, as ``tokamax.backends()`` lists it."""

  name: str
  distribution: str | None
  version: str | None
  status: str  # "ok", "disabled" or "error"
  implementations: tuple[str, ...] = ()  # "op/name" of what it registered


@dataclasses.dataclass(frozen=True)
class BackendError:
  """A plugin that failed to load or register, kept for ``tokamax.backend_errors()``."""

  backend: str
  distribution: str | None
  message: str
  exception: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Entry:
  """One registered implementation."""

  spec: plugin.Implementation
  backend: str
  distribution: str | None
  version: str | None
  builtin: bool

  @property
  def op(self) -> str:
    return self.spec.op

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def qualified_name(self) -> str:
    return f"{self.backend}:{self.spec.name}"


class _Registry:

  def __init__(self):
    self.entries: dict[str, list[Entry]] = {op: [] for op in plugin.OP_NAMES}
    self.by_name: dict[tuple[str, str], Entry] = {}
    self.backends: list[BackendInfo] = []
    self.errors: list[BackendError] = []
    self.failed_entry_points: dict[str, BaseException] = {}
    # (op, name) of a backend that loaded but was refused (another plugin API
    # version): naming one raises why.
    self.refused_names: dict[tuple[str, str], BaseException] = {}
    # Entry points that TOKAMAX_DISABLED_BACKENDS turned off before loading, and
    # the (op, name) -> backend of those read so far (`disabled_backend_of`).
    self.disabled_entry_points: list[Any] = []
    self.disabled_names: dict[tuple[str, str], str] | None = None
    # (package, distribution, version) of each backend's tuned data.
    self.tuned_packages: list[tuple[str, str | None, str | None]] = []

  def add_backend(self, backend: Any, distribution: str | None, version: str | None,
                  builtin: bool) -> None:
    names = []
    for spec in backend.implementations:
      entry = Entry(spec, backend.name, distribution, version, builtin)
      taken = self.by_name.get((spec.op, entry.qualified_name))
      if taken is not None:
        # Its qualified name is taken too (the same backend name twice): no name
        # would reach it, so it is not registered at all.
        warnings.warn(
            f"tokamax: backend {backend.name!r} ({distribution}) registers "
            f"{spec.op} implementation {spec.name!r}, but {entry.qualified_name!r} "
            f"already means the one from {taken.distribution}; this one is not "
            "registered (give the backend or the implementation another name).",
            PluginWarning, stacklevel=2)
        continue
      self.entries[spec.op].append(entry)
      key = (spec.op, spec.name)
      if key in self.by_name:
        winner = self.by_name[key]
        warnings.warn(
            f"tokamax: backend {backend.name!r} ({distribution}) registers "
            f"{spec.op} implementation {spec.name!r}, already registered by "
            f"{winner.backend!r} ({winner.distribution}); the name "
            f"{spec.name!r} keeps meaning {winner.qualified_name!r}, and this one "
            f"is reachable as {entry.qualified_name!r}.",
            PluginWarning, stacklevel=2)
      else:
        self.by_name[key] = entry
      self.by_name[(spec.op, entry.qualified_name)] = entry
      names.append(f"{spec.op}/{spec.name}")
    tuned = getattr(backend, "tuned_data", None)
    if tuned:
      self.tuned_packages.append((tuned, distribution, version))
    self.backends.append(
        BackendInfo(backend.name, distribution, version, "ok", tuple(names)))


_lock = threading.Lock()
_registry: _Registry | None = None


def _builtin_backend() -> plugin.Backend:
  return xla_backend.BACKEND


def _entry_point_order(ep) -> tuple:
  dist = ep.dist.name if ep.dist is not None else ""
  first_party = dist.lower().replace("_", "-").startswith("tokamax-")
  return (not first_party, ep.name, dist)


def _check_backend(obj: Any, ep_name: str) -> plugin.Backend:
  if callable(obj) and not isinstance(obj, plugin.Backend):
    obj = obj()
  for attr in ("name", "api_version", "implementations"):
    if not hasattr(obj, attr):
      raise TypeError(
          f"entry point {ep_name!r} gave {type(obj).__name__}, which has no "
          f"{attr!r}; expected a tokamax.plugin.Backend")
  for spec in obj.implementations:
    if not isinstance(spec, plugin.Implementation):
      raise TypeError(
          f"backend {obj.name!r} lists {type(spec).__name__}; expected "
          "tokamax.plugin.Implementation")
  return obj


def _installed_version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _backend_key(name: str | None) -> str:
  """A backend, entry-point or distribution name as `TOKAMAX_DISABLED_BACKENDS`
  matches it: case and ``-`` / ``_`` aside (``gpu-triton`` is ``gpu_triton``)."""
  return (name or "").lower().replace("-", "_")


def _discover() -> _Registry:
  reg = _Registry()
  disabled = {_backend_key(name): name for name in settings.disabled_backends()}
  matched = set()

  def is_disabled(*names: str | None) -> bool:
    keys = {_backend_key(n) for n in names if n} & disabled.keys()
    matched.update(keys)
    return bool(keys)

  builtin = _builtin_backend()
  reg.add_backend(builtin, "tokamax-xla-reference",
                  _installed_version("tokamax-xla-reference"), builtin=True)

  eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
               key=_entry_point_order)
  for ep in eps:
    dist = ep.dist.name if ep.dist is not None else None
    version = ep.dist.version if ep.dist is not None else None
    if is_disabled(ep.name, dist):
      reg.backends.append(BackendInfo(ep.name, dist, version, "disabled"))
      reg.disabled_entry_points.append(ep)
      continue
    backend = None
    try:
      backend = _check_backend(ep.load(), ep.name)
      if is_disabled(backend.name):
        reg.backends.append(BackendInfo(backend.name, dist, version, "disabled"))
        reg.disabled_entry_points.append(ep)
        continue
      if backend.api_version != plugin.PLUGIN_API_VERSION:
        raise RuntimeError(
            f"backend {backend.name!r} ({dist} {version}) was written for tokamax "
            f"plugin API version {backend.api_version}, but this tokamax-core "
            f"{_installed_version('tokamax-core')} speaks version "
            f"{plugin.PLUGIN_API_VERSION}; install a release of the two whose "
            "versions match (each backend's requirement on tokamax-core says which)")
    except Exception as e:
      if settings.strict_plugins():
        raise
      message = f"{type(e).__name__}: {e}"
      reg.errors.append(BackendError(ep.name, dist, message, e))
      reg.failed_entry_points[ep.name] = e
      for spec in getattr(backend, "implementations", ()):
        for name in (spec.name, f"{backend.name}:{spec.name}"):
          reg.refused_names[(spec.op, name)] = e
      reg.backends.append(BackendInfo(ep.name, dist, version, "error"))
      warnings.warn(
          f"tokamax: backend plugin {ep.name!r} from {dist} was not loaded: "
          f"{message} (tokamax.backend_errors() lists it; set "
          "TOKAMAX_STRICT_PLUGINS=1 to raise)", PluginWarning, stacklevel=2)
      continue
    reg.add_backend(backend, dist, version, builtin=False)

  builtin_names = {_backend_key(builtin.name), _backend_key("tokamax-xla-reference")}
  if builtin_names & disabled.keys():
    warnings.warn(
        f"tokamax: TOKAMAX_DISABLED_BACKENDS names the built-in backend "
        f"{builtin.name!r} (the XLA reference), which cannot be disabled",
        PluginWarning, stacklevel=2)
    matched.update(builtin_names)
  unknown = [name for key, name in disabled.items() if key not in matched]
  if unknown:
    known = sorted({ep.name for ep in eps} | {b.name for b in reg.backends})
    warnings.warn(
        f"tokamax: TOKAMAX_DISABLED_BACKENDS names {', '.join(unknown)}, which no "
        f"installed backend has (a backend, entry-point or distribution name); "
        f"installed: {', '.join(known) or 'none'}", PluginWarning, stacklevel=2)
  for entries in reg.entries.values():
    # Stable: equal priorities keep registration order (built-in first).
    entries.sort(key=lambda e: -e.spec.priority)
  return reg


def get() -> _Registry:
  global _registry
  if _registry is None:
    with _lock:
      if _registry is None:
        _registry = _discover()
  return _registry


def reset() -> None:
  """Forgets discovery (tests, or after installing a plugin in-process)."""
  global _registry
  with _lock:
    _registry = None
    _loaded.clear()


_loaded: dict[str, type] = {}


def load_class(ref: str, expected: type) -> type:
  """Imports ``"module:attr"`` and checks it is a subclass of `expected`."""
  if ref in _loaded:
    return _loaded[ref]
  module_name, attr = ref.split(":")
  module = importlib.import_module(module_name)
  cls = getattr(module, attr)
  if not (isinstance(cls, type) and issubclass(cls, expected)):
    raise TypeError(f"{ref} is {cls!r}, not a subclass of tokamax.{expected.__name__}")
  _loaded[ref] = cls
  return cls


def _entry_class(entry: Entry, field: str, expected: type) -> type:
  """The class an entry's `field` ("forward" or "backward") names.

  A plugin's mistake there (a misspelled class, a target that is no `Op`) is an
  ImportError naming the implementation, as a module that fails to import is:
  `implementation=None` and sequences skip it, and only naming it alone raises.
  """
  ref = getattr(entry.spec, field)
  try:
    return load_class(ref, expected)
  except ImportError:
    raise
  except (AttributeError, TypeError, ValueError) as e:
    raise ImportError(
        f"{entry.op} implementation {entry.name!r} of backend {entry.backend!r} "
        f"({entry.distribution}): its {field}={ref!r} cannot be loaded: "
        f"{type(e).__name__}: {e}") from e


def forward_class(entry: Entry) -> type[Op]:
  return _entry_class(entry, "forward", Op)


def backward_class(entry: Entry) -> type[VjpOp] | None:
  if entry.spec.backward is None:
    return None
  return _entry_class(entry, "backward", VjpOp)


def label(entry: Entry) -> str:
  """The name that reaches `entry`: its plain name, or where another registration
  of the same (op, name) keeps that, its qualified one."""
  return entry.name if get().by_name.get((entry.op, entry.name)) == entry else (
      entry.qualified_name)


def entries(op: str) -> list[Entry]:
  return list(get().entries[op])


@dataclasses.dataclass(frozen=True)
class Unavailable:
  """Why a name gives no implementation of an op here.

  A sequence of names skips an entry for which this is `known` (the name is real,
  it just cannot serve this op here); an unknown name is more likely a typo, so it
  raises even inside a sequence.
  """

  name: str
  error: type[Exception]  # what `raise_error` raises
  reason: str  # short, for a list of reasons
  message: str  # the whole error message
  known: bool
  cause: BaseException | None = None

  def raise_error(self):
    if self.cause is not None:
      raise self.error(self.message) from self.cause
    raise self.error(self.message)


def normalized(distribution: str | None) -> str | None:
  """A distribution name as package indexes compare them (PEP 503)."""
  return re.sub(r"[-_.]+", "-", distribution).lower() if distribution else distribution


def _install_hint(dist: str) -> str:
  return f"pip install {dist} (or tokamax-core[{EXTRA_FOR_DISTRIBUTION[dist]}])"


def disabled_backend_of(op: str, name: str) -> str | None:
  """The disabled backend that has `op`'s implementation `name`, if any.

  Disabled backends are not loaded at discovery; their entry points (which import
  no kernel module: docs/plugins.md) are read here, once, only when a name is found
  nowhere else (a backend that fails even to load has no names to give). Read
  outside the registry's lock: a plugin's import may itself call into tokamax.
  """
  reg = get()
  if reg.disabled_names is None:
    found = {}
    for ep in reg.disabled_entry_points:
      try:
        backend = _check_backend(ep.load(), ep.name)
      except Exception:  # noqa: BLE001 (disabled: its errors are not ours to raise)
        continue
      for spec in backend.implementations:
        for key in ((spec.op, spec.name), (spec.op, f"{backend.name}:{spec.name}")):
          found.setdefault(key, backend.name)
    reg.disabled_names = found  # two threads may both read them: the same names
  return reg.disabled_names.get((op, name))


def lookup(op: str, name: str) -> Entry | Unavailable:
  """The entry for `name` (plain or qualified), or why there is none."""
  reg = get()
  entry = reg.by_name.get((op, name))
  if entry is not None:
    return entry
  if name in reg.failed_entry_points or (op, name) in reg.refused_names:
    cause = reg.failed_entry_points.get(name) or reg.refused_names[(op, name)]
    return Unavailable(
        name, ImportError, f"its backend plugin failed to load: {cause}",
        f"implementation {name!r} comes from a backend plugin that failed to "
        f"load: {cause}", known=True, cause=cause)
  other_ops = [o for o, ents in reg.entries.items()
               if any(name in (e.name, e.qualified_name) for e in ents)]
  dist = FIRST_PARTY_DISTRIBUTIONS.get(name)
  if dist is not None and not other_ops:
    # Installed but unusable is not "not installed": say which, so that the fix
    # (re-enable, repair, or install) is the right one.
    for err in reg.errors:
      if normalized(err.distribution) == dist:
        return Unavailable(
            name, ImportError,
            f"{dist} is installed but its backend {err.backend!r} failed to load: "
            f"{err.message}",
            f"implementation={name!r} is provided by {dist}, which is installed "
            f"but its backend {err.backend!r} failed to load: {err.message}",
            known=True, cause=err.exception)
    for info in reg.backends:
      if info.status == "disabled" and normalized(info.distribution) == dist:
        return Unavailable(
            name, ImplementationNotInstalledError,
            f"its backend {info.name!r} ({dist}) is disabled by "
            "TOKAMAX_DISABLED_BACKENDS",
            f"implementation={name!r} is provided by {dist}, whose backend "
            f"{info.name!r} is disabled by TOKAMAX_DISABLED_BACKENDS; remove "
            f"the backend's (or its distribution's) name from it to use {name!r}",
            known=True)
    return Unavailable(
        name, ImplementationNotInstalledError,
        f"not installed: {_install_hint(dist)}",
        f"implementation={name!r} is provided by the distribution {dist}, which is "
        f"not installed: {_install_hint(dist)}", known=True)
  available = sorted({e.name for e in reg.entries[op]})
  if other_ops:
    return Unavailable(
        name, ValueError,
        f"has no {op} implementation (it implements {', '.join(other_ops)})",
        f"implementation={name!r} is not an implementation of {op} (it implements "
        f"{', '.join(other_ops)}); {op} implementations here: {available}",
        known=True)
  disabled_by = disabled_backend_of(op, name)
  if disabled_by is not None:
    return Unavailable(
        name, ImplementationNotInstalledError,
        f"its backend {disabled_by!r} is disabled by TOKAMAX_DISABLED_BACKENDS",
        f"implementation={name!r} comes from the backend {disabled_by!r}, which "
        f"TOKAMAX_DISABLED_BACKENDS disables; remove the backend's (or its "
        f"distribution's) name from it to use {name!r}", known=True)
  message = (f"implementation={name!r} is not an implementation of {op}; "
             f"available here: {available}")
  broken = [err.backend for err in reg.errors]
  if broken:
    message += f" (backends that failed to load: {broken}; see tokamax.backend_errors())"
  disabled = [b.name for b in reg.backends if b.status == "disabled"]
  if disabled:
    message += f" (backends disabled by TOKAMAX_DISABLED_BACKENDS: {disabled})"
  return Unavailable(name, ValueError, "unknown name", message, known=False)


def find(op: str, name: str) -> Entry:
  """The entry for `name` (plain or qualified), or a clear error.

  Raises:
    ImplementationNotInstalledError: a first-party name whose distribution is not
      installed (or whose backend is disabled).
    ImportError: the name's backend plugin failed to load.
    ValueError: no implementation of `op` has this name.
  """
  found = lookup(op, name)
  if isinstance(found, Unavailable):
    found.raise_error()
  return found


def backends() -> list[BackendInfo]:
  return list(get().backends)


def backend_errors() -> list[BackendError]:
  return list(get().errors)
