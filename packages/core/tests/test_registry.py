"""Plugin discovery: isolation of broken plugins, API versions, clashes, disabling."""

import dataclasses
import importlib.metadata
import sys
import types

import jax
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
    from tokamax_xla_reference import layer_norm
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
  # Naming its implementation raises why its backend was refused.
  with pytest.raises(ImportError, match="failed to load.*plugin API version 99"):
    tokamax.layer_norm(_x(), None, None, implementation="doubled")
  message = tokamax.backend_errors()[0].message
  assert "version 99" in message
  # Both sides' versions, so that the user knows which of the two to change.
  assert f"speaks version {tokamax.plugin.PLUGIN_API_VERSION}" in message
  assert f"tokamax-core {importlib.metadata.version('tokamax-core')}" in message


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


def test_a_qualified_name_taken_twice_registers_only_the_first(fresh_registry):
  # Two distributions whose backends have one name: the second's implementation
  # would have no name that reaches it, so it is not registered (and not run).
  _install(fresh_registry,
           FakeEntryPoint("one", _backend("same"), FakeDist("one-dist")),
           FakeEntryPoint("two", _backend("same", priority=900), FakeDist("two-dist")))
  with pytest.warns(tokamax.PluginWarning,
                    match=r"'same:doubled' already means the one from one-dist; "
                          r"this one is not registered"):
    reg = registry.get()
  assert [e.distribution for e in reg.entries["layer_norm"] if e.backend == "same"] == [
      "one-dist"]
  assert reg.by_name[("layer_norm", "same:doubled")].distribution == "one-dist"


def _backend_naming(name, forward):
  return tokamax.plugin.Backend(
      name=name, api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="layer_norm", name="misnamed", forward=forward,
          platforms=("cpu", "gpu", "tpu"), priority=900),))


@pytest.mark.parametrize("forward,why", [
    ("fake_tokamax_plugin:DoubledNormm", "AttributeError"),
    ("numpy:ndarray", "not a subclass of tokamax.Op")])
def test_a_forward_that_cannot_be_loaded_is_skipped_unless_named(fresh_registry,
                                                                 forward, why):
  # A misspelled class (or a target that is no Op) in a plugin's registration
  # leaves implementation=None working; named alone, the error says whose it is.
  _install(fresh_registry, FakeEntryPoint("typo", _backend_naming("typo", forward),
                                          FakeDist("typo-dist")))
  x = _x()
  want = tokamax.layer_norm(x, None, None, implementation="xla")
  with tokamax.record_dispatch() as records:
    np.testing.assert_array_equal(tokamax.layer_norm(x, None, None), want)
  assert records[0].implementation != "misnamed"
  np.testing.assert_array_equal(
      tokamax.layer_norm(x, None, None, implementation=["misnamed", "xla"]), want)
  with pytest.raises(ImportError, match=rf"layer_norm implementation 'misnamed' of "
                     rf"backend 'typo' \(typo-dist\): its forward='{forward}' cannot "
                     rf"be loaded: .*{why}"):
    tokamax.layer_norm(x, None, None, implementation="misnamed")


def test_a_named_implementation_runs_only_on_its_platforms(fresh_registry):
  # A plugin's check_supported need not check the platforms it registered for.
  backend = tokamax.plugin.Backend(
      name="gpuonly", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="layer_norm", name="doubled", forward="fake_tokamax_plugin:DoubledNorm",
          platforms=("gpu",), priority=500),))
  _install(fresh_registry, FakeEntryPoint("gpuonly", backend, FakeDist("gpuonly-dist")))
  if jax.devices()[0].platform == "gpu":
    pytest.skip("the implementation's platform is this one")
  with pytest.raises(NotImplementedError,
                     match=r"'doubled' cannot run this call: runs on gpu; this device "
                           r"is (cpu|tpu)"):
    tokamax.layer_norm(_x(), None, None, implementation="doubled")
  # Interpret mode runs anywhere; automatic choice never takes it here.
  x = _x()
  with tokamax.interpret():
    np.testing.assert_allclose(
        tokamax.layer_norm(x, None, None, implementation="doubled"),
        2 * tokamax.layer_norm(x, None, None, implementation="xla"), rtol=1e-6)
  with tokamax.record_dispatch() as records:
    tokamax.layer_norm(x, None, None)
  assert records[0].implementation != "doubled"


def test_builtin_names_cannot_be_taken_over(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("evil", _backend("evil", impl_name="xla"),
                                          FakeDist("evil-dist")))
  with pytest.warns(tokamax.PluginWarning):
    reg = registry.get()
  assert reg.by_name[("layer_norm", "xla")].backend == "xla_reference"


