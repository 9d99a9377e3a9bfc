"""The packages' metadata agree with each other, and the release tools do what they say.

`nox -s build` and `nox -s install_test` check built artifacts; these are the quick
checks that run with every test run: version ranges between our own packages, the
plugin API literal, and tools/release.py's changelog and version logic on a
scratch git repository.
"""

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import dist  # noqa: E402
import repo_packages as pkgs  # noqa: E402
import release  # noqa: E402

BACKENDS = ("gpu-triton", "gpu-mosaic", "tpu-mosaic")


def _project(folder):
  with open(ROOT / "packages" / folder / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]


def _requirements(project, extra=None):
  reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
  return {r.name: r for r in map(Requirement, reqs)}


def test_core_requires_the_current_reference_by_range():
  ref = _requirements(_project("core"))["tokamax-xla-reference"]
  assert ref.url is None and ref.specifier
  assert ref.specifier.contains(_project("xla-reference")["version"])


@pytest.mark.parametrize("extra,folders", [("gpu", ["gpu-triton", "gpu-mosaic"]),
                                           ("tpu", ["tpu-mosaic"]), ("all", list(BACKENDS))])
def test_core_extras_name_the_backends_by_range(extra, folders):
  reqs = _requirements(_project("core"), extra)
  assert sorted(reqs) == sorted(_project(f)["name"] for f in folders)
  for folder in folders:
    req = reqs[_project(folder)["name"]]
    assert req.url is None and req.specifier.contains(_project(folder)["version"]), req


@pytest.mark.parametrize("folder", BACKENDS)
def test_backend_accepts_the_current_core(folder):
  core = _requirements(_project(folder))["tokamax-core"]
  assert core.url is None
  # An upper bound: a core that may change the plugin API is not accepted blindly.
  assert any(s.operator == "<" for s in core.specifier), core
  assert core.specifier.contains(_project("core")["version"]), (
      f"{folder} does not accept tokamax-core {_project('core')['version']}: if the plugin "
      "API is unchanged, widen its range (a changelog entry); else port it")


@pytest.mark.parametrize("folder", BACKENDS)
def test_backend_declares_its_plugin_api_as_a_literal(folder):
  # Read from tokamax.plugin at run time it would always equal the installed core's
  # version, and a core that changed the API could not refuse an old backend.
  source = next((ROOT / "packages" / folder / "src").glob("*/_plugin.py")).read_text()
  core_plugin = (ROOT / "packages/core/src/tokamax/_src/plugin.py").read_text()
  core_api = re.search(r"(?m)^PLUGIN_API_VERSION = (\d+)$", core_plugin).group(1)
  assert re.search(r"api_version=(\d+),", source).group(1) == core_api


@pytest.mark.parametrize("folder", pkgs.FOLDERS)
def test_installed_version_is_the_pyproject_version(folder):
  name = _project(folder)["name"]
  module = {"core": "tokamax"}.get(folder, name.replace("-", "_"))
  installed = importlib.metadata.version(name)
  assert installed == _project(folder)["version"]
  assert __import__(module).__version__ == installed


# ------------------------------------------------------------------ tools/dist.py


@pytest.mark.parametrize("req,bad", [
    ("tokamax-xla-reference @ file:///home/me/packages/xla-reference", True),
    ("tokamax-gpu-triton; extra == 'gpu'", True),
    ("tokamax-gpu-triton>=0.1.0; extra == 'gpu'", False),
    ("jax>=0.10.2", False),
    ("numpy", False),
])
def test_requirement_check(req, bad):
  assert bool(dist.requirement_problems(req, "METADATA")) == bad


# ------------------------------------------------------------------ tools/release.py


