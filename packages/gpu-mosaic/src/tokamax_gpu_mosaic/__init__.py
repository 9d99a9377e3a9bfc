"""tokamax-gpu-mosaic: a tokamax backend package (registered through the `tokamax.backends` entry point)."""

import importlib.metadata

# pyproject.toml holds the version (tools/release.py bumps it there only).
try:
  __version__ = importlib.metadata.version("tokamax-gpu-mosaic")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
  __version__ = "unknown"
