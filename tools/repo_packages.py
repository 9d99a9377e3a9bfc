"""The five packages of this repository, read from their pyproject.toml files.

Shared by tools/dist.py (build and check), tools/install_test.py and
tools/release.py, so that the list of packages and their names live in one place.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Order matters where packages are installed one by one: dependencies first.
FOLDERS = ("xla-reference", "core", "gpu-triton", "gpu-mosaic", "tpu-mosaic")
EXAMPLE_PLUGIN = ROOT / "integration_tests" / "plugins" / "example"


@dataclasses.dataclass(frozen=True)
class Package:
  """One distribution: where it lives and what its pyproject.toml says."""

  path: pathlib.Path
  project: dict  # the [project] table

  @property
  def name(self) -> str:
    return self.project["name"]

  @property
  def version(self) -> str:
    return self.project["version"]

  @property
  def folder(self) -> str:
    return self.path.name

  @property
  def filename_stem(self) -> str:
    """The name as wheel and sdist file names spell it (PEP 491/625)."""
    return re.sub(r"[-_.]+", "_", self.name).lower()

  @property
  def tag_prefix(self) -> str:
    """Release tags are ``<distribution>-v<version>``."""
    return f"{self.name}-v"

  @property
  def tuned_files(self) -> list[pathlib.Path]:
    """Tuned-data JSON files shipped inside the package (see tokamax._src.tuned_data)."""
    return sorted(self.path.glob("src/*/tuned/*/*.json"))


def load(path: pathlib.Path) -> Package:
  with open(path / "pyproject.toml", "rb") as f:
    return Package(path, tomllib.load(f)["project"])


def all_packages() -> list[Package]:
  return [load(ROOT / "packages" / folder) for folder in FOLDERS]


def find(name: str) -> Package:
  """A package by folder name ("core") or distribution name ("tokamax-core")."""
  for package in all_packages():
    if name in (package.folder, package.name):
      return package
  known = ", ".join(p.folder for p in all_packages())
  raise SystemExit(f"unknown package {name!r}; one of: {known}")
