"""Where one kernel's warps wait: the stall samples of an Nsight Compute profile,
by SASS instruction, by execution count and by instruction range.

    ncu --clock-control none --kernel-name regex:mosaic --launch-skip 1 \
        --launch-count 1 --set full -o prof python tools/tune.py --op ragged_dot \
        --implementation mosaic_gpu --grid --shape 'K768 N2048 G128' \
        --direction forward --profile-runs 2
    ncu --import prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python tools/sass_stalls.py prof.csv [--top 25] [--region 40]

Three views of the samples (each instruction's "Warp Stall Sampling (All
Samples)"):

- the instructions with the most samples, with their two largest stall reasons;
- the samples per execution count: in a warp-specialized kernel the count says
  which loop an instruction is in (once a K step for each memory warp, once a K
  step for each compute warp, once an item...), so the sums split the time
  between the warpgroups' loops without reading the SASS;
- the samples of consecutive instruction ranges (the K loop, the epilogue and
  the item's setup are contiguous in the SASS);
- the samples of each block: a run of consecutive instructions with one
  execution count (a loop body, an item's epilogue between two branches).

`--count OPCODE` (repeatable) adds how often each opcode ran, e.g. `--count
HGMMA` to check that two builds of a kernel issue the same wgmmas.

Where the profile has the Source Counters section (`--set full`, or `--section
SourceCounters`), a last view adds the shared-memory wavefronts of each opcode
and execution count against ncu's ideal: the excess is bank conflicts (an
`HGMMA`'s operand reads count there too, 20 wavefronts a warp for a
`64x256x16`).

notes/MEASUREMENTS.md, session 42 item 3, is such a reading; session 45 item 8
reads the shared-memory view.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SHARED = "L1 Wavefronts Shared"
SHARED_IDEAL = "L1 Wavefronts Shared Ideal"


def load(path: str) -> list[dict]:
  """The instruction rows of `ncu --page source --csv --print-source sass`:
  each a dict with "source" (the SASS text), "samples", "executed", "stalls"
  (reason -> samples) and "shared" / "shared_ideal" (shared-memory
  wavefronts, 0 where the profile lacks them). The CSV's first line names the
  kernel; the second is the header."""
  with open(path, newline="") as f:
    lines = list(csv.reader(f))
  header = next((i for i, line in enumerate(lines) if SAMPLES in line), None)
  if header is None:
    raise ValueError(f"{path}: no {SAMPLES!r} column (an `ncu --page source --csv "
                     "--print-source sass` export of a profile with stall sampling, "
                     "e.g. --set full)")
  names = lines[header]
  reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
  rows = []
  for line in lines[header + 1:]:
    if len(line) < len(names):
      continue
    row = dict(zip(names, line))
    rows.append(dict(
        source=row["Source"].strip(), samples=_int(row[SAMPLES]),
        executed=_int(row.get(EXECUTED, "")),
        stalls={r[len("stall_"):]: _int(row[r]) for r in reasons},
        shared=_int(row.get(SHARED, "")),
        shared_ideal=_int(row.get(SHARED_IDEAL, ""))))
  return rows


def _int(text: str) -> int:
  try:
    return int(text.replace(",", ""))
  except ValueError:
    return 0


def top_instructions(rows: list[dict], n: int) -> list[tuple[int, dict]]:
  """The `n` instructions with the most samples, as (index, row)."""
  order = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])
  return [(i, rows[i]) for i in order[:n] if rows[i]["samples"]]


def by_execution_count(rows: list[dict]) -> list[tuple[int, int, int]]:
  """(execution count, instructions, samples) per count, most samples first."""
  samples = collections.Counter()
  count = collections.Counter()
  for row in rows:
    samples[row["executed"]] += row["samples"]
    count[row["executed"]] += 1
  return sorted(((e, count[e], s) for e, s in samples.items() if s),
                key=lambda t: -t[2])


def by_region(rows: list[dict], size: int) -> list[tuple[int, int, int]]:
  """(first index, last index, samples) of each range of `size` instructions."""
  return [(start, min(start + size, len(rows)) - 1,
           sum(r["samples"] for r in rows[start:start + size]))
          for start in range(0, len(rows), size)]


def by_block(rows: list[dict]) -> list[tuple[int, int, int, int]]:
  """(first index, last index, execution count, samples) of each run of
  consecutive instructions with the same execution count."""
  blocks = []
  for i, row in enumerate(rows):
    if blocks and blocks[-1][2] == row["executed"]:
      first, _, executed, samples = blocks[-1]
      blocks[-1] = (first, i, executed, samples + row["samples"])
    else:
      blocks.append((i, i, row["executed"], row["samples"]))
  return blocks


def executions(rows: list[dict], opcode: str) -> tuple[int, int]:
  """(instructions, total executions) of the instructions whose opcode (after
  any predicate) starts with `opcode`."""
  matching = [r for r in rows if _opcode(r["source"]).startswith(opcode)]
  return len(matching), sum(r["executed"] for r in matching)


def shared_wavefronts(rows: list[dict]) -> list[tuple[str, int, int, int, int]]:
  """(opcode, execution count, instructions, wavefronts, ideal wavefronts) of
  the instructions that touch shared memory, grouped by opcode and execution
  count (the same instruction in another copy of the code, e.g. a partial
  tile's path, is a group of its own where its count differs), most excess
  first."""
  groups = collections.defaultdict(lambda: [0, 0, 0])
  for row in rows:
    if row["shared"]:
      group = groups[_opcode(row["source"]), row["executed"]]
      group[0] += 1
      group[1] += row["shared"]
      group[2] += row["shared_ideal"]
  return sorted(((op, executed, n, wavefronts, ideal)
                 for (op, executed), (n, wavefronts, ideal) in groups.items()),
                key=lambda t: (t[4] - t[3], -t[3]))


def _opcode(source: str) -> str:
  words = source.split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0] if words else ""


def summarize(rows: list[dict], top: int = 25, region: int = 40,
              min_share: float = 0.005, count: tuple[str, ...] = ()) -> str:
  """The views as text (ranges, counts and blocks under `min_share` of the
  samples left out), then the executions of each opcode in `count`."""
  total = sum(r["samples"] for r in rows) or 1
  out = [f"{len(rows)} instructions, {total} stall samples"]
  out.append(f"\nthe {top} instructions with the most samples:")
  for i, row in top_instructions(rows, top):
    reasons = sorted(row["stalls"].items(), key=lambda kv: -kv[1])[:2]
    why = ", ".join(f"{name} {s}" for name, s in reasons if s)
    out.append(f"  {i:5d} {row['samples']:7d} {row['samples'] / total:6.1%}  "
               f"x{row['executed']:<8d} {row['source'][:56]:56s} {why}")
  out.append("\nsamples by execution count (the loop an instruction is in):")
  for executed, n, s in by_execution_count(rows):
    if s / total >= min_share:
      out.append(f"  x{executed:<9d} {n:5d} instructions {s:7d} {s / total:6.1%}")
  out.append(f"\nsamples by ranges of {region} instructions:")
  for first, last, s in by_region(rows, region):
    if s / total >= min_share:
      busiest = max(rows[first:last + 1], key=lambda r: r["samples"])
      out.append(f"  {first:5d}-{last:<5d} {s:7d} {s / total:6.1%}  "
                 f"(most: {busiest['source'][:48]})")
  out.append("\nsamples by block (consecutive instructions of one execution count):")
  for first, last, executed, s in by_block(rows):
    if s / total >= min_share:
      out.append(f"  {first:5d}-{last:<5d} x{executed:<9d} {s:7d} {s / total:6.1%}  "
                 f"{rows[first]['source'][:32]} .. {rows[last]['source'][:32]}")
  for opcode in count:
    n, executed = executions(rows, opcode)
    out.append(f"\n{opcode}: {n} instructions, executed {executed} times")
  shared = shared_wavefronts(rows)
  if shared:
    total_shared = sum(t[3] for t in shared)
    excess = sum(t[3] - t[4] for t in shared)
    out.append(f"\nshared-memory wavefronts: {total_shared}, of which {excess} "
               "over ncu's ideal (bank conflicts), by opcode and execution count:")
    for op, executed, n, wavefronts, ideal in shared:
      if wavefronts / total_shared >= min_share:
        out.append(f"  {op:24s} x{executed:<9d} {n:4d} instructions {wavefronts:10d} "
                   f"wavefronts {wavefronts / total_shared:6.1%}, ideal {ideal} "
                   f"({wavefronts / max(ideal, 1):.1f}x)")
  return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("csv", help="`ncu --page source --csv --print-source sass` output")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--region", type=int, default=40,
                      help="instructions per range in the third view")
  parser.add_argument("--count", action="append", default=[], metavar="OPCODE",
                      help="also print how often the instructions of this opcode "
                           "prefix ran (repeatable), e.g. HGMMA")
  args = parser.parse_args(argv)
  print(summarize(load(args.csv), args.top, args.region, count=tuple(args.count)))


if __name__ == "__main__":
  main()
