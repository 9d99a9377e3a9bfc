"""Writes docs/tpu_roofline.md: roofline of the Mosaic TPU kernels from their block specs.

Nothing runs on a TPU. For each shared/BENCHMARKS.md shape and each generation,
the kernels' heuristic plans (`heuristic_plans`: the grid and BlockSpecs their
wrappers pass to pallas_call) are built from shapes, their index maps are
replayed over the whole grid with the real scalar-prefetch schedules
(`_common.hbm_bytes`: one DMA per change of block index, as the Pallas TPU
pipeline does), and the MXU work is counted per visited block.

Usage:
  python tools/tpu_roofline.py            # rewrites docs/tpu_roofline.md
  python tools/tpu_roofline.py --stdout   # prints it instead
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax_tpu_mosaic import _common
from tokamax_tpu_mosaic import attention as att
from tokamax_tpu_mosaic import gated_linear_unit as glu
from tokamax_tpu_mosaic import layer_norm as ln
from tokamax_tpu_mosaic import ragged_dot as rd

PEAKS = {  # bf16 dense FLOP/s, HBM bytes/s
    "v5p": (459e12, 2.76e12),
    "v6e": (918e12, 1.6e12),
}
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tpu_roofline.md"


@dataclasses.dataclass
class Pass:
  """One row: a pass of an op at one shape and generation."""

  flops: float  # BENCHMARKS.md convention
  executed: float  # MXU FLOPs the kernels issue (whole tiles, padding included)
  kernel_bytes: int  # from the DMA schedule
  xla_bytes: int = 0  # glue outside the kernels (minimum: each operand once)
  blocks: str = ""
  vmem: str = ""


def _plan_summary(plans, blocks):
  vmem = ", ".join(f"{p.vmem_bytes() / 2**20:.1f}" for p, _ in plans)
  return blocks, vmem


def _traffic(plans):
  return sum(sum(_common.hbm_bytes(p, pre or ()).values()) for p, pre in plans)


# ----------------------------------------------------------------------------
# Attention.
# ----------------------------------------------------------------------------


def _attention(b, t, n, k, h, causal, generation):
  args = tokamax.AttentionArgs(S((b, t, n, h), BF16), S((b, t, k, h), BF16),
                               S((b, t, k, h), BF16), is_causal=causal)
  plans = att.heuristic_plans(args, generation, with_prefetch=True)
  hp = _common.round_up(h, 128)
  per_pair = {"fwd": 2 * hp + 2 * hp, "dkdv": 4 * 2 * hp, "dq": 3 * 2 * hp}
  executed = {}
  for (plan, pre), kind in zip(plans, ("fwd", "dkdv", "dq")):
    bq = plan.inputs[0].spec.block_shape[1]
    bk = plan.inputs[1].spec.block_shape[1]
    visits = int(np.asarray(pre[4]).sum()) * (1 if att._layout(args).per_batch else b)
    # Every query head visits its blocks (dK/dV: G query heads per kv head).
    executed[kind] = visits * n * bq * bk * per_pair[kind]
  fwd_flops = 4 * b * n * t * t * h / (2 if causal else 1)
  item = 2
  pad = 0 if h % 128 == 0 else 1
  # XLA glue: zero-padding of q, k, v (read + write padded) and of out's slice.
  pad_fwd = pad * (b * t * (n + 2 * k) * (h + hp) * item + b * t * n * (hp + h) * item)
  # delta = rowsum(dO * O): reads dO, O; writes f32 [B, N, T]; pads of dO, q, k, v
  # again for the backward kernels, and the dq/dk/dv slices.
  delta = 2 * b * t * n * h * item + 4 * b * n * t
  pad_bwd = pad * (b * t * (2 * n + 2 * k) * (h + hp) * item
                   + b * t * (n + 2 * k) * (hp + h) * item)
  c, cb = att.heuristic_configs(args, generation)
  label = (f"fwd {c.block_q}x{c.block_k}, dK/dV {cb.block_q_dkv}x{cb.block_k_dkv}, "
           f"dQ {cb.block_q_dq}x{cb.block_k_dq}")
  fwd = Pass(fwd_flops, executed["fwd"], _traffic(plans[:1]), pad_fwd,
             *_plan_summary(plans[:1], label))
  both = Pass(3.5 * fwd_flops, sum(executed.values()), _traffic(plans),
              pad_fwd + delta + pad_bwd, *_plan_summary(plans, label))
  return {"fwd": fwd, "fwd+bwd": both}


# ----------------------------------------------------------------------------
# ragged_dot.
# ----------------------------------------------------------------------------


def _group_sizes(m, g, equal):
  if equal:
    return np.full(g, m // g, np.int32)
  rng = np.random.default_rng(0)
  return rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)


def _ragged(m, k, n, g, equal, generation):
  sizes = jnp.asarray(_group_sizes(m, g, equal))
  args = tokamax.RaggedDotArgs(S((m, k), BF16), S((g, k, n), BF16), sizes)
  plans = rd.heuristic_plans(args, generation, with_prefetch=True)
  executed = []
  for plan, pre in plans:
    lo, hi = np.asarray(pre[2]), np.asarray(pre[3])
    with_rows = int((lo < hi).sum())
    bm = plan.inputs[0].spec.block_shape[0]
    executed.append(with_rows * 2 * bm * k * n)
  flops = 2 * m * k * n
  c = rd._heuristic(args, generation)
  label = f"bm {c.block_m}, bk {c.block_k}, bn {c.block_n}"
  out = {"fwd": Pass(flops, executed[0], _traffic(plans[:1]), 0,
                     *_plan_summary(plans[:1], label))}
  out["fwd+bwd"] = Pass(3 * flops, sum(executed), _traffic(plans), 0,
                        *_plan_summary(plans, label))
  return out


# ----------------------------------------------------------------------------
# gated_linear_unit and layer_norm.
# ----------------------------------------------------------------------------


def _glu(m, k, n, generation):
  args = tokamax.GatedLinearUnitArgs(S((m, k), BF16), S((k, 2, n), BF16), jax.nn.silu)
  plans = glu.heuristic_plans(args, generation)
  np_ = _common.round_up(n, 128)
  fwd_flops = 4 * m * k * n
  # dx = dg @ wg^T + du @ wu^T, dw = x^T @ [dg, du] in XLA: each operand once.
  xla = 2 * (2 * m * np_ + 2 * k * np_ + m * k + m * k + 2 * k * n)
  cf, cb = (glu._heuristic(args, b, generation) for b in (False, True))
  label = (f"fwd {cf.block_m}/{cf.block_n}/{cf.block_k}, "
           f"bwd {cb.block_m}/{cb.block_n}/{cb.block_k} (bm/bn/bk)")
  fwd = Pass(fwd_flops, 4 * m * k * np_, _traffic(plans[:1]), 0,
             *_plan_summary(plans[:1], label))
  both = Pass(3 * fwd_flops, 2 * 4 * m * k * np_ + 8 * m * k * np_, _traffic(plans), xla,
              *_plan_summary(plans, label))
  return {"fwd": fwd, "fwd+bwd": both}


def _norm(r, d, subtract_mean, generation):
  args = tokamax.LayerNormArgs(S((r, d), BF16), S((d,), BF16), S((d,), BF16),
                               subtract_mean=subtract_mean)
  plans = ln.heuristic_plans(args, generation)
  nb = plans[1][0].grid[0]
  partials = (2 if subtract_mean else 1) * nb * d * 4  # read back by XLA's sum
  label = (f"fwd {plans[0][0].inputs[0].spec.block_shape[0]} rows, "
           f"bwd {plans[1][0].inputs[0].spec.block_shape[0]} rows")
  fwd = Pass(0, 0, _traffic(plans[:1]), 0, *_plan_summary(plans[:1], label))
  both = Pass(0, 0, _traffic(plans), partials, *_plan_summary(plans, label))
  return {"fwd": fwd, "fwd+bwd": both}


# ----------------------------------------------------------------------------
# Rendering.
# ----------------------------------------------------------------------------

CASES = [
    ("Attention", "B4 T=S=4096 N16 H128", lambda g: _attention(4, 4096, 16, 16, 128, False, g)),
    ("Attention", "B4 T=S=4096 N16 H128 causal",
     lambda g: _attention(4, 4096, 16, 16, 128, True, g)),
    ("Attention", "B2 T=S=8192 N16 H64", lambda g: _attention(2, 8192, 16, 16, 64, False, g)),
    ("Attention", "B2 T=S=8192 N16 H64 causal",
     lambda g: _attention(2, 8192, 16, 16, 64, True, g)),
    ("Attention", "B2 T=S=8192 Nq32 Nkv8 H128 causal (GQA)",
     lambda g: _attention(2, 8192, 32, 8, 128, True, g)),
    ("Ragged dot", "M16384 K2048 N16384 G16 equal",
     lambda g: _ragged(16384, 2048, 16384, 16, True, g)),
    ("Ragged dot", "M65536 K7168 N2048 G256 random",
     lambda g: {"fwd": _ragged(65536, 7168, 2048, 256, False, g)["fwd"]}),
    ("Gated linear unit", "x 16384x4096, w 4096x2x14336 silu",
     lambda g: _glu(16384, 4096, 14336, g)),
    ("Layer norm / RMS norm", "layer_norm 32768x8192", lambda g: _norm(32768, 8192, True, g)),
    ("Layer norm / RMS norm", "rms_norm 32768x8192", lambda g: _norm(32768, 8192, False, g)),
]

INTRO = """\
# TPU roofline (tokamax-tpu-mosaic)

