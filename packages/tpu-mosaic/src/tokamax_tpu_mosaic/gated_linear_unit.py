"""Gated linear unit as Pallas Mosaic TPU kernels, forward and backward.

``out = activation(x @ w_gate) * (x @ w_up)``.

Forward: one kernel, grid ``(M tiles, N tiles, K tiles)``, K innermost. The
weights ``[K, 2, N]`` are viewed as ``[K, 2 * N_p]`` and read through two
BlockSpecs on the same array (gate block ``j``, up block ``j + N_p / block_n``),
so each grid step DMAs one x tile and one gate and one up tile and runs two MXU
matmuls into two float32 VMEM accumulators; the activation (any elementwise
JAX callable, applied on float32) and the product run on the last K step. N is
padded to a multiple of the N block (``N_p``, a copy of the weights) only when
N is not a multiple of 128; K (contracted) is padded with zeros only when it is
larger than its block and not a multiple of 128. Rows use partial edge blocks.

Backward: a kernel of the same shape recomputes both projections and writes
``d_gate = dout * up * activation'(gate)`` and ``d_up = dout * activation(gate)``
as two ``[M, N_p]`` arrays in x's dtype (the derivative by `jax.jvp` of the
activation, in-kernel); then ``dx = d_gate @ w_gate^T + d_up @ w_up^T`` and
``dw = x^T @ [d_gate, d_up]`` are dense matmuls left to XLA, which runs them
near the MXU peak on TPU.

Block sizes per generation (bf16; f32 halves block_k), from
`_GENERATION_CONFIGS` (generation of the default device's `device_kind`, v5e
when unknown), ``block_n`` halved until the kernel's plan fits 3/4 of the
scoped VMEM (`_common.vmem_bytes`): v5e / v5p ``block_m=block_n=block_k=512``
(7 MiB forward, 9 MiB backward; ``2*bm*bn/(bm+2*bn)`` = 341 FLOP/byte, above the
v5e (240) and v5p (166) ridge points); v6e forward ``1024/1024/512`` (22 MiB of
its 32 MiB; 683 FLOP/byte against a 574 ridge), backward ``1024/512/512``
(its extra dout / d_gate / d_up blocks do not fit at 1024). See
docs/tpu_roofline.md (tools/tpu_roofline.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import tokamax
from tokamax import plugin
from tokamax_tpu_mosaic import _common


@dataclasses.dataclass(frozen=True)
class GatedLinearUnitConfig:
  """Block sizes: rows (multiple of 16), N and K columns (multiples of 128)."""

  block_m: int = 512
  block_n: int = 512
  block_k: int = 512

  def __post_init__(self):
    _common.check_blocks(self, rows=("block_m",), lanes=("block_n", "block_k"))


_GENERATION_CONFIGS = {
    "v5e": GatedLinearUnitConfig(512, 512, 512),
    "v5p": GatedLinearUnitConfig(512, 512, 512),
    "v6e": GatedLinearUnitConfig(1024, 1024, 512),
}


def _heuristic(args, backward: bool, generation: str | None = None
               ) -> GatedLinearUnitConfig:
  """The generation's table entry (f32: half the K block), N halved to fit VMEM.

  `generation` defaults to the default device's (`_common.device_generation`);
  unknown devices and interpret mode get the v5e-safe entry.
  """
  generation = generation or _common.device_generation()
  config = _GENERATION_CONFIGS.get(generation,
                                   _GENERATION_CONFIGS[_common.DEFAULT_GENERATION])
  if jnp.dtype(args.x.dtype).itemsize == 4:
    config = dataclasses.replace(config, block_k=max(128, config.block_k // 2))
  budget = _common.vmem_budget(generation)
  while _plan(args, config, backward).vmem_bytes() > budget and config.block_n > 128:
    config = dataclasses.replace(config, block_n=config.block_n // 2)
  return config


def _search_space(args, backward: bool):
  configs = [_heuristic(args, backward)]
  for bm in (256, 512, 1024):
    for bn in (256, 512, 1024):
      for bk in (256, 512):
        configs.append(GatedLinearUnitConfig(bm, bn, bk))
  return list(dict.fromkeys(configs))


# ----------------------------------------------------------------------------
# Activation checks.
# ----------------------------------------------------------------------------


def _check_activation(activation) -> None:
  """Refuses activations that are not elementwise float32 -> float32 maps (the
  kernels apply them to tiles), whose derivative does not trace by jvp, or that
  close over arrays (the kernels trace them in their bodies, and `pallas_call`
  refuses captured arrays, scalars included)."""
  tokamax.plugin.check_elementwise_activation(activation)
  if activation is None:
    return
  try:
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    closed = jax.make_jaxpr(lambda g: jax.jvp(activation, (g,), (g,)))(x)
  except Exception as e:  # any failure: the kernel cannot apply it, so refuse it
    raise NotImplementedError(f"activation {activation!r}: its derivative does not "
                              f"trace by jvp: {type(e).__name__}: {e}") from e
  value = closed.out_avals[0]
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise NotImplementedError(f"activation {activation!r} maps float32 to "
                              f"{value.dtype}; the kernels need a float result "
                              "(its derivative is float0 otherwise)")
  captured = tokamax.plugin.closed_over_arrays(closed)
  if captured:
    raise NotImplementedError(f"activation {activation!r} closes over arrays "
                              f"({', '.join(str(jnp.shape(c)) for c in captured)}), "
                              "which a kernel body cannot capture")


def _act_and_grad(activation, g):
  if activation is None:
    return g, jnp.ones_like(g)
  return jax.jvp(activation, (g,), (jnp.ones_like(g),))


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _project(x_ref, wg_ref, wu_ref, accg_ref, accu_ref, precision):
  @pl.when(pl.program_id(2) == 0)
  def _():
    accg_ref[...] = jnp.zeros_like(accg_ref)
    accu_ref[...] = jnp.zeros_like(accu_ref)

  x = x_ref[...]
  accg_ref[...] += jnp.dot(x, wg_ref[...], precision=precision,
                           preferred_element_type=jnp.float32)
  accu_ref[...] += jnp.dot(x, wu_ref[...], precision=precision,
                           preferred_element_type=jnp.float32)


def _fwd_kernel(x_ref, wg_ref, wu_ref, out_ref, accg_ref, accu_ref, *, activation,
                precision):
  _project(x_ref, wg_ref, wu_ref, accg_ref, accu_ref, precision)

  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    g = accg_ref[...]
    act = g if activation is None else activation(g)
    out_ref[...] = (act * accu_ref[...]).astype(out_ref.dtype)


def _bwd_kernel(x_ref, wg_ref, wu_ref, dout_ref, dg_ref, du_ref, accg_ref, accu_ref, *,
                activation, precision, n, ragged_n):
  _project(x_ref, wg_ref, wu_ref, accg_ref, accu_ref, precision)

  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    dout = dout_ref[...].astype(jnp.float32)
    if ragged_n:
      # Columns past N (weight padding) read garbage cotangents: zero them.
      bn = dout.shape[1]
      col = pl.program_id(1) * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
      dout = jnp.where(col < n, dout, 0.0)
    act, dact = _act_and_grad(activation, accg_ref[...])
    dg_ref[...] = (dout * accu_ref[...] * dact).astype(dg_ref.dtype)
    du_ref[...] = (dout * act).astype(du_ref.dtype)


# ----------------------------------------------------------------------------
# Wrappers.
# ----------------------------------------------------------------------------


def _blocks(args, config):
  """(bm, bn, bk, N_p, K_p): blocks clamped / fitted to the shapes, padded dims."""
  m, k = args.x.shape
  n = args.weights.shape[-1]
  bm = m if m <= config.block_m else config.block_m
  n_pad = _common.round_up(n, _common.LANES)
  bn = min(config.block_n, n_pad)
  while n_pad % bn:
    bn -= _common.LANES
  if k <= config.block_k:
    bk, k_pad = k, k
  else:
    k_pad = _common.round_up(k, _common.LANES)
    bk = config.block_k
    while k_pad % bk:
      bk -= _common.LANES
  return bm, bn, bk, n_pad, k_pad


def _padded(args, k_pad, n_pad):
  """x [M, K_p] and the weights viewed as [K_p, 2 * N_p] (copies only if padded)."""
  x = _common.pad_axis(args.x, 1, k_pad)
  w = _common.pad_axis(_common.pad_axis(args.weights, 0, k_pad), 2, n_pad)
  return x, w.reshape(k_pad, 2 * n_pad)


def _plan(args, config, backward: bool) -> _common.KernelPlan:
  """Grid (M tiles, N tiles, K tiles); x, gate and up tiles in, out tile(s) out."""
  m = args.x.shape[0]
  n = args.weights.shape[-1]
  bm, bn, bk, n_pad, k_pad = _blocks(args, config)
  up = n_pad // bn
  x_dt, w_dt = args.x.dtype, args.weights.dtype
  inputs = (
      _common.Operand((m, k_pad), x_dt, pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk))),
      _common.Operand((k_pad, 2 * n_pad), w_dt,
                      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))),
      _common.Operand((k_pad, 2 * n_pad), w_dt,
                      pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j + up))),
  )
  out_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
  if backward:
    half = _common.Operand((m, n_pad), x_dt, out_spec)
    inputs, outputs = inputs + (half,), (half, half)
  else:
    outputs = (_common.Operand((m, n), x_dt, out_spec),)
  return _common.KernelPlan(
      name=f"tokamax_tpu_glu_{'bwd' if backward else 'fwd'}",
      grid=(_common.cdiv(m, bm), up, k_pad // bk), inputs=inputs, outputs=outputs,
      semantics=("parallel", "parallel", "arbitrary"),
      scratch=(((bm, bn), jnp.float32),) * 2,
      # A step's f32 dot result before it is added to its accumulator.
      temp_bytes=_common.tile_bytes((bm, bn), jnp.float32))


def _forward(args, config):
  plan = _plan(args, config, backward=False)
  _, _, _, n_pad, k_pad = _blocks(args, config)
  x, w = _padded(args, k_pad, n_pad)
  kernel = functools.partial(_fwd_kernel, activation=args.activation,
                             precision=_common.dot_precision(args.precision))
  (out,) = plan.call(kernel, x, w, w)
  return out


def _backward(args, dout, config):
  k = args.x.shape[1]
  n = args.weights.shape[-1]
  plan = _plan(args, config, backward=True)
  _, _, _, n_pad, k_pad = _blocks(args, config)
  x, w = _padded(args, k_pad, n_pad)
  kernel = functools.partial(
      _bwd_kernel, activation=args.activation,
      precision=_common.dot_precision(args.precision), n=n, ragged_n=n_pad != n)
  dg, du = plan.call(kernel, x, w, w, dout.astype(args.x.dtype))
  w = w[:k].reshape(k, 2, n_pad)
  dims_nt = (((1,), (1,)), ((), ()))  # [M, N] x [K, N] -> [M, K]
  dims_tn = (((0,), (0,)), ((), ()))  # [M, K] x [M, N] -> [K, N]
  dot = functools.partial(jax.lax.dot_general, precision=args.precision,
                          preferred_element_type=jnp.float32)
  dx = dot(dg, w[:, 0], dims_nt) + dot(du, w[:, 1], dims_nt)
  dw = jnp.stack([dot(args.x, dg, dims_tn), dot(args.x, du, dims_tn)], axis=1)
  return {"x": dx.astype(args.x.dtype),
          "weights": dw[:, :, :n].astype(args.weights.dtype)}


def _check_args(args, device) -> None:
  _common.check_tpu_device(device)
  _common.check_dtypes(args.x.dtype, args.weights.dtype)
  _common.check_precision(args.precision)
  m, k = args.x.shape
  n = args.weights.shape[-1]
  if 0 in (m, k, n):
    raise NotImplementedError(f"empty problem (M={m}, K={k}, N={n})")
  _check_activation(args.activation)


class _GluFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "gated_linear_unit"
  name = "mosaic_tpu"
  config_cls = GatedLinearUnitConfig
  check_args = staticmethod(_check_args)
  heuristic = staticmethod(_heuristic)
  configs = staticmethod(_search_space)


@dataclasses.dataclass(frozen=True)
class MosaicTpuGatedLinearUnit(_GluFunctions, tokamax.Op):
  """GLU forward: one Pallas Mosaic TPU kernel for both projections."""

  def forward(self, args, config):
    return _forward(args, config), {}


@dataclasses.dataclass(frozen=True)
class MosaicTpuGatedLinearUnitVjp(_GluFunctions, tokamax.VjpOp):
  """GLU backward: fused recompute + activation-derivative kernel, XLA matmuls."""

  def backward(self, args, residuals, out, dout, config):
    del residuals, out
    return _backward(args, dout, config)


MosaicTpuGatedLinearUnit.vjp = MosaicTpuGatedLinearUnitVjp


def heuristic_plans(args, generation: str | None = None, with_prefetch: bool = False):
  """[(plan, ())] of the forward and backward kernels at the heuristic configs."""
  del with_prefetch  # no scalar prefetch
  return [(_plan(args, _heuristic(args, b, generation), b), ()) for b in (False, True)]
