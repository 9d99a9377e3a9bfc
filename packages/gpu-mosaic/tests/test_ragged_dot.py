"""Tests of the Mosaic GPU ragged_dot kernel.

The numerical tests here run natively on a Hopper GPU and are skipped elsewhere (on
a CPU with JAX >= 0.12 the kernel also runs in the Mosaic GPU interpreter:
test_interpret.py); on the CPU the registration, the refusals and the lowering to
Mosaic GPU IR (a full trace of the kernel for the "cuda" platform, which needs no
GPU) are checked.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.tuning import context as tuning_context
from tokamax_gpu_mosaic import ragged_dot as rd
from tokamax_gpu_mosaic import ragged_dot_kernel as rdk
from tokamax_gpu_mosaic import ragged_dot_kernel_drhs as rdd

HIGHEST = jax.lax.Precision.HIGHEST
_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))


def gpu(test):
  """A native test: skipped off a Hopper GPU, and marked `gpu` so that the
  native run of README.md (`pytest -m gpu`) selects it."""
  hopper_only = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
  return pytest.mark.gpu(hopper_only(test))


_seed = iter(range(1_000_000))


def _rng():
  return np.random.default_rng(next(_seed))


def _inputs(m, k, n, num_held, dtype):
  rng = _rng()
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((num_held, k, n)) / np.sqrt(k), dtype)
  return lhs, rhs


def _reference(lhs, rhs, group_sizes, group_offset, preferred_element_type=None):
  return tokamax.ragged_dot(
      lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
      group_offset=group_offset, precision=HIGHEST, implementation="xla",
      preferred_element_type=preferred_element_type and jnp.float32)


class _BackwardConfig:
  """A config source giving the Mosaic GPU backward `config` (None: heuristic)."""

  def __init__(self, config):
    self.config = config

  def lookup(self, op, args):
    del args
    return self.config if isinstance(op, rd.MosaicGpuRaggedDotVjp) else None


def _check(m, k, n, sizes, *, num_held=None, group_offset=None, dtype=jnp.bfloat16,
           preferred_element_type=None, config=None, grads=True, bwd_config=None):
  num_held = num_held or len(sizes)
  lhs, rhs = _inputs(m, k, n, num_held, dtype)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  impl = rd.MosaicGpuRaggedDot(config) if config else "mosaic_gpu"
  with tokamax.record_dispatch() as records:
    out = jax.jit(lambda l, r, g: tokamax.ragged_dot(
        l, r, g, group_offset=group_offset, implementation=impl,
        preferred_element_type=preferred_element_type))(lhs, rhs, group_sizes)
  assert any(r.implementation == "mosaic_gpu" and r.direction == "forward"
             for r in records)
  ref = _reference(lhs, rhs, group_sizes, group_offset, preferred_element_type)
  assert out.dtype == jnp.dtype(preferred_element_type or dtype)
  tol_dtype = dtype if preferred_element_type is None else jnp.dtype(
      preferred_element_type)
  if tol_dtype == jnp.float32:
    tol_dtype = dtype  # bf16/f16 operands: the products are exact, sums f32
  testing.assert_close(out, ref, tol_dtype, what="forward", gpu=True)
  # Rows outside the held groups must be exactly zero (never left unwritten).
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  lo = 0 if group_offset is None else group_offset
  held = np.zeros(m, bool)
  for s, e in zip(starts[lo:lo + num_held], ends[lo:lo + num_held]):
    held[s:e] = True
  assert not np.any(np.asarray(out, np.float32)[~held]), "rows outside held groups"
  if grads:
    cot = jnp.asarray(_rng().standard_normal(out.shape), jnp.float32)

    def loss(l, r, impl):
      o = tokamax.ragged_dot(l, r, group_sizes, group_offset=group_offset,
                             implementation=impl)
      return jnp.sum(o.astype(jnp.float32) * cot)
    with (tokamax.record_dispatch() as records,
          tuning_context.use(_BackwardConfig(bwd_config))):
      dl, dr = jax.grad(loss, argnums=(0, 1))(lhs, rhs, impl)
    assert any(r.implementation == "mosaic_gpu" and r.direction == "backward"
               for r in records), records
    rl, rr = jax.grad(loss, argnums=(0, 1))(lhs.astype(jnp.float32),
                                            rhs.astype(jnp.float32), "xla")
    testing.assert_close(dl, rl, dtype, what="dlhs", scale=2, gpu=True)
    testing.assert_close(dr, rr, dtype, what="drhs", scale=2, gpu=True)


# ---------------------------------------------------------------- GPU (native)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_awkward_groups(dtype):
  # Empty groups, boundaries off the tile grid, M not a tile multiple.
  _check(1000, 512, 392, [100, 0, 333, 1, 0, 466, 100], dtype=dtype)


@gpu
def test_rows_past_total_and_tiny_m():
  _check(300, 256, 256, [17, 0, 150], grads=False)
  _check(37, 64, 24, [5, 9, 0], grads=False)


@gpu
def test_group_offset():
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=2, group_offset=2)
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=1, group_offset=4,
         grads=False)


@gpu
def test_preferred_float32():
  _check(500, 256, 264, [123, 250, 127], preferred_element_type=jnp.float32,
         grads=False)


@gpu
@pytest.mark.parametrize("config", [
    rd.RaggedDotConfig(block_m=64, block_n=64, block_k=32, num_stages=2,
                       grid_tile_width=3, row_tiling="fixed"),
    rd.RaggedDotConfig(block_m=128, block_n=128, block_k=64, num_stages=3,
                       row_tiling="fixed"),
    rd.RaggedDotConfig(block_m=128, block_n=64, block_k=32, num_stages=4,
                       grid_tile_width=3),
    rd.RaggedDotConfig(block_m=128, block_n=128, block_k=64, num_stages=3,
                       grid_tile_width=16),
])
def test_configs(config):
  _check(1500, 640, 704, [400, 3, 0, 600, 497], config=config, grads=False)


@gpu
def test_many_groups_random_sizes():
  rng = _rng()
  cuts = np.sort(rng.integers(0, 4000, 63))
  sizes = np.diff(np.concatenate([[0], cuts, [4000]]))
  _check(4096, 512, 512, sizes.tolist(), grads=False)


@gpu
def test_dlhs_kernel():
  """The transposed-rhs kernel (the dlhs product) against the reference."""
  _check_dlhs(900, 256, 384, [300, 0, 201, 399], rd.RaggedDotConfig(), "dlhs kernel")


def _check_dlhs(m, k, n, sizes, config, what):
  """The transposed-rhs kernel (dlhs: dout [M, N] times rhs [G, N, K] read as
  ``[K, N]`` tiles) against the grouped product in float32."""
  dout, rhs = _inputs(m, n, k, len(sizes), jnp.bfloat16)  # rhs [G, N, K]
  gs = jnp.asarray(sizes, jnp.int32)
  starts, ends = tokamax.plugin.held_row_ranges(gs, None, len(sizes), m)
  out = jax.jit(lambda d, r: rd.grouped_matmul(
      d, r, starts, ends, transpose_rhs=True, out_dtype=jnp.bfloat16,
      config=config))(dout, jnp.swapaxes(rhs, 1, 2))
  testing.assert_close(out, _grouped_reference(dout, rhs, sizes), jnp.bfloat16,
                       what=what, gpu=True)


@gpu
@pytest.mark.parametrize("sizes,m", [([300, 0, 201, 399], 900), ([5, 9, 0, 3], 40),
                                     ([0, 0], 30), ([130, 1, 64, 700], 1000)])
def test_drhs_kernel(sizes, m):
  """The ragged contraction alone, with groups off the 8-row grid."""
  k, n = 200, 392
  rng = _rng()
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  starts, ends = tokamax.plugin.held_row_ranges(gs, None, len(sizes), m)
  out = jax.jit(lambda a, d: rd.grouped_transposed_matmul(
      a, d, starts, ends, out_dtype=jnp.float32,
      config=rd.RaggedDotConfig(num_stages=4)))(lhs, dout)
  ends_np = np.cumsum(sizes)
  starts_np = ends_np - np.asarray(sizes)
  lf, df = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  ref = np.stack([lf[s:e].T @ df[s:e] for s, e in zip(starts_np, ends_np)])
  testing.assert_close(out, ref, jnp.bfloat16, what="drhs kernel", gpu=True)


# Session 5 variants: select with -k "pieces or drhs".


def _cid(c):
  return f"n{c.block_n}k{c.block_k}s{c.num_stages}p{c.out_pieces}w{c.grid_tile_width}"

_PIECES = [rd.RaggedDotConfig(num_stages=4, out_pieces=2),
           rd.RaggedDotConfig(num_stages=3, out_pieces=2, grid_tile_width=4),
           rd.RaggedDotConfig(block_n=64, block_k=32, num_stages=2, out_pieces=2)]


@gpu
@pytest.mark.parametrize("config", _PIECES, ids=_cid)
def test_pieces_forward(config):
  # Partial row tiles (unaligned boundaries, 1-row groups), empty groups, N not
  # a multiple of the CTA width: every piece takes the partial-tile path too.
  _check(1500, 640, 704, [400, 3, 0, 600, 1, 496], config=config, grads=False)
  _check(300, 256, 392, [17, 0, 150], config=config, grads=False)


@gpu
def test_pieces_group_offset_and_f32_out():
  config = rd.RaggedDotConfig(num_stages=4, out_pieces=2)
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=2, group_offset=2,
         config=config, grads=False)
  _check(500, 256, 264, [123, 250, 127], preferred_element_type=jnp.float32,
         config=rd.RaggedDotConfig(num_stages=3, out_pieces=2), grads=False)


@gpu
@pytest.mark.parametrize("config", _PIECES[:2], ids=_cid)
def test_pieces_dlhs_kernel(config):
  _check_dlhs(900, 256, 392, [300, 0, 201, 5, 394], config, "dlhs (pieces)")


_WS = [rd.RaggedDotConfig(num_stages=4, out_pieces=2, drhs_kernel="ws"),
       rd.RaggedDotConfig(num_stages=3, drhs_kernel="ws"),
       rd.RaggedDotConfig(block_n=64, num_stages=2, drhs_kernel="ws"),
       # Each item's chunks through an emit_pipeline_warp_specialized of its own.
       rd.RaggedDotConfig(num_stages=3, drhs_kernel="ws", chain_items=False)]


@pytest.mark.parametrize("k_tiles,n_tiles", [(1, 1), (3, 5), (16, 64), (17, 3),
                                             (56, 8), (112, 2)])
def test_drhs_item_order(k_tiles, n_tiles):
  """The drhs kernels' item order (`_drhs_item`, runs on any backend): every
  (group, K tile, N tile) once, including a last band of fewer than
  `rdd.K_BAND` K tiles; K fastest within a band; each item's rows are its
  group's, read from the start rounded down to 8."""
  bounds = jnp.array([[0, 13], [13, 13], [13, 40]], jnp.int32)
  items = 3 * k_tiles * n_tiles
  g, ki, ni, start, end, first = jax.vmap(
      lambda i: rdd._drhs_item(i, bounds, k_tiles, n_tiles))(jnp.arange(items))
  g, ki, ni = np.asarray(g), np.asarray(ki), np.asarray(ni)
  assert sorted(zip(g, ki, ni)) == [(a, b, c) for a in range(3)
                                    for b in range(k_tiles) for c in range(n_tiles)]
  np.testing.assert_array_equal(g, np.repeat(np.arange(3), k_tiles * n_tiles))
  # Per group: bands of K_BAND K tiles (the last holds the rest), each band
  # column tile by column tile with its K tiles fastest.
  order = [(b0 + j, n) for b0 in range(0, k_tiles, rdd.K_BAND)
           for n in range(n_tiles) for j in range(min(rdd.K_BAND, k_tiles - b0))]
  expected_ki, expected_ni = np.array(order * 3).T
  np.testing.assert_array_equal(ki, expected_ki)
  np.testing.assert_array_equal(ni, expected_ni)
  np.testing.assert_array_equal(np.asarray(start), np.asarray(bounds)[g, 0])
  np.testing.assert_array_equal(np.asarray(end), np.asarray(bounds)[g, 1])
  np.testing.assert_array_equal(np.asarray(first), np.asarray(bounds)[g, 0] // 8 * 8)


@pytest.mark.parametrize("rows,cols,width", [(1, 1, 8), (13, 28, 8), (64, 24, 8),
                                              (7, 29, 3), (5, 8, 16), (3, 5, 1)])
def test_static_snake_is_the_planar_snake(rows, cols, width):
  """`_pipeline.static_snake` (the forward's snake order, branch-free with static
  divisors) visits what `plgpu.planar_snake` does, index by index, a last band
  narrower than `width` included: bands of `width` columns, each walked row by
  row with its columns fastest, every other band's rows reversed."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from tokamax_gpu_mosaic import _pipeline
  index = jnp.arange(rows * cols, dtype=jnp.int32)
  row, col = jax.vmap(lambda i: _pipeline.static_snake(i, rows, cols, width))(index)
  want_row, want_col = jax.vmap(
      lambda i: plgpu.planar_snake(i, (rows, cols), 1, width))(index)
  np.testing.assert_array_equal(row, want_row)
  np.testing.assert_array_equal(col, want_col)
  order = []
  for band, c0 in enumerate(range(0, cols, width)):
    walk = range(rows) if band % 2 == 0 else range(rows - 1, -1, -1)
    order += [(r, c) for r in walk for c in range(c0, min(c0 + width, cols))]
  np.testing.assert_array_equal(np.stack([row, col], axis=1), np.array(order))


def _drhs_reference(lhs, dout, sizes, offset, held):
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  lf, df = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  return np.stack([lf[s:e].T @ df[s:e] for s, e in
                   zip(starts[offset:offset + held], ends[offset:offset + held])])


@gpu
@pytest.mark.parametrize("config", _WS, ids=_cid)
@pytest.mark.parametrize("sizes,m,offset,held", [
    ([300, 0, 201, 399], 900, 0, 4),  # an empty group, unaligned starts
    ([5, 9, 0, 3, 1, 7, 2], 40, 0, 7),  # 1-7 rows: one chunk, padded to two
    ([0, 0], 30, 0, 2),  # no rows at all
    ([130, 1, 64, 700], 1000, 0, 4),  # rows past sum(sizes)
    ([100, 200, 0, 150, 300], 777, 2, 2),  # group_offset; first held empty
    ([64, 128, 63, 65, 192], 512, 1, 3),  # chunk-aligned and off-by-one ends
])
def test_drhs_ws_kernel(config, sizes, m, offset, held):
  k, n = 200, 392  # Neither a tile multiple: reads past K/N, sliced output.
  rng = _rng()
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  starts, ends = tokamax.plugin.held_row_ranges(gs, offset, held, m)
  ws = rd.drhs_ws_config(config, 2, 4)
  out = jax.jit(lambda a, d: rd.grouped_transposed_matmul(
      a, d, starts, ends, out_dtype=jnp.float32, config=ws))(lhs, dout)
  ref = _drhs_reference(lhs, dout, sizes, offset, held)
  assert out.shape == ref.shape
  testing.assert_close(out, ref, jnp.bfloat16, what="drhs ws kernel", gpu=True)
  empty = [g for g in range(held) if sizes[offset + g] == 0]
  assert not np.any(np.asarray(out)[empty]), "empty groups must give zeros"


@gpu
def test_drhs_ws_aligned_bf16_out():
  # The reference shapes' case: K, N tile multiples, bf16 output, many groups.
  rng = _rng()
  m, k, n = 4096, 512, 512
  cuts = np.sort(rng.integers(0, m, 31))
  sizes = np.diff(np.concatenate([[0], cuts, [m]])).tolist()
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  starts, ends = tokamax.plugin.held_row_ranges(gs, None, len(sizes), m)
  for config in _WS[:2]:
    out = jax.jit(lambda a, d, c=config: rd.grouped_transposed_matmul(
        a, d, starts, ends, out_dtype=jnp.bfloat16, config=c))(lhs, dout)
    ref = _drhs_reference(lhs, dout, sizes, 0, len(sizes))
    testing.assert_close(out, ref, jnp.bfloat16, what=f"drhs ws {config}",
                         gpu=True)


@gpu
@pytest.mark.parametrize("config", _WS[:2], ids=_cid)
def test_drhs_ws_through_vjp(config):
  """The whole backward with the "ws" drhs (and pieces in dlhs), via dispatch."""
  _check(1000, 512, 392, [100, 0, 333, 1, 0, 466, 100], bwd_config=config)
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=2, group_offset=2,
         bwd_config=config)


# Weight-reuse variants (session 5): select with -k "order or tall".


def _wid(c):
  return (f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.num_stages}p{c.out_pieces}"
          f"w{c.grid_tile_width}{c.item_order}{'-sync' if c.sync_sharers else ''}"
          f"{'-claim' if c.claim_items else ''}"
          f"{ {None: '', True: '-strips', False: '-plain'}[c.strip_staging]}")


_REUSE = [
    rd.RaggedDotConfig(block_m=256, num_stages=3),
    rd.RaggedDotConfig(block_m=256, num_stages=4, out_pieces=2, item_order="group"),
    rd.RaggedDotConfig(num_stages=3, item_order="group", grid_tile_width=2),
    rd.RaggedDotConfig(num_stages=4, out_pieces=2, item_order="group"),
]


# `sync_sharers` (device-memory semaphores between blocks) must compute what
# the plain group order does, and finish: a protocol mistake hangs, so run the
# native tests under a timeout.
_SYNC = [
    rd.RaggedDotConfig(num_stages=4, out_pieces=2, item_order="group",
                       grid_tile_width=2, sync_sharers=True),
    rd.RaggedDotConfig(block_m=256, num_stages=4, out_pieces=2, item_order="group",
                       sync_sharers=True),
]


# `claim_items` (blocks claim items from a device-memory counter): the same
# results as the round-robin deal, whichever block claims what; a protocol
# mistake hangs, so run the native tests under a time limit
# (tools/h200_steps.sh).
_CLAIM = [
    rd.RaggedDotConfig(num_stages=4, out_pieces=2, item_order="group",
                       claim_items=True),
    rd.RaggedDotConfig(block_m=256, num_stages=4, out_pieces=2, item_order="group",
                       claim_items=True),
    rd.RaggedDotConfig(num_stages=3, claim_items=True),  # snake order
]
# Half-depth K steps, an 8-deep ring in the shared memory of 4 full ones.
_CLAIM_K32 = rd.RaggedDotConfig(block_k=32, num_stages=8, out_pieces=2,
                                item_order="group", claim_items=True)
_CLAIM.append(_CLAIM_K32)
# Partial tiles staged against `uses_strips`' choice: plain where it takes
# strips (two per 128-column piece), strips where it stages plainly (four per
# 256-column tile).
_CLAIM.append(rd.RaggedDotConfig(num_stages=4, out_pieces=2, item_order="group",
                                 claim_items=True, strip_staging=False))
_CLAIM.append(rd.RaggedDotConfig(num_stages=3, item_order="group", claim_items=True,
                                 strip_staging=True))


def _grouped_reference(lhs, rhs, sizes):
  """The grouped product in float32, one dense matmul per group's rows (zeros
  past the last group), in one program. Not `jax.lax.ragged_dot`: on the GPU,
  XLA expands it to a [G, M, N] product (32 GiB at M65536 G128 N1024)."""
  return _grouped_reference_jit(lhs, rhs, tuple(sizes))


@functools.partial(jax.jit, static_argnums=2)
def _grouped_reference_jit(lhs, rhs, sizes):
  lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
  parts, start = [], 0
  for g, size in enumerate(sizes):
    parts.append(jnp.matmul(lhs[start:start + size], rhs[g], precision=HIGHEST))
    start += size
  parts.append(jnp.zeros((lhs.shape[0] - start, rhs.shape[-1]), jnp.float32))
  return jnp.concatenate(parts)


@gpu
@pytest.mark.parametrize("config", _REUSE + _SYNC + _CLAIM, ids=_wid)
def test_reuse_order_tall_forward(config):
  # Empty groups, 1- and 3-row groups, starts off the 8-row grid, a group
  # whose rows fill one 64-row half of a tall item and spill into the next,
  # rows past sum(sizes), N and K not tile multiples.
  _check(1500, 640, 704, [400, 3, 0, 600, 1, 130, 200], config=config,
         grads=False)
  _check(300, 256, 392, [17, 0, 150], config=config, grads=False)
  _check(37, 64, 24, [5, 9, 0], config=config, grads=False)
  # Directly against the grouped product (no group_offset there).
  sizes = [70, 0, 1, 255, 257, 0, 129, 300]
  lhs, rhs = _inputs(1012, 384, 512, len(sizes), jnp.bfloat16)
  out = jax.jit(lambda l, r, g: tokamax.ragged_dot(
      l, r, g, implementation=rd.MosaicGpuRaggedDot(config)))(
          lhs, rhs, jnp.asarray(sizes, jnp.int32))
  testing.assert_close(out, _grouped_reference(lhs, rhs, sizes), jnp.bfloat16,
                       what=f"forward {config}", gpu=True)


@gpu
@pytest.mark.parametrize("config", _REUSE[:3], ids=_wid)
def test_reuse_order_tall_group_offset_and_f32_out(config):
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=2, group_offset=2,
         config=config, grads=False)
  _check(777, 384, 520, [100, 200, 0, 150, 300], num_held=1, group_offset=4,
         config=config, grads=False)
  f32 = config  # f32 outputs: 3 stages + 2 pieces where the config does not fit.
  if rd.smem_bytes(f32, 2, 4) > rd._common.SMEM_LIMIT:
    f32 = dataclasses.replace(config, num_stages=3, out_pieces=2)
  _check(500, 256, 264, [123, 250, 127], preferred_element_type=jnp.float32,
         config=f32, grads=False)


@gpu
@pytest.mark.parametrize("config", _REUSE + _SYNC + _CLAIM, ids=_wid)
def test_reuse_order_tall_many_random_groups(config):
  rng = _rng()
  cuts = np.sort(rng.integers(0, 4000, 63))
  sizes = np.diff(np.concatenate([[0], cuts, [4000]])).tolist()
  lhs, rhs = _inputs(4096, 512, 512, len(sizes), jnp.bfloat16)
  out = jax.jit(lambda l, r, g: tokamax.ragged_dot(
      l, r, g, implementation=rd.MosaicGpuRaggedDot(config)))(
          lhs, rhs, jnp.asarray(sizes, jnp.int32))
  ref = _grouped_reference(lhs, rhs, sizes)
  testing.assert_close(out, ref, jnp.bfloat16, what=f"forward {config}", gpu=True)
  assert not np.any(np.asarray(out, np.float32)[sum(sizes):])


@gpu
def test_claim_items_many_items_a_block():
  """Claims over many items a block (M65536 in 128 random groups, two empty,
  rows past the last): the forward (4 column tiles of 256: about 18 items a
  block) and the gradients through dispatch (whose backward heuristic claims
  too), and dlhs alone (128 output columns: about 5). The tests above give a
  block about 2 items."""
  rng = _rng()
  cuts = np.sort(rng.integers(0, 60000, 127))
  sizes = np.diff(np.concatenate([[0], cuts, [60000]]))
  sizes[[3, 50]] = 0
  sizes = sizes.tolist()
  _check(65536, 128, 1024, sizes, config=_CLAIM[0])
  _check_dlhs(65536, 128, 1024, sizes, _CLAIM[0], "dlhs, many items a block")


@gpu
def test_claim_items_under_vmap():
  """`jax.vmap` of a claiming ragged_dot, forward and gradients: Pallas runs
  the batch as one launch, whose instances would share the claims' counter,
  so the vmapped kernels deal round robin (`_GroupTiles.persistent_call`).
  Each batch element against the float32 reference."""
  m, k, n, sizes = 1000, 256, 392, [300, 0, 201, 5, 394]
  lhs = jnp.stack([_inputs(m, k, n, len(sizes), jnp.bfloat16)[0] for _ in range(2)])
  rhs = _inputs(m, k, n, len(sizes), jnp.bfloat16)[1]
  group_sizes = jnp.asarray(sizes, jnp.int32)
  impl = rd.MosaicGpuRaggedDot(_CLAIM[0])

  def batched(l, r, implementation):
    return jax.vmap(lambda x: tokamax.ragged_dot(
        x, r, group_sizes, implementation=implementation))(l)
  with tokamax.record_dispatch() as records:
    out = jax.jit(batched, static_argnums=2)(lhs, rhs, impl)
  assert any(r.implementation == "mosaic_gpu" for r in records), records
  for b in range(2):
    testing.assert_close(out[b], _grouped_reference(lhs[b], rhs, sizes), jnp.bfloat16,
                         what=f"vmapped forward, element {b}", gpu=True)
  cot = jnp.asarray(_rng().standard_normal(out.shape), jnp.float32)

  def loss(l, r, implementation):
    return jnp.sum(batched(l, r, implementation).astype(jnp.float32) * cot)
  with tokamax.record_dispatch() as records:
    dl, dr = jax.grad(loss, argnums=(0, 1))(lhs, rhs, impl)
  assert any(r.implementation == "mosaic_gpu" and r.direction == "backward"
             for r in records), records
  rl, rr = jax.grad(loss, argnums=(0, 1))(lhs.astype(jnp.float32),
                                          rhs.astype(jnp.float32), "xla")
  testing.assert_close(dl, rl, jnp.bfloat16, what="vmapped dlhs", scale=2, gpu=True)
  testing.assert_close(dr, rr, jnp.bfloat16, what="vmapped drhs", scale=2, gpu=True)


@gpu
@pytest.mark.parametrize("config", _REUSE[:3] + _SYNC + _CLAIM[:2] + [_CLAIM_K32],
                         ids=_wid)
def test_reuse_order_tall_dlhs_and_vjp(config):
  """The transposed-rhs kernel (dlhs) with the variant, and the whole backward
  through dispatch with the variant as the backward config."""
  _check_dlhs(900, 256, 392, [300, 0, 201, 5, 394], config, f"dlhs {config}")
  _check(1000, 512, 392, [100, 0, 333, 1, 0, 466, 100],
         bwd_config=dataclasses.replace(config, drhs_kernel="ws"))


# ---------------------------------------------------------------- anywhere


def test_registered():
  names = {(s.op, s.name) for s in tokamax.implementations()}
  assert ("ragged_dot", "mosaic_gpu") in names


def test_refuses_non_hopper():
  lhs, rhs = _inputs(16, 16, 16, 2, jnp.bfloat16)
  from tokamax._src.ops.ragged_dot import RaggedDotArgs
  args = RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=jnp.asarray([8, 8], jnp.int32))
  for device in (tokamax.DeviceInfo("cpu", "cpu"),
                 tokamax.DeviceInfo("gpu", "NVIDIA A100", compute_capability="8.0")):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      rd.MosaicGpuRaggedDot().check_supported(args, device)
  with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
    rd.MosaicGpuRaggedDotVjp().check_supported(
        args, tokamax.DeviceInfo("cpu", "cpu"))


@pytest.mark.smoke
def test_refuses_unsupported_args():
  from tokamax._src.ops.ragged_dot import RaggedDotArgs
  h200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
  sizes = jnp.asarray([8, 8], jnp.int32)
  lhs, rhs = _inputs(16, 16, 16, 2, jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    rd.MosaicGpuRaggedDot().check_supported(
        RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=sizes), h200)
  lhs, rhs = _inputs(16, 16, 16, 2, jnp.bfloat16)
  rd.MosaicGpuRaggedDot().check_supported(
      RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=sizes), h200)
  rd.MosaicGpuRaggedDotVjp().check_supported(
      RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=sizes), h200)


@pytest.mark.skipif(_ON_HOPPER, reason="checks the refusal off Hopper")
def test_dispatch_on_cpu_falls_back():
  lhs, rhs = _inputs(16, 16, 16, 2, jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Hopper"):
    tokamax.ragged_dot(lhs, rhs, jnp.asarray([8, 8], jnp.int32),
                       implementation="mosaic_gpu")
  # Interpret mode depends on the JAX release: test_registration.py.


def _lowers(f, *shapes):
  exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
      *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
  assert "mosaic_gpu" in exported.mlir_module()


def _grouped_matmul_lowers(m, k, n, g, config, transpose_rhs,
                           out_dtype=jnp.bfloat16):
  """`grouped_matmul` (forward, or dlhs with `transpose_rhs`) lowers for CUDA."""
  def f(lhs, rhs, sizes):
    starts, ends = tokamax.plugin.held_row_ranges(sizes, None, g, m)
    return rd.grouped_matmul(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
                             out_dtype=out_dtype, config=config)
  rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
  _lowers(f, ((m, k), jnp.bfloat16), (rhs_shape, jnp.bfloat16), ((g,), jnp.int32))


@pytest.mark.smoke
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("tiling,pieces", [("group", 1), ("fixed", 1),
                                           ("group", 2)])
def test_lowers_for_cuda(transpose_rhs, tiling, pieces):
  """The whole kernel traces and lowers to Mosaic GPU for "cuda" without a GPU."""
  pytest.importorskip("absl")
  m, k, n, g = 300, 128, 200, 3
  config = rd.RaggedDotConfig(block_m=128 if tiling == "group" else 64,
                              block_n=64, block_k=64, num_stages=2,
                              row_tiling=tiling, out_pieces=pieces)
  _grouped_matmul_lowers(m, k, n, g, config, transpose_rhs)


@pytest.mark.parametrize("sizes,m,held,offset", [
    ([100, 0, 333, 1, 0, 466, 100], 1100, 7, 0),
    # Held groups from the third: the first held group is empty and starts
    # mid-tile (row 300 of tile [256, 384)).
    ([100, 200, 0, 150, 300], 777, 2, 2),
    ([100, 0, 0, 150, 300, 0], 640, 4, 1),
])
def test_tile_groups_table(sizes, m, held, offset):
  starts, ends = tokamax.plugin.held_row_ranges(jnp.asarray(sizes, jnp.int32), offset, held, m)
  table = np.asarray(rdk.tile_groups(starts, ends, m, 128))
  s, e = np.asarray(starts), np.asarray(ends)
  for t, (first, last) in enumerate(table):
    lo, hi = t * 128, t * 128 + 128
    meets = [g for g in range(held) if e[g] > s[g] and s[g] < hi and e[g] > lo]
    if not meets:
      assert first > last
    else:
      assert first == meets[0] and last >= meets[-1]
      assert all(e[g] <= s[g] for g in range(first, last + 1) if g not in meets)


@pytest.mark.parametrize("sizes,m,held,offset", [
    ([100, 0, 333, 1, 0, 466, 100], 1100, 7, 0),
    ([5, 9, 0], 64, 3, 0),
    ([0, 0], 16, 2, 0),
    ([100, 200, 0, 150, 300], 800, 2, 2),
    ([100, 200, 0, 150, 300], 800, 1, 4),
    ([300, 200], 500, 2, 0),
])
def test_work_items_cover_every_row_once(sizes, m, held, offset):
  starts, ends = tokamax.plugin.held_row_ranges(jnp.asarray(sizes, jnp.int32), offset, held, m)
  items = np.asarray(rdk.work_items(starts, ends, m, 128))
  owner = np.full(m, -2)
  s, e = np.asarray(starts), np.asarray(ends)
  for row0, group, lo, hi in items:
    assert row0 % 8 == 0 or group < 0
    for r in range(row0 + lo, row0 + hi):
      assert owner[r] == -2, f"row {r} owned twice"
      owner[r] = group
  for r in range(m):
    expected = next((g for g in range(held) if s[g] <= r < e[g]), -1)
    assert owner[r] == expected, (r, owner[r], expected)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_pieces_heuristic_lowers_for_cuda(transpose_rhs, out_dtype):
  """The heuristic's 4-stage, two-piece config for groups of many row tiles (3
  stages for f32 outputs); smaller groups keep 3 stages and one piece."""
  pytest.importorskip("absl")
  m, k, n, g = 4096, 256, 512, 4
  itemsize = jnp.dtype(out_dtype).itemsize
  config = rd.heuristic(m, k, n, g, 2, itemsize, pieces=True)
  assert config.out_pieces == 2
  assert config.num_stages == (4 if out_dtype == jnp.bfloat16 else 3)
  small = rd.heuristic(m, k, n, 64, 2, itemsize, pieces=True)
  assert small.num_stages == 3
  _grouped_matmul_lowers(m, k, n, g, config, transpose_rhs, out_dtype=out_dtype)


@pytest.mark.smoke
@pytest.mark.parametrize("block_n,stages,pieces,out_dtype,chain", [
    (128, 4, 2, jnp.bfloat16, True), (128, 3, 1, jnp.bfloat16, True),
    (64, 2, 1, jnp.float32, True), (128, 3, 2, jnp.float32, True),
    (128, 3, 1, jnp.bfloat16, False)])  # the per-item pipeline kernel
def test_drhs_ws_lowers_for_cuda(block_n, stages, pieces, out_dtype, chain):
  pytest.importorskip("absl")
  m, k, n, g = 300, 200, 392, 3
  config = rd.RaggedDotConfig(block_n=block_n, num_stages=stages,
                              out_pieces=pieces, drhs_kernel="ws", chain_items=chain)

  def f(lhs, dout, sizes):
    starts, ends = tokamax.plugin.held_row_ranges(sizes, None, g, m)
    return rd.grouped_transposed_matmul(lhs, dout, starts, ends,
                                        out_dtype=out_dtype, config=config)
  _lowers(f, ((m, k), jnp.bfloat16), ((m, n), jnp.bfloat16), ((g,), jnp.int32))


def test_config_validation():
  with pytest.raises(ValueError, match="out_pieces"):
    rd.RaggedDotConfig(out_pieces=3)
  with pytest.raises(ValueError, match="out_pieces=2 needs"):
    rd.RaggedDotConfig(block_m=64, row_tiling="fixed", out_pieces=2)
  with pytest.raises(ValueError, match="drhs_kernel"):
    rd.RaggedDotConfig(drhs_kernel="tma")
  # 4 stages next to a whole staged 64 x 256 tile per warpgroup: 257 KiB.
  big = rd.RaggedDotConfig(num_stages=4, out_pieces=1)
  lhs, rhs = _inputs(256, 128, 256, 2, jnp.bfloat16)
  starts = jnp.asarray([0, 128], jnp.int32)
  ends = jnp.asarray([128, 256], jnp.int32)
  with pytest.raises(ValueError, match=r"num_stages=4.*needs 263168 bytes"):
    rd.grouped_matmul(lhs, rhs, starts, ends, transpose_rhs=False,
                      out_dtype=jnp.bfloat16, config=big)
  with pytest.raises(ValueError, match="drhs"):
    rd.grouped_transposed_matmul(lhs, lhs, starts, ends, out_dtype=jnp.bfloat16,
                                 config=dataclasses.replace(big, drhs_kernel="ws"))
  fitted = rd.drhs_ws_config(dataclasses.replace(big, block_k=32, num_stages=6),
                             2, 2)
  assert (fitted.block_k, fitted.num_stages, fitted.out_pieces) == (64, 3, 1)


@pytest.mark.parametrize("block_m,pieces,out_itemsize,strips", [
    (128, 2, 2, True),  # two 64-column strips per 128-column piece
    (128, 1, 2, False),  # four per 256-column tile
    (256, 1, 2, True),  # tall items: 128 columns
    (128, 2, 4, False),  # float32: four 32-column strips per piece
])
def test_strips_where_a_piece_is_at_most_two_wide(block_m, pieces, out_itemsize,
                                                  strips):
  """`strip_staging=None` takes the strips where they measured faster (pieces
  of two), the plain staging where it did (four); True/False overrule it."""
  config = rdk.RaggedDotConfig(block_m=block_m, out_pieces=pieces)
  piece_n = rdk.cta_n(config) // pieces
  assert rdk.uses_strips(config, piece_n, out_itemsize) is strips
  for forced in (True, False):
    forced_config = dataclasses.replace(config, strip_staging=forced)
    assert rdk.uses_strips(forced_config, piece_n, out_itemsize) is forced


def test_strips_need_whole_strips():
  """A piece under one 128-byte strip (64 one-byte columns) is staged plainly,
  and forcing strips on it is refused by name."""
  config = rdk.RaggedDotConfig(block_m=256, out_pieces=2)  # 64-column pieces
  assert not rdk.uses_strips(config, 64, 1)
  with pytest.raises(ValueError, match="strip_staging=True needs output pieces of "
                     "whole 128-byte strips; got 64 columns of 1 bytes"):
    rdk.uses_strips(dataclasses.replace(config, strip_staging=True), 64, 1)


def test_heuristics_pick_pieces_only_for_this_module():
  from tokamax._src.ops.ragged_dot import RaggedDotArgs
  lhs, rhs = _inputs(2048, 128, 256, 2, jnp.bfloat16)  # groups of 1024 rows
  args = RaggedDotArgs(lhs=lhs, rhs=rhs,
                       group_sizes=jnp.asarray([1000, 1048], jnp.int32))
  for op in (rd.MosaicGpuRaggedDot(), rd.MosaicGpuRaggedDotVjp()):
    config = op.heuristic_config(args)
    assert (config.num_stages, config.out_pieces) == (4, 2), config
    assert rd.smem_bytes(config, 2, 2) <= rd._common.SMEM_LIMIT
  assert rd.MosaicGpuRaggedDotVjp().heuristic_config(args).drhs_kernel == "ws"
  # gated_linear_unit rebuilds configs from block_n/num_stages alone: the plain
  # heuristic must stay a whole-tile config that fits.
  plain = rd.heuristic(0, 0, 0, 1, 2, 2)
  assert (plain.block_n, plain.num_stages, plain.out_pieces) == (128, 3, 1)
  assert rd.smem_bytes(plain, 2, 2) <= rd._common.SMEM_LIMIT


@pytest.mark.parametrize("is_h100,split_lost,pieces", [
    (False, None, 1), (True, None, 2), (False, "lost", 2), (True, "lost", 2)])
def test_few_rows_per_group_stage_their_output_in_pieces(
    is_h100, split_lost, pieces, monkeypatch):
  """Under 512 rows a group (3 stages) both Ops stage the output in two pieces
  on the H100 (measured faster there) and where JAX's compile loses the
  register split (one piece spills there); the H200 keeps one piece."""
  from tokamax._src.ops.ragged_dot import RaggedDotArgs
  monkeypatch.setattr(rd._common, "is_h100", lambda: is_h100)
  monkeypatch.setattr(rd._common, "register_split_lost", lambda: split_lost)
  lhs, rhs = _inputs(2048, 128, 256, 64, jnp.bfloat16)
  args = RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=jnp.full((64,), 32, jnp.int32))
  for op in (rd.MosaicGpuRaggedDot(), rd.MosaicGpuRaggedDotVjp()):
    config = op.heuristic_config(args)
    assert (config.num_stages, config.out_pieces) == (3, pieces), config
    assert rd.smem_bytes(config, 2, 2) <= rd._common.SMEM_LIMIT
  # Groups of many row tiles keep their 4-stage config either way.
  many = rd.heuristic(2048, 128, 256, 2, 2, 2, pieces=True)
  assert (many.num_stages, many.out_pieces) == (4, 2), many


@pytest.mark.parametrize("groups,order", [(64, "group"), (4, "snake"), (2, "snake")])
def test_backward_heuristic_order_by_rows_per_group(groups, order):
  """dlhs in the group order under 512 rows a group (measured faster there,
  slower at 512), the snake order from 512."""
  from tokamax._src.ops.ragged_dot import RaggedDotArgs
  lhs, rhs = _inputs(2048, 128, 256, groups, jnp.bfloat16)
  sizes = jnp.full((groups,), 2048 // groups, jnp.int32)
  args = RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=sizes)
  assert rd.MosaicGpuRaggedDotVjp().heuristic_config(args).item_order == order


def test_search_space_has_piece_variants():
  space = rd._search_space(16384, 2048, 16384, 16, 2, 2)
  assert all(rd.smem_bytes(c, 2, 2) <= rd._common.SMEM_LIMIT for c in space)
  assert rd.RaggedDotConfig(num_stages=4, out_pieces=2) in space
  assert rd.RaggedDotConfig(num_stages=3, out_pieces=2) in space
  assert rd.RaggedDotConfig(num_stages=3) in space


# ---------------------------------------------------------------- weight reuse


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("config", [
    rd.RaggedDotConfig(block_m=256, block_n=64, num_stages=2),
    rd.RaggedDotConfig(block_m=256, num_stages=3, out_pieces=2),
    rd.RaggedDotConfig(block_m=256, block_k=32, num_stages=2, item_order="group"),
    rd.RaggedDotConfig(block_n=64, num_stages=2, item_order="group"),
], ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}p{c.out_pieces}{c.item_order}")
def test_weight_reuse_lowers_for_cuda(transpose_rhs, config):
  pytest.importorskip("absl")
  m, k, n, g = 700, 128, 200, 3
  _grouped_matmul_lowers(m, k, n, g, config, transpose_rhs)


def test_weight_reuse_f32_out_lowers_for_cuda():
  pytest.importorskip("absl")
  m, k, n, g = 300, 128, 136, 2
  config = rd.RaggedDotConfig(block_m=256, num_stages=3, out_pieces=2,
                              item_order="group")
  _grouped_matmul_lowers(m, k, n, g, config, False, out_dtype=jnp.float32)


@pytest.mark.parametrize("sizes,m,held,offset", [
    ([100, 0, 333, 1, 0, 466, 100], 1100, 7, 0),
    ([100, 200, 0, 150, 300], 800, 2, 2),
    ([1000, 24], 1100, 2, 0),
    ([0, 0], 16, 2, 0),
])
@pytest.mark.parametrize("bm,n_tiles,width", [(128, 5, 2), (256, 3, 4), (128, 1, 8)])
def test_ordered_items_table(sizes, m, held, offset, bm, n_tiles, width):
  starts, ends = tokamax.plugin.held_row_ranges(jnp.asarray(sizes, jnp.int32), offset, held, m)
  items = np.asarray(rdk.work_items(starts, ends, m, bm))
  table = np.asarray(rdk.ordered_items(jnp.asarray(items), n_tiles, width))
  assert table.shape == (items.shape[0] * n_tiles, 5)
  # Every (item, column tile) exactly once.
  pairs = {(tuple(r[:4]), r[4]) for r in table}
  expected = {(tuple(it), ni) for it in items for ni in range(n_tiles)}
  assert len(pairs) == len(expected) == len({tuple(r) for r in table})
  assert pairs == expected
  # A group's entries are contiguous; within them, runs of one column tile
  # hold consecutive row tiles: whole bands of `width` tiles (the last band
  # of a group shorter), each band visiting every column tile.
  for g in range(held):
    mine = [L for L, r in enumerate(table) if r[1] == g]
    if not mine:
      continue
    assert mine == list(range(mine[0], mine[0] + len(mine)))
    tiles = len(mine) // n_tiles
    bands = [min(width, tiles - b) for b in range(0, tiles, width)]
    runs, L = [], mine[0]
    for size in (b for b in bands for _ in range(n_tiles)):
      run = table[L:L + size]
      assert np.all(run[:, 4] == run[0, 4])
      assert np.all(np.diff(run[:, 0]) == bm)
      runs.append(run)
      L += size
    for b in range(len(bands)):
      cols = [r[0, 4] for r in runs[b * n_tiles:(b + 1) * n_tiles]]
      assert sorted(cols) == list(range(n_tiles))
      assert cols == sorted(cols, reverse=b % 2 == 1)  # snaking between bands


@pytest.mark.parametrize("sizes,m,held,offset", [
    ([100, 0, 333, 1, 0, 466, 100], 1100, 7, 0),
    ([100, 200, 0, 150, 300], 800, 2, 2),
    ([2000, 24, 900], 3000, 3, 0),
])
@pytest.mark.parametrize("bm,n_tiles,width,sms", [(128, 5, 2, 7), (256, 3, 4, 5),
                                                 (128, 1, 8, 132)])
def test_ordered_items_sharer_blocks(sizes, m, held, offset, bm, n_tiles, width, sms):
  """`sync_sharers`' columns: each row's block is the run of consecutive rows
  holding its band's row tiles of its column tile; and `meet_sharers`'
  protocol over them (indices dealt round robin to `sms` blocks, all
  resident) finishes in any interleaving with every semaphore back at zero."""
  starts, ends = tokamax.plugin.held_row_ranges(jnp.asarray(sizes, jnp.int32), offset, held, m)
  items = jnp.asarray(rdk.work_items(starts, ends, m, bm))
  plain = np.asarray(rdk.ordered_items(items, n_tiles, width))
  table = np.asarray(rdk.ordered_items(items, n_tiles, width, sharers=True))
  assert table.shape == (plain.shape[0], 7)
  np.testing.assert_array_equal(table[:, :5], plain)
  for L, row in enumerate(table):
    first, count = row[rdk._FIRST], row[rdk._SHARERS]
    assert first <= L < first + count and 1 <= count <= width
    block = table[first:first + count]
    # One group and column tile, consecutive row tiles, the same block.
    assert np.all(block[:, 1] == row[1]) and np.all(block[:, 4] == row[4])
    assert np.all(block[:, 5:] == row[5:])
    assert np.all(np.diff(block[:, 0]) == bm)
    if row[1] < 0:
      assert count == 1  # zero and past-the-end items meet nobody
  for seed in range(5):
    assert _replay_meetings(table, sms, np.random.default_rng(seed)) == [0] * sms
  # Where a group has several row tiles (and bands may hold several), they meet.
  groups = np.asarray(items)[:, 1]
  multi = any(np.count_nonzero(groups == g) > 1 for g in range(held))
  assert (table[:, rdk._SHARERS] > 1).any() == (multi and width > 1)


def _replay_meetings(table, sms, rng):
  """`_GroupTiles.meet_sharers` over a table: block b runs indices b, b + sms,
  ...; before a meeting item it signals the semaphore of each other member's
  block, then waits for (and takes) count - 1 on its own. Blocks step in a
  random order; returns the semaphores at the end, None on a deadlock."""
  todo = [list(range(b, table.shape[0], sms)) for b in range(sms)]
  sems, signalled = [0] * sms, [False] * sms
  while any(todo):
    progressed = False
    for b in rng.permutation(sms):
      if not todo[b]:
        continue
      L = todo[b][0]
      first, count = table[L, rdk._FIRST], table[L, rdk._SHARERS]
      if table[L, 1] < 0 or table[L, 3] <= table[L, 2] or count == 1:
        todo[b].pop(0)
        progressed = True
        continue
      if not signalled[b]:
        for other in range(first, first + count):
          if other != L:
            sems[other % sms] += 1
        signalled[b] = progressed = True
      if sems[b] >= count - 1:
        sems[b] -= count - 1
        signalled[b] = False
        todo[b].pop(0)
        progressed = True
    if not progressed:
      return None
  return sems


def test_sync_sharers_needs_the_group_order():
  with pytest.raises(ValueError, match="sync_sharers=True needs item_order='group'"):
    rd.RaggedDotConfig(sync_sharers=True)
  rd.RaggedDotConfig(item_order="group", sync_sharers=True)


def test_sync_sharers_refused_by_the_interpreter():
  if not rd._common.interpreter_runs_these_kernels():
    pytest.skip("JAX's Mosaic GPU interpreter does not run these kernels here")
  config = rd.RaggedDotConfig(item_order="group", grid_tile_width=1,
                              sync_sharers=True)
  lhs, rhs = _inputs(256, 64, 128, 2, jnp.bfloat16)
  starts = jnp.asarray([0, 100], jnp.int32)
  ends = jnp.asarray([100, 256], jnp.int32)
  with tokamax.interpret(), pytest.raises(NotImplementedError, match="interpreter"):
    rd.grouped_matmul(lhs, rhs, starts, ends, transpose_rhs=False,
                      out_dtype=jnp.bfloat16, config=config)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_sync_sharers_lowers_for_cuda(transpose_rhs):
  pytest.importorskip("absl")
  config = rd.RaggedDotConfig(block_n=64, num_stages=2, item_order="group",
                              grid_tile_width=3, sync_sharers=True)
  _grouped_matmul_lowers(700, 128, 200, 3, config, transpose_rhs)


def test_claim_items_validation():
  with pytest.raises(ValueError, match="claim_items=True needs row_tiling='group'"):
    rd.RaggedDotConfig(block_m=64, row_tiling="fixed", claim_items=True)
  with pytest.raises(ValueError, match="exclude each other"):
    rd.RaggedDotConfig(item_order="group", sync_sharers=True, claim_items=True)
  rd.RaggedDotConfig(item_order="group", claim_items=True)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("block_m,order", [(128, "group"), (256, "snake")])
def test_claim_items_lowers_for_cuda(transpose_rhs, block_m, order):
  """The claimed item loop (the inlined atomic add, the slots' barriers)
  traces and lowers to Mosaic GPU for "cuda"."""
  pytest.importorskip("absl")
  config = rd.RaggedDotConfig(block_m=block_m, block_n=64, num_stages=2,
                              item_order=order, grid_tile_width=3,
                              claim_items=True)
  _grouped_matmul_lowers(700, 128, 200, 3, config, transpose_rhs)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_claim_items_vmapped_deals_round_robin(transpose_rhs):
  """Pallas batches a vmapped kernel into one launch, whose batch instances
  would share the claims' one counter (each running only the items its own
  blocks claimed): a vmapped call must lower to the round-robin deal (no
  atomic add), the plain call to claims."""
  pytest.importorskip("absl")
  m, k, n, g = 700, 128, 200, 3
  config = rd.RaggedDotConfig(block_n=64, num_stages=2, item_order="group",
                              claim_items=True)

  def f(lhs, rhs, sizes):
    starts, ends = tokamax.plugin.held_row_ranges(sizes, None, g, m)
    return rd.grouped_matmul(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
                             out_dtype=jnp.bfloat16, config=config)
  rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32)

  def module(fn, lhs_shape):
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(
        jax.ShapeDtypeStruct(lhs_shape, jnp.bfloat16), rhs, sizes).mlir_module()
  assert "atom.global.add" in module(f, (m, k))
  batched = module(jax.vmap(f, in_axes=(0, None, None)), (2, m, k))
  assert "mosaic_gpu" in batched and "atom.global.add" not in batched
  nested = module(jax.vmap(jax.vmap(f, in_axes=(0, None, None)),
                           in_axes=(0, None, None)), (2, 2, m, k))
  assert "mosaic_gpu" in nested and "atom.global.add" not in nested


def _snake_or_table(config, items, n_tiles):
  if config.item_order == "group":
    table = np.asarray(rdk.ordered_items(jnp.asarray(items), n_tiles,
                                         config.grid_tile_width))
    return [(L, int(table[L, 4])) for L in range(table.shape[0])], table
  order = []
  for L in range(items.shape[0] * n_tiles):
    ii, ni = rdk.plgpu.planar_snake(jnp.int32(L), (items.shape[0], n_tiles), 1,
                                    config.grid_tile_width)
    order.append((int(ii), int(ni)))
  return order, items


@pytest.mark.parametrize("config", [
    rd.RaggedDotConfig(block_m=256, block_n=64, item_order="group", grid_tile_width=2),
    rd.RaggedDotConfig(block_m=256, block_n=64, grid_tile_width=3),
    rd.RaggedDotConfig(block_n=32 * 2, item_order="group", grid_tile_width=3),
], ids=lambda c: f"m{c.block_m}{c.item_order}")
@pytest.mark.parametrize("sizes,m,held,offset", [
    ([70, 0, 1, 255, 257, 0, 129, 300], 1100, 8, 0),
    ([100, 200, 0, 150, 300], 800, 2, 2),
    ([5, 9, 0], 37, 3, 0),
])
def test_tall_and_order_tile_model(config, sizes, m, held, offset):
  """A NumPy model of the kernel's item loop (tables, order, 64-row halves a
  warpgroup issues, rows it stores) against the reference: every output row is
  stored exactly once, from halves that were computed."""
  rng = np.random.default_rng(0)
  k, n = 48, 200
  starts, ends = tokamax.plugin.held_row_ranges(jnp.asarray(sizes, jnp.int32), offset, held, m)
  bm, half, cta_n = config.block_m, config.block_m // 2, rdk.cta_n(config)
  m_pad, n_tiles = max(-(-m // 8) * 8, bm), -(-n // cta_n)
  lhs = np.zeros((m_pad + bm, k))
  lhs[:m] = rng.standard_normal((m, k))
  rhs = np.zeros((held, k, n_tiles * cta_n))
  rhs[:, :, :n] = rng.standard_normal((held, k, n))
  items = np.asarray(rdk.work_items(starts, ends, m_pad, bm))
  order, table = _snake_or_table(config, items, n_tiles)
  out = np.full((m_pad, n_tiles * cta_n), np.nan)
  for ii, ni in order:
    row0, group, lo, hi = table[ii][:4]
    n0 = ni * cta_n
    for w in range(2):
      wlo, whi = np.clip(lo - w * half, 0, half), np.clip(hi - w * half, 0, half)
      acc = np.full((half, cta_n), np.nan)  # halves never issued stay NaN
      for h in range(half // 64):
        if group >= 0 and min(whi, 64 * (h + 1)) > max(wlo, 64 * h):
          r = row0 + w * half + 64 * h
          acc[64 * h:64 * h + 64] = lhs[r:r + 64] @ rhs[group][:, n0:n0 + cta_n]
      if group < 0:
        acc[:] = 0
      dst = row0 + w * half
      assert np.all(np.isnan(out[dst + wlo:dst + whi, n0:n0 + cta_n])), "twice"
      out[dst + wlo:dst + whi, n0:n0 + cta_n] = acc[wlo:whi]
  ref = np.asarray(_reference(jnp.asarray(lhs[:m], jnp.float32),
                              jnp.asarray(rhs[:, :, :n], jnp.float32),
                              jnp.asarray(sizes, jnp.int32), offset), np.float64)
  assert not np.any(np.isnan(out[:m, :n])), "rows never written or from skipped halves"
  np.testing.assert_allclose(out[:m, :n], ref, rtol=1e-4, atol=1e-4)


def test_weight_reuse_config_validation_and_space():
  with pytest.raises(ValueError, match="block_n <= 128"):
    rd.RaggedDotConfig(block_m=256, block_n=256)
  with pytest.raises(ValueError, match="item_order must"):
    rd.RaggedDotConfig(item_order="zigzag")
  with pytest.raises(ValueError, match="item_order='group' needs"):
    rd.RaggedDotConfig(block_m=128, row_tiling="fixed", item_order="group")
  tall = rd.RaggedDotConfig(block_m=256, block_n=128, num_stages=4, out_pieces=2)
  assert rdk.cta_n(tall) == 128
  # Stage (256 x 64 + 64 x 128) x 2 B, staging 256 x 128 x 2 B / 2 pieces.
  assert rd.smem_bytes(tall, 2, 2) == 4 * 49152 + 32768 + 1024
  assert rd.smem_bytes(rd.RaggedDotConfig(), 2, 2) == 3 * 49152 + 65536 + 1024
  for g in (16, 256):
    space = rd._search_space(65536, 7168, 2048, g, 2, 2)
    assert all(rd.smem_bytes(c, 2, 2) <= rd._common.SMEM_LIMIT for c in space)
    assert tall in space
    assert rd.RaggedDotConfig(num_stages=4, out_pieces=2, item_order="group") in space
    assert dataclasses.replace(tall, item_order="group") in space
  # The defaults did not move.
  assert rd.RaggedDotConfig().item_order == "snake"
  assert rd.heuristic(0, 0, 0, 1, 2, 2) == rd.RaggedDotConfig()


def test_output_pieces_narrower_than_the_swizzle_are_refused():
  # 256 x 64 items staged in two 32-column pieces failed on the H200 with a
  # misaligned address.
  with pytest.raises(ValueError, match="pieces of >= 64 columns"):
    rd.RaggedDotConfig(block_m=256, block_n=64, block_k=32, num_stages=2,
                       out_pieces=2)
  rd.RaggedDotConfig(block_n=64, block_k=32, num_stages=2, out_pieces=2)  # 128 wide


@pytest.mark.parametrize("fields,match", [
    (dict(block_n=256, out_pieces=2), "block_n <= 128"),
    (dict(block_n=64, out_pieces=2), "block_n >= 128"),
])
def test_ws_drhs_refuses_tiles_it_cannot_hold(fields, match):
  with pytest.raises(ValueError, match=match):
    rd.RaggedDotConfig(drhs_kernel="ws", num_stages=2, **fields)
  rd.RaggedDotConfig(drhs_kernel="ring", num_stages=2, **fields)  # the forward's fine


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("g,n,block_m,order", [
    (16, 512, 128, "group"),  # 256 rows per group: `heuristic`'s 3 stages
    (8, 640, 256, "group"),  # 512 rows, 128-row items would pad N to 768
    (8, 512, 128, "group"),  # 512 rows, N a multiple of 256: 128-row items
    (4, 640, 128, "group")])  # 1024 rows: 128-row items
def test_forward_heuristic_lowers_for_cuda(transpose_rhs, g, n, block_m, order):
  """The forward's default by rows per group and N, lowered."""
  pytest.importorskip("absl")
  m, k = 4096, 256
  config = rd._forward_heuristic(m, k, n, g, 2, 2)
  assert (config.block_m, config.item_order) == (block_m, order)
  assert config.num_stages == (3 if g == 16 else 4)
  _grouped_matmul_lowers(m, k, n, g, config, transpose_rhs)