@pytest.fixture
def scratch_repo(tmp_path, monkeypatch):
  """A git repository with one package, `pkg` (version 0.1.0), as tools/release.py sees it."""
  package = tmp_path / "packages" / "pkg"
  (package / "src").mkdir(parents=True)
  (package / "tests").mkdir()
  (package / "pyproject.toml").write_text('[project]\nname = "tokamax-pkg"\nversion = "0.1.0"\n')
  (package / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n\n")
  (package / "src" / "mod.py").write_text("x = 1\n")
  (package / "tests" / "test_mod.py").write_text("")
  monkeypatch.setattr(pkgs, "ROOT", tmp_path)
  git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
  git("init", "-q")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "0")
  return tmp_path, package, git


def _commit(git, message="c"):
  git("add", "-A")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)


def test_changelog_check_never_released(scratch_repo):
  _, package, git = scratch_repo
  _commit(git)
  assert "never released" in release.changelog_problems(pkgs.load(package))[0]
  (package / "CHANGELOG.md").write_text("## [Unreleased]\n\n- First release.\n")
  assert release.changelog_problems(pkgs.load(package)) == []


def test_changelog_check_after_a_tag(scratch_repo):
  _, package, git = scratch_repo
  _commit(git)
  git("tag", "tokamax-pkg-v0.1.0")
  assert release.changelog_problems(pkgs.load(package)) == []  # nothing changed
  (package / "tests" / "test_mod.py").write_text("# tests need no entry\n")
  assert release.changelog_problems(pkgs.load(package)) == []
  (package / "src" / "mod.py").write_text("x = 2\n")
  (problem,) = release.changelog_problems(pkgs.load(package))
  assert "packages/pkg/src/mod.py" in problem and "tokamax-pkg-v0.1.0" in problem
  (package / "src" / "new.py").write_text("")  # untracked files count too
  _commit(git)
  assert "src/new.py" in release.changelog_problems(pkgs.load(package))[0]
  (package / "CHANGELOG.md").write_text("## [Unreleased]\n\n- x is 2.\n\n## [0.1.0]\n\n- a\n")
  assert release.changelog_problems(pkgs.load(package)) == []


def test_changelog_check_without_tags_uses_the_release_commit(scratch_repo):
  _, package, git = scratch_repo
  (package / "CHANGELOG.md").write_text("## [Unreleased]\n\n## [0.1.0]\n\n- a\n")
  _commit(git, "Release tokamax-pkg 0.1.0")
  assert release.changelog_problems(pkgs.load(package)) == []
  (package / "src" / "mod.py").write_text("x = 2\n")
  _commit(git, "x is 2")
  assert "src/mod.py" in release.changelog_problems(pkgs.load(package))[0]


def test_next_version(scratch_repo):
  _, package, git = scratch_repo
  _commit(git)
  assert str(release.next_version(pkgs.load(package), "patch", None)) == "0.1.0"  # untagged
  git("tag", "tokamax-pkg-v0.1.0")
  assert str(release.next_version(pkgs.load(package), "patch", None)) == "0.1.1"
  assert str(release.next_version(pkgs.load(package), "minor", None)) == "0.2.0"
  assert str(release.next_version(pkgs.load(package), "major", None)) == "1.0.0"
  with pytest.raises(SystemExit, match="not newer"):
    release.next_version(pkgs.load(package), "patch", "0.1.0")


def test_release_moves_unreleased_entries(scratch_repo):
  _, package, _ = scratch_repo
  with pytest.raises(SystemExit, match="nothing under"):
    release.move_unreleased(package, "0.1.1", "2026-01-01")
  (package / "CHANGELOG.md").write_text("## [Unreleased]\n\n- Fixed x.\n")
  release.move_unreleased(package, "0.1.1", "2026-01-01")
  text = (package / "CHANGELOG.md").read_text()
  assert text == "## [Unreleased]\n\n## [0.1.1] - 2026-01-01\n\n- Fixed x.\n"
  assert release.unreleased_entries(text) == []
  release.set_version(package, "0.1.1")
  assert pkgs.load(package).version == "0.1.1"


def test_core_changelog_names_the_plugin_api_version():
  assert release.plugin_api_problems() == []
