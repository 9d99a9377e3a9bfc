"""Sessions: demo, tests, lint (and bench on a GPU).

    pip install nox && nox -s demo     # set up and run the demo
    pip install nox && nox -s tests    # set up and run every test
"""

import os

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PACKAGES = ["core", "xla-reference", "gpu-triton", "gpu-mosaic", "tpu-mosaic"]
EXAMPLE_PLUGINS = ["example", "broken", "future"]


def _install_tokamax(session, extras="all"):
  # Core pulls the reference package and (with extras) the backend packages from
  # the sibling folders; nothing is taken from a package index but their deps.
  session.install(f"./packages/core[{extras}]")


@nox.session
def demo(session):
  """Installs tokamax with every backend and runs `python -m tokamax demo`."""
  _install_tokamax(session)
  session.run("python", "-m", "tokamax", "info")
  session.run("python", "-m", "tokamax", "demo")


@nox.session
def tests(session):
  """Every package's tests and the integration tests (pytest + xdist)."""
  _install_tokamax(session, "all,test,flax")
  session.install(*(f"./integration_tests/plugins/{p}" for p in EXAMPLE_PLUGINS))
  workers = os.environ.get("TOKAMAX_TEST_WORKERS", "auto")
  session.run("python", "-m", "pytest", "-n", workers, "-m", "not slow and not gpu",
              *[f"packages/{p}/tests" for p in PACKAGES], "integration_tests",
              "--ignore=packages/core/tests/multidevice", *session.posargs)
  # 8 virtual CPU devices: XLA_FLAGS must be set before JAX starts, hence a
  # pytest process of its own.
  session.run("python", "-m", "pytest", "-m", "not slow and not gpu",
              "packages/core/tests/multidevice", *session.posargs,
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})


@nox.session
def lint(session):
  session.install("ruff")
  session.run("ruff", "check", "packages", "integration_tests", "noxfile.py")
