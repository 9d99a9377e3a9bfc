"""The package installs, registers through its entry point and is discovered."""

import importlib.metadata

import pytest

import tokamax
from tokamax_tpu_mosaic import _plugin

pytestmark = pytest.mark.smoke  # cheap: CI runs these on the oldest JAX too


def test_entry_point_is_declared():
  eps = importlib.metadata.entry_points(group="tokamax.backends")
  assert any(ep.value == "tokamax_tpu_mosaic._plugin:BACKEND" for ep in eps)


def test_backend_is_discovered():
  backends = {b.name: b for b in tokamax.backends()}
  assert backends["tpu_mosaic"].status == "ok"
  assert backends["tpu_mosaic"].distribution == "tokamax-tpu-mosaic"
  assert _plugin.BACKEND.api_version == tokamax.plugin.PLUGIN_API_VERSION
