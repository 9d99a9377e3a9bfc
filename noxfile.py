"""Sessions: demo, tests, lint; build, install_test, release, changelog_check;
tests_jax_newest (and bench on a GPU).

    pip install nox uv && nox -s demo   # set up and run the demo
    pip install nox uv && nox -s tests  # lint, then set up and run every test
    nox -s build                        # sdist + wheel of every package into dist/, checked
    nox -s release -- core --dry-run    # docs/releasing.md
"""

import glob
import os
import pathlib

import nox

# The CPU machines' image sets PYTHONDONTWRITEBYTECODE, so every Python process
# the sessions start (each pytest worker, each venv of install_test) compiled
# JAX's sources anew: importing jax, numpy, scipy and tokamax took 4.0 s there
# against 1.3 s from the bytecode an earlier process wrote (session 64).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]
# uv makes the venvs and installs into them where it is installed (`pip install nox
# uv`, as .ci/run does), else virtualenv and pip: the same packages, but the test
# sessions' installs took 16 s instead of 146 s on a CI-sized CPU machine (session
# 21). Sessions that run pip themselves install it (`_install_dist_tools`).
nox.options.default_venv_backend = "uv|virtualenv"

QWIX = "qwix==0.1.8"  # the version the quantized-operand tests are written against
PACKAGES = ["core", "xla-reference", "gpu-triton", "gpu-mosaic", "tpu-mosaic"]
EXAMPLE_PLUGINS = ["example", "broken", "future"]
# The sibling folders each extra of tokamax-core stands for.
EXTRA_FOLDERS = {
    "gpu": ["gpu-triton", "gpu-mosaic"],
    "tpu": ["tpu-mosaic"],
    "all": ["gpu-triton", "gpu-mosaic", "tpu-mosaic"],
}
# The newest JAX release, tested on Python 3.12 by tests_jax_newest (JAX >= 0.11
# needs Python >= 3.12). Raised by hand, so that a JAX release cannot turn CI red
# overnight; the README's "JAX versions" table says what runs where.
JAX_NEWEST = "0.12.0.1"
# What tests_jax_newest runs: every package's tests in full (the kernels in
# interpret mode and lowered for their hardware) and plugin discovery with
# installed plugins; the integration tests and core's multi-device tests run on
# the default JAX in `tests` only (core's `CORE_TESTS_OLDEST` on both). The
# backend packages' tests run in full here and only their smoke set on the oldest
# JAX (`BACKEND_SMOKE`): on the CPU they take about 40% of their 0.10.2 time on
# 0.12 (session 20: 1003 CPU-seconds for this whole run against 1952 for the
# backend packages alone on 0.10.2).
JAX_NEWEST_TESTS = [*(f"packages/{p}/tests" for p in PACKAGES),
                    "integration_tests/test_plugins.py"]
# Core's test files the oldest JAX runs: the ops through the public API under jit,
# grad and vmap (the reference's conformance cases, transforms, empty inputs), the
# integrations installed only there (Flax, Qwix); its multi-device tests run there
# too. Core's other files test its own logic (dispatch, autotuning, bench, demo,
# registry, ...) and run on the newest JAX only, where they cost two thirds of
# their CPU time on the oldest (session 21: 154 against 231 CPU-seconds).
CORE_TESTS_OLDEST = [f"packages/core/tests/{f}" for f in (
    "test_conformance_reference.py", "test_transforms.py", "test_empty_inputs.py",
    "test_flax.py", "test_quantized_ragged_dot.py")]
