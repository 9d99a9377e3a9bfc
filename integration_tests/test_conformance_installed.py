"""The conformance suite for every installed implementation that can run here.

Kernels for GPUs run in Pallas interpret mode on the CPU (quick case subset, in
float32, to fit the CI budget); on a GPU everything runs natively, in every dtype.

On the CPU this file runs in CI on the oldest JAX only, where it checks that each
installed kernel computes the right numbers there; float32's tight tolerances
are what tells a wrong mask or offset from rounding. The kernels' bfloat16 paths
are checked by their packages' own tests (in full on the newest JAX) and
natively on GPUs. bfloat16 here cost as much again (140 of 272 CPU-seconds, session 22).
"""

import jax
import pytest

import tokamax
from tokamax import testing

_ON_CPU = jax.default_backend() == "cpu"
_REFERENCE = {"xla", "cudnn", "xla_chunked", "composed", "example_rms"}  # tested elsewhere


def _kernel_implementations():
  names = set()
  with tokamax.interpret(_ON_CPU):
    for status in tokamax.implementations():
      if status.usable and status.name not in _REFERENCE:
        names.add((status.op, status.name))
  return sorted(names)


_PAIRS = _kernel_implementations()


@pytest.mark.parametrize("dtype", ["float32"] if _ON_CPU else
                         ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case,name", [(c, n) for op, n in _PAIRS
                                       for c in testing.all_cases(op, quick=_ON_CPU)],
                         ids=str)
def test_installed_kernel_conforms(case, name, dtype):
  with tokamax.interpret(_ON_CPU):
    try:
      testing.check_case(case, name, dtype)
    except NotImplementedError as e:
      pytest.skip(f"not supported: {e}")


def test_installed_kernels_are_exercised():
  """Installed kernel backends must really be checked here, not silently skipped."""
  import importlib.metadata
  try:
    importlib.metadata.version("tokamax-gpu-triton")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("tokamax-gpu-triton is not installed")
  assert {op for op, name in _PAIRS if name == "triton"} == set(tokamax.plugin.OP_NAMES)
