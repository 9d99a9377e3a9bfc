"""The package installs, registers through its entry point and is discovered."""

import importlib.metadata
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src.ops.ragged_dot import RaggedDotArgs
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _plugin
from tokamax_gpu_mosaic import attention as mat
from tokamax_gpu_mosaic import gated_linear_unit as glu
from tokamax_gpu_mosaic import ragged_dot as rd

pytestmark = pytest.mark.smoke  # cheap: CI runs these on the oldest JAX too


def test_entry_point_is_declared():
  eps = importlib.metadata.entry_points(group="tokamax.backends")
  assert any(ep.value == "tokamax_gpu_mosaic._plugin:BACKEND" for ep in eps)


def test_backend_is_discovered():
  backends = {b.name: b for b in tokamax.backends()}
  assert backends["gpu_mosaic"].status == "ok"
  assert backends["gpu_mosaic"].distribution == "tokamax-gpu-mosaic"
  assert _plugin.BACKEND.api_version == tokamax.plugin.PLUGIN_API_VERSION


def _every_op():
  x = jnp.zeros((16, 64), jnp.bfloat16)
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  attention = tokamax.AttentionArgs(query=q, key=q, value=q)
  ragged = RaggedDotArgs(lhs=x, rhs=jnp.zeros((2, 64, 64), jnp.bfloat16),
                         group_sizes=jnp.asarray([8, 8], jnp.int32))
  glu_args = tokamax.GatedLinearUnitArgs(x=x, weights=jnp.zeros((64, 2, 64), jnp.bfloat16),
                                         activation=jax.nn.silu)
  return [(mat.MosaicGpuAttention(), attention), (mat.MosaicGpuAttentionVjp(), attention),
          (rd.MosaicGpuRaggedDot(), ragged), (rd.MosaicGpuRaggedDotVjp(), ragged),
          (glu.MosaicGpuGatedLinearUnit(), glu_args),
          (glu.MosaicGpuGatedLinearUnitVjp(), glu_args)]


def test_interpret_mode_where_the_interpreter_runs_the_kernels():
  """Interpret mode on a CPU: taken from JAX 0.12 (test_interpret.py runs the
  kernels there), refused with the reason before."""
  device = tokamax.DeviceInfo("cpu", "cpu", interpret=True)
  for op, args in _every_op():
    if _common.interpreter_runs_these_kernels():
      op.check_supported(args, device)
    else:
      with pytest.raises(NotImplementedError, match="needs JAX >= 0.12"):
        op.check_supported(args, device)
  # And through dispatch, on a CPU (a Hopper GPU runs them natively under interpret).
  if not _common.interpreter_runs_these_kernels() and jax.default_backend() == "cpu":
    _, ragged = _every_op()[2]
    with tokamax.interpret(), pytest.raises(NotImplementedError,
                                            match="needs JAX >= 0.12"):
      tokamax.ragged_dot(ragged.lhs, ragged.rhs, ragged.group_sizes,
                         implementation="mosaic_gpu")


def test_a_hopper_gpu_under_interpret_mode_is_taken():
  """On a GPU, interpret mode never refused these kernels: natively where JAX
  cannot interpret them, in the interpreter where it can."""
  h200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", interpret=True,
                            compute_capability="9.0")
  for op, args in _every_op():
    op.check_supported(args, h200)


def _test_functions(path: pathlib.Path):
  """The test functions of the test module at `path`, loaded afresh."""
  spec = importlib.util.spec_from_file_location(f"_scanned_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  # Registered while it runs, as an import would (dataclasses look their
  # module up there).
  sys.modules[spec.name] = module
  try:
    spec.loader.exec_module(module)
  finally:
    del sys.modules[spec.name]
  return [(name, fn) for name, fn in vars(module).items()
          if name.startswith("test") and callable(fn)]


def test_native_tests_carry_the_gpu_marker():
  """README.md's native run selects tests with `pytest -m gpu`: a test skipped
  off a Hopper GPU without the marker would never run there (every native test
  of this package lacked it until session 35)."""
  native, unmarked = 0, []
  for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
    for name, fn in _test_functions(path):
      marks = getattr(fn, "pytestmark", [])
      hopper_only = any(m.name == "skipif" and m.kwargs.get("reason") ==
                        "needs an NVIDIA Hopper GPU" for m in marks)
      native += hopper_only
      if hopper_only and not any(m.name == "gpu" for m in marks):
        unmarked.append(f"{path.name}::{name}")
  assert native >= 90, native  # the kernels' native tests were found
  assert not unmarked, unmarked
