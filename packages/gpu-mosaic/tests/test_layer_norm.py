"""The Mosaic GPU layer / RMS norm: natively on a Hopper GPU against the XLA
reference (forward and gradients, every config, widths the backward refuses),
its refusals, configs and CUDA lowering on any machine. The Mosaic GPU
interpreter runs both kernels in tests/test_interpret.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops.layer_norm import LayerNormArgs
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import layer_norm as mln

_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))


def gpu(test):
  """A native test: skipped off a Hopper GPU, and marked `gpu` so that the
  native run of README.md (`pytest -m gpu`) selects it."""
  hopper_only = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
  return pytest.mark.gpu(hopper_only(test))


H200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
_seed = iter(range(1_000_000))


def _normal(shape, dtype, scale=1.0, shift=0.0):
  rng = np.random.default_rng(next(_seed))
  return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype)


def _args(r, d, dtype=jnp.bfloat16, **kwargs):
  return LayerNormArgs(x=jax.ShapeDtypeStruct((r, d), dtype), **kwargs)


def test_registered_with_its_backward():
  """Where the backward declines, dispatch keeps this forward and runs another
  backward on its residuals (core's tests/test_training_choice.py)."""
  specs = {(s.op, s.name): s for s in tokamax.implementations()}
  assert specs["layer_norm", "mosaic_gpu"].has_backward


def test_refusals():
  op = mln.MosaicGpuLayerNorm()
  op.check_supported(_args(4, 1024), H200)
  with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
    op.check_supported(_args(4, 1024), tokamax.DeviceInfo("cpu", "cpu"))
  for d in (1000, 1088, 2 * mln.MAX_BLOCK_ELEMENTS):
    with pytest.raises(NotImplementedError, match=f"multiple of 128 .*got {d}"):
      op.check_supported(_args(4, d), H200)
  for d in (128, 896, 1536, 3584):  # tail pieces (`mln.row_pieces`)
    op.check_supported(_args(4, d), H200)
  with pytest.raises(NotImplementedError, match="float64"):
    op.check_supported(_args(4, 1024, scale=jax.ShapeDtypeStruct((1024,), "float64")),
                       H200)
  with pytest.raises(NotImplementedError, match="2\\*\\*31"):
    op.check_supported(_args(2**18, 8192), H200)
  with pytest.raises(ValueError, match="power of 2"):
    op.forward(LayerNormArgs(x=jnp.zeros((6, 1024), jnp.bfloat16)),
               mln.LayerNormConfig(rows_per_block=3))
  with pytest.raises(ValueError, match="at most 16384 fit registers"):
    op.forward(LayerNormArgs(x=jnp.zeros((8, 4096), jnp.bfloat16)),
               mln.LayerNormConfig(rows_per_block=8))


def test_backward_declines_only_where_it_measured_slower():
  vjp = mln.MosaicGpuLayerNormVjp()
  with_params = lambda r, d, **kw: _args(
      r, d, scale=jax.ShapeDtypeStruct((d,), jnp.bfloat16),
      offset=jax.ShapeDtypeStruct((d,), jnp.bfloat16), **kw)
  for args in (with_params(131072, 1024), with_params(65536, 2048),
               with_params(4096, 4096), with_params(26214, 5120),
               with_params(16384, 8192), _args(10922, 12288, subtract_mean=False),
               _args(4096, 3072)):
    assert vjp.declines(args) is None, args.x.shape
  assert vjp.declines(with_params(10922, 12288)) is None
  # Split over two warpgroups: taken. On one (13 or 15 pieces): declined.
  assert vjp.declines(with_params(8192, 16384)) is None
  for d in (13312, 15360):
    assert "LayerNorm at" in vjp.declines(with_params(8192, d))
  assert vjp.declines(_args(8192, 16384, subtract_mean=False)) is None
  for d in (1024, 2048):
    assert "too few rows" in vjp.declines(with_params(4096, d))


def test_forward_declines_only_rows_of_tails():
  # Its RMSNorm decline at 4096 rows of >= 8192 columns went with the auto
  # barriers (measured since: as fast or faster forward+backward).
  op = mln.MosaicGpuLayerNorm()
  for args in (_args(4096, 8192), _args(4096, 8192, subtract_mean=False),
               _args(4096, 16384, subtract_mean=False), _args(1024, 1024)):
    assert op.declines(args) is None
  # Rows narrower than one whole piece run, named, but measured slower than
  # Triton's: both directions pass them on. A tail after whole pieces: taken.
  vjp = mln.MosaicGpuLayerNormVjp()
  for d in (128, 640, 896):
    assert "tail pieces only" in op.declines(_args(32768, d))
    assert "tail pieces only" in vjp.declines(_args(32768, d))
  for d in (1280, 3584, 14848):
    assert op.declines(_args(32768, d)) is None
    assert vjp.declines(_args(32768, d, subtract_mean=False)) is None


@pytest.mark.parametrize("d,itemsize,want", [
    # (start, columns, elements a thread's vector): 1024-column pieces, then
    # the rest halving, each tail with the widest vector its columns take.
    (2048, 2, [(0, 1024, 8), (1024, 1024, 8)]),
    (3584, 2, [(0, 1024, 8), (1024, 1024, 8), (2048, 1024, 8), (3072, 512, 4)]),
    (896, 2, [(0, 512, 4), (512, 256, 2), (768, 128, 1)]),
    (2304, 2, [(0, 1024, 8), (1024, 1024, 8), (2048, 256, 2)]),
    (128, 2, [(0, 128, 1)]),
    # float32: 16 bytes are 4 elements, a 1024-column piece two vectors.
    (1536, 4, [(0, 1024, 4), (1024, 512, 4)]),
    (640, 4, [(0, 512, 4), (512, 128, 1)])])
def test_row_pieces(d, itemsize, want):
  assert [tuple(p) for p in mln.row_pieces(d, itemsize)] == want


def test_row_pieces_of_a_warpgroup():
  """A warpgroup's columns of a split row start at its first column."""
  assert [tuple(p) for p in mln.row_pieces(2048, 2, start=4096)] == [
      (4096, 1024, 8), (5120, 1024, 8)]


def test_backward_refusals():
  vjp = mln.MosaicGpuLayerNormVjp()
  args = lambda d, **kw: _args(8, d, scale=jax.ShapeDtypeStruct((d,), jnp.float32),
                               **kw)
  vjp.check_supported(args(8192, offset=jax.ShapeDtypeStruct((8192,), jnp.bfloat16)),
                      H200)
  vjp.check_supported(args(16384, subtract_mean=False), H200)  # RMSNorm: dscale only
  # Both gradient sums over the register budget: the offset's in shared memory.
  vjp.check_supported(args(16384, offset=jax.ShapeDtypeStruct((16384,), "bfloat16")),
                      H200)
  with pytest.raises(NotImplementedError, match="do not fit shared memory"):
    vjp.check_supported(_args(8, 16384, jnp.float32, subtract_mean=False), H200)
  with pytest.raises(NotImplementedError, match="mean and rstd residuals"):
    vjp.check_supported(args(1024), H200, residuals={})
  vjp.check_supported(args(1024), H200, residuals={"mean": 0, "rstd": 0})
  with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
    vjp.check_supported(args(1024), tokamax.DeviceInfo("cpu", "cpu"))
  with pytest.raises(NotImplementedError, match="multiple of 128"):
    vjp.check_supported(args(1000), H200)
  vjp.check_supported(args(3584), H200)
  x = jnp.zeros((8, 8192), jnp.bfloat16)
  full = LayerNormArgs(x=x, scale=jnp.ones(8192), offset=jnp.ones(8192))
  residuals = {"mean": jnp.zeros(8), "rstd": jnp.ones(8)}
  with pytest.raises(ValueError, match="shared memory at 8192 columns"):
    vjp.backward(full, residuals, x, x, mln.LayerNormVjpConfig(num_stages=8))
  with pytest.raises(ValueError, match="num_stages must be >= 2"):
    vjp.backward(full, residuals, x, x, mln.LayerNormVjpConfig(num_stages=1))
  with pytest.raises(ValueError, match="blocks_per_sm must be >= 1"):
    vjp.backward(full, residuals, x, x, mln.LayerNormVjpConfig(blocks_per_sm=0))


@pytest.mark.parametrize("d,dtype,config", [
    (1024, jnp.bfloat16, mln.LayerNormVjpConfig(8, 3)),  # 8 x 12 KiB
    (1024, jnp.float32, mln.LayerNormVjpConfig(4, 3)),  # the slot of bf16 2048
    (3072, jnp.bfloat16, mln.LayerNormVjpConfig(4, 2)),
    (4096, jnp.bfloat16, mln.LayerNormVjpConfig(3, 2)),
    (5120, jnp.bfloat16, mln.LayerNormVjpConfig(2, 3)),
    (8192, jnp.bfloat16, mln.LayerNormVjpConfig(2, 2)),  # 2 x 64 KiB
    # One block an SM: its rows split over two warpgroups.
    (12288, jnp.bfloat16, mln.LayerNormVjpConfig(1, 3, 2)),  # 144 KiB
    (8192, jnp.float32, mln.LayerNormVjpConfig(1, 2, 2)),  # 128 KiB
    (16384, jnp.bfloat16, mln.LayerNormVjpConfig(1, 2, 2)),
    (13312, jnp.bfloat16, mln.LayerNormVjpConfig(1, 2))])  # 13 pieces: one
def test_backward_heuristic_fits_shared_memory(d, dtype, config):
  args = _args(4096, d, dtype, scale=jax.ShapeDtypeStruct((d,), jnp.bfloat16),
               subtract_mean=False)
  assert mln.heuristic_vjp_config(args) == config
  space = mln.vjp_search_space(args)
  assert config in space
  assert all(c.blocks_per_sm * mln.bwd_smem_bytes(args, c) <= _common.SMEM_LIMIT
             for c in space)


@pytest.mark.parametrize("d", [9216, 12288, 13312, 16384])
def test_offset_sums_in_shared_memory_above_8192_columns(d):
  """With a scale and an offset on one warpgroup a block: one block of two
  slots (the measured best at 12288), whatever the grid says for the width;
  split over two warpgroups where they divide the pieces, the sums in
  registers."""
  vec = lambda d: jax.ShapeDtypeStruct((d,), jnp.bfloat16)
  both = lambda d: _args(4096, d, scale=vec(d), offset=vec(d))
  assert not mln._offset_sums_in_smem(both(8192))
  assert not mln._offset_sums_in_smem(_args(4096, d, scale=vec(d), subtract_mean=False))
  assert mln._offset_sums_in_smem(both(d))
  one = mln.LayerNormVjpConfig(1, 2)
  assert mln._one_warpgroup_config(both(d)) == one
  # The slots (x and dy rows of bf16), one float32 row of sums and Pallas'
  # 2 KiB reduction scratch.
  assert mln.bwd_smem_bytes(both(d), one) == 2 * 2 * d * 2 + 4 * d + 2048
  assert mln.bwd_smem_bytes(both(d), one) <= _common.SMEM_LIMIT
  split = (d // 1024) % 2 == 0
  assert mln.heuristic_vjp_config(both(d)) == mln.LayerNormVjpConfig(
      1, 2, 2 if split else 1)
  assert not mln._offset_sums_in_smem(both(d), 2)  # two warpgroups' registers hold both


def test_backward_warpgroups():
  """Several warpgroups a block: each keeps its columns' parameter sums in
  registers (both sums of 16384 columns fit over two); they must divide the
  row's 1024-column pieces; the heuristic takes two where one block an SM
  fits, the search space two and four."""
  vec = lambda d: jax.ShapeDtypeStruct((d,), jnp.bfloat16)
  both = _args(4096, 16384, scale=vec(16384), offset=vec(16384))
  assert mln._offset_sums_in_smem(both) and not mln._offset_sums_in_smem(both, 2)
  # Two slots of x and dy rows, and the exchange's two buffers (1 KiB each);
  # with the scale's copy, its bf16 row too.
  assert mln.bwd_smem_bytes(both, mln.LayerNormVjpConfig(1, 2, 2)) == (
      2 * 2 * 16384 * 2 + 2 * 1024)
  assert mln.bwd_smem_bytes(both, mln.LayerNormVjpConfig(1, 2, 2, True)) == (
      2 * 2 * 16384 * 2 + 2 * 1024 + 16384 * 2)
  assert mln.bwd_smem_bytes(_args(4096, 16384), mln.LayerNormVjpConfig(1, 2, 2, True)) == (
      2 * 2 * 16384 * 2 + 2 * 1024)  # no scale: no copy
  assert {c.warpgroups for c in mln.vjp_search_space(both)} == {1, 2, 4}
  assert mln.heuristic_vjp_config(both) == mln.LayerNormVjpConfig(1, 2, 2)
  # Two one-warpgroup blocks an SM at 8192 columns: not split (it measured
  # slower).
  assert mln.heuristic_vjp_config(_args(4096, 8192)).warpgroups == 1
  assert {c.warpgroups for c in mln.vjp_search_space(_args(4096, 13312))} == {1}
  vjp = mln.MosaicGpuLayerNormVjp()
  x = jnp.zeros((8, 3072), jnp.bfloat16)
  args = LayerNormArgs(x=x, scale=jnp.ones(3072))
  residuals = {"mean": jnp.zeros(8), "rstd": jnp.ones(8)}
  with pytest.raises(ValueError, match="warpgroups=2 must divide the row's 3 1024-column"):
    vjp.backward(args, residuals, x, x, mln.LayerNormVjpConfig(1, 2, 2))
  with pytest.raises(ValueError, match="warpgroups must be 1, 2 or 4; got 3"):
    vjp.backward(args, residuals, x, x, mln.LayerNormVjpConfig(1, 2, 3))
  # Tail pieces: one warpgroup a row only (each reduces one piece shape), in
  # the heuristic and the search space too.
  x = jnp.zeros((8, 4608), jnp.bfloat16)
  args = LayerNormArgs(x=x, scale=jnp.ones(4608))
  with pytest.raises(ValueError, match="whole 1024-column pieces only; got 4608"):
    vjp.backward(args, residuals, x, x, mln.LayerNormVjpConfig(1, 2, 2))
  assert {c.warpgroups for c in mln.vjp_search_space(_args(4096, 14848))} == {1}
  assert mln.heuristic_vjp_config(_args(4096, 14848)).warpgroups == 1
  x = jnp.zeros((8, 4096), jnp.bfloat16)
  args = LayerNormArgs(x=x, scale=jnp.ones(4096))
  with pytest.raises(ValueError, match="at most 32 .a barrier each.; got 9 x 4"):
    vjp.backward(args, residuals, x, x, mln.LayerNormVjpConfig(1, 9, 4))


@pytest.mark.parametrize("r,d,rows", [(4096, 1024, 4), (4096, 2048, 4), (6, 1024, 2),
                                      (7, 1024, 1), (65536, 16384, 1)])
def test_heuristic_divides_the_rows_and_fits_registers(r, d, rows):
  config = mln.heuristic_config(_args(r, d))
  assert config.rows_per_block == rows
  assert config in mln.search_space(_args(r, d))
  assert all(r % c.rows_per_block == 0
             and c.rows_per_block * d <= mln.MAX_BLOCK_ELEMENTS
             for c in mln.search_space(_args(r, d)))


@pytest.mark.parametrize("d,dtype,params,most_slots", [
    (8192, jnp.bfloat16, False, 12), (4096, jnp.float32, False, 12),
    (16384, jnp.bfloat16, False, 6), (16384, jnp.float32, False, 3),
    (16384, jnp.bfloat16, True, 3), (4096, jnp.bfloat16, False, None)])
def test_ring_configs_fit_shared_memory(d, dtype, params, most_slots):
  """The ring's configs in the search space: every one fits its blocks' slots
  and its copy of the scale and offset in an SM's shared memory, and the
  largest fit is there (4 slots x 3 blocks of 16 KiB rows; 3 x 2 of 32 KiB; 3
  x 1 of 64 KiB; 3 x 1 of 32 KiB beside a float32 scale and a bfloat16 offset,
  96 KiB: 4 x 1 would leave less than the 3 KiB counted for Pallas' own scratch,
  about 2.1 KiB at lowering); none for rows under 16 KiB."""
  vec = lambda dtype: jax.ShapeDtypeStruct((d,), dtype) if params else None
  args = _args(4096, d, dtype, scale=vec(jnp.float32), offset=vec(jnp.bfloat16))
  ring = [c for c in mln.search_space(args) if c.num_stages]
  row, kept = d * jnp.dtype(dtype).itemsize, (6 * d if params else 0)
  assert all(c.blocks_per_sm * (c.num_stages * row + kept + _common.PALLAS_SMEM_SCRATCH)
             <= _common.SMEM_LIMIT
             and c.rows_per_block == 1 for c in ring)
  assert max((c.blocks_per_sm * c.num_stages for c in ring), default=None) == most_slots


@pytest.mark.parametrize("config,match", [
    (mln.LayerNormConfig(num_stages=1), "num_stages must be 0 .no ring. or 2 to 32; got 1"),
    (mln.LayerNormConfig(2, num_stages=2), "rows_per_block must be 1; got 2"),
    (mln.LayerNormConfig(num_stages=2, blocks_per_sm=0), "blocks_per_sm must be >= 1; got 0"),
    (mln.LayerNormConfig(num_stages=4, blocks_per_sm=2),
     "2 blocks an SM of 4 16384-column slots need 268288 bytes")])
def test_ring_config_errors(config, match):
  x = jnp.zeros((8, 16384), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    mln.MosaicGpuLayerNorm(config).forward(LayerNormArgs(x=x), config)


@pytest.mark.parametrize("config", [
    mln.LayerNormConfig(rows_per_block=4), mln.LayerNormConfig(4, auto_barriers=True),
    mln.LayerNormConfig(num_stages=3, blocks_per_sm=2),
    mln.LayerNormConfig(num_stages=2, blocks_per_sm=1, auto_barriers=True)])
@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("d", [3072, 3968])  # 3968: every tail piece
def test_lowers_for_cuda(subtract_mean, with_stats, config, d):
  if config.rows_per_block * d > mln.MAX_BLOCK_ELEMENTS:
    config = dataclasses.replace(config, rows_per_block=2)
  args = LayerNormArgs(x=jax.ShapeDtypeStruct((4096, d), jnp.bfloat16),
                       scale=jax.ShapeDtypeStruct((d,), jnp.float32),
                       offset=jax.ShapeDtypeStruct((d,), jnp.bfloat16),
                       subtract_mean=subtract_mean)

  def forward(x, scale, offset):
    a = LayerNormArgs(x=x, scale=scale, offset=offset, subtract_mean=subtract_mean)
    return mln.layer_norm_forward(a, config, with_stats=with_stats)

  exported = jax.export.export(jax.jit(forward), platforms=["cuda"])(
      args.x, args.scale, args.offset)
  assert "mosaic_gpu" in exported.mlir_module()
  shapes = [a.shape for a in exported.out_avals]
  assert shapes == [(4096, d)] + [(4096,)] * (2 if with_stats else 0)


@pytest.mark.parametrize("config,body", [
    (mln.LayerNormConfig(4), "_kernel"), (mln.LayerNormConfig(num_stages=2), "_ring_kernel")])
def test_num_stages_picks_the_kernel(monkeypatch, config, body):
  """The numerical tests pass with either kernel; this says which one a config
  runs: the ring's body with `num_stages`, the direct kernel's without."""
  traced = []

  def spy(name):
    kernel = getattr(mln, name)

    def traced_kernel(*refs, **kwargs):
      traced.append(name)
      return kernel(*refs, **kwargs)
    return traced_kernel

  for name in ("_kernel", "_ring_kernel"):
    monkeypatch.setattr(mln, name, spy(name))
  x = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
  jax.export.export(jax.jit(lambda x: mln.layer_norm_forward(
      LayerNormArgs(x=x), config, with_stats=False)), platforms=["cuda"])(x)
  assert traced and set(traced) == {body}


_BF16, _F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("d,stages,warpgroups,scale_in_smem,scale_dtype,auto_barriers", [
    (2048, 2, 1, False, _BF16, False), (2048, 4, 1, False, _BF16, False),
    (16384, 2, 1, False, _BF16, False), (16384, 2, 4, False, _BF16, False),
    (4096, 3, 2, False, _BF16, False), (16384, 2, 2, True, _F32, False),
    (2048, 3, 1, True, _F32, False), (8192, 2, 4, True, _BF16, False),
    # With Pallas' auto barriers (opt-in): one warpgroup (the offset's sums in
    # shared memory at 16384), two (the row sums' exchange).
    (16384, 2, 1, False, _BF16, True), (4096, 3, 2, False, _BF16, True),
    # Tail pieces (512 + 256 + 128 columns after the whole ones); the offset's
    # sums in shared memory at 14208 columns.
    (3968, 3, 1, False, _BF16, False), (14208, 2, 1, True, _F32, False)])
@pytest.mark.parametrize("scale,offset", [(True, True), (False, True), (False, False)])
def test_backward_lowers_for_cuda(scale, offset, d, stages, warpgroups, scale_in_smem,
                                  scale_dtype, auto_barriers):
  """At 16384 columns with both parameters the offset's sums are in shared
  memory (one warpgroup a block; in registers with four). The scale's copy in
  shared memory in float32 (its pieces load 8 of its elements a thread, as
  x's) and bfloat16."""
  vec = lambda dtype: jax.ShapeDtypeStruct((d,), dtype)
  args = LayerNormArgs(x=jax.ShapeDtypeStruct((1031, d), jnp.bfloat16),
                       scale=vec(scale_dtype) if scale else None,
                       offset=vec(jnp.bfloat16) if offset else None)
  config = mln.LayerNormVjpConfig(blocks_per_sm=3 if d <= 2048 else 1, num_stages=stages,
                                  warpgroups=warpgroups, scale_in_smem=scale_in_smem,
                                  auto_barriers=auto_barriers)

  def backward(x, dy, mean, rstd, *params):
    params = iter(params)
    a = LayerNormArgs(x=x, scale=next(params) if scale else None,
                      offset=next(params) if offset else None)
    return mln.layer_norm_backward(a, mean, rstd, dy, config)

  row = jax.ShapeDtypeStruct((1031,), jnp.float32)
  params = [p for p in (args.scale, args.offset) if p is not None]
  exported = jax.export.export(jax.jit(backward), platforms=["cuda"])(
      args.x, args.x, row, row, *params)
  assert "mosaic_gpu" in exported.mlir_module()
  assert len(exported.out_avals) == 1 + scale + offset


@pytest.mark.parametrize("d,offset,fits", [
    (14336, False, True), (14464, False, False), (11392, True, True), (11520, True, False)])
def test_backward_shared_memory_at_the_limit(d, offset, fits):
  """Float32 rows at the widest the backward takes: what `check_backward_args`
  accepts lowers for CUDA (Pallas counts its own buffers at lowering), the
  next width up is refused before it. The count must be exact: rows grow in
  steps of 128 columns."""
  vec = jax.ShapeDtypeStruct((d,), jnp.float32)
  args = LayerNormArgs(x=jax.ShapeDtypeStruct((1031, d), jnp.float32), scale=vec,
                       offset=vec if offset else None)
  if not fits:
    with pytest.raises(NotImplementedError, match="do not fit shared memory"):
      mln.check_backward_args(args, None)
    return
  mln.check_backward_args(args, None)
  config = mln.heuristic_vjp_config(args)

  def backward(x, dy, mean, rstd, *params):
    a = LayerNormArgs(x=x, scale=params[0], offset=params[1] if offset else None)
    return mln.layer_norm_backward(a, mean, rstd, dy, config)

  row = jax.ShapeDtypeStruct((1031,), jnp.float32)
  exported = jax.export.export(jax.jit(backward), platforms=["cuda"])(
      args.x, args.x, row, row, *[vec] * (1 + offset))
  assert "mosaic_gpu" in exported.mlir_module()


def test_backward_warpgroups_lower_for_cuda_in_float32():
  """A float32 x: the pieces (and the inline reduction's strided layout) take
  4 elements a thread instead of 8."""
  d = 4096
  x = jax.ShapeDtypeStruct((1031, d), jnp.float32)
  vec = jax.ShapeDtypeStruct((d,), jnp.float32)
  row = jax.ShapeDtypeStruct((1031,), jnp.float32)

  def backward(x, dy, mean, rstd, scale, offset):
    a = LayerNormArgs(x=x, scale=scale, offset=offset)
    return mln.layer_norm_backward(a, mean, rstd, dy, mln.LayerNormVjpConfig(1, 2, 2))

  exported = jax.export.export(jax.jit(backward), platforms=["cuda"])(
      x, x, row, row, vec, vec)
  assert "mosaic_gpu" in exported.mlir_module()
  assert len(exported.out_avals) == 3


def _check(r, d, dtype, subtract_mean, *, scale=True, offset=True, config=None,
           lead=None):
  """Forward and gradients (random cotangent) against the float32 XLA reference;
  the forward must be this kernel, and the backward too where it takes the
  call (`check_backward_args`)."""
  shape = lead + (r // int(np.prod(lead)), d) if lead else (r, d)
  # A shifted x with one outlier channel: two-pass statistics keep it exact.
  x = _normal(shape, dtype, 2.0, 0.5).at[..., 3].add(40.0)
  s = _normal((d,), jnp.float32) if scale else None
  o = _normal((d,), dtype) if offset else None
  try:
    mln.check_backward_args(LayerNormArgs(x=x.reshape(-1, d), scale=s, offset=o,
                                          subtract_mean=subtract_mean), None)
    backward_runs = True
  except NotImplementedError:
    backward_runs = False
  # Named, mosaic_gpu runs both directions; an instance of the forward Op lets
  # dispatch choose the backward: the first registered that takes the call,
  # this one where it runs.
  impl = ("mosaic_gpu" if backward_runs and not config
          else mln.MosaicGpuLayerNorm(config))

  def call(implementation, x, s, o):
    return tokamax.layer_norm(x, s, o, subtract_mean=subtract_mean,
                              implementation=implementation)

  with tokamax.record_dispatch() as records:
    out, vjp = jax.vjp(jax.jit(lambda *a: call(impl, *a)), x, s, o)
    dy = _normal(out.shape, dtype)
    grads = vjp(dy)
  ran = {(r.direction, r.implementation) for r in records}
  assert ("forward", "mosaic_gpu") in ran
  assert (("backward", "mosaic_gpu") in ran) == backward_runs, ran
  upcast = lambda a: None if a is None else a.astype(jnp.float32)
  ref, ref_vjp = jax.vjp(lambda *a: call("xla", *a), upcast(x), upcast(s), upcast(o))
  assert out.dtype == dtype
  testing.assert_close(out, ref, dtype, what="forward", gpu=True)
  for name, g, rg in zip(("x", "scale", "offset"), grads, ref_vjp(upcast(dy))):
    if rg is not None:
      testing.assert_close(g, rg, dtype, what=f"d{name}", scale=2.0, gpu=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("r,d", [(4096, 1024), (1031, 3072), (512, 7168), (96, 16384),
                                 (64, 8192), (40, 13312),
                                 # Tail pieces (`mln.row_pieces`): 512 columns;
                                 # 256 and 128; 512, 256 and 128 alone.
                                 (1031, 3584), (300, 2432), (70, 896)])
def test_forward_and_gradients(r, d, dtype, subtract_mean):
  _check(r, d, dtype, subtract_mean)


@gpu
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("r,d,config", [
    (1031, 2048, mln.LayerNormVjpConfig(1, 2)),  # rows uneven over blocks
    (1031, 2048, mln.LayerNormVjpConfig(4, 4)),
    (70, 4096, mln.LayerNormVjpConfig(3, 3)),  # fewer rows than blocks
    (300, 2048, mln.LayerNormVjpConfig(1, 4)),  # 3 rows a block: fewer than stages
    (20000, 8192, mln.LayerNormVjpConfig(2, 2)),
    # Rows split over a block's warpgroups.
    (8192, 16384, mln.LayerNormVjpConfig(1, 2, warpgroups=4)),
    (1031, 12288, mln.LayerNormVjpConfig(1, 3, warpgroups=2)),
    (70, 4096, mln.LayerNormVjpConfig(2, 3, warpgroups=4)),
    # The scale (float32 here) from the block's copy in shared memory.
    (8192, 16384, mln.LayerNormVjpConfig(1, 2, warpgroups=2, scale_in_smem=True)),
    (1031, 2048, mln.LayerNormVjpConfig(4, 3, scale_in_smem=True)),
    # With Pallas' auto barriers (opt-in): one warpgroup (the offset's sums in
    # shared memory at 9216), two and four (the row sums' exchange).
    (1031, 2048, mln.LayerNormVjpConfig(4, 3, auto_barriers=True)),
    (3000, 9216, mln.LayerNormVjpConfig(1, 2, auto_barriers=True)),
    (8192, 16384, mln.LayerNormVjpConfig(1, 2, warpgroups=2, auto_barriers=True)),
    (1031, 12288, mln.LayerNormVjpConfig(1, 3, warpgroups=4, auto_barriers=True))])
def test_backward_configs(r, d, config, subtract_mean):
  # A positive scale and a cotangent that follows x with a nonzero mean, so
  # that dx depends on the row means (test_interpret.py's
  # `_layer_norm_backward_check` says why).
  x = _normal((r, d), jnp.bfloat16, 2.0, 0.5)
  scale = _normal((d,), jnp.float32, 0.1, 1.0) * jnp.linspace(0.2, 2.0, d)
  offset = _normal((d,), jnp.bfloat16)
  dy = (_normal((r, d), jnp.float32) + 0.5 * x.astype(jnp.float32)
        + _normal((r, 1), jnp.float32, 3.0)).astype(jnp.bfloat16)
  args = LayerNormArgs(x=x, scale=scale, offset=offset, subtract_mean=subtract_mean)
  _, residuals = jax.jit(lambda a: mln.layer_norm_forward(
      a, mln.heuristic_config(a), with_stats=True))(args)
  grads = jax.jit(lambda a, res, dy: mln.layer_norm_backward(
      a, res["mean"], res["rstd"], dy, config))(args, residuals, dy)
  upcast = [a.astype(jnp.float32) for a in (x, scale, offset)]
  _, ref_vjp = jax.vjp(lambda *a: tokamax.layer_norm(
      *a, subtract_mean=subtract_mean, implementation="xla"), *upcast)
  for name, ref in zip(("x", "scale", "offset"), ref_vjp(dy.astype(jnp.float32))):
    assert grads[name].dtype == getattr(args, name).dtype
    testing.assert_close(grads[name], ref, jnp.bfloat16, what=f"d{name}", scale=2.0,
                         gpu=True)


@gpu
@pytest.mark.parametrize("config", [
    mln.LayerNormConfig(1), mln.LayerNormConfig(2), mln.LayerNormConfig(4),
    mln.LayerNormConfig(8), mln.LayerNormConfig(1, True), mln.LayerNormConfig(4, True),
    # The ring on 132 SMs: 2 rows a block of 2 slots; 1 row a block of 4
    # slots; 4 rows a block of 3 slots, with Pallas' auto barriers.
    mln.LayerNormConfig(num_stages=2, blocks_per_sm=2),
    mln.LayerNormConfig(num_stages=4, blocks_per_sm=4),
    mln.LayerNormConfig(num_stages=3, blocks_per_sm=1, auto_barriers=True)])
def test_configs(config):
  _check(520, 2048, jnp.bfloat16, True, config=config)


@gpu
@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("r,d,config", [
    # On 132 SMs: 32 rows a block; 21 (the last block 2); 8 (the last 7).
    (4096, 16384, mln.LayerNormConfig(num_stages=2, blocks_per_sm=1)),
    (8192, 4096, mln.LayerNormConfig(num_stages=4, blocks_per_sm=3)),
    (1031, 7168, mln.LayerNormConfig(num_stages=2, blocks_per_sm=1)),
    (1031, 4608, mln.LayerNormConfig(num_stages=3, blocks_per_sm=2))])  # a 512 tail
def test_ring_forward(r, d, config, subtract_mean):
  _check(r, d, jnp.bfloat16, subtract_mean, config=config)


@gpu
@pytest.mark.parametrize("config", [None, mln.LayerNormConfig(num_stages=2, blocks_per_sm=2)])
@pytest.mark.parametrize("scale,offset", [(False, False), (True, False), (False, True)])
def test_without_params_and_leading_dims(scale, offset, config):
  _check(2 * 3 * 40, 1024, jnp.bfloat16, True, scale=scale, offset=offset, lead=(2, 3),
         config=config)