# The `tests` session's option for the backend packages (conftest.py): their
# tests marked smoke, each at its first parametrization (registration, refusals,
# one lowering of each kernel, one dispatch of each op): what an older JAX's
# missing API breaks. The conformance suite still runs every installed kernel on
# the oldest JAX, in float32 (integration_tests/test_conformance_installed.py).
BACKEND_SMOKE = "--backend-smoke"
# XLA_FLAGS of the test sessions. On CI's CPU machines most of the test time is XLA
# compiling (the kernels in interpret mode, the references: 78 of the 101 s of
# test_demo.py's demo run), so the CPU backend compiles at LLVM -O0 there, for about
# a third less CPU time. The tests check the same programs: every HLO pass still
# runs, only LLVM's optimization of the machine code is left out. Results may differ
# from -O2's by rounding, far inside every tolerance (the quick conformance cases,
# xla in float32 and interpreted triton in bfloat16: 37 of 201 outputs and gradients
# differ, by a relative L2 error of at most 1.5e-7 and 3.6e-4 where the tolerances
# are 2e-5 and 2e-2). GPU tests run with plain `pytest -m gpu`, without it.
TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
# What ruff checks (ruff.toml says how), and the ruff that does: pinned, raised by
# hand like JAX_NEWEST, so that a ruff release with new checks cannot turn CI red.
LINT_PATHS = ["packages", "integration_tests", "tools", "noxfile.py", "conftest.py"]
RUFF = "ruff==0.17.6"


def _install_tokamax(session, extras="all"):
  """Installs tokamax-core[extras] and the packages it names from the sibling folders.

  The packages' metadata names its tokamax dependencies by name and version range
  (what a package index needs), so `pip install ./packages/core` alone would look
  for tokamax-xla-reference on the index. We name every sibling folder on the same
  pip command line instead: pip then takes each folder as the only candidate for
  its name, and still checks the declared version ranges, so a range that excludes
  the sibling fails here as it would for users. This is how opentelemetry-python
  (tox) and google-cloud-python (nox) develop their many packages in one
  repository: plain pip, no workspace tool, the published metadata the only truth.
  """
  folders = ["xla-reference"]
  for extra in extras.split(","):
    folders += EXTRA_FOLDERS.get(extra, [])
  session.install(f"./packages/core[{extras}]",
                  *(f"./packages/{f}" for f in dict.fromkeys(folders)))


@nox.session
def demo(session):
  """Installs tokamax with every backend and runs `python -m tokamax demo`."""
  _install_tokamax(session)
  session.run("python", "-m", "tokamax", "info")
  session.run("python", "-m", "tokamax", "demo")


def _test_env(session, *flags):
  """The environment of a pytest run: XLA_FLAGS with TEST_XLA_FLAGS and `flags` added,
  and JAX's persistent compilation cache in the session's folder (unless the caller
  names one).

  The cache is keyed by the compiled program (its HLO, compile options, JAX and
  backend versions), so it only ever returns what compiling again would give; the
  tests compile many identical programs (the references and input draws at the same
  shapes, in differently built functions that jit's in-process cache never matches),
  and from an empty cache a run took 8-22% less time (notes/MEASUREMENTS.md,
  session 105). Every entry is kept, however quick its compile.
  """
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
      pathlib.Path(session.create_tmp()).resolve() / "jax_cache")
  return {"XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS,
                                 *flags]).strip(),
          "JAX_COMPILATION_CACHE_DIR": cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _ruff(session):
  session.install(RUFF)
  session.run("ruff", "check", *LINT_PATHS)