Generated by `python tools/tpu_roofline.py` (do not edit by hand; edit the
script or the kernels and rerun it). No TPU was available: these are models
computed from the kernels' own block specs, not measurements.

How the numbers are made:

- **Blocks** are the heuristic configs for each generation (`heuristic_plans`
  of each kernel module; the generation comes from `DeviceInfo.device_kind` /
  the default device, v5e-safe when unknown), shrunk until the kernel's
  double-buffered VMEM estimate (`_common.vmem_bytes`: every input and output
  block twice, scratch once, large f32 temporaries) is under 3/4 of the
  generation's scoped default (v5e / v5p 16 MiB, v6e 32 MiB).
  `packages/tpu-mosaic/tests/test_plans.py` checks the same plans against the
  TPU layout rule and that budget.
- **Kernel HBM bytes** replay every BlockSpec's index map over the whole grid
  with the real scalar-prefetch schedules (block-sparse attention lists,
  ragged_dot visit schedules) and count one DMA each time a block index changes
  (`_common.hbm_bytes`): re-reads of K/V per query block, of x per N tile, of the
  rhs panel per visit, and skipped (fully masked) blocks are all as scheduled.
- **XLA glue bytes** are the work outside the kernels (padding copies for head
  dims that are not multiples of 128, `delta = rowsum(dO * O)`, GLU's dx / dw
  matmuls, the norm's per-block dscale / doffset partial sums), counted at their
  minimum (each operand once).
- **FLOPs** follow shared/BENCHMARKS.md (attention forward `4BNTSH`, halved for
  causal, fwd+bwd 3.5x; matmuls `2MKN`, GLU two of them, fwd+bwd 3x).
  **MXU FLOPs executed** count what the kernels issue: whole tiles of every
  visited block (attention: 2 matmuls per visible block pair forward, 4 in
  dK/dV and 3 in dQ, at the head dim padded to 128; ragged_dot: a whole row tile
  per visit; GLU: the backward kernel recomputes both projections).
- **Bound**: time = work / peak, compute with the executed FLOPs at the bf16
  peak, memory with kernel + glue bytes; the larger one bounds the pass.
  Peaks: v5p 459 TFLOP/s, 2.76 TB/s; v6e 918 TFLOP/s, 1.6 TB/s.
"""

NOTES = {
    "Attention": """\
Reading it: the forward re-reads K and V once per query block (`T / block_q`
times), so on v6e (2x the MXU of v5p on 0.58x its bandwidth) the v6e table uses
1024-row query blocks to halve that traffic. H=64 is padded to 128 lanes: the
MXU does 2x the useful work and the pads cost copies. GQA re-reads K/V once per
query head of the group; a group-per-program schedule would divide that by G.
""",
    "Ragged dot": """\
Reading it: each visit reads its lhs row tile and its group's whole `K x bn` rhs
panel; at G=256 (~256-row groups, `block_m` capped at 256) row tiles straddle
groups, so panels are re-read and the MXU computes whole tiles per visit (the
executed/convention ratio). A grid over groups with rows inner would keep each
panel resident.
""",
    "Gated linear unit": """\
Reading it: x is re-read once per N tile and both weight halves once per row
tile. The backward kernel recomputes both projections (33% more MXU work than
saving them, which the op's residual contract does not allow today).
""",
    "Layer norm / RMS norm": """\
Normalization is memory-bound on every generation (about 10 FLOPs per
element); one block table serves all generations.
""",
}


def _ms(x):
  return f"{x * 1e3:.2f}"


def _bound(p: Pass, generation):
  flops, bw = PEAKS[generation]
  compute = p.executed / flops
  memory = (p.kernel_bytes + p.xla_bytes) / bw
  return f"{_ms(compute)} / {_ms(memory)}, {'compute' if compute >= memory else 'memory'}"


def render() -> str:
  lines = [INTRO]
  section = None
  blocks_rows = []
  for title, shape, fn in CASES:
    results = {g: fn(g) for g in ("v5e", "v5p", "v6e")}
    if title != section:
      if section is not None:
        lines.append("\n" + NOTES[section])
      section = title
      lines += [f"\n## {title}\n",
                "| shape | pass | FLOPs (convention) | MXU FLOPs executed v5p / v6e | "
                "kernel HBM bytes v5p / v6e | XLA glue bytes | v5p: compute / memory ms, "
                "bound | v6e: compute / memory ms, bound |",
                "|---|---|---|---|---|---|---|---|"]
    for name, p5 in results["v5p"].items():
      p6 = results["v6e"][name]
      flops = f"{p5.flops / 1e12:.2f} T" if p5.flops else "~0"
      executed = (f"{p5.executed / 1e12:.2f} / {p6.executed / 1e12:.2f} T"
                  if p5.executed else "~0")
      lines.append(
          f"| {shape} | {name} | {flops} | {executed} | {p5.kernel_bytes / 1e9:.2f} / "
          f"{p6.kernel_bytes / 1e9:.2f} GB | {p5.xla_bytes / 1e9:.2f} GB | "
          f"{_bound(p5, 'v5p')} | {_bound(p6, 'v6e')} |")
    both = list(results["v5e"])[-1]
    blocks_rows.append(
        f"| {shape} | " + " | ".join(
            f"{results[g][both].blocks} ({results[g][both].vmem} MiB)"
            for g in ("v5e", "v5p", "v6e")) + " |")
  lines.append("\n" + NOTES[section])
  lines += ["\n## Block sizes per generation\n",
            "Heuristic blocks and, in parentheses, each kernel's VMEM estimate in MiB "
            "(forward kernel(s) first), at the benchmark shapes, "
            "bf16. v5e and v5p share the v5e-safe table (16 MiB scoped VMEM); v6e "
            "(32 MiB) uses larger tiles where the roofline asks for them "
            "(attention forward `block_q`, GLU `block_m`/`block_n`, ragged_dot "
            "`block_m`); normalization uses one table.\n",
            "| shape | v5e | v5p | v6e |", "|---|---|---|---|", *blocks_rows, ""]
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stdout", action="store_true", help="print instead of writing")
  text = render()
  if parser.parse_args().stdout:
    print(text)
  else:
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
  main()
