"""What ptxas makes of a Mosaic GPU kernel under other register splits, on a
machine without a GPU (the CUDA toolkit's `ptxas` is enough).

    # on the GPU machine, one compile of the kernel (any script that runs it):
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dump python ...
    # here:
    python tools/ptxas_registers.py dump/kernel_0.ptx --consumer 152,160 \
        --producer 40,24 [--threads 384,512] [--ptxas PATH]

Each variant rewrites the PTX's `setmaxnreg.inc` count (what the compute
warpgroups raise their registers to), its `setmaxnreg.dec` count (the memory
warpgroup's) and its `.maxntid` (the block's threads), runs `ptxas
-arch=sm_90a -v` and prints the spills, whether ptxas serialized the wgmmas
(C7512: for want of registers), and a fatal error if any. How ptxas budgets
registers (notes/MEASUREMENTS.md, session 45, item 2): one instruction's
operands must fit the count a thread starts with (65536 / threads, in steps of
8; else "C7602 Insufficient registers"), while between instructions the
compute branch gets what `setmaxnreg.inc` raised it to. The report's "Used N
registers" is the start count. A split whose warpgroups ask for more than the
SM's 64K registers would hang at `setmaxnreg`: such variants are marked.

On the H200's dumps of session 45, the ptxas of a CPU machine (CUDA 13.0)
reported the same spills as the GPU machine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import shutil
import subprocess
import tempfile

REGISTER_FILE = 65536  # 32-bit registers of an SM
WARPGROUP = 128  # threads

_INC = re.compile(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+);")
_DEC = re.compile(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+);")
_THREADS = re.compile(r"^\.maxntid (\d+), 1, 1$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Split:
  """A variant's registers: the compute warpgroups', the memory warpgroup's
  and the block's threads (None: as the PTX has it)."""

  consumer: int | None = None
  producer: int | None = None
  threads: int | None = None


@dataclasses.dataclass(frozen=True)
class Report:
  """What ptxas said of one variant."""

  registers: int | None  # "Used N registers" (the count at the kernel's start)
  spill_stores: int
  spill_loads: int
  serialized: str | None  # its code where ptxas serialized the wgmmas, e.g. C7512 (registers)
  fatal: str | None  # the first fatal line, e.g. C7602
  # C7504: the setmaxnreg counts were ignored (a relocatable compile, as JAX
  # 0.12's nvJitLink path; notes/MEASUREMENTS.md session 67): every warpgroup
  # then has the start count only.
  setmaxnreg_ignored: bool = False


def counts(ptx: str) -> Split:
  """The split the PTX has: its `setmaxnreg` counts and `.maxntid`."""
  def only(pattern, what):
    found = {int(m) for m in pattern.findall(ptx)}
    if len(found) > 1:
      raise ValueError(f"the PTX has several {what} counts: {sorted(found)}")
    return found.pop() if found else None
  return Split(only(_INC, "setmaxnreg.inc"), only(_DEC, "setmaxnreg.dec"),
               only(_THREADS, ".maxntid"))


def variant(ptx: str, split: Split) -> str:
  """`ptx` with the counts of `split` that are not None."""
  for value, pattern, template, what in (
      (split.consumer, _INC, "setmaxnreg.inc.sync.aligned.u32 {};", "setmaxnreg.inc"),
      (split.producer, _DEC, "setmaxnreg.dec.sync.aligned.u32 {};", "setmaxnreg.dec"),
      (split.threads, _THREADS, ".maxntid {}, 1, 1", ".maxntid")):
    if value is None:
      continue
    if not pattern.search(ptx):
      raise ValueError(f"the PTX has no {what} to change")
    ptx = pattern.sub(template.format(value), ptx)
  return ptx


def over_register_file(split: Split) -> bool:
  """Whether one memory warpgroup and the rest compute warpgroups at these
  counts ask for more registers than the SM has (`setmaxnreg.inc` would
  wait forever)."""
  compute = split.threads // WARPGROUP - 1
  return (compute * split.consumer + split.producer) * WARPGROUP > REGISTER_FILE


def serialization_code(text: str) -> str | None:
  """The code of ptxas' note that it serialized the wgmmas (None: it did not).
  Read by the message: each cause has its own code (C7512: too few registers;
  others: calls, accumulators touched by other instructions, ...), and the
  codes move between ptxas versions."""
  found = re.search(r"\((C\d+)\)[^\n]*wgmma\.mma_async instructions are serialized",
                    text)
  if found:
    return found.group(1)
  return "?" if "wgmma.mma_async instructions are serialized" in text else None


def parse(text: str) -> Report:
  """ptxas -v's output for one kernel."""
  used = re.search(r"Used (\d+) registers", text)
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
  fatal = next((line.strip() for line in text.splitlines()
                if "ptxas fatal" in line), None)
  return Report(registers=int(used.group(1)) if used else None,
                spill_stores=int(spills.group(1)) if spills else 0,
                spill_loads=int(spills.group(2)) if spills else 0,
                serialized=serialization_code(text), fatal=fatal,
                setmaxnreg_ignored="C7504" in text)


def run_ptxas(ptxas: str, ptx: str) -> Report:
  with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/kernel.ptx"
    with open(path, "w") as f:
      f.write(ptx)
    done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", f"{tmp}/k.cubin"],
                          capture_output=True, text=True, check=False)
  return parse(done.stdout + done.stderr)


def describe(split: Split, report: Report) -> str:
  if None in (split.threads, split.consumer, split.producer):  # no warp roles
    head = f"threads {split.threads}  (no setmaxnreg):"
  else:
    over = (" (over the register file: setmaxnreg would hang)"
            if over_register_file(split) else "")
    head = (f"threads {split.threads:4d}  compute {split.consumer:3d}  "
            f"memory {split.producer:3d}{over}:")
  if report.fatal:
    return f"{head} {report.fatal}"
  notes = ((", setmaxnreg ignored (C7504)" if report.setmaxnreg_ignored else "")
           + (f", wgmmas serialized ({report.serialized})" if report.serialized else ""))
  return (f"{head} spills {report.spill_stores} B stored / {report.spill_loads} B "
          f"loaded, {report.registers} registers at start{notes}")


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",")]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("ptx", help="a kernel's PTX (MOSAIC_GPU_DUMP_PTX=1)")
  parser.add_argument("--consumer", type=_ints, help="setmaxnreg.inc counts, e.g. 152,160")
  parser.add_argument("--producer", type=_ints, help="setmaxnreg.dec counts, e.g. 40,24")
  parser.add_argument("--threads", type=_ints, help=".maxntid values, e.g. 384,512")
  parser.add_argument("--ptxas", default=shutil.which("ptxas"),
                      help="the ptxas to run (default: the one on PATH)")
  args = parser.parse_args(argv)
  if not args.ptxas:
    parser.error("no ptxas on PATH (the CUDA toolkit's); name one with --ptxas")
  with open(args.ptx) as f:
    ptx = f.read()
  base = counts(ptx)
  if None in (base.consumer, base.producer, base.threads):
    parser.error(f"{args.ptx}: not a warp-specialized kernel ({base})")
  for consumer, producer, threads in itertools.product(
      args.consumer or [base.consumer], args.producer or [base.producer],
      args.threads or [base.threads]):
    split = Split(consumer, producer, threads)
    print(describe(split, run_ptxas(args.ptxas, variant(ptx, split))))


if __name__ == "__main__":
  main()
