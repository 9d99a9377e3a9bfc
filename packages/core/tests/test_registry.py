"""Plugin discovery: isolation of broken plugins, API versions, clashes, disabling."""

import dataclasses
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import registry


@dataclasses.dataclass
class FakeDist:
  name: str
  version: str = "1.0"


@dataclasses.dataclass
class FakeEntryPoint:
  name: str
  target: object
  dist: FakeDist

  def load(self):
    if isinstance(self.target, BaseException):
      raise self.target
    return self.target


@dataclasses.dataclass(frozen=True)
class DoubledNorm(tokamax.Op):
  """A test implementation: the reference layer norm, times two."""

  op_name = "layer_norm"
  name = "doubled"

  def forward(self, args, config):
    from tokamax_xla_reference import layer_norm  # pylint: disable=g-import-not-at-top
    y, mean, rstd = layer_norm(args.x, args.scale, args.offset, epsilon=args.epsilon,
                               subtract_mean=args.subtract_mean)
    return 2 * y, {"mean": mean, "rstd": rstd}


_module = types.ModuleType("fake_tokamax_plugin")
_module.DoubledNorm = DoubledNorm
sys.modules["fake_tokamax_plugin"] = _module


# Fixed seed: a failure reproduces (and CI does not flake on a rare input).
_RNG = np.random.default_rng(0)

def _backend(name, impl_name="doubled", api_version=tokamax.plugin.PLUGIN_API_VERSION,
             priority=500):
  return tokamax.plugin.Backend(
      name=name, api_version=api_version,
      implementations=(tokamax.plugin.Implementation(
          op="layer_norm", name=impl_name, forward="fake_tokamax_plugin:DoubledNorm",
          platforms=("cpu", "gpu", "tpu"), priority=priority),))


def _install(monkeypatch, *eps):
  """Makes `eps` the only installed tokamax plugins (isolated from what is installed)."""
  real = registry.importlib.metadata.entry_points

  def entry_points(group=None, **kwargs):
    if group != registry.ENTRY_POINT_GROUP:
      return real(group=group, **kwargs)
    return list(eps)

  monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
  registry.reset()


def _x():
  return jnp.asarray(_RNG.standard_normal((3, 8)), jnp.float32)


def test_plugin_is_discovered_and_dispatched_to(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("fake", _backend("fake"), FakeDist("fake-dist")))
  assert any(b.name == "fake" and b.status == "ok" for b in tokamax.backends())
  x = _x()
  with tokamax.record_dispatch() as records:
    y = tokamax.layer_norm(x, None, None)  # priority 500 beats the reference
  ref = tokamax.layer_norm(x, None, None, implementation="xla")
  np.testing.assert_allclose(y, 2 * ref, rtol=1e-6)
  assert records[0].implementation == "doubled"


def test_backend_object_may_be_a_factory(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("fake", lambda: _backend("fake"),
                                          FakeDist("fake-dist")))
  assert ("layer_norm", "doubled") in registry.get().by_name


def test_broken_plugin_is_isolated_and_reported(fresh_registry):
  _install(fresh_registry,
           FakeEntryPoint("broken", ImportError("no module named kaboom"),
                          FakeDist("broken-dist")),
           FakeEntryPoint("fake", _backend("fake"), FakeDist("fake-dist")))
  with pytest.warns(tokamax.PluginWarning, match="broken"):
    registry.get()
  errors = tokamax.backend_errors()
  assert [e.backend for e in errors] == ["broken"]
  assert "kaboom" in errors[0].message and errors[0].distribution == "broken-dist"
  # Everything else still works.
  tokamax.layer_norm(_x(), None, None, implementation="doubled")
  tokamax.layer_norm(_x(), None, None, implementation="xla")
  # Naming the broken plugin re-raises its error.
  with pytest.raises(ImportError, match="kaboom"):
    tokamax.layer_norm(_x(), None, None, implementation="broken")


