"""Gated linear unit kernels (forward and backward) in Pallas Mosaic GPU (sm_90).

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

In a training step (`Op.residuals_wanted()`), the epilogue also stores the gate
and up tiles: the ``projections`` residual ``h = x @ w``. The backward then needs
no projection matmul: ``dh`` is elementwise and ``dx``, ``dw`` are two dense
matmuls, which `GatedLinearUnitArgs.backward_from_projections` runs through XLA
(cuBLAS beats our grouped-matmul kernel at one group). The projections cost the
epilogue a second staging tile, so the forward then runs with one stage fewer
where shared memory asks for it (`_room_for_projections`).

Backward without projections (`glu_backward`), with ``h = x @ w`` the ``[M, 2N]``
pre-activations (gate, up) and ``dh = [dy * up * act'(gate), dy * act(gate)]``:

1. ``dh`` comes from one kernel, `_glu_dh`: the forward's kernel whose epilogue
   loads the ``dy`` tile (TMA, issued before the K loop so it lands meanwhile)
   and applies the activation's VJP (``jax.vjp`` of the user's callable, traced
   into the epilogue) to the float32 accumulators; it writes the gate and up
   halves of ``dh`` straight into an ``[M, 2N]`` array laid out like the
   weights. ``h`` itself never goes through device memory. Activations whose
   VJP the epilogue cannot lower (or ``fuse_activation=False``) take two steps
   instead: ``h`` in float32 from ragged_dot's dense kernel, then XLA.
2. ``dx = dh @ w^T`` and ``dw = x^T @ dh`` are ragged_dot's grouped-matmul kernel
   with one group (a dense matmul): dx reads w tiles transposed in shared memory
   (as ragged_dot's dlhs), dw multiplies an XLA transpose of x (a pass over x,
   a seventh of dh's bytes at the reference shape) by dh.

Grouped calls (``weights [G, K, 2, N]``, MoE experts): `grouped_glu` is
ragged_dot's forward kernel over the groups' row tiles whose items stream the
gate and the up weight tiles of the same columns into two accumulators, the
activation in the epilogue (an inference forward; a training forward runs
ragged_dot's kernel for the projections and XLA's activation, see
`gated_linear_unit._grouped_forward`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic import ragged_dot
from tokamax_gpu_mosaic import ragged_dot_kernel


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


@dataclasses.dataclass(frozen=True)
class GatedLinearUnitVjpConfig:
  """Tiling of the backward.

  ``block_m``, ``block_n``, ``block_k``, ``num_stages``, ``grid_tile_width``: the
  dh kernel, as `GatedLinearUnitConfig` tiles the forward. ``matmul_*``: the dx
  and dw matmuls (ragged_dot's kernel: ``128 x 2 matmul_block_n`` tiles, 64 deep).
  ``fuse_activation=False`` recomputes h in float32 and differentiates the
  activation in XLA (what activations the epilogue cannot lower always get).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_stages: int = 3
  grid_tile_width: int = 8
  matmul_block_n: int = 128
  matmul_num_stages: int = 3
  matmul_grid_tile_width: int = 8
  fuse_activation: bool = True

  def __post_init__(self):
    self.dh_config()  # Validates the dh kernel's fields,
    self.matmul_config()  # and the matmuls'.

  def dh_config(self) -> GatedLinearUnitConfig:
    return GatedLinearUnitConfig(self.block_m, self.block_n, self.block_k,
                                 self.num_stages, self.grid_tile_width)

  def matmul_config(self) -> ragged_dot_kernel.RaggedDotConfig:
    return ragged_dot_kernel.RaggedDotConfig(
        block_m=128, block_n=self.matmul_block_n, block_k=64,
        num_stages=self.matmul_num_stages,
        grid_tile_width=self.matmul_grid_tile_width)

COLS = 64  # Minor dimensions are padded to this (the 128-byte swizzle's width).


def _gate_up_pipeline(dtype, config: GatedLinearUnitConfig):
  """The K loop shared by the forward and the backward's dh kernel: a memory
  warpgroup streams the x tile and the gate and up weight tiles by TMA, two
  compute warpgroups run the body on them."""
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  x_spec = _pipeline.tma_spec((bm, bk), lambda ki: (0, ki), dtype, bk)
  w_spec = _pipeline.tma_spec((bk, bn), lambda ki: (ki, 0), dtype, bk)
  return _pipeline.WarpSpecializedPipeline((x_spec, w_spec, w_spec), config.num_stages)


def _gate_up_mma(wg, half: int):
  """The pipeline body: this compute warpgroup's rows of the x tile times the gate
  and the up weight tiles, into the (gate, up) accumulator pair."""

  def mma(_, x_smem, g_w_smem, u_w_smem, carry):
    acc_g, acc_u = carry
    own = x_smem.at[pl.ds(wg * half, half)]
    plgpu.wgmma(acc_g, own, g_w_smem)
    plgpu.wgmma(acc_u, own, u_w_smem)
    plgpu.wgmma_wait(2)  # The previous step's pair is done: release it.
    return carry
  return mma


def fused_glu(x, weights, activation, config: GatedLinearUnitConfig,
              keep_projections: bool = False):
  """``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` in x's dtype.

  With `keep_projections`, ``(out, projections)``: the epilogue also writes the
  gate and up tiles ``x @ weights`` (``[M, 2, N]`` in x's dtype) for the backward.
  """
  m_orig, k_orig = x.shape
  n_orig = weights.shape[2]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  half = bm // 2
  m = _common.round_up(m_orig, 8, bm)
  # At least two K steps, as ragged_dot does: a one-step warp-specialized
  # pipeline crashed on the H200 (notes/MOSAIC_GPU.md); zero columns add nothing.
  k = _common.round_up(k_orig, COLS, 2 * bk)
  # The projections' gate tiles must not reach into the up columns at n: whole
  # tiles then.
  n = _common.round_up(n_orig, bn if keep_projections else COLS, bn)
  x = _common.pad_axis(_common.pad_axis(x, 0, m), 1, k)
  weights = _common.pad_axis(_common.pad_axis(weights, 0, k), 2, n)
  w2 = weights.reshape(k, 2 * n)
  dtype = x.dtype
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)
  act = _common.inline_elementwise(activation)

  pipeline = _gate_up_pipeline(dtype, config)

  def kernel(x_ref, w_ref, out_ref, *h_ref):
    allocs = pipeline.allocations(x_ref, w_ref.at[:, pl.ds(0, n)],
                                  w_ref.at[:, pl.ds(n, n)], steps=k_steps)
    buffers = 2 if keep_projections else 1

    @functools.partial(
        pl.run_scoped, allocs=allocs,
        out_smem=plgpu.SMEM((2, buffers, half, bn), dtype,
                            transforms=_common.swizzled(dtype, bn)),
        collective_axes="wg")
    def _scope(allocs, out_smem):
      wg = lax.axis_index("wg")
      own_smem = out_smem.at[jnp.minimum(wg, 1)]

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(info):
        _, m0, n0 = _pipeline.snake_tile(info.index[0], m_tiles, n_tiles,
                                         config.grid_tile_width, bm, bn)

        def context(eval_pipeline):
          @functools.partial(pl.run_scoped,
                             acc_g=plgpu.ACC((half, bn), jnp.float32),
                             acc_u=plgpu.ACC((half, bn), jnp.float32))
          def _acc_scope(acc_g, acc_u):
            eval_pipeline((acc_g, acc_u))
            gate, up = acc_g[...], acc_u[...]
            if keep_projections:
              # The output from the projections as the backward reads them
              # (rounded to x's dtype), as the plain program computes it.
              gate, up = gate.astype(dtype), up.astype(dtype)
            y = act(gate.astype(jnp.float32)) * up.astype(jnp.float32)
            rows = pl.ds(m0 + wg * half, half)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if keep_projections:
              # Gate and up go out first; the output then reuses the gate's
              # buffer once its store has read it (one store left in flight).
              own_smem.at[0][...] = gate
              own_smem.at[1][...] = up
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(own_smem.at[0], h_ref[0].at[rows, pl.ds(n0, bn)])
              plgpu.copy_smem_to_gmem(own_smem.at[1],
                                      h_ref[0].at[rows, pl.ds(n + n0, bn)])
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            _pipeline.store_tile(own_smem.at[0], y.astype(dtype),
                                 out_ref.at[rows, pl.ds(n0, bn)])

        pipeline(_gate_up_mma(wg, half), context, k_steps)(
            x_ref.at[pl.ds(m0, bm), :], w_ref.at[:, pl.ds(n0, bn)],
            w_ref.at[:, pl.ds(n + n0, bn)], allocations=allocs)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_type = [jax.ShapeDtypeStruct((m, n), dtype)]
  if keep_projections:
    out_type.append(jax.ShapeDtypeStruct((m, 2 * n), dtype))
  call = _pipeline.persistent_kernel(kernel, out_type=tuple(out_type))
  out, *h = call(x, w2)
  out = out[:m_orig, :n_orig]
  if not keep_projections:
    return out
  return out, h[0].reshape(m, 2, n)[:m_orig, :, :n_orig]


