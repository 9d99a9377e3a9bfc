"""Installs the built packages from a local package index into clean venvs, as users will.

    python tools/install_test.py WORKDIR

Builds every package and the example plugin (tools/dist.py, checked), downloads the
third-party wheels they need (jax, numpy, ...; from pip's cache after the first
run) and writes a PEP 503 simple index of both under WORKDIR. Every pip call below
uses that index only (`--index-url file://...`, the machine's pip configuration
ignored), so a name that our metadata got wrong cannot be found on the real index.
Then, each in a clean venv:

  1. `pip install tokamax-core`: the XLA reference and no backend package; all four
     ops run (forward and backward) with the built-in implementations (the
     reference; the dense GLU as the composed plain program); `python -m tokamax info`
     lists exactly that; the example plugin installs by name from the index and its
     own conformance tests (integration_tests/plugins/example/tests) pass there.
  2. `pip install "tokamax-core[tpu]"`: tokamax-tpu-mosaic and nothing for GPUs.
     Then a newer core of the same plugin API (0.1.99, built here) upgrades it and
     the released backend is accepted; a newer core with plugin API 2 (0.2.0) is
     refused by pip next to that backend (naming both versions), pip picks the
     compatible core for `tokamax-core[tpu]`, and forced in with --no-deps it
     refuses the backend with a warning naming both versions: no crash, the ops run.
  3. `pip install "tokamax-core[gpu]"`: both GPU backends and nothing for TPUs.

Exit status 1 with every failed check printed; timings per step on stdout.
"""

from __future__ import annotations

import html
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import dist
import repo_packages as pkgs

FAILURES: list[str] = []
PASSED: list[str] = []
# Distributions that mean "something for GPUs" or "something for TPUs" got installed.
GPU_MARKERS = ("tokamax-gpu-", "nvidia-", "jax-cuda", "jax_cuda", "triton", "jax-triton")
TPU_MARKERS = ("tokamax-tpu-", "libtpu")
# What `install_probe` records on a CPU with no backend package: the XLA reference,
# but the dense GLU's composed implementation (the plain program, ahead of it).
BUILT_IN_DISPATCH = {
    "dot_product_attention": ["backward:xla", "forward:xla"],
    "layer_norm": ["backward:xla", "forward:xla"],
    "gated_linear_unit": ["backward:composed", "forward:composed"],
    "ragged_dot": ["backward:xla", "forward:xla"],
}


def expect(condition: bool, what: str) -> None:
  print(f"  {'ok  ' if condition else 'FAIL'} {what}")
  (PASSED if condition else FAILURES).append(what)


