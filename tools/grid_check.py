"""How well the nearest-grid-point rule picks implementations: measured, on the CPU.

    python tools/grid_check.py [--device nvidia_h200] [--baseline PATH]
    python tools/grid_check.py --device nvidia_h200 --pick OP 'ARGS KEY' [--pick ...]

Reads the tuned data shipped for the device (every backend package's
``tuned/<device>/*.json``, merged as dispatch merges them) and reports, per op and
direction (forward; backward, which dispatch chooses on its own where the op has
no residuals, as ragged_dot; "step" = forward + own backward, what a training step
pays where a forward's residuals tie it to its backward):

- leave-one-out: each grid call's implementation as predicted from the *other*
  grid calls (`tuning.nearest`, of its kind (`nearest.TILE_ALIGNED` too),
  within the op's radius, a direction's own size first where
  `nearest.SAME_SIZE_FIRST` names one; beyond the radius the registry's first
  measured implementation, as dispatch falls back), against
  the fastest measured at that call. The nearest other point is at least one
  grid step away, farther than a call between grid points is from its nearest:
  a pessimistic test of the rule.
- other kinds alone: for ops whose kinds may answer for each other
  (`nearest.KIND_FALLBACK`: attention's head sharing), each grid call
  predicted from the calls of the other kinds only, as where its own kind has
  no point within the radius, against the registry's order there;
- with ``--baseline``: each bench row's shape (off the grid) as the rule would
  choose from the grid alone, against the fastest tokamax implementation that
  baseline measured there (its "tokamax <impl>" rows; same device kind);
- with ``--pick OP KEY`` (instead of the reports): what the rule takes for one
  call off or on the grid, per direction, from all the grid's calls, and which
  grid calls it answered from. KEY is the call's args key as tuned data
  writes it (e.g. ``'x=bfloat16[8192,4608] scale=bfloat16[4608]
  epsilon=1e-06 subtract_mean=False'``). Only the tuned-data step of dispatch:
  an implementation that refuses or declines the call is passed over there.

"Regret" is the chosen implementation's time over the fastest one's, minus 1;
rows above 3% are listed. Nothing runs on an accelerator.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os

import jax

import tokamax
from tokamax._src import bench_suite
from tokamax._src import dispatch
from tokamax._src.tuning import nearest
from tokamax._src.tuning import shipped as shipped_data
from tokamax._src.tuning.results import AutotuningResult, args_key, failed_outright

_DIRECTIONS = ("forward", "backward", "step")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tuned_files(device: str) -> list[str]:
  """The shipped tuned-data files of `device` (a device slug, or "*" for all)."""
  return sorted(glob.glob(os.path.join(_REPO, "packages", "*", "src", "*", "tuned",
                                       device, "*.json")))


def _shipped(device: str) -> AutotuningResult:
  merged = AutotuningResult()
  for path in _tuned_files(device):
    with open(path) as f:
      merged = merged.merge(AutotuningResult.loads(f.read()))
  return merged


def _times(result: AutotuningResult) -> dict:
  """{(op, key): {"forward" | "backward" | "step": {impl: ms}}}"""
  by = collections.defaultdict(lambda: collections.defaultdict(dict))
  for m in result.measurements:
    by[(m.op, m.key)][m.direction][m.implementation] = m.time_ms
  for f in result.failures:  # as dispatch sees them: tried last
    if (f.get("op"), f.get("key")) in by and failed_outright(f):
      by[(f["op"], f["key"])][f["direction"]].setdefault(f["implementation"], float("inf"))
  for times in by.values():
    fwd, bwd = times.get("forward", {}), times.get("backward", {})
    times["step"] = {i: fwd[i] + bwd[i] for i in fwd if i in bwd}
  return by


def _regret(times: dict, chosen: str) -> float | None:
  if chosen not in times:
    return None
  return times[chosen] / min(times.values()) - 1


def _pick(times: dict) -> str:
  return min(times, key=times.get)


def _registry_first(op: str, times: dict) -> str | None:
  """What dispatch runs where no tuned data reaches: the first registered of `times`."""
  order = [s.name for s in tokamax.implementations() if s.op == op]
  return next((name for name in order if name in times), None)


def _grid_times(op: str, key: str, others: list[str], by: dict, direction: str):
  """(the times dispatch sees for `key` in `direction`, the grid points they come
  from), as `AutotuningResult.measured_times` and `.step_times` find them
  ("step": points measured both ways, with no size first; equally near points
  blended, `nearest.blend`); (None, None) where no grid point is within the
  radius."""
  measured = [k for k in others if by[(op, k)][direction]]
  same_first = () if direction == "step" else nearest.same_size_first(op, direction)
  directions = ("forward", "backward") if direction == "step" else (direction,)
  near = nearest.op_nearest_keys(op, key, measured, same_first, directions)
  if not near:
    return None, None
  # Several points: named by their first field (the query's shape) to stay short.
  source = near[0] if len(near) == 1 else " + ".join(k.split(" ")[0] for k in near)
  return nearest.blend([by[(op, k)][direction] for k in near]), source


def _choice(op: str, key: str, others: list[str], by: dict, direction: str,
            times: dict):
  """(chosen implementation, where the choice came from)."""
  grid, near = _grid_times(op, key, others, by, direction)
  if grid is None:
    return _registry_first(op, times), "registry order: no grid point of its kind within the radius"
  return (_pick(grid) if grid else None), near


def pick(by: dict, op: str, key: str) -> list[tuple]:
  """Rows of (direction, chosen, source) for one call of `op`: as `_choice`
  answers from every grid call of the op (the call itself included, if it is
  one), and the registry's first where no grid call is within the radius."""
  grid = [k for (o, k) in by if o == op]
  registered = {s.name: 0.0 for s in tokamax.implementations() if s.op == op}
  return [(direction, *_choice(op, key, grid, by, direction, registered))
          for direction in _DIRECTIONS]