def vjp_fn(activation):
  """``(gate, up, dy) -> (d_gate, d_up)`` in float32, from ``jax.vjp`` of the
  activation (so `jax.custom_vjp` / `custom_jvp` rules are honoured)."""

  # Ordered so that values die early (in the kernel these are register tiles):
  # up right away, act as soon as d_up is made.
  def fn(gate, up, dy):
    dy_up = dy * up
    if activation is None:
      return dy_up, dy * gate
    act, pullback = jax.vjp(activation, gate)
    d_up = (dy * act).astype(jnp.float32)
    (d_gate,) = pullback(dy_up.astype(act.dtype))
    return d_gate.astype(jnp.float32), d_up
  return fn


def vjp_jaxpr(activation, shape=(64, 128)):
  tile = jax.ShapeDtypeStruct(shape, jnp.float32)
  return jax.make_jaxpr(vjp_fn(activation))(tile, tile, tile)


def epilogue_can_fuse(activation) -> bool:
  """Whether the dh kernel's epilogue can lower the activation's VJP: only
  primitives the Lane lowering has, and no array constants (a kernel cannot
  capture them)."""
  try:
    closed = vjp_jaxpr(activation)
  except Exception:  # whatever tracing raised, the epilogue cannot take it
    return False
  if any(getattr(c, "ndim", 0) for c in closed.consts):
    return False
  return not _common.missing_primitives(closed.jaxpr)


