"""Repository-wide pytest options.

``--backend-smoke``: the backend packages' tests (gpu-triton, gpu-mosaic,
tpu-mosaic) reduced to those marked ``smoke``, each at its first
parametrization. CI runs the backend packages' full tests on the newest JAX
(`nox -s tests_jax_newest`, where they cost about 40% of their CPU time on the
oldest) and this smoke set on the oldest JAX (`nox -s tests`): registration,
refusals, one lowering of each kernel for its hardware and one dispatch of
each op through interpret mode, i.e. what breaks when an older JAX lacks an
API. On the oldest JAX the numbers of every installed kernel are still checked
by integration_tests/test_conformance_installed.py.
"""

import os

# JAX's Mosaic GPU interpreter runs each warpgroup of a block as a computation
# of XLA's CPU client, which must run them all at once (four warpgroups a block
# at most here; `tokamax_gpu_mosaic._common.check_interpreter_threads`). XLA
# sizes that pool by the CPUs (two on the CI machines) unless PJRT_NPROC says
# otherwise, and reads it once, when JAX starts its CPU backend: before any test.
_CPUS = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
         else os.cpu_count() or 1)
os.environ.setdefault("PJRT_NPROC", str(max(4, _CPUS)))

# The GPU tests' float32 references are XLA matmuls (precision HIGHEST) of a
# new shape in nearly every case, and XLA autotunes each one's GEMM on a GPU
# for seconds: on the H200 one case of test_attention.py's
# test_tiles_per_block spent 61 of its 102 s compiling such einsums (30.6 s
# without autotuning; notes/MEASUREMENTS.md, session 38). The tests check
# numbers, not speed, and an untuned GEMM's results are as precise (it may sum
# in another order). Read when JAX starts its GPU backend; an XLA_FLAGS that
# sets the level wins (integration_tests/test_gpu_determinism.py says when to).
if "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_autotune_level=0").strip()

_BACKEND_TEST_DIRS = tuple(f"packages/{name}/tests/"
                           for name in ("gpu-triton", "gpu-mosaic", "tpu-mosaic"))


def pytest_addoption(parser):
  parser.addoption("--backend-smoke", action="store_true",
                   help="run only the backend packages' tests marked smoke, each at "
                        "its first parametrization (the other tests as usual)")


def _first_parametrization(item) -> bool:
  callspec = getattr(item, "callspec", None)
  return callspec is None or not any(callspec.indices.values())


def pytest_collection_modifyitems(config, items):
  if not config.getoption("--backend-smoke"):
    return
  kept, deselected = [], []
  for item in items:
    in_backend = any(d in item.path.as_posix() for d in _BACKEND_TEST_DIRS)
    smoke = item.get_closest_marker("smoke") and _first_parametrization(item)
    (kept if smoke or not in_backend else deselected).append(item)
  if deselected:
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept
