"""Compiles tokamax's calls for a Hopper GPU on a machine without one, so that
Mosaic GPU's PTX and ptxas' report (registers, spills, wgmma serialization) of
every kernel can be read without device time.

    python tools/sm90_compile.py --op ragged_dot --implementation mosaic_gpu \
        --shape 'fp8 1x128/128x128 K-major' --direction forward \
        [--ab block_n=128 --ab num_stages=3] \
        [--grid | --call SIZES | --random COUNT --seed S] \
        [--fail-on-serialized] --out DIR

The problems are tools/tune.py's (`--shape` a regular expression over the
benchmark suite's names, `--ab FIELD=VALUE` replacing fields of the heuristic
configs). Each problem is lowered and compiled by XLA for a deviceless CUDA
target (tools/sm90_target.txtpb, an H100 SXM's limits; Mosaic GPU compiles
for sm_90a on any of them) with dispatch told it runs on an H200, so it picks
what it picks there (that device kind's tuned data, else the heuristics).
Mosaic GPU then writes ``DIR/<problem>/<direction>/kernel_N.{ptx,ptxas}``;
this tool prints each kernel's ptxas summary. XLA finds ptxas as on a GPU
machine; the PTX needs one of CUDA 13 (/usr/local/cuda on the project's CPU
machines): session 46 compiled a kernel here and on the H200 and read the
same 368 bytes of spills (notes/MEASUREMENTS.md).

Needs the CUDA plugin of the installed JAX, with its CUDA libraries
(``pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax;
print(jax.__version__)')"``, about 3 GB), and that ptxas; no GPU or driver. For the SASS of a
kernel: ``ptxas -arch=sm_90a -o k.cubin kernel_N.ptx && nvdisasm -c k.cubin``
(CUDA 13 tools; the ``nvidia-cuda-nvdisasm`` wheel has nvdisasm), where
``(*"SpillRefill"*)`` marks spill code; ``--sass`` does that for every kernel
(``kernel_N.sass``) and adds static counts to its line: its wgmma
instructions, how many of them start a fresh accumulator without reading it
(``RZ, !UPT``: ptxas folded its zeros) and the register-pair zeroings (CS2R)
that a fresh accumulator costs where ptxas could not (notes/MOSAIC_GPU.md,
session 47). ``--fail-on-serialized`` exits 1 where any kernel's wgmmas are
serialized, ptxas fails or a problem fails to compile (a call that compiles
no Mosaic GPU kernel is not an error: the GLU's ``mosaic_gpu`` at M1073 runs
none): at the grid's shapes (``--grid
--implementation mosaic_gpu``, about 25 minutes on a 2-core machine) none is
since session 75; the grid has no batch of one row, where kernels compile
otherwise: ``--call 1,4096,16,16,128,causal`` (tools/tune.py's form) takes
such calls. Off the grid some serialize (the one-kernel attention backward
at a third of the B2-B16 calls tried, notes/MEASUREMENTS.md session 80);
``--random COUNT --seed S`` draws calls as tools/none_check.py does, and
without ``--implementation`` compiles what `None` runs there. (Each kernel
also logs "nvdisasm invocation failed" to stderr: Mosaic GPU looks for
nvdisasm under the CUDA root; harmless.)
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  # Before JAX starts: CPU as the default backend, and no CUDA driver check
  # (the plugin's version check calls cuInit, which fails without a driver).
  # Only when run: a test importing this module keeps its environment.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import none_check  # noqa: E402  (tools/none_check.py: its random draws)
import ptxas_registers  # noqa: E402
import tune  # noqa: E402  (tools/tune.py: problems and config replacement)

from tokamax._src import bench_suite  # noqa: E402
from tokamax._src import op as op_module  # noqa: E402
from tokamax._src.tuning import context as tuning_context  # noqa: E402

TARGET = pathlib.Path(__file__).with_name("sm90_target.txtpb")
# What dispatch is told it runs on: the device the kernels are tuned for.
DEVICE = op_module.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")


def cuda_sharding() -> NamedSharding:
  """A sharding on one device of a deviceless CUDA topology."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name="1x1x1", topology="1x1x1",
        target_config=TARGET.read_text())
  except Exception as e:
    raise SystemExit(
        f"no deviceless CUDA target ({type(e).__name__}: {e}); install the CUDA "
        "plugin of this JAX with its libraries: pip install "
        f"'jax-cuda12-plugin[with-cuda]=={jax.__version__}'") from e
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def on_hopper():
  """Dispatch decides as on an H200 (traced arrays name no device)."""
  original = op_module.DeviceInfo.__dict__["of"]
  op_module.DeviceInfo.of = classmethod(lambda cls, arrays=(): DEVICE)
  try:
    yield
  finally:
    op_module.DeviceInfo.of = original


@contextlib.contextmanager
def dumping_to(folder: pathlib.Path):
  """Mosaic GPU's PTX and ptxas report of each kernel compiled inside, in
  `folder` (read when a kernel is compiled)."""
  folder.mkdir(parents=True, exist_ok=True)
  with tune.environment({"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
                         "MOSAIC_GPU_DUMP_TO": str(folder)}):
    yield


def abstract_step(problem, implementation: str, direction: str, sharding):
  """`problem`'s call (forward, or forward and float inputs' cotangents for a
  cotangent of the output's shape), and abstract arguments on `sharding`."""
  def spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  inputs = jax.tree.map(spec, jax.eval_shape(problem.make_inputs))
  call = lambda a: problem.call(a, implementation)
  if direction == "forward":
    return call, (inputs,)

  step = lambda inputs, dy: bench_suite.float_vjp(call, inputs, dy)
  return step, (inputs, jax.tree.map(spec, jax.eval_shape(call, inputs)))


def kernel_summary(ptx: str, report: str) -> str:
  """A kernel's register split (from its PTX) and ptxas' report, on one line."""
  return ptxas_registers.describe(ptxas_registers.counts(ptx),
                                  ptxas_registers.parse(report))


def sass_counts(sass: str) -> dict[str, int]:
  """Static counts in a kernel's SASS (nvdisasm's text): wgmma instructions
  (``HGMMA``, ``QGMMA``, ...), those of them that do not read their
  accumulator (``RZ, !UPT``) and the CS2R register-pair zeroings."""
  mma = re.findall(r"\b[A-Z]GMMA\.[^;]*;", sass)
  return {"wgmma": len(mma), "fresh": sum("RZ, !UPT" in m for m in mma),
          "zeroings": len(re.findall(r"\bCS2R R\d+, SRZ", sass))}


def disassemble(ptx: pathlib.Path, ptxas: str, nvdisasm: str) -> str:
  """The SASS of a kernel's PTX (assembled for sm_90a), also written beside it."""
  cubin = ptx.with_suffix(".cubin")
  subprocess.run([ptxas, "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True,
                 capture_output=True)
  sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                        text=True).stdout
  cubin.unlink()
  ptx.with_suffix(".sass").write_text(sass)
  return sass


def folder_name(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def kernel_order(path: pathlib.Path):
  """``kernel_2`` before ``kernel_10`` (Mosaic GPU numbers a process's kernels)."""
  number = re.search(r"(\d+)$", path.stem)
  return (path.stem[:number.start()] if number else path.stem,
          int(number.group(1)) if number else -1)


NO_KERNEL = "  (no Mosaic GPU kernel)"
# Pallas' Triton lowering asks the device for its compute capability, which a
# deviceless target has none of: dispatch's Triton kernels are not compiled here.
TRITON_KERNEL = ("  (Pallas Triton kernels among the call's: their lowering needs a GPU; "
                 "not compiled here)")
_TRITON_WITHOUT_GPU = "No supported GPU devices found"


def compile_problem(problem, implementation: str, direction: str, fields: dict,
                    sharding, out: pathlib.Path, tools=None) -> list[str]:
  """Compiles one problem's direction with dumps into its folder of `out`;
  returns a summary line per kernel (with `tools`, ``(ptxas, nvdisasm)``: and
  its SASS counts)."""
  folder = out / folder_name(f"{problem.op} {problem.name}") / folder_name(direction)
  shutil.rmtree(folder, ignore_errors=True)  # no kernels of an earlier run
  # With --ab, the heuristic configs with the fields replaced; else what
  # dispatch picks (tuned data, then heuristics).
  source = tune._Replaced(tune._field_values(fields)) if fields else None  # pylint: disable=protected-access
  with contextlib.ExitStack() as stack:
    stack.enter_context(on_hopper())
    stack.enter_context(dumping_to(folder))
    if source is not None:
      stack.enter_context(tuning_context.use(source))
    fn, args = abstract_step(problem, implementation, direction, sharding)
    jax.jit(fn).lower(*args).compile()
  if source is not None and not source.applied:
    raise SystemExit(f"--ab {fields}: no Op's config has these fields")
  lines = []
  for report in sorted(folder.glob("*.ptxas"), key=kernel_order):
    ptx = report.with_suffix(".ptx").read_text()
    line = f"  {report.stem}: {kernel_summary(ptx, report.read_text())}"
    if tools:
      counts = sass_counts(disassemble(report.with_suffix(".ptx"), *tools))
      line += (f"; {counts['wgmma']} wgmma, {counts['fresh']} fresh (RZ), "
               f"{counts['zeroings']} CS2R")
    lines.append(line)
  for log in folder.glob("*.mlir-passes.log"):
    log.unlink()  # tens of MB each; the PTX and report are what is read
  return lines or [NO_KERNEL]


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--op", action="append", default=[], required=True)
  parser.add_argument("--implementation", default=None,
                      help="a registered implementation (default: dispatch's choice)")
  parser.add_argument("--shape", help="a regular expression over problem names")
  parser.add_argument("--grid", action="store_true", help="the tuning grid's shapes")
  parser.add_argument("--call", action="append", default=[], metavar="SIZES",
                      help="a call off the suites instead (repeatable), as tools/tune.py "
                           "takes it, e.g. 1,4096,16,16,128,causal (one batch row: "
                           "the grid has none, and there kernels compiled otherwise)")
  parser.add_argument("--random", type=none_check.positive_int, metavar="COUNT",
                      help="instead of the suites, COUNT calls of the one --op drawn "
                           "with --seed as tools/none_check.py --random draws them "
                           "(sizes an outside checker might pick; with "
                           "--implementation left out, the kernels `None` runs there)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--direction", choices=("forward", "forward+backward"),
                      action="append")
  parser.add_argument("--ab", action="append", default=[], type=tune._field_value,  # pylint: disable=protected-access
                      metavar="FIELD=VALUE", help="replace a field of the heuristic configs")
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--sass", action="store_true",
                      help="disassemble each kernel (kernel_N.sass) and count its "
                           "wgmmas, fresh accumulators and zeroings")
  parser.add_argument("--fail-on-serialized", action="store_true",
                      help="exit 1 when any kernel's wgmmas are serialized (any of "
                           "ptxas' causes), ptxas fails or a problem fails to compile: "
                           "the check after a kernel change")
  parser.add_argument("--ptxas", default=shutil.which("ptxas"),
                      help="with --sass: a CUDA 13 ptxas (default: on PATH)")
  parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"),
                      help="with --sass: nvdisasm (default: on PATH; the "
                           "nvidia-cuda-nvdisasm wheel has one)")
  return parser


def main():
  parser = make_parser()
  args = parser.parse_args()
  tools = None
  if args.sass:
    if not args.ptxas or not args.nvdisasm:
      parser.error(f"--sass needs ptxas and nvdisasm; got --ptxas {args.ptxas}, "
                   f"--nvdisasm {args.nvdisasm}")
    tools = (args.ptxas, args.nvdisasm)
  problems = chosen_problems(parser, args)
  sharding = cuda_sharding()
  bad = []
  for problem in problems:
    for direction in args.direction or ("forward", "forward+backward"):
      name = f"{problem.op} {problem.name} {direction}"
      print(f"## {name}", flush=True)
      try:
        lines = compile_problem(problem, args.implementation, direction,
                                dict(args.ab), sharding, args.out, tools)
      except Exception as e:  # one that fails is reported, the others go on
        lines = [failure_line(e)]
      print("\n".join(lines), flush=True)
      bad += [f"{name}:{line}" for line in lines if is_bad(line)]
  if args.fail_on_serialized and bad:
    raise SystemExit("serialized wgmmas or failed compiles:\n" + "\n".join(bad))


def chosen_problems(parser, args) -> list:
  """The problems of `args`: `--call`'s, `--random`'s draws, else the suite's
  (`--grid`'s or the reference shapes) selected by `--shape`."""
  if args.call and args.random:
    parser.error("--call and --random: give one of them")
  if args.call:
    return tune.call_problems(parser, args.op, args.call, args.shape or args.grid)
  if args.random:
    if len(args.op) != 1 or args.op[0] not in none_check.OPS:
      parser.error(f"--random takes one --op of {sorted(none_check.OPS)}; "
                   f"got {args.op}")
    if args.shape or args.grid:
      parser.error("--random draws its calls: no --shape or --grid beside it")
    return none_check.random_problems(args.op[0], args.random, args.seed)
  suite = bench_suite.grid_suite() if args.grid else bench_suite.reference_suite()
  return tune.select_problems(parser, suite, args.op, args.shape)


def failure_line(e: Exception) -> str:
  """The report of a problem whose compile raised `e`: a failure, or where
  dispatch picked a Pallas Triton kernel, that (not a failure)."""
  if isinstance(e, RuntimeError) and str(e).startswith(_TRITON_WITHOUT_GPU):
    return TRITON_KERNEL
  return f"  failed: {type(e).__name__}: {str(e)[:300]}"


def is_bad(summary_line: str) -> bool:
  """Whether a `compile_problem` line reports serialized wgmmas (in the fused
  attention backward that cost 1.40x, notes/MEASUREMENTS.md session 75), a
  ptxas fatal error or a failed compile."""
  return ("wgmmas serialized" in summary_line or "ptxas fatal" in summary_line
          or summary_line.lstrip().startswith("failed:"))


if __name__ == "__main__":
  main()