def glu_dh(x, w2, dout, activation, config: GatedLinearUnitConfig) -> jax.Array:
  """``[d_gate, d_up]`` as ``[m, 2n]`` from padded ``x [m, k]``, ``w2 [k, 2n]``
  and ``dout [m, n]``, where `n` is a multiple of ``block_n`` (a gate tile must
  not reach into the up columns, which another tile writes).

  The forward's pipeline with a different epilogue: each compute warpgroup
  fetches its ``[block_m / 2, block_n]`` dy tile by TMA before its K loop and
  after the loop turns the float32 gate and up accumulators and dy into d_gate
  (written over dy in shared memory) and d_up, stored with two TMA stores.
  """
  m, k = x.shape
  n = dout.shape[1]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  half = bm // 2
  dtype = x.dtype
  m_tiles, n_tiles, k_steps = pl.cdiv(m, bm), n // bn, pl.cdiv(k, bk)
  grads = _common.inline(vjp_fn(activation))

  pipeline = _gate_up_pipeline(dtype, config)

  tile_smem = plgpu.SMEM((2, half, bn), dtype, transforms=_common.swizzled(dtype, bn))

  def kernel(x_ref, w_ref, dout_ref, dh_ref, dout_barriers):
    allocs = pipeline.allocations(x_ref, w_ref.at[:, pl.ds(0, n)],
                                  w_ref.at[:, pl.ds(n, n)], steps=k_steps)

    @functools.partial(pl.run_scoped, allocs=allocs, gate_smem=tile_smem,
                       up_smem=tile_smem, collective_axes="wg")
    def _scope(allocs, gate_smem, up_smem):
      wg = lax.axis_index("wg")
      cwg = jnp.minimum(wg, 1)  # Only compute warpgroups use these.
      g_smem = gate_smem.at[cwg]
      u_smem = up_smem.at[cwg]
      barrier = dout_barriers.at[cwg]

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(info):
        _, m0, n0 = _pipeline.snake_tile(info.index[0], m_tiles, n_tiles,
                                         config.grid_tile_width, bm, bn)
        rows = pl.ds(m0 + cwg * half, half)

        def context(eval_pipeline):
          # The previous tile's stores read g_smem: done before dy overwrites it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.copy_gmem_to_smem(dout_ref.at[rows, pl.ds(n0, bn)], g_smem, barrier)

          @functools.partial(pl.run_scoped,
                             acc_g=plgpu.ACC((half, bn), jnp.float32),
                             acc_u=plgpu.ACC((half, bn), jnp.float32))
          def _acc_scope(acc_g, acc_u):
            eval_pipeline((acc_g, acc_u))
            plgpu.barrier_wait(barrier)
            dy = g_smem[...].astype(jnp.float32)
            d_gate, d_up = grads(acc_g[...], acc_u[...], dy)
            # Each thread overwrites exactly the dy elements it loaded (one
            # register layout for both), so no barrier between load and store.
            g_smem[...] = d_gate.astype(dtype)
            u_smem[...] = d_up.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(g_smem, dh_ref.at[rows, pl.ds(n0, bn)])
            plgpu.copy_smem_to_gmem(u_smem, dh_ref.at[rows, pl.ds(n + n0, bn)])

        pipeline(_gate_up_mma(wg, half), context, k_steps)(
            x_ref.at[pl.ds(m0, bm), :], w_ref.at[:, pl.ds(n0, bn)],
            w_ref.at[:, pl.ds(n + n0, bn)], allocations=allocs)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = _pipeline.persistent_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, 2 * n), dtype),
      scratch_types=[plgpu.Barrier(num_arrivals=1, num_barriers=2)])
  return call(x, w2, dout)