def leave_one_out(by: dict) -> list[tuple]:
  rows = []
  for (op, key), times in sorted(by.items()):
    others = [k for (o, k) in by if o == op and k != key]
    for direction in _DIRECTIONS:
      if not times[direction]:
        continue
      chosen, source = _choice(op, key, others, by, direction, times[direction])
      rows.append((op, key, direction, chosen, _regret(times[direction], chosen), source))
  return rows


def other_kind_only(by: dict) -> list[tuple]:
  """Each grid call of an op with `nearest.KIND_FALLBACK` predicted from the
  calls of other kinds alone (what answers for a call whose own kind has no
  point within the radius), beside what the registry's order would run: rows
  of (op, key, direction, chosen, regret, source, registry's regret); chosen,
  regret and source None where no call of another kind is within the radius.
  A regret is None too where the implementation chosen was not measured there."""
  rows = []
  for (op, key), times in sorted(by.items()):
    if op not in nearest.KIND_FALLBACK:
      continue
    for direction in _DIRECTIONS:
      if not times[direction]:
        continue
      directions = ("forward", "backward") if direction == "step" else (direction,)
      own = nearest.op_kind(op, key, directions)
      others = [k for (o, k) in by if o == op and nearest.op_kind(op, k, directions) != own]
      grid, source = _grid_times(op, key, others, by, direction)
      chosen = _pick(grid) if grid else None
      regret = None if chosen is None else _regret(times[direction], chosen)
      registry = _registry_first(op, times[direction])
      rows.append((op, key, direction, chosen, regret, source,
                   None if registry is None else _regret(times[direction], registry)))
  return rows


def _report_other_kind(rows: list[tuple]) -> None:
  print("## other kinds alone (each grid call predicted from calls of other kinds "
        "only, as `nearest.KIND_FALLBACK` answers; against the registry's order)")
  for op in sorted({r[0] for r in rows}):
    for direction in _DIRECTIONS:
      mine = [r for r in rows if r[0] == op and r[2] == direction]
      scored = [r for r in mine if r[4] is not None and r[6] is not None]
      if not scored:
        continue
      ours, registry = [r[4] for r in scored], [r[6] for r in scored]
      print(f"{op} {direction}: {len(scored)} of {len(mine)} calls have a call of "
            f"another kind within the radius; from those: "
            f"{sum(x <= 0.03 for x in ours)} within 3% (worst {max(ours):.1%}); "
            f"registry order: {sum(x <= 0.03 for x in registry)} "
            f"(worst {max(registry):.1%})")


