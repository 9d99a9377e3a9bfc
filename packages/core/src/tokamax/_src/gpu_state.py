"""The GPU's clock, power and temperature as `nvidia-smi` reports them, for the
bench's output: the same program's time on an H200 differed by up to 8% between
machine starts (notes/MEASUREMENTS.md, session 25), so a run records the state
it ran in (SM clock against its maximum, power against its limit, and what is
holding the clock down) at its start and its end."""

from __future__ import annotations

import shutil
import subprocess

# nvidia-smi's query fields, with the label each gets in the description.
_FIELDS = (("clocks.sm", "SM clock {} MHz"), ("clocks.max.sm", "of {} MHz"),
           ("power.draw", "power {} W"), ("power.limit", "of {} W"),
           ("temperature.gpu", "{} C"))
# The bitmask of what holds the clock down, under its newer and its older name;
# a driver that knows neither is asked for the other fields alone.
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
_REASON_LABEL = "clock limit reasons {}"


def _query(fields) -> list[str] | None:
  """The first GPU's values of `fields` (strings), None where the query fails."""
  try:
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(f for f, _ in fields)}",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  lines = done.stdout.strip().splitlines()
  if done.returncode != 0 or not lines:
    return None
  values = [v.strip() for v in lines[0].split(",")]
  return values if len(values) == len(fields) else None


def describe() -> str | None:
  """E.g. ``"SM clock 1980 MHz of 1980 MHz, power 128.65 W of 700.00 W, 41 C,
  clock limit reasons ..."`` (an H200 just after a bench run, session 25) for
  the first GPU nvidia-smi lists (JAX's first device unless CUDA_VISIBLE_DEVICES
  reorders them), None without nvidia-smi."""
  if shutil.which("nvidia-smi") is None:
    return None
  for fields in (*((*_FIELDS, (name, _REASON_LABEL)) for name in _REASON_FIELDS),
                 _FIELDS):
    values = _query(fields)
    if values is not None:
      return _text(label.format(value) for (_, label), value in zip(fields, values))
  return None


def _text(parts) -> str:
  """The parts joined by commas, an "of ..." part to the one before it."""
  out = []
  for part in parts:
    if part.startswith("of ") and out:
      out[-1] += " " + part
    else:
      out.append(part)
  return ", ".join(out)