def _dh_unfused(x, w2, dout, activation, f32_out_config) -> jax.Array:
  """`glu_dh` in two steps: h in float32 by the dense kernel, the VJP in XLA."""
  m = x.shape[0]
  n = dout.shape[1]
  h = ragged_dot_kernel.grouped_matmul(
      x, w2[None], jnp.zeros((1,), jnp.int32), jnp.full((1,), m, jnp.int32),
      transpose_rhs=False, out_dtype=jnp.float32, config=f32_out_config)
  d_gate, d_up = vjp_fn(activation)(h[:, :n], h[:, n:], dout.astype(jnp.float32))
  return jnp.concatenate([d_gate, d_up], axis=1).astype(x.dtype)


def glu_backward(x, weights, dout, activation, config: GatedLinearUnitVjpConfig):
  """``(dx [M, K], dw [K, 2, N])`` of ``activation(x @ w_gate) * (x @ w_up)``.

  x ``[M, K]``, weights ``[K, 2, N]`` (bf16/f16), dout ``[M, N]``. Float32
  accumulation; dh (``[M, 2N]``) is rounded to x's dtype before the two matmuls,
  as Triton's backward does.

  Example:
    >>> dx, dw = glu_backward(x, w, dy, jax.nn.silu, GatedLinearUnitVjpConfig())
  """
  m_orig, k_orig = x.shape
  n_orig = weights.shape[2]
  dh_config = config.dh_config()
  mm_config = config.matmul_config()
  bm, bn = dh_config.block_m, dh_config.block_n
  dtype = x.dtype
  # M: whole dh-kernel row tiles, so no dy tile load lies wholly past the array
  # (and rows come in 64s, as dh's rows are dw's swizzled contraction).
  # K: at least two steps of every kernel's 64-deep pipeline (a one-step
  # warp-specialized pipeline crashed on the H200, notes/MOSAIC_GPU.md).
  # N: whole dh-kernel tiles (see `glu_dh`). Aligned shapes are not copied.
  m = _common.round_up(m_orig, bm, bm)
  k = _common.round_up(k_orig, COLS, 128)
  n = _common.round_up(n_orig, bn, bn)
  x = _common.pad_axis(_common.pad_axis(x, 0, m), 1, k)
  weights = _common.pad_axis(_common.pad_axis(weights, 0, k), 2, n)
  dout = _common.pad_axis(_common.pad_axis(dout.astype(dtype), 0, m), 1, n)
  w2 = weights.reshape(k, 2 * n)
  if config.fuse_activation and epilogue_can_fuse(activation):
    dh = glu_dh(x, w2, dout, activation, dh_config)
  else:
    itemsize = jnp.dtype(dtype).itemsize
    f32_config = ragged_dot.heuristic(m, k, 2 * n, 1, itemsize, 4)
    dh = _dh_unfused(x, w2, dout, activation, f32_config)
  if (m, n) != (m_orig, n_orig):
    # Padded rows and columns have gate 0 and dy 0, but an activation whose
    # derivative at 0 is infinite (log|g|, cbrt) gives 0 * inf = NaN there, which
    # the matmuls below would spread over all of dx and dw.
    rows = jnp.arange(m)[:, None] < m_orig
    cols = (jnp.arange(2 * n) % n)[None, :] < n_orig
    dh = jnp.where(rows & cols, dh, jnp.zeros((), dh.dtype))
  zero = jnp.zeros((1,), jnp.int32)
  dx = ragged_dot_kernel.grouped_matmul(dh, w2[None], zero, jnp.full((1,), m, jnp.int32),
                                 transpose_rhs=True, out_dtype=dtype,
                                 config=mm_config)
  dw = ragged_dot_kernel.grouped_matmul(x.T, dh[None], zero, jnp.full((1,), k, jnp.int32),
                                 transpose_rhs=False, out_dtype=dtype,
                                 config=mm_config)
  dx = dx[:m_orig, :k_orig]
  dw = dw.reshape(k, 2, n)[:k_orig, :, :n_orig]
  return dx, dw


