"""Gated linear unit forward in Pallas Mosaic GPU (Hopper, sm_90).

``out = activation(x @ w_gate) * (x @ w_up)``: one fused kernel, so the two
projections never go through device memory and each x tile is loaded once for
both.

Kernel shape: a persistent grid (one block per SM) walking output tiles of
``block_m x block_n`` in a planar-snake order. Each block has a memory warpgroup
that streams, per step of ``block_k``, the x tile and the matching gate and up
weight tiles into a ``num_stages``-deep ring of swizzled shared memory (TMA), and
two compute warpgroups, each owning ``block_m / 2`` of the rows, that issue two
wgmma per step (gate and up, float32 accumulators in registers). The epilogue
applies the activation in float32 in registers, multiplies, and writes the tile
with one TMA store (which clips rows past M and columns past N).

The weights ``[K, 2, N]`` are read as ``[K, 2N]`` (a free reshape): gate columns
at ``[0, N)``, up columns at ``[N, 2N)``. Shapes that are not multiples of the
128-byte swizzle (64 elements) are zero-padded first (a copy, only then).

Backward: not written yet; the backward refuses and dispatch takes another.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax import Op
from tokamax_gpu_mosaic import _common

_COLS = 64  # Minor dimensions are padded to this (the 128-byte swizzle's width).


@dataclasses.dataclass(frozen=True)
class GatedLinearUnitConfig:
  """Tiling: ``block_m x block_n`` outputs per block (two warpgroups of
  ``block_m / 2`` rows), ``block_k`` per pipeline step, ``num_stages`` in flight,
  ``grid_tile_width`` column tiles per band of the snake order."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_stages: int = 4
  grid_tile_width: int = 8

  def __post_init__(self):
    if self.block_m not in (128, 256):
      raise ValueError(f"block_m must be 128 or 256; got {self.block_m}")
    if self.block_n % 64 or self.block_n > 256:
      raise ValueError(f"block_n must be a multiple of 64 up to 256; got {self.block_n}")
    if self.block_k not in (32, 64):
      raise ValueError(f"block_k must be 32 or 64; got {self.block_k}")
    if self.num_stages < 2 or self.grid_tile_width < 1:
      raise ValueError(f"num_stages >= 2 and grid_tile_width >= 1: {self}")


def smem_bytes(config: GatedLinearUnitConfig, itemsize: int) -> int:
  stage = (config.block_m + 2 * config.block_n) * config.block_k * itemsize
  return config.num_stages * stage + config.block_m * config.block_n * itemsize