def test_strict_mode_raises(fresh_registry):
  fresh_registry.setenv("TOKAMAX_STRICT_PLUGINS", "1")
  _install(fresh_registry, FakeEntryPoint("broken", ImportError("kaboom"),
                                          FakeDist("broken-dist")))
  with pytest.raises(ImportError, match="kaboom"):
    registry.get()


def test_incompatible_api_version_is_refused(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("future", _backend("future", api_version=99),
                                          FakeDist("future-dist")))
  with pytest.warns(tokamax.PluginWarning, match="plugin API version 99"):
    registry.get()
  assert ("layer_norm", "doubled") not in registry.get().by_name
  assert "version 99" in tokamax.backend_errors()[0].message


def test_not_a_backend_is_reported(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("odd", 42, FakeDist("odd-dist")))
  with pytest.warns(tokamax.PluginWarning, match="tokamax.plugin.Backend"):
    registry.get()


def test_name_clash_is_deterministic(fresh_registry):
  _install(fresh_registry,
           FakeEntryPoint("zeta", _backend("zeta"), FakeDist("zeta-dist")),
           FakeEntryPoint("alpha", _backend("alpha"), FakeDist("alpha-dist")))
  with pytest.warns(tokamax.PluginWarning, match="already registered"):
    reg = registry.get()
  assert reg.by_name[("layer_norm", "doubled")].backend == "alpha"
  assert reg.by_name[("layer_norm", "zeta:doubled")].backend == "zeta"
  tokamax.layer_norm(_x(), None, None, implementation="zeta:doubled")


def test_builtin_names_cannot_be_taken_over(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("evil", _backend("evil", impl_name="xla"),
                                          FakeDist("evil-dist")))
  with pytest.warns(tokamax.PluginWarning):
    reg = registry.get()
  assert reg.by_name[("layer_norm", "xla")].backend == "xla_reference"


def test_disabled_backends(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "fake, other")
  _install(fresh_registry, FakeEntryPoint("fake", _backend("fake"), FakeDist("fake-dist")))
  assert ("layer_norm", "doubled") not in registry.get().by_name
  assert any(b.name == "fake" and b.status == "disabled" for b in tokamax.backends())


def test_missing_first_party_backend_names_the_distribution(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "gpu_triton,gpu_mosaic,tpu_mosaic")
  registry.reset()
  with pytest.raises(tokamax.ImplementationNotInstalledError,
                     match="pip install tokamax-gpu-triton"):
    tokamax.layer_norm(_x(), None, None, implementation="triton")
  with pytest.raises(tokamax.ImplementationNotInstalledError, match="mosaic"):
    tokamax.layer_norm(_x(), None, None, implementation="mosaic")


def test_unknown_name_lists_what_exists():
  with pytest.raises(ValueError, match=r"'nope' is not an implementation of layer_norm.*xla"):
    tokamax.layer_norm(_x(), None, None, implementation="nope")


def test_kernel_modules_are_imported_lazily(fresh_registry):
  sys.modules.pop("fake_lazy_kernels", None)
  backend = tokamax.plugin.Backend(
      name="lazy", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="ragged_dot", name="lazy", forward="fake_lazy_kernels:Op",
          platforms=("tpu",)),))
  _install(fresh_registry, FakeEntryPoint("lazy", backend, FakeDist("lazy-dist")))
  registry.get()
  tokamax.implementations("layer_norm")
  assert "fake_lazy_kernels" not in sys.modules


def test_implementation_spec_validation():
  with pytest.raises(ValueError, match="op must be one of"):
    tokamax.plugin.Implementation(op="softmax", name="x", forward="a:b")
  with pytest.raises(ValueError, match="module:attr"):
    tokamax.plugin.Implementation(op="ragged_dot", name="x", forward="a.b")
  with pytest.raises(ValueError, match="platforms"):
    tokamax.plugin.Implementation(op="ragged_dot", name="x", forward="a:b",
                                  platforms=("quantum",))