# Elements of one array per block of `glu_dh_from_projections`: 16 per thread
# (128 threads), two 16-byte vectors of 16-bit values.
DH_TILE_ELEMENTS = 2048


def dh_tile(m: int, n: int) -> tuple[int, int] | None:
  """The ``(rows, columns)`` block of `glu_dh_from_projections` for ``dout [m,
  n]``: the widest rows of 256, 128 or 64 columns that tile it whole (its loads
  and stores go straight between device memory and registers, unmasked), or
  None where none does."""
  for bn in (256, 128, 64):
    bm = DH_TILE_ELEMENTS // bn
    if n % bn == 0 and m % bm == 0:
      return bm, bn
  return None


def glu_dh_from_projections(projections, dout, activation) -> jax.Array:
  """``dh = [dy * up * act'(gate), dy * act(gate)]`` as ``[M, 2N]``, from the
  forward's projections ``[M, 2N]`` (gate columns, then up) and ``dout [M, N]``.

  Memory-bound: each block reads its dy, gate and up tiles once and writes both
  halves of dh, 5 element transfers per (gate, up) pair (XLA's fusion of the
  same VJP writes each half from its own loop and reads dy and the gate for
  both: 7). No shared memory: tiles go from device memory to registers and back
  (vectorized, coalesced rows); the blocks in flight on an SM (several, a
  warpgroup each) hide the latency. The shape must have a `dh_tile`.
  """
  m, n = dout.shape
  if projections.shape != (m, 2 * n):
    raise ValueError(f"projections must be [{m}, {2 * n}] for dout {dout.shape}; "
                     f"got {projections.shape}")
  tile = dh_tile(m, n)
  if tile is None:
    raise ValueError(f"dout {dout.shape}: no block of {DH_TILE_ELEMENTS} elements "
                     "with 64, 128 or 256 columns tiles it")
  bm, bn = tile
  dtype = projections.dtype
  grads = _common.inline(vjp_fn(activation))

  def kernel(h_ref, dout_ref, dh_ref):
    rows = pl.ds(lax.axis_index("m") * bm, bm)
    j = lax.axis_index("n") * bn
    gate_cols, up_cols = pl.ds(j, bn), pl.ds(n + j, bn)
    dy = dout_ref[rows, gate_cols].astype(jnp.float32)
    gate = h_ref[rows, gate_cols].astype(jnp.float32)
    up = h_ref[rows, up_cols].astype(jnp.float32)
    d_gate, d_up = grads(gate, up, dy)
    dh_ref[rows, gate_cols] = d_gate.astype(dtype)
    dh_ref[rows, up_cols] = d_up.astype(dtype)

  call = _common.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, 2 * n), dtype),
      grid=(m // bm, n // bn), grid_names=("m", "n"),
      compiler_params=_common.compiler_params())
  return call(projections, dout.astype(dtype))


# ----------------------------------------------------------------------------
# Grouped (MoE experts): ragged_dot's group tiles with the activation in the
# epilogue.