def _pad_to(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def _round_up(x: int, multiple: int, minimum: int) -> int:
  return max(-(-x // multiple) * multiple, minimum)


def fused_glu(x, weights, activation, config: GatedLinearUnitConfig) -> jax.Array:
  """``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` in x's dtype."""
  m_orig, k_orig = x.shape
  n_orig = weights.shape[2]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  half = bm // 2
  m = _round_up(m_orig, 8, bm)
  # At least two K steps, as ragged_dot does: a one-step warp-specialized
  # pipeline crashed on the H200 (notes/MOSAIC_GPU.md); zero columns add nothing.
  k = _round_up(k_orig, _COLS, 2 * bk)
  n = _round_up(n_orig, _COLS, bn)
  x = _pad_to(_pad_to(x, 0, m), 1, k)
  weights = _pad_to(_pad_to(weights, 0, k), 2, n)
  w2 = weights.reshape(k, 2 * n)
  dtype = x.dtype
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)
  act = _common.inline_elementwise(activation)

  transforms = _common.swizzled(dtype, bk)
  x_spec = plgpu.BlockSpec((bm, bk), lambda ki: (0, ki), transforms=transforms,
                           delay_release=1)
  w_spec = plgpu.BlockSpec((bk, bn), lambda ki: (ki, 0), transforms=transforms,
                           delay_release=1)

  def make_pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[x_spec, w_spec, w_spec], wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=config.num_stages, compute_context=context)

  def kernel(x_ref, w_ref, out_ref):
    ignore = lambda *_, **__: None
    allocs = make_pipeline(ignore, ignore).get_allocations(
        x_ref, w_ref.at[:, pl.ds(0, n)], w_ref.at[:, pl.ds(n, n)])

    @functools.partial(
        pl.run_scoped, allocs=allocs,
        out_smem=plgpu.SMEM((2, half, bn), dtype,
                            transforms=_common.swizzled(dtype, bn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      o_smem = out_smem.at[jnp.minimum(wg, 1)]

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(info):
        mi, ni = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1,
                                    config.grid_tile_width)
        m0 = mi * bm
        n0 = ni * bn

        def mma(_, x_smem, g_smem, u_smem, carry):
          acc_g, acc_u = carry
          rows = x_smem.at[pl.ds(wg * half, half)]
          plgpu.wgmma(acc_g, rows, g_smem)
          plgpu.wgmma(acc_u, rows, u_smem)
          plgpu.wgmma_wait(2)  # The previous step's pair is done: release it.
          return carry

        def context(eval_pipeline):
          @functools.partial(pl.run_scoped,
                             acc_g=plgpu.ACC((half, bn), jnp.float32),
                             acc_u=plgpu.ACC((half, bn), jnp.float32))
          def _acc_scope(acc_g, acc_u):
            eval_pipeline((acc_g, acc_u))
            y = act(acc_g[...]) * acc_u[...]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = y.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem, out_ref.at[pl.ds(m0 + wg * half, half), pl.ds(n0, bn)])

        make_pipeline(mma, context)(
            x_ref.at[pl.ds(m0, bm), :], w_ref.at[:, pl.ds(n0, bn)],
            w_ref.at[:, pl.ds(n + n0, bn)], allocations=allocs)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), dtype),
      grid=(_common.num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg", compiler_params=_common.compiler_params())
  out = call(x, w2)
  if (m, n) != (m_orig, n_orig):
    out = out[:m_orig, :n_orig]
  return out


def _heuristic(args) -> GatedLinearUnitConfig:
  itemsize = jnp.dtype(args.x.dtype).itemsize
  for block_n, stages in ((128, 4), (128, 3), (64, 4)):
    config = GatedLinearUnitConfig(block_n=block_n, num_stages=stages)
    if smem_bytes(config, itemsize) <= _common.SMEM_LIMIT:
      return config
  return GatedLinearUnitConfig(block_n=64, block_k=32, num_stages=3)


def _search_space(args):
  itemsize = jnp.dtype(args.x.dtype).itemsize
  out = []
  for bm in (128, 256):
    for bn in (64, 128, 192, 256):
      for bk in (32, 64):
        for stages in (2, 3, 4, 5, 6):
          for width in (4, 8, 16):
            if bm * bn > 128 * 128:
              continue  # two float32 accumulators per warpgroup in registers
            c = GatedLinearUnitConfig(block_m=bm, block_n=bn, block_k=bk,
                                      num_stages=stages, grid_tile_width=width)
            if smem_bytes(c, itemsize) <= _common.SMEM_LIMIT:
              out.append(c)
  return tuple(out)


def _check_args(args) -> None:
  _common.check_dtype("x/weights", args.x.dtype)
  if (isinstance(args.precision, lax.DotAlgorithmPreset)
      and args.precision != lax.DotAlgorithmPreset.DEFAULT):
    raise NotImplementedError(f"dot algorithm {args.precision}")
  if 0 in args.x.shape or 0 in args.weights.shape:
    raise NotImplementedError(
        f"empty operands (x {args.x.shape}, weights {args.weights.shape})")
  _common.check_elementwise_fn("activation", args.activation)


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedLinearUnit(Op):
  """Fused GLU forward: both projections from one x tile, activation in the epilogue."""

  op_name = "gated_linear_unit"
  name = "mosaic_gpu"
  config_cls = GatedLinearUnitConfig

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    _check_args(args)

  def heuristic_config(self, args):
    return _heuristic(args)

  def search_space(self, args):
    return _search_space(args)

  def forward(self, args, config):
    return fused_glu(args.x, args.weights, args.activation, config), {}


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedLinearUnitVjp(_common.UnwrittenBackward):
  """Backward: not yet in Mosaic GPU; refuses so dispatch takes another."""

  op_name = "gated_linear_unit"
  config_cls = GatedLinearUnitConfig