@nox.session
def tests(session):
  """ruff (seconds: a lint error fails before the tests), then on the oldest JAX
  the reference's tests, core's `CORE_TESTS_OLDEST` and multi-device tests, the
  backend packages' smoke set (`BACKEND_SMOKE`) and the integration tests (pytest +
  xdist); then `tests_jax_newest`, where core's other tests and the backend
  packages' tests run in full (without core's reference conformance file: about 4
  minutes there, already run here; `nox -s tests_jax_newest` runs it)."""
  session.notify("tests_jax_newest",
                 posargs=["--ignore=packages/core/tests/test_conformance_reference.py"])
  _ruff(session)
  _install_tokamax(session, "all,test,flax")
  session.install(*(f"./integration_tests/plugins/{p}" for p in EXAMPLE_PLUGINS))
  session.install(QWIX)  # ragged_dot takes Qwix's quantized arrays as they come
  workers = os.environ.get("TOKAMAX_TEST_WORKERS", "auto")
  session.run("python", "-m", "pytest", "-n", workers, "-m", "not slow and not gpu",
              *CORE_TESTS_OLDEST,
              *[f"packages/{p}/tests" for p in PACKAGES if p != "core"],
              "integration_tests", BACKEND_SMOKE,
              # The example plugin's own CI tests run in install_test, from its wheel.
              "--ignore=integration_tests/plugins", *session.posargs, env=_test_env(session))
  # 8 virtual CPU devices: XLA_FLAGS must be set before JAX starts, hence a
  # pytest process of its own (its workers each see the 8 devices).
  session.run("python", "-m", "pytest", "-n", workers, "-m", "not slow and not gpu",
              "packages/core/tests/multidevice", *session.posargs,
              env=_test_env(session, "--xla_force_host_platform_device_count=8"))


def _find_python(version):
  """An interpreter for `version`: on PATH, else pyenv's (where the CPU machines have one).

  The CPU machines' default python3 is 3.11, but their image carries pyenv builds of
  3.12 and 3.13 that are not on PATH (pyenv's shim refuses them while 3.11 is the
  global version). Returning the bare version when neither exists lets nox report
  the missing interpreter (an error under CI=true, not a silent skip).
  """
  pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
  found = sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"))
  return found[-1] if found else version


@nox.session(python=_find_python("3.12"))
def tests_jax_newest(session):
  """JAX_NEWEST on Python 3.12 (CPU): every package's tests but core's multi-device
  ones."""
  session.install(f"jax=={JAX_NEWEST}")
  _install_tokamax(session, "all,test")
  session.install(*(f"./integration_tests/plugins/{p}" for p in EXAMPLE_PLUGINS))
  session.run("python", "-c", "import jax; v = jax.__version__; print('JAX', v); "
              f"assert v == {JAX_NEWEST!r}, v")
  workers = os.environ.get("TOKAMAX_TEST_WORKERS", "auto")
  session.run("python", "-m", "pytest", "-n", workers, "-m", "not slow and not gpu",
              *JAX_NEWEST_TESTS, "--ignore=packages/core/tests/multidevice",
              *session.posargs, env=_test_env(session))


@nox.session
def lint(session):
  """ruff alone (`tests` runs it first too)."""
  _ruff(session)


def _install_dist_tools(session):
  # hatchling for the builds without isolation (install_test, release --dry-run);
  # pip for install_test's `pip download` (a uv-made venv has none).
  session.install("build>=1.2", "twine>=6.1", "packaging>=24", "hatchling>=1.27",
                  "pip")


@nox.session
def build(session):
  """sdist + wheel of each package into dist/ (or the folder given), checked."""
  _install_dist_tools(session)
  outdir = session.posargs[0] if session.posargs else "dist"
  session.run("python", "tools/dist.py", "build", outdir)


@nox.session
def install_test(session):
  """Builds every package, serves the folder as a local index, installs into clean venvs.

  tools/install_test.py says what each venv checks; jax and the other third-party
  wheels come from pip's cache through `pip download`, so the venvs never see the
  real index (where a `tokamax` distribution of someone else's exists).
  """
  _install_dist_tools(session)
  work = pathlib.Path(session.create_tmp()).resolve() / "install_test"
  session.run("python", "tools/install_test.py", str(work), *session.posargs)


@nox.session
def release(session):
  """`nox -s release -- <package> [--dry-run] [--part patch|minor|major | --version X]`."""
  _install_dist_tools(session)
  session.run("python", "tools/release.py", "release", *session.posargs)


@nox.session
def changelog_check(session):
  """Fails when a package's source changed since its last tag with nothing under Unreleased."""
  session.install("packaging>=24")
  session.run("python", "tools/release.py", "check-changelogs")