def grouped_glu_config(config: ragged_dot_kernel.RaggedDotConfig, itemsize: int
                       ) -> ragged_dot_kernel.RaggedDotConfig:
  """ragged_dot's forward config for the projections ``x @ [G, K, 2N]``, as
  `grouped_glu` runs it: 128-row items over the groups (its two ``[64,
  block_n]`` float32 accumulators per warpgroup take the registers of
  ragged_dot's ``[64, 2 block_n]``; 256-row items would need twice that) and
  one ``[128, block_n]`` output staging tile (``out_pieces=2``'s bytes), with
  fewer stages where a 64-row fixed tiling's ring does not fit 128 rows.
  Items are dealt round robin (``claim_items=False``, whatever ragged_dot's
  config says): this kernel's claims have run only in the interpreter, not
  yet on a GPU (notes/MEASUREMENTS.md, session 41)."""
  # block_n up to 128: two [64, block_n] float32 accumulators per thread's
  # registers. out_pieces=2: ragged_dot's shared-memory formula then counts one
  # [128, block_n] staging tile, what this kernel stages (`_GroupGluTiles`).
  config = dataclasses.replace(config, block_m=128, block_n=min(config.block_n, 128),
                               row_tiling="group", out_pieces=2,
                               drhs_kernel="ring", claim_items=False)
  while (ragged_dot_kernel.smem_bytes(config, itemsize, itemsize) > _common.SMEM_LIMIT
         and config.num_stages > 2):
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  return config


