"""Tuned data shipped inside backend packages, used by ``implementation=None``.

A backend declares ``tokamax.plugin.Backend(tuned_data="<package>")``; that
package holds ``<device_kind_slug>/<op>.json`` files in the `AutotuningResult`
format (``python -m tokamax autotune --out <folder>`` writes them). A file is
used only on the device kind it was measured on and with the package versions
it records; a corrupt, foreign or mismatched file gives a warning and is ignored
(dispatch then uses heuristics). Loading never imports or runs code.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import re
import threading
import warnings

import jax

from tokamax._src import registry


def device_slug(device_kind: str) -> str:
  """``"NVIDIA H200"`` -> ``"nvidia_h200"``: the folder name for a device kind."""
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def _installed_version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _check_versions(result, source: str) -> str | None:
  """Why `result` does not apply to the installed packages, or None."""
  for dist, version in result.versions.items():
    if dist == "jax":
      installed = jax.__version__
    elif dist.startswith("tokamax"):
      installed = _installed_version(dist)
    else:
      continue
    if installed != version:
      return f"{source} was measured with {dist} {version}, installed is {installed}"
  return None


def load_backend_data(package: str, device_kind: str):
  """Every valid tuned-data file of `package` for `device_kind`, merged (or None)."""
  from tokamax._src.autotuning import AutotuningResult  # pylint: disable=g-import-not-at-top
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
    mismatch = _check_versions(result, source)
    if mismatch:
      warnings.warn(f"tokamax: {mismatch}; ignored", stacklevel=2)
      continue
    merged = result if merged is None else merged.merge(result)
  return merged


class _Shipped:
  """The config source of all backends' tuned data for the current device kind."""

  def __init__(self):
    self._lock = threading.Lock()
    self._by_device: dict[str, object] = {}

  def _result(self):
    kind = jax.devices()[0].device_kind
    if kind not in self._by_device:
      with self._lock:
        if kind not in self._by_device:
          merged = None
          for backend in registry.get().tuned_packages:
            data = load_backend_data(backend, kind)
            if data is not None:
              merged = data if merged is None else merged.merge(data)
          self._by_device[kind] = merged
    return self._by_device[kind]

  def lookup(self, op, args):
    result = self._result()
    return None if result is None else result.lookup(op, args)

  def lookup_implementation(self, op_name, direction, args):
    result = self._result()
    return None if result is None else result.lookup_implementation(
        op_name, direction, args)

  def reset(self):
    with self._lock:
      self._by_device.clear()


_SHIPPED = _Shipped()


def shipped() -> _Shipped:
  return _SHIPPED



