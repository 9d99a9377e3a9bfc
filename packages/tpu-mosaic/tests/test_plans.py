"""TPU layout and VMEM rules, checked on the block specs the kernels really use.

Every kernel's wrapper builds its pallas_call from a `_common.KernelPlan`; here
the heuristic plans are built (shapes only, nothing runs) for each generation at
the shared/BENCHMARKS.md shapes and at awkward ones, and checked:

- layout: the last two block dims are multiples of (8 | 16 | 32, 128) for
  (32 | 16 | 8)-bit dtypes, or equal to the array's dims;
- VMEM: the double-buffered working set (`_common.vmem_bytes`, the estimate the
  heuristics size blocks with) is under the generation's budget, 3/4 of its
  scoped default (v5e / v5p 16 MiB, v6e 32 MiB).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tokamax
from tokamax_tpu_mosaic import _common
from tokamax_tpu_mosaic import attention as att
from tokamax_tpu_mosaic import gated_linear_unit as glu
from tokamax_tpu_mosaic import layer_norm as ln
from tokamax_tpu_mosaic import ragged_dot as rd

pytestmark = pytest.mark.smoke  # cheap: CI runs these on the oldest JAX too

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def _attention(b, t, s, n, k, h, dtype=BF16, **kw):
  return att, tokamax.AttentionArgs(S((b, t, n, h), dtype), S((b, s, k, h), dtype),
                                    S((b, s, k, h), dtype), **kw)


def _ragged(m, k, n, g, dtype=BF16):
  return rd, tokamax.RaggedDotArgs(S((m, k), dtype), S((g, k, n), dtype),
                                   S((g,), jnp.int32))


def _glu(m, k, n, dtype=BF16):
  return glu, tokamax.GatedLinearUnitArgs(S((m, k), dtype), S((k, 2, n), dtype),
                                          jax.nn.silu)


def _norm(r, d, dtype=BF16):
  return ln, tokamax.LayerNormArgs(S((r, d), dtype), S((d,), dtype), S((d,), dtype))


BENCHMARK_CASES = {  # shared/BENCHMARKS.md
    "attn B4 T4096 N16 H128": _attention(4, 4096, 4096, 16, 16, 128),
    "attn B4 T4096 N16 H128 causal": _attention(4, 4096, 4096, 16, 16, 128, is_causal=True),
    "attn B2 T8192 N16 H64": _attention(2, 8192, 8192, 16, 16, 64),
    "attn B2 T8192 Nq32 Nkv8 H128 causal": _attention(2, 8192, 8192, 32, 8, 128,
                                                      is_causal=True),
    "ragged M16384 K2048 N16384 G16": _ragged(16384, 2048, 16384, 16),
    "ragged M65536 K7168 N2048 G256": _ragged(65536, 7168, 2048, 256),
    "norm 32768x8192": _norm(32768, 8192),
    "glu 16384x4096x14336": _glu(16384, 4096, 14336),
}

AWKWARD_CASES = {
    "attn f32 H256 T1 S8191": _attention(1, 1, 8191, 4, 1, 256, F32),
    "attn f32 H80 T300 S100 window": _attention(2, 300, 100, 3, 1, 80, F32,
                                                local_window=(30, 0)),
    "attn bf16 H96 T16385": _attention(1, 16385, 16385, 2, 2, 96),
    "ragged f32 M37 K20 N24 G4": _ragged(37, 20, 24, 4, F32),
    "ragged bf16 M1000 K300 N200 G3": _ragged(1000, 300, 200, 3),
    "ragged f32 M8192 K8192 N8192 G1": _ragged(8192, 8192, 8192, 1, F32),
    "glu f32 M37 K300 N200": _glu(37, 300, 200, F32),
    "glu f32 M8191 K16384 N28672": _glu(8191, 16384, 28672, F32),
    "norm f32 7x3": _norm(7, 3, F32),
    "norm f32 1000x16000": _norm(1000, 16000, F32),  # near the widest supported
    "norm bf16 37x96": _norm(37, 96),
}


@pytest.mark.parametrize("generation", _common.GENERATIONS)
@pytest.mark.parametrize("case", list(BENCHMARK_CASES) + list(AWKWARD_CASES))
def test_heuristic_plans_obey_layout_and_vmem(case, generation):
  module, args = {**BENCHMARK_CASES, **AWKWARD_CASES}[case]
  plans = [p for p, _ in module.heuristic_plans(args, generation)]
  assert len(plans) >= 2
  budget = _common.vmem_budget(generation)
  for plan in plans:
    assert plan.layout_errors() == []
    assert len(plan.semantics) == len(plan.grid)
    need = plan.vmem_bytes()
    if module is ln and case in AWKWARD_CASES:
      # Very wide rows stop at the minimum (16-row) block: they must still fit
      # the scoped default, which `check_supported` enforces.
      budget = _common.SCOPED_VMEM_BYTES[generation]
    assert need <= budget, (plan.name, need / 2**20, budget / 2**20)


def test_benchmark_blocks_per_generation():
  """The documented table (docs/tpu_roofline.md): v6e gets larger tiles."""
  _, args = BENCHMARK_CASES["attn B4 T4096 N16 H128"]
  assert att.heuristic_configs(args, "v5e") == att.heuristic_configs(args, "v5p")
  assert att.heuristic_configs(args, "v6e")[0] == att.AttentionConfig(1024, 512)
  assert att.heuristic_configs(args, None)[0] == att.AttentionConfig(512, 512)
  _, args = BENCHMARK_CASES["glu 16384x4096x14336"]
  assert glu._heuristic(args, False, "v6e").block_m == 1024
  assert glu._heuristic(args, False, None) == glu.GatedLinearUnitConfig(512, 512, 512)
  assert _common.generation_of("TPU v5 lite") == "v5e"
  assert _common.generation_of("TPU v5p") == "v5p"
  assert _common.generation_of("TPU v6e") == "v6e"
  assert _common.generation_of("NVIDIA H200") is None


def test_layout_check_can_fail():
  """A bf16 block of 8 rows (needs 16) and a 100-lane block are both reported."""
  ok = _common.Operand((64, 256), BF16, pl.BlockSpec((16, 128), lambda i: (i, 0)))
  rows = _common.Operand((64, 256), BF16, pl.BlockSpec((8, 128), lambda i: (i, 0)))
  lanes = _common.Operand((64, 256), F32, pl.BlockSpec((8, 100), lambda i: (i, 0)))
  full = _common.Operand((7, 100), F32, pl.BlockSpec((7, 100), lambda i: (0, 0)))
  plan = _common.KernelPlan("t", (4,), (ok, rows, lanes, full), (), ("parallel",))
  errors = plan.layout_errors()
  assert len(errors) == 2 and "multiple of 16" in errors[0] and "128" in errors[1]


def test_vmem_estimate_by_hand():
  # (10, 100) f32 pads to (16, 128); (3, 5) bf16 to (16, 128); doubled, plus scratch.
  got = _common.vmem_bytes([((10, 100), F32), ((None, 3, 5), BF16)],
                           scratch=[((8, 256), F32)], temp_bytes=7)
  assert got == 2 * (16 * 128 * 4 + 16 * 128 * 2) + 8 * 256 * 4 + 7


def test_hbm_bytes_replays_index_maps():
  """GLU: x is re-read once per N tile, each weight half once per row tile."""
  m, k, n = 64, 256, 384
  args = tokamax.GatedLinearUnitArgs(S((m, k), F32), S((k, 2, n), F32), None)
  plan = glu._plan(args, glu.GatedLinearUnitConfig(16, 128, 128), backward=False)
  assert plan.grid == (4, 3, 2)
  traffic = _common.hbm_bytes(plan)
  assert traffic["read"] == 4 * (3 * m * k + 4 * 2 * k * n)
  assert traffic["write"] == 4 * m * n


def test_hbm_bytes_skips_masked_attention_blocks():
  """Causal 4x4 blocks: the forward visits 1+2+3+4 K blocks, not 16.

  The walk is 0 | 0 1 | 0 1 2 | 0 1 2 3 (idle steps repeat the last index): 10
  visits, 9 DMAs, since q block 1 starts on the block q block 0 ended on.
  """
  q = jax.random.normal(jax.random.key(0), (1, 512, 1, 128), F32)
  args = tokamax.AttentionArgs(q, q, q, is_causal=True)
  plan, prefetch = att.kernel_plan(args, "fwd", 128, 128)
  fetches = _common.block_fetches(plan.inputs[1], plan.grid, prefetch)
  np.testing.assert_array_equal(fetches, np.full(9, 128 * 128 * 4))