def test_disabled_backends(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "fake, other")
  _install(fresh_registry, FakeEntryPoint("fake", _backend("fake"), FakeDist("fake-dist")))
  # A name no installed backend has is said, with the names that would work.
  with pytest.warns(tokamax.PluginWarning,
                    match=r"TOKAMAX_DISABLED_BACKENDS names other, which no installed "
                          r"backend has .*; installed: .*fake"):
    assert ("layer_norm", "doubled") not in registry.get().by_name
  assert any(b.name == "fake" and b.status == "disabled" for b in tokamax.backends())


def test_an_implementation_of_a_disabled_backend_is_said_to_be_disabled(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "fake")
  _install(fresh_registry, FakeEntryPoint("fake", _backend("fake"), FakeDist("fake-dist")))
  x = _x()
  for name in ("doubled", "fake:doubled"):
    with pytest.raises(tokamax.ImplementationNotInstalledError,
                       match=rf"implementation='{name}' comes from the backend 'fake', "
                             r"which TOKAMAX_DISABLED_BACKENDS disables"):
      tokamax.layer_norm(x, None, None, implementation=name)
  # In a sequence it is skipped, as one not installed is.
  np.testing.assert_array_equal(
      tokamax.layer_norm(x, None, None, implementation=["doubled", "xla"]),
      tokamax.layer_norm(x, None, None, implementation="xla"))


def test_the_builtin_backend_cannot_be_disabled(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "tokamax-xla-reference")
  _install(fresh_registry)
  with pytest.warns(tokamax.PluginWarning, match="the built-in backend 'xla_reference' "
                    r"\(the XLA reference\), which cannot be disabled"):
    assert ("layer_norm", "xla") in registry.get().by_name


@pytest.mark.parametrize("name", ["fake_dist", "FAKE-DIST", "fake-backend"])
def test_disabled_backends_by_distribution_name_or_either_spelling(fresh_registry, name):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", name)
  _install(fresh_registry, FakeEntryPoint("fake_backend", _backend("fake"),
                                          FakeDist("fake-dist")))
  assert ("layer_norm", "doubled") not in registry.get().by_name
  assert any(b.status == "disabled" for b in tokamax.backends())


def test_missing_first_party_backend_names_the_distribution(fresh_registry):
  _install(fresh_registry)  # tokamax-core and its XLA reference only
  with pytest.raises(tokamax.ImplementationNotInstalledError,
                     match="pip install tokamax-gpu-triton"):
    tokamax.layer_norm(_x(), None, None, implementation="triton")
  with pytest.raises(tokamax.ImplementationNotInstalledError,
                     match="pip install tokamax-gpu-triton"):
    tokamax.layer_norm(_x(), None, None, implementation=["triton"])  # one name
  # The alias is named as typed, with why each of its members cannot run.
  with pytest.raises(tokamax.ImplementationNotInstalledError) as e:
    tokamax.layer_norm(_x(), None, None, implementation="mosaic")
  message = str(e.value)
  assert message.startswith("implementation='mosaic' ")
  assert "mosaic_gpu: not installed: pip install tokamax-gpu-mosaic" in message
  assert "mosaic_tpu: not installed: pip install tokamax-tpu-mosaic" in message


def test_sequence_skips_entries_that_are_not_installed(fresh_registry):
  _install(fresh_registry)  # tokamax-core and its XLA reference only
  q = jnp.asarray(_RNG.standard_normal((1, 8, 2, 16)), jnp.float32)
  with tokamax.record_dispatch() as records:
    # The README's example: on a core-only install it must run "xla".
    out = tokamax.dot_product_attention(q, q, q, implementation=["triton", "xla"])
    tokamax.layer_norm(_x(), None, None, implementation=["mosaic", "xla"])
  np.testing.assert_array_equal(
      out, tokamax.dot_product_attention(q, q, q, implementation="xla"))
  assert [(r.op, r.implementation) for r in records] == [
      ("dot_product_attention", "xla"), ("layer_norm", "xla")]
  assert records[0].rejected == (
      ("triton", "not installed: pip install tokamax-gpu-triton "
                 "(or tokamax-core[gpu])"),)
  assert [label for label, _ in records[1].rejected] == ["mosaic_gpu", "mosaic_tpu"]


def test_sequence_of_nothing_that_runs_lists_every_entry(fresh_registry):
  _install(fresh_registry)
  with pytest.raises(NotImplementedError) as e:
    tokamax.layer_norm(_x(), None, None, implementation=["triton", "mosaic", "cudnn"])
  message = str(e.value)
  assert message.startswith("layer_norm forward: no implementation can run this call")
  assert "'triton': not installed: pip install tokamax-gpu-triton" in message
  assert "'mosaic' (mosaic_gpu): not installed: pip install tokamax-gpu-mosaic" in message
  assert "'mosaic' (mosaic_tpu): not installed: pip install tokamax-tpu-mosaic" in message
  assert "'cudnn': has no layer_norm implementation (it implements dot_product_attention)" in message


