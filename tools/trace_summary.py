"""Where the GPU time of a traced function goes, per device.

    from tools.trace_summary import traced_summary
    print(traced_summary(f, *args, calls=3))

Runs `f` under `jax.profiler.trace` (with a Perfetto trace), then reads the GPU
kernel events back: per device, the time per call spent in communication kernels
("comm": NCCL), in custom kernels ("custom": Pallas kernels, cuBLAS, cuDNN; in
the MoE problems of tools/multi_gpu_scaling.py these are the experts' matmuls),
in XLA's own fusions ("xla"), the span from the first to the last kernel, and how
much of the communication ran while another kernel was running (overlap). A
weak-scaling loss can then be pinned on exposed transfers or on extra work.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile

import jax

# Kernel names of Pallas calls (Mosaic GPU: "..._mosaic_gpu_kernel"; Triton: the
# pallas_call's name, ours start with "tokamax_" or the op's name) and of GEMM /
# attention libraries.
_CUSTOM_WORDS = ("mosaic_gpu", "tokamax", "ragged_dot", "gemm", "cutlass", "sm90",
                 "xmma", "cublas", "cudnn")


def _category(name: str) -> str:
  low = name.lower()
  if "nccl" in low:
    return "comm"
  if any(w in low for w in _CUSTOM_WORDS):
    return "custom"
  return "xla"


def _union(intervals):
  merged = []
  for s, e in sorted(intervals):
    if merged and s <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], e)
    else:
      merged.append([s, e])
  return merged


def _intersection_length(a, b) -> float:
  total, i, j = 0.0, 0, 0
  while i < len(a) and j < len(b):
    lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    total += max(0.0, hi - lo)
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def summarize(trace: dict, calls: int) -> str:
  """Per-device summary of a Chrome/Perfetto trace's GPU kernel events."""
  names = {}
  for ev in trace.get("traceEvents", []):
    if ev.get("ph") == "M" and ev.get("name") == "process_name":
      names[ev["pid"]] = ev.get("args", {}).get("name", str(ev["pid"]))
  per_device = {}
  for ev in trace.get("traceEvents", []):
    if ev.get("ph") != "X" or "dur" not in ev:
      continue
    pname = names.get(ev.get("pid"), "")
    if "GPU" not in pname and "gpu" not in pname:
      continue
    per_device.setdefault(pname, []).append(
        (_category(ev.get("name", "")), float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]),
         ev.get("name", "")))
  lines = []
  for pname, events in sorted(per_device.items()):
    by_cat = {}
    for cat, s, e, _ in events:
      by_cat.setdefault(cat, []).append((s, e))
    span = max(e for _, _, e, _ in events) - min(s for _, s, _, _ in events)
    busy = {c: sum(e - s for s, e in iv) / calls / 1e3 for c, iv in by_cat.items()}
    comm = _union(by_cat.get("comm", []))
    compute = _union(by_cat.get("custom", []) + by_cat.get("xla", []))
    hidden = _intersection_length(comm, compute) / calls / 1e3
    comm_ms = sum(e - s for s, e in comm) / calls / 1e3
    top = {}
    for _, s, e, name in events:
      top[name] = top.get(name, 0.0) + (e - s) / calls / 1e3
    heavy = ", ".join(f"{n[:40]} {ms:.3f}" for n, ms in
                      sorted(top.items(), key=lambda kv: -kv[1])[:6])
    lines.append(
        f"  {pname[:40]}: span/call {span / calls / 1e3:.3f} ms; kernels per call: "
        + ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(busy.items()))
        + f"; comm {comm_ms:.3f} of which {hidden:.3f} under compute\n    top: {heavy}")
  return "\n".join(lines) or "  (no GPU kernel events in the trace)"


def traced_summary(f, *args, calls: int = 3) -> str:
  jax.block_until_ready(f(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        out = f(*args)
      jax.block_until_ready(out)
    files = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    if not files:
      return f"  (no Perfetto trace written under {tmp})"
    with gzip.open(max(files, key=os.path.getmtime), "rt") as fh:
      return summarize(json.load(fh), calls)