def clean_env() -> dict:
  """The environment without the machine's pip configuration (extra indexes, find-links)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
             PYTHONNOUSERSITE="1")
  env.pop("PYTHONPATH", None)
  return env


def run(cmd: list, check: bool = True, **kw) -> subprocess.CompletedProcess:
  proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                        env=kw.pop("env", clean_env()), **kw)
  if check and proc.returncode:
    raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}")
  return proc


# ------------------------------------------------------------------ the index


def build_all(outdir: pathlib.Path) -> None:
  # Without build isolation (hatchling comes from this venv): twice as fast, and
  # `nox -s build` checks the isolated build.
  dist.build(outdir, pkgs.all_packages(), isolated=False)
  problems = dist.check(outdir, pkgs.all_packages())
  for problem in problems:
    expect(False, f"built artifact: {problem}")
  run([sys.executable, "-m", "build", "--no-isolation", "--outdir", outdir, pkgs.EXAMPLE_PLUGIN])
  example = sorted(map(str, outdir.glob("tokamax_example_plugin-*")))
  twine = run([sys.executable, "-m", "twine", "check", "--strict", *example], check=False)
  expect(len(example) == 2 and twine.returncode == 0,
         f"example plugin: sdist and wheel pass twine check ({example})")


def build_core_variant(work: pathlib.Path, version: str, api_version: int) -> None:
  """A newer tokamax-core: the current source with another version (and plugin API)."""
  source = work / f"core-{version}"
  shutil.rmtree(source, ignore_errors=True)
  shutil.copytree(pkgs.ROOT / "packages" / "core", source,
                  ignore=shutil.ignore_patterns("__pycache__", "tests"))
  replace_once(source / "pyproject.toml", r'(?m)^version = ".*"$', f'version = "{version}"')
  replace_once(source / "src/tokamax/_src/plugin.py", r"(?m)^PLUGIN_API_VERSION = \d+$",
               f"PLUGIN_API_VERSION = {api_version}")
  run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", work / "variants",
       source])


def replace_once(path: pathlib.Path, pattern: str, new: str) -> None:
  # Exactly one match, so that a change of these files cannot make the test vacuous.
  text, count = re.subn(pattern, new, path.read_text())
  if count != 1:
    raise SystemExit(f"{path}: expected one match of {pattern!r}, found {count}")
  path.write_text(text)


def third_party_requirements(outdir: pathlib.Path) -> list[str]:
  """Every non-tokamax requirement of the built wheels (extras for GPUs/TPUs aside), and pytest."""
  reqs = {"pytest", "pip>=24"}
  for wheel in outdir.glob("*.whl"):
    metadata = dist.dist_info(dist.wheel_files(wheel), "METADATA")[1].decode()
    for line in metadata.splitlines():
      if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line.removeprefix("Requires-Dist: ")
        if not req.lower().startswith("tokamax"):
          reqs.add(req)
  return sorted(reqs)


def download_wheelhouse(outdir: pathlib.Path, wheelhouse: pathlib.Path) -> None:
  # The real index once (pip's cache makes reruns quick); the machine's own pip
  # configuration is kept here, as it is how this machine reaches the index.
  run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
       "--dest", wheelhouse, *third_party_requirements(outdir)], env=dict(os.environ))


def write_index(root: pathlib.Path, folders: list[pathlib.Path]) -> str:
  """A PEP 503 simple index of every file in `folders`; returns its file:// URL."""
  by_project: dict[str, list[pathlib.Path]] = {}
  for folder in folders:
    for f in folder.iterdir():
      if f.suffix == ".whl" or f.name.endswith(".tar.gz"):
        name = re.sub(r"[-_.]+", "-", re.split(r"-\d", f.name, maxsplit=1)[0]).lower()
        by_project.setdefault(name, []).append(f)
  shutil.rmtree(root, ignore_errors=True)
  for name, files in by_project.items():
    (root / name).mkdir(parents=True)
    links = "".join(f'<a href="{f.as_uri()}">{html.escape(f.name)}</a>\n' for f in files)
    (root / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
  return root.as_uri()


# ------------------------------------------------------------------ venvs


class Venv:
  """A clean virtual environment that installs from one index only."""

  def __init__(self, path: pathlib.Path, index: str, wheelhouse: pathlib.Path):
    shutil.rmtree(path, ignore_errors=True)
    run([sys.executable, "-m", "venv", path])
    self.python = path / "bin" / "python"
    self.index = index
    # ensurepip's pip may predate the wheels' metadata version: upgrade it first.
    run([self.python, "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
         "--find-links", wheelhouse, "--upgrade", "pip"])

  def pip(self, *args, check=True) -> subprocess.CompletedProcess:
    # --no-compile: byte-compiling jax and scipy's files would be most of the time.
    extra = ["--no-compile"] if args[0] == "install" else []
    return run([self.python, "-m", "pip", *args, *extra, "--index-url", self.index], check=check)

  def probe(self) -> dict:
    out = run([self.python, pkgs.ROOT / "tools" / "install_probe.py"]).stdout
    return json.loads(out.strip().splitlines()[-1])

  def info(self) -> subprocess.CompletedProcess:
    return run([self.python, "-m", "tokamax", "info"], check=False, cwd="/")


def info_backends(info_stdout: str) -> dict[str, str]:
  """`python -m tokamax info`'s backends section: distribution -> "version [status]"."""
  section = info_stdout.split("\nbackends:\n", 1)[1].split("\n\n", 1)[0]
  rows = {}
  for line in section.splitlines():
    fields = line.split()
    rows[fields[1]] = f"{fields[2]} {fields[3]}"
  return rows


def tokamax_dists(report: dict) -> dict[str, str]:
  return dict(d.lower().split("==") for d in report["distributions"]
              if d.lower().startswith("tokamax"))


def check_install(venv: Venv, expected: set[str], forbidden: tuple[str, ...], label: str) -> dict:
  """The tokamax distributions are exactly `expected`; info lists exactly those."""
  report = venv.probe()
  installed = tokamax_dists(report)
  expect(set(installed) == expected, f"{label}: installed {sorted(installed)}")
  stray = [d for d in report["distributions"] if d.lower().startswith(forbidden)]
  expect(not stray, f"{label}: nothing of {forbidden} installed (found {stray})")
  info = venv.info()
  expect(info.returncode == 0, f"{label}: python -m tokamax info exits 0")
  listed = info_backends(info.stdout) if info.returncode == 0 else {}
  backends = {d: f"{v} [ok]" for d, v in installed.items() if d != "tokamax-core"}
  expect(listed == backends, f"{label}: info lists exactly the installed backends ({listed})")
  return report


# ------------------------------------------------------------------ scenarios


def core_only(venv: Venv, current: dict[str, str]) -> None:
  venv.pip("install", "tokamax-core")
  report = check_install(venv, {"tokamax-core", "tokamax-xla-reference"},
                         GPU_MARKERS + TPU_MARKERS, "tokamax-core")
  expect(report["ops"] == BUILT_IN_DISPATCH,
         f"tokamax-core: the four ops run forward and backward with the built-in "
         f"implementations ({report['ops']})")
  expect(tokamax_dists(report)["tokamax-core"] == current["tokamax-core"],
         "tokamax-core: the version just built")
  example_plugin(venv)


def example_plugin(venv: Venv) -> None:
  """A third party's plugin, installed by name from the index, runs its own CI tests."""
  venv.pip("install", "tokamax-example-plugin", "pytest")
  report = venv.probe()
  expect(["example", "tokamax-example-plugin", "0.3.0", "ok"] in report["backends"],
         "example plugin: discovered from its wheel")
  tests = run([venv.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
              check=False, cwd=pkgs.EXAMPLE_PLUGIN,
              env={**clean_env(), "TOKAMAX_CONFORMANCE_QUICK": "1"})
  print("\n".join("    " + line for line in tests.stdout.strip().splitlines()[-2:]))
  expect(tests.returncode == 0 and " passed" in tests.stdout,
         "example plugin: its conformance tests pass against the installed core")


def tpu_then_newer_cores(venv: Venv, newer_index: str, current: dict[str, str]) -> None:
  venv.pip("install", "tokamax-core[tpu]")
  check_install(venv, {"tokamax-core", "tokamax-xla-reference", "tokamax-tpu-mosaic"},
                GPU_MARKERS, "tokamax-core[tpu]")
  venv.index = newer_index
  compatible_core(venv, current)
  incompatible_core(venv, current)


def compatible_core(venv: Venv, current: dict[str, str]) -> None:
  venv.pip("install", "tokamax-core==0.1.99")
  report = check_install(venv, {"tokamax-core", "tokamax-xla-reference", "tokamax-tpu-mosaic"},
                         GPU_MARKERS, "newer core, same plugin API")
  expect(tokamax_dists(report)["tokamax-core"] == "0.1.99" and
         ["tpu_mosaic", "tokamax-tpu-mosaic", current["tokamax-tpu-mosaic"], "ok"]
         in report["backends"], "newer core, same plugin API: the released backend is accepted")


def incompatible_core(venv: Venv, current: dict[str, str]) -> None:
  tpu = f"tokamax-tpu-mosaic=={current['tokamax-tpu-mosaic']}"
  refused = venv.pip("install", "--dry-run", "tokamax-core==0.2.0", tpu, check=False)
  text = refused.stdout + refused.stderr
  expect(refused.returncode != 0 and "tokamax-core==0.2.0" in text and tpu in text
         and "tokamax-core<0.2" in text.replace(" ", ""),
         "plugin API 2 core: pip refuses it beside the released backend, naming both")
  resolved = venv.pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
                      "tokamax-core[tpu]")
  picked = {i["metadata"]["name"]: i["metadata"]["version"]
            for i in json.loads(resolved.stdout)["install"]}
  expect(picked.get("tokamax-core") == "0.1.99",
         f"plugin API 2 core: pip resolves tokamax-core[tpu] to a compatible core ({picked})")
  venv.pip("install", "--no-deps", "tokamax-core==0.2.0")
  report = venv.probe()
  warning = " ".join(report["warnings"])
  expect(["tpu_mosaic", "tokamax-tpu-mosaic", current["tokamax-tpu-mosaic"], "error"]
         in report["backends"], "plugin API 2 core forced in: the backend is refused")
  expect(all(s in warning for s in (f"tokamax-tpu-mosaic {current['tokamax-tpu-mosaic']}",
                                    "plugin API version 1", "tokamax-core 0.2.0",
                                    "speaks version 2")),
         f"plugin API 2 core forced in: a warning names both versions ({warning})")
  expect(report["ops"] == BUILT_IN_DISPATCH,
         "plugin API 2 core forced in: no crash, the ops run with the built-in "
         "implementations")
  info = venv.info()
  expect(info.returncode == 0 and "speaks version 2" in info.stdout + info.stderr,
         "plugin API 2 core forced in: python -m tokamax info runs and says why")


def gpu(venv: Venv) -> None:
  venv.pip("install", "tokamax-core[gpu]")
  check_install(venv, {"tokamax-core", "tokamax-xla-reference", "tokamax-gpu-triton",
                       "tokamax-gpu-mosaic"}, TPU_MARKERS, "tokamax-core[gpu]")


def timed(label: str, fn, *args) -> None:
  start = time.monotonic()
  print(f"{label}:")
  fn(*args)
  print(f"  ({time.monotonic() - start:.0f} s)")


def main(work: pathlib.Path) -> int:
  start = time.monotonic()
  built, wheelhouse = work / "dist", work / "wheelhouse"
  current = {p.name: p.version for p in pkgs.all_packages()}
  timed("build and check", build_all, built)
  timed("core variants 0.1.99 (plugin API 1) and 0.2.0 (plugin API 2)", lambda: [
      build_core_variant(work, "0.1.99", 1), build_core_variant(work, "0.2.0", 2)])
  timed("third-party wheels", download_wheelhouse, built, wheelhouse)
  index = write_index(work / "index", [built, wheelhouse])
  newer_index = write_index(work / "index-newer", [built, wheelhouse, work / "variants"])
  timed("tokamax-core alone, then the example plugin", core_only,
        Venv(work / "venv-core", index, wheelhouse), current)
  timed("tokamax-core[tpu], then newer cores", tpu_then_newer_cores,
        Venv(work / "venv-tpu", index, wheelhouse), newer_index, current)
  timed("tokamax-core[gpu]", gpu, Venv(work / "venv-gpu", index, wheelhouse))
  print(f"install test took {time.monotonic() - start:.0f} s")
  print(f"install_test: {len(PASSED)} passed, {len(FAILURES)} failed")
  return 1 if FAILURES else 0


if __name__ == "__main__":
  sys.exit(main(pathlib.Path(sys.argv[1]).resolve()))