def test_unknown_name_in_a_sequence_still_raises(fresh_registry):
  # Likely a typo: skipping it would hide that the intended kernel never runs.
  _install(fresh_registry)
  with pytest.raises(ValueError, match="implementation='tritn' is not an implementation"):
    tokamax.layer_norm(_x(), None, None, implementation=["tritn", "xla"])


def test_disabled_backend_is_told_apart_from_a_missing_one(fresh_registry):
  fresh_registry.setenv("TOKAMAX_DISABLED_BACKENDS", "gpu_triton")
  _install(fresh_registry, FakeEntryPoint("gpu_triton", _backend("gpu_triton", "triton"),
                                          FakeDist("tokamax_gpu_triton")))
  with pytest.raises(tokamax.ImplementationNotInstalledError) as e:
    tokamax.layer_norm(_x(), None, None, implementation="triton")
  assert str(e.value) == (
      "implementation='triton' is provided by tokamax-gpu-triton, whose backend "
      "'gpu_triton' is disabled by TOKAMAX_DISABLED_BACKENDS; remove the "
      "backend's (or its distribution's) name from it to use 'triton'")
  with tokamax.record_dispatch() as records:
    tokamax.layer_norm(_x(), None, None, implementation=["triton", "xla"])
  assert records[0].implementation == "xla"
  assert records[0].rejected == (("triton", "its backend 'gpu_triton' "
                                  "(tokamax-gpu-triton) is disabled by "
                                  "TOKAMAX_DISABLED_BACKENDS"),)


def test_broken_first_party_backend_is_not_called_missing(fresh_registry):
  _install(fresh_registry, FakeEntryPoint("gpu_triton", ImportError("no module kaboom"),
                                          FakeDist("tokamax-gpu-triton")))
  with pytest.warns(tokamax.PluginWarning):
    registry.get()
  with pytest.raises(ImportError, match="installed but its backend 'gpu_triton' failed "
                                        "to load: ImportError: no module kaboom"):
    tokamax.layer_norm(_x(), None, None, implementation="triton")
  with tokamax.record_dispatch() as records:
    tokamax.layer_norm(_x(), None, None, implementation=["triton", "xla"])
  assert records[0].implementation == "xla"
  assert "failed to load" in records[0].rejected[0][1]


@dataclasses.dataclass(frozen=True)
class TpuOnlyNorm(tokamax.Op):
  """Stands for mosaic_tpu: runs on a TPU or in interpret mode."""

  op_name = "layer_norm"
  name = "mosaic_tpu"

  def check_supported(self, args, device):
    if device.platform != "tpu" and not device.interpret:
      raise NotImplementedError("needs a TPU or TOKAMAX_INTERPRET=1")

  def forward(self, args, config):
    return DoubledNorm().forward(args, config)


_module.TpuOnlyNorm = TpuOnlyNorm


def _mosaic_backends(fresh_registry):
  """mosaic_gpu without a layer_norm (as shipped), mosaic_tpu with one."""
  gpu = tokamax.plugin.Backend(
      name="gpu_mosaic", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="ragged_dot", name="mosaic_gpu", forward="fake_tokamax_plugin:Absent",
          platforms=("gpu",)),))
  tpu = tokamax.plugin.Backend(
      name="tpu_mosaic", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="layer_norm", name="mosaic_tpu", forward="fake_tokamax_plugin:TpuOnlyNorm",
          platforms=("tpu",)),))
  _install(fresh_registry,
           FakeEntryPoint("gpu_mosaic", gpu, FakeDist("tokamax-gpu-mosaic")),
           FakeEntryPoint("tpu_mosaic", tpu, FakeDist("tokamax-tpu-mosaic")))


