"""Tuned data shipped inside backend packages, used by ``implementation=None``.

A backend declares ``tokamax.plugin.Backend(tuned_data="<package>")``; that
package holds ``<device_kind_slug>/<op>.json`` files in the `AutotuningResult`
format (``python -m tokamax autotune --out <folder>`` writes them). A file is
used only on the device kind it was measured on and with the package versions
it records; a corrupt, foreign or mismatched file gives a warning and is ignored
(dispatch then uses heuristics). Loading never imports or runs code.

Two kinds of file. ``<op>.json`` (`autotune`) holds the best config found at
each call it measured. ``<op>_grid.json`` (`autotune --grid`) holds each
implementation's time at its heuristic config over a grid of shapes: it ranks the
implementations (there and, by `tuning.nearest`, between grid points), and its
entries are read without their configs, so that where a grid time is an
implementation's fastest at a call, the call runs today's heuristic, like any
other call. Otherwise every heuristic change would skip the grid points until
the grid was measured again (session 53 found 18 of 266 H200 grid entries
pinning an older config: ragged_dot at G8/G16 without the claimed items, the
H256 attention forward without `overlap_qk`). Where a per-call file measured the
same call faster, its config runs.
"""

from __future__ import annotations

import importlib.resources
import re
import threading
import warnings

import jax

from tokamax._src import registry
from tokamax._src.op import DeviceInfo
from tokamax._src.tuning.results import AutotuningResult


def device_slug(device_kind: str) -> str:
  """``"NVIDIA H200"`` -> ``"nvidia_h200"``: the folder name for a device kind."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def _check_versions(result, source: str, shipped_by: tuple[str, str | None] | None
                    ) -> str | None:
  """Why `result` does not apply here, or None.

  A file applies with the JAX it was measured with and the version of the
  distribution that ships it (`shipped_by`: name and installed version): its
  configs are that package's kernels'. The other tokamax versions it records
  (core, the reference, a backend whose timings it compares) are not required,
  so that a release of one package does not turn off the tuned data of the others
  (each package releases on its own train; docs/releasing.md).
  """
  expected = {"jax": jax.__version__}
  if shipped_by is not None:
    expected[shipped_by[0]] = shipped_by[1]
  for dist, installed in expected.items():
    recorded = result.versions.get(dist)
    if recorded is not None and recorded != installed:
      return f"{source} was measured with {dist} {recorded}, installed is {installed}"
  return None


GRID_SUFFIX = "_grid"  # ``<op>_grid.json``: `autotune --grid`'s file


def grid_file(op_name: str) -> str:
  """The name of an op's grid file (times that rank; no configs to run)."""
  return f"{op_name}{GRID_SUFFIX}.json"


def is_grid_file(name: str) -> bool:
  return name.endswith(f"{GRID_SUFFIX}.json")


def load_backend_data(package: str, device_kind: str,
                      shipped_by: tuple[str, str | None] | None = None):
  """Every valid tuned-data file of `package` for `device_kind`, merged (or None),
  a grid file's without its configs (module docstring).

  `shipped_by` is the (distribution, version) that ships `package`, when known.
  """
  merged = None
  try:
    folder = importlib.resources.files(package) / device_slug(device_kind)
    files = [f for f in folder.iterdir() if f.name.endswith(".json")] if folder.is_dir() else []
  except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
    return None
  for file in sorted(files, key=lambda f: f.name):
    source = f"tuned data {package}/{device_slug(device_kind)}/{file.name}"
    try:
      result = AutotuningResult.loads(file.read_text())
    except (ValueError, OSError, UnicodeDecodeError) as e:
      warnings.warn(f"tokamax: {source} ignored: {e}", stacklevel=2)
      continue
    if result.device_kind != device_kind:
      warnings.warn(f"tokamax: {source} ignored: measured on {result.device_kind!r}, "
                    f"this device is {device_kind!r}", stacklevel=2)
      continue
    mismatch = _check_versions(result, source, shipped_by)
    if mismatch:
      warnings.warn(f"tokamax: {mismatch}; ignored", stacklevel=2)
      continue
    if is_grid_file(file.name):
      result = result.without_configs()
    merged = result if merged is None else merged.merge(result)
  return merged


class _Shipped:
  """The config source of all backends' tuned data for the current device kind."""

  def __init__(self):
    self._lock = threading.Lock()
    self._registry = None  # the discovery the cache below was read for
    self._by_device: dict[str, object] = {}

  def _result(self):
    kind = DeviceInfo.of().device_kind  # as `AutotuningResult._applies_here`
    found = registry.get()
    with self._lock:
      # `registry.reset()` (a plugin installed in-process) makes a new
      # discovery, whose backends' data is read anew.
      if found is not self._registry:
        self._registry = found
        self._by_device.clear()
      if kind not in self._by_device:
        merged = None
        for package, distribution, version in found.tuned_packages:
          shipped_by = None if distribution is None else (distribution, version)
          data = load_backend_data(package, kind, shipped_by)
          if data is not None:
            merged = data if merged is None else merged.merge(data)
        self._by_device[kind] = merged
      return self._by_device[kind]

  def lookup(self, op, args):
    result = self._result()
    return None if result is None else result.lookup(op, args)

  def measured_times(self, op_name, direction, args):
    result = self._result()
    return {} if result is None else result.measured_times(op_name, direction, args)

  def step_times(self, op_name, args):
    result = self._result()
    return {} if result is None else result.step_times(op_name, args)

  def reset(self):
    with self._lock:
      self._by_device.clear()


_SHIPPED = _Shipped()


def shipped() -> _Shipped:
  return _SHIPPED