@dataclasses.dataclass(frozen=True)
class _GroupGluTiles(ragged_dot_kernel._GroupTiles):  # pylint: disable=protected-access
  """ragged_dot's forward over row tiles that follow the groups
  (`ragged_dot_kernel._GroupTiles`: work items, chained rings), with
  a GLU's epilogue. An item is a row tile x ``block_n`` output columns: the
  weights stream as two operands, the gate tile and the up tile of those
  columns, into two accumulators, and the epilogue writes ``activation(gate) *
  up`` and, with `keep_projections`, the gate and up projections (what a
  backward's dh reads)."""

  activation: Any  # elementwise, inlined (`_common.inline_elementwise`)
  up_offset: int  # the first up column of the ``[K, 2N]`` weights
  keep_projections: bool

  @property
  def num_outputs(self):
    return 2 if self.keep_projections else 1

  @property
  def cta_n(self):  # output columns of an item; its accumulators hold twice that
    return self.config.block_n

  @property
  def pieces(self):  # each output tile goes out whole from one staging tile
    return 1

  def operand_blocks(self, item, operands):
    lhs_ref, w_ref, _ = operands  # the weights, streamed as gate and as up
    cols = lambda first: pl.ds(first + item.n0, self.cta_n)
    return (lhs_ref.at[pl.ds(item.row0, self.bm), :],
            w_ref.at[item.group, :, cols(0)],
            w_ref.at[item.group, :, cols(self.up_offset)])

  def mma(self, item, _, x_smem, gate_smem, up_smem, carry):
    acc_gate, acc_up = carry

    @pl.when(item.whi > item.wlo)
    def _issue():
      own = x_smem.at[pl.ds(item.cwg * self.half, self.half)]
      plgpu.wgmma(acc_gate, own, gate_smem)
      plgpu.wgmma(acc_up, own, up_smem)
    plgpu.wgmma_wait(2)  # only this step's pair pending: the previous slot is free
    return carry

  def context(self, item, out_ref, out_smem, allocs, eval_pipeline):
    shape = (self.half, self.cta_n)

    @functools.partial(pl.run_scoped, acc_gate=plgpu.ACC(shape, jnp.float32),
                       acc_up=plgpu.ACC(shape, jnp.float32))
    def _acc_scope(acc_gate, acc_up):
      eval_pipeline((acc_gate, acc_up))
      self.finish_loop(allocs)
      self.store_outputs(item, out_ref, out_smem, acc_gate[...], acc_up[...])

  def outputs(self, out_ref):
    """(output ref, projections ref or None)."""
    return out_ref if self.keep_projections else (out_ref, None)

  def store_outputs(self, item, out_ref, out_smem, gate, up):
    y_ref, h_ref = self.outputs(out_ref)
    # The output from the projections rounded to x's dtype: as the backward
    # reads them, and as the plain program (two matmuls, then the activation)
    # computes it.
    gate, up = gate.astype(self.out_dtype), up.astype(self.out_dtype)
    cols = pl.ds(item.n0, self.cta_n)
    if h_ref is not None:
      self.store_rows(item, h_ref, out_smem, gate, cols)
      self.store_rows(item, h_ref, out_smem, up,
                      pl.ds(self.up_offset + item.n0, self.cta_n))
    y = self.activation(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    self.store_rows(item, y_ref, out_smem, y.astype(self.out_dtype), cols)

  def store_zeros(self, item, out_ref, out_smem):
    y_ref, h_ref = self.outputs(out_ref)
    zeros = _pipeline.zeros_tile((self.half, self.cta_n), self.out_dtype)
    targets = [(y_ref, 0)]
    if h_ref is not None:
      targets += [(h_ref, 0), (h_ref, self.up_offset)]
    for ref, first in targets:
      self.store_rows(item, ref, out_smem, zeros, pl.ds(first + item.n0, self.cta_n))


def grouped_glu(x, weights, starts, ends, activation,
                config: ragged_dot_kernel.RaggedDotConfig,
                keep_projections: bool = False):
  """``activation(x @ weights[g, :, 0]) * (x @ weights[g, :, 1])`` for the rows
  ``[starts[g], ends[g])`` of group ``g`` (0 in rows no group holds), in x's
  dtype, from ``x [M, K]`` and ``weights [G, K, 2, N]``.

  One kernel: ragged_dot's forward whose items stream the gate and the up
  tiles of the same columns, with the activation in the epilogue, so the
  projections need not go through device memory and back for it. With
  `keep_projections`, ``(out, projections)``: the epilogue also writes the
  projections ``[M, 2, N]`` (x's dtype) for the backward. `config`: ragged_dot's
  config for the projections' matmul, run as `grouped_glu_config` says.
  """
  rdk = ragged_dot_kernel
  itemsize = jnp.dtype(x.dtype).itemsize
  config = grouped_glu_config(config, itemsize)
  rdk.check_fits(config, itemsize, itemsize, "gated_linear_unit grouped_glu")
  m_orig = x.shape[0]
  num_groups, _, _, n_orig = weights.shape
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  # K gets two pipeline steps at least (`ragged_dot_kernel._pad_operands`); N
  # whole column tiles, so that no gate tile reaches into the up columns.
  x = rdk.pad_to_multiple(rdk.pad_to_multiple(x, 0, 8, bm), 1, COLS, 2 * bk)
  m, k = x.shape
  n = _common.round_up(n_orig, bn, bn)
  weights = _common.pad_axis(_common.pad_axis(weights, 1, k), 3, n)
  w2 = weights.reshape(num_groups, k, 2 * n)
  items = rdk.work_items(starts, ends, m, bm)
  num_items = items.shape[0]
  n_tiles = n // bn
  items = rdk.item_table(items, n_tiles, config)
  k_steps = pl.cdiv(k, bk)
  depth = (_pipeline.ChainedPipeline.ring_depth(k_steps, config.num_stages)
           if config.chain_items else None)
  chained = depth is not None
  delay = 0 if chained else 1
  x_spec = _pipeline.tma_spec((bm, bk), lambda ki: (0, ki), x.dtype, bk, delay)
  w_spec = _pipeline.tma_spec((bk, bn), lambda ki: (ki, 0), x.dtype, bk, delay)
  pipeline_cls = _pipeline.ChainedPipeline if chained else _pipeline.WarpSpecializedPipeline
  tiles = _GroupGluTiles(
      config=config, transpose_rhs=False, out_dtype=x.dtype, num_items=num_items,
      n_tiles=n_tiles, k_steps=k_steps,
      pipeline=pipeline_cls((x_spec, w_spec, w_spec),
                            depth if chained else config.num_stages),
      activation=_common.inline_elementwise(activation), up_offset=n,
      keep_projections=keep_projections)

  def body(tiles):
    def kernel(items_ref, x_ref, w_ref, *out_refs):
      tiles.kernel(items_ref, x_ref, w_ref, w_ref, *out_refs)
    return kernel

  out_type = [jax.ShapeDtypeStruct((m, n), x.dtype)]
  if keep_projections:
    out_type.append(jax.ShapeDtypeStruct((m, 2 * n), x.dtype))
  call = tiles.persistent_call(body, out_type=tuple(out_type))
  out, *h = call(items, x, w2)
  out = out[:m_orig, :n_orig]
  if not keep_projections:
    return out
  return out, h[0].reshape(m, 2, n)[:m_orig, :, :n_orig]