def test_alias_means_the_members_that_implement_the_op(fresh_registry):
  _mosaic_backends(fresh_registry)
  scale = jnp.ones((8,), jnp.float32)
  if tokamax.interpret_mode() or jax.default_backend() != "cpu":
    pytest.skip("the refusal below is the one on a CPU outside interpret mode")
  # Not "implementation='mosaic_gpu' is not an implementation of layer_norm": the
  # name typed, then why each member cannot run.
  with pytest.raises(NotImplementedError) as e:
    tokamax.rms_norm(_x(), scale, implementation="mosaic")
  assert str(e.value) == (
      "layer_norm forward: implementation 'mosaic' (mosaic_gpu or mosaic_tpu here) "
      "cannot run this call: 'mosaic_gpu': has no layer_norm implementation (it "
      "implements ragged_dot); 'mosaic_tpu': needs a TPU or TOKAMAX_INTERPRET=1")
  with tokamax.record_dispatch() as records:
    tokamax.rms_norm(_x(), scale, implementation=["mosaic", "xla"])
  assert records[0].implementation == "xla"
  assert [label for label, _ in records[0].rejected] == ["mosaic_gpu", "mosaic_tpu"]
  x = _x()
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    y = tokamax.rms_norm(x, scale, implementation="mosaic")
  assert records[0].implementation == "mosaic_tpu"
  np.testing.assert_allclose(
      y, 2 * tokamax.rms_norm(x, scale, implementation="xla"), rtol=1e-6)


def test_rms_norm_errors_say_the_call_was_rms_norm(fresh_registry):
  """rms_norm runs as layer_norm: dispatch's errors naming layer_norm carry a
  note saying the call was rms_norm, the exception otherwise as raised."""
  _install(fresh_registry)
  scale = jnp.ones((8,), jnp.float32)
  note = "in rms_norm (run as layer_norm with subtract_mean=False)"
  with pytest.raises(ValueError, match=r"^implementation='bogus' is not an "
                     r"implementation of layer_norm") as e:
    tokamax.rms_norm(_x(), scale, implementation="bogus")
  assert e.value.__notes__ == [note]
  # One that names no op, and an argument error, stay without it.
  with pytest.raises(tokamax.ImplementationNotInstalledError,
                     match=r"^implementation='triton' is provided by .*tokamax-gpu-triton") as e:
    tokamax.rms_norm(_x(), scale, implementation="triton")
  assert not getattr(e.value, "__notes__", None)
  with pytest.raises(ValueError, match="^scale") as e:
    tokamax.rms_norm(_x(), jnp.ones((3,), jnp.float32))
  assert not getattr(e.value, "__notes__", None)


def test_alias_with_no_member_for_the_op_names_the_alias(fresh_registry):
  _mosaic_backends(fresh_registry)
  with tokamax.interpret(), pytest.raises(ValueError) as e:
    tokamax.dot_product_attention(*(jnp.ones((1, 8, 2, 16)),) * 3,
                                  implementation="mosaic")
  assert str(e.value) == (
      "implementation='mosaic' (mosaic_gpu on GPU / mosaic_tpu on TPU) has no "
      "implementation of dot_product_attention here (platform "
      f"{jax.default_backend()}, interpret mode): mosaic_gpu: has no "
      "dot_product_attention implementation (it implements ragged_dot); mosaic_tpu: "
      "has no dot_product_attention implementation (it implements layer_norm)")


def test_alias_on_a_gpu_means_mosaic_gpu_only(fresh_registry):
  # As on an NVIDIA GPU: "mosaic" is mosaic_gpu, which has no layer_norm.
  _mosaic_backends(fresh_registry)
  fresh_registry.setattr(tokamax.DeviceInfo, "of", classmethod(
      lambda cls, arrays=(): cls(platform="gpu", device_kind="NVIDIA H100",
                                 interpret=False, compute_capability="9.0")))
  scale = jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError) as e:
    tokamax.rms_norm(_x(), scale, implementation="mosaic")
  assert str(e.value) == (
      "implementation='mosaic' (mosaic_gpu on GPU / mosaic_tpu on TPU) has no "
      "implementation of layer_norm here (platform gpu): mosaic_gpu: has no "
      "layer_norm implementation (it implements ragged_dot)")
  with tokamax.record_dispatch() as records:
    tokamax.rms_norm(_x(), scale, implementation=["mosaic", "xla"])
  assert records[0].implementation == "xla"
  assert [label for label, _ in records[0].rejected] == ["mosaic_gpu"]


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
  spec = tokamax.plugin.Implementation(op="ragged_dot", name="x", forward="a:b")
  with pytest.raises(TypeError, match=r"Backend 'b': implementations must be a tuple "
                                      r"of tokamax.plugin.Implementation"):
    tokamax.plugin.Backend(name="b", api_version=1, implementations=spec)
  assert tokamax.plugin.Backend("b", 1, [spec]).implementations == (spec,)
  with pytest.raises(ValueError, match="op must be one of"):
    tokamax.plugin.Implementation(op="softmax", name="x", forward="a:b")
  with pytest.raises(ValueError, match="module:attr"):
    tokamax.plugin.Implementation(op="ragged_dot", name="x", forward="a.b")
  with pytest.raises(ValueError, match="platforms"):
    tokamax.plugin.Implementation(op="ragged_dot", name="x", forward="a:b",
                                  platforms=("quantum",))
