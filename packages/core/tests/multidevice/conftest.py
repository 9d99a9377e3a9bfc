"""Multi-device tests: 8 virtual CPU devices, in their own pytest process.

XLA_FLAGS must be set before JAX starts its backend, so this folder runs in a
separate process (``nox -s tests`` does it):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m pytest -q packages/core/tests/multidevice
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  del config
  # The meshes follow the device count: 8 virtual CPU devices in CI, 2 or 4 GPUs.
  wanted = 2
  if jax.device_count() < wanted:
    skip = pytest.mark.skip(reason=f"needs {wanted} devices, have {jax.device_count()} "
                            "(JAX started before XLA_FLAGS was set: run this folder "
                            "in its own pytest process)")
    for item in items:
      if "multidevice" in str(item.fspath):
        item.add_marker(skip)
