"""Plugin discovery with really pip-installed packages (see noxfile.py `tests`)."""

import importlib.metadata
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing


def _installed(dist):
  try:
    importlib.metadata.version(dist)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


pytestmark = pytest.mark.skipif(
    not _installed("tokamax-example-plugin"),
    reason="the example plugins are pip-installed by `nox -s tests`")


def _backends():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", tokamax.PluginWarning)
    return {b.name: b for b in tokamax.backends()}


def test_every_first_party_backend_is_discovered():
  backends = _backends()
  for name, dist in [("xla_reference", "tokamax-xla-reference"),
                     ("gpu_triton", "tokamax-gpu-triton"),
                     ("gpu_mosaic", "tokamax-gpu-mosaic"),
                     ("tpu_mosaic", "tokamax-tpu-mosaic")]:
    assert backends[name].status == "ok", backends[name]
    assert backends[name].distribution == dist
    assert backends[name].version == importlib.metadata.version(dist)


def test_example_plugin_is_discovered_and_dispatched_to():
  backend = _backends()["example"]
  assert (backend.status, backend.distribution, backend.version) == (
      "ok", "tokamax-example-plugin", "0.3.0")
  x = jnp.asarray(np.random.default_rng(51).standard_normal((5, 24)), jnp.float32)
  scale = jnp.asarray(np.random.default_rng(52).standard_normal(24), jnp.float32)
  with tokamax.record_dispatch() as records:
    y, g = jax.value_and_grad(
        lambda x: jnp.sum(tokamax.rms_norm(x, scale, implementation="example_rms") * x))(x)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "example_rms"), ("backward", "example_rms")]
  ref_y, ref_g = jax.value_and_grad(
      lambda x: jnp.sum(tokamax.rms_norm(x, scale, implementation="xla") * x))(x)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5)
  np.testing.assert_allclose(g, ref_g, rtol=1e-4, atol=1e-5)


def test_example_plugin_refuses_layer_norm_with_reason():
  x = jnp.ones((2, 8))
  with pytest.raises(NotImplementedError, match="example_rms.*only does RMS"):
    tokamax.layer_norm(x, None, None, implementation="example_rms")


def test_broken_plugin_is_isolated():
  errors = {e.backend: e for e in tokamax.backend_errors()}
  assert "deliberately broken" in errors["broken_example"].message
  assert errors["broken_example"].distribution == "tokamax-broken-plugin"
  assert _backends()["broken_example"].status == "error"
  with pytest.raises(ImportError, match="deliberately broken"):
    tokamax.layer_norm(jnp.ones((2, 8)), None, None, implementation="broken_example")


def test_future_api_version_is_refused_with_clear_warning():
  errors = {e.backend: e for e in tokamax.backend_errors()}
  assert "plugin API version 2" in errors["future"].message
  core = importlib.metadata.version("tokamax-core")
  assert f"tokamax-core {core} speaks version 1" in errors["future"].message
  assert "(tokamax-future-plugin 9.0.0)" in errors["future"].message
  # Its implementation, named, raises why its backend was refused (as README.md's
  # plugin section says); in a sequence it is skipped.
  for name in ("future_norm", "future:future_norm"):
    with pytest.raises(ImportError, match="failed to load.*plugin API version 2"):
      tokamax.layer_norm(jnp.ones((2, 8)), None, None, implementation=name)
  x = jnp.ones((2, 8))
  assert jnp.array_equal(
      tokamax.layer_norm(x, None, None, implementation=["future_norm", "xla"]),
      tokamax.layer_norm(x, None, None, implementation="xla"))


def test_strict_mode_fails_loudly():
  code = "import tokamax, jax.numpy as jnp; tokamax.layer_norm(jnp.ones((2, 4)), None, None)"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "TOKAMAX_STRICT_PLUGINS": "1"})
  assert result.returncode != 0 and "deliberately broken" in result.stderr


def test_info_cli_lists_everything():
  result = subprocess.run([sys.executable, "-m", "tokamax", "info"], capture_output=True,
                          text=True, check=True)
  out = result.stdout
  for text in ("tokamax-example-plugin 0.3.0", "example_rms", "broken_example",
               "deliberately broken", "tokamax-gpu-triton", "xla_chunked"):
    assert text in out, text


# The example plugin passes the conformance suite for what it supports (the rest
# raises NotImplementedError and is reported as skipped).
testing.define_conformance_tests("example_rms", namespace=globals(), ops=["layer_norm"])


def test_bench_runs_an_rms_only_plugin_at_the_rms_norm_rows():
  # `tokamax.implementations` calls example_rms unusable at the op's typical
  # call (a LayerNorm); the bench still runs it where it takes the call.
  from tokamax._src import bench_suite
  names = {p.name: bench_suite.implementations_taking(p)
           for p in bench_suite.reference_suite() if p.op == "layer_norm"}
  assert any("example_rms" in taking for name, taking in names.items()
             if name.startswith("rms_norm")), names
  assert not any("example_rms" in taking for name, taking in names.items()
                 if name.startswith("layer_norm")), names