def _problem_keys() -> dict:
  """{bench problem name: (op, args key)} for the reference suite's problems."""
  keys = {}
  for p in bench_suite.reference_suite():
    seen = []

    def observer(op_name, args, implementation, seen=seen):
      seen.append((op_name, args_key(args)))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    jax.eval_shape(p.make_inputs))
    with dispatch.observe(observer):
      try:
        jax.eval_shape(lambda a, p=p: p.call(a, None), shapes)
      except Exception:  # a call this platform refuses: the observer saw it first
        pass
    if seen:
      keys[p.name] = seen[0]
  return keys


def against_baseline(by: dict, baseline_path: str) -> list[tuple]:
  with open(baseline_path) as f:
    baseline = json.load(f)["rows"]
  measured = collections.defaultdict(dict)
  for r in baseline:
    if "ms" in r and r["implementation"].startswith("tokamax ") and \
        r["implementation"] != "tokamax auto":
      direction = "forward" if r["direction"] == "forward" else "step"
      measured[(r["shape"], direction)][r["implementation"][len("tokamax "):]] = r["ms"]
  rows = []
  for name, (op, key) in sorted(_problem_keys().items()):
    grid = [k for (o, k) in by if o == op]
    for direction in ("forward", "step"):
      times = measured.get((name, direction))
      if not times:
        continue
      chosen, source = _choice(op, key, grid, by, direction, times)
      rows.append((op, name, direction, chosen, _regret(times, chosen), source))
  return rows


def _report(title: str, rows: list[tuple]) -> None:
  print(f"## {title}")
  for op in sorted({r[0] for r in rows}):
    for direction in _DIRECTIONS:
      mine = [r for r in rows if r[0] == op and r[2] == direction]
      scored = [r for r in mine if r[4] is not None]
      if not mine:
        continue
      worst = max((r[4] for r in scored), default=0.0)
      within = sum(r[4] <= 0.03 for r in scored)
      print(f"{op} {direction}: {within}/{len(scored)} within 3% "
            f"(worst {worst:.1%}); {len(mine) - len(scored)} without a prediction")
      for r in mine:
        if r[4] is None or r[4] > 0.03:
          regret = "n/a" if r[4] is None else f"{r[4]:.1%}"
          print(f"  {r[1]}: chose {r[3]}, regret {regret} (from {r[5]})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="nvidia_h200")
  parser.add_argument("--baseline", help="a bench --json file of the same device kind")
  parser.add_argument("--pick", nargs=2, action="append", metavar=("OP", "KEY"),
                      help="only print what the rule takes for this call (repeatable)")
  args = parser.parse_args()
  shipped = _shipped(args.device)
  if not shipped.measurements:
    folders = sorted({os.path.basename(os.path.dirname(p)) for p in _tuned_files("*")})
    parser.error(f"--device {args.device}: no shipped tuned data; the tuned folders "
                 f"are {', '.join(folders)}")
  if args.baseline:
    try:
      doc, _ = bench_suite.load_rows(args.baseline)
    except bench_suite.BadRowsFile as e:
      parser.error(f"--baseline: {e}")
    kind = doc.get("device_kind")
    if kind and shipped_data.device_slug(kind) != args.device:
      parser.error(f"--baseline {args.baseline} is from {kind}; --device is "
                   f"{args.device}")
  by = _times(shipped)
  if args.pick:
    ops = {o for o, _ in by}
    for op, key in args.pick:
      if op not in ops:
        parser.error(f"--pick {op}: no tuned data of that op for {args.device}; "
                     f"it has {', '.join(sorted(ops))}")
      # Its first field is the grid calls' first operand: name, dtype, rank.
      known = {nearest.parse(k)[0][0] for (o, k) in by if o == op}
      kind = nearest.parse(key)[0]
      if not kind or kind[0] not in known:
        example = next(k for (o, k) in by if o == op)
        parser.error(f"--pick {op} {key!r}: not an args key of {op} (one of its "
                     f"grid calls: {example!r})")
      print(f"{op} {key}")
      for direction, chosen, source in pick(by, op, key):
        print(f"  {direction}: {chosen} (from {source})")
    return
  _report("leave one out (grid calls predicted from the other grid calls)",
          leave_one_out(by))
  _report_other_kind(other_kind_only(by))
  if args.baseline:
    _report(f"bench shapes against {args.baseline}", against_baseline(by, args.baseline))


if __name__ == "__main__":
  main()
