"""Gated linear unit (`tokamax.gated_linear_unit`) in Pallas Mosaic GPU (Hopper, sm_90).

``out = activation(x @ w_gate) * (x @ w_up)``. The Ops, their configs,
heuristics and search spaces; the kernels (one fused forward kernel, the
backward's dh kernel with dx, dw by ragged_dot's grouped-matmul kernel, and the
one-pass dh from a training forward's projections) are in
`gated_linear_unit_kernel`, whose docstring describes them. Grouped calls
(`group_sizes`, MoE experts) run ragged_dot's kernels: an inference forward's
with the activation in its epilogue (`grouped_glu`), a training forward's and
the backward's around the activation and the one-pass dh (`_grouped_forward`,
`_grouped_backward`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import tokamax
from tokamax import Op, VjpOp
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import ragged_dot
from tokamax_gpu_mosaic.gated_linear_unit_kernel import GatedLinearUnitConfig
from tokamax_gpu_mosaic.gated_linear_unit_kernel import GatedLinearUnitVjpConfig
from tokamax_gpu_mosaic.gated_linear_unit_kernel import dh_tile
from tokamax_gpu_mosaic.gated_linear_unit_kernel import epilogue_can_fuse
from tokamax_gpu_mosaic.gated_linear_unit_kernel import fused_glu
from tokamax_gpu_mosaic.gated_linear_unit_kernel import glu_backward
from tokamax_gpu_mosaic.gated_linear_unit_kernel import glu_dh_from_projections
from tokamax_gpu_mosaic.gated_linear_unit_kernel import grouped_glu
from tokamax_gpu_mosaic.gated_linear_unit_kernel import vjp_jaxpr

__all__ = ["GatedLinearUnitConfig", "GatedLinearUnitVjpConfig",
           "MosaicGpuGatedLinearUnit", "MosaicGpuGatedLinearUnitVjp", "dh_smem_bytes",
           "fused_glu", "glu_backward", "smem_bytes"]


def smem_bytes(config: GatedLinearUnitConfig, itemsize: int,
               keep_projections: bool = False) -> int:
  stage = (config.block_m + 2 * config.block_n) * config.block_k * itemsize
  # The epilogue's staging tiles: the output's, and the up projection's when the
  # projections are kept (the gate's shares the output's buffer).
  epilogue = (2 if keep_projections else 1) * config.block_m * config.block_n
  return config.num_stages * stage + epilogue * itemsize


def _heuristic(args, keep_projections: bool = False) -> GatedLinearUnitConfig:
  itemsize = jnp.dtype(args.x.dtype).itemsize
  for block_n, stages in ((128, 4), (128, 3), (64, 4)):
    config = GatedLinearUnitConfig(block_n=block_n, num_stages=stages)
    if smem_bytes(config, itemsize, keep_projections) <= _common.SMEM_LIMIT:
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


def _check_operands(args) -> None:
  """What the forward and the backward kernels both refuse."""
  _common.check_dtype("x/weights", args.x.dtype)
  _common.check_default_dot_algorithm(args.precision)
  if 0 in args.x.shape or 0 in args.weights.shape:
    raise NotImplementedError(
        f"empty operands (x {args.x.shape}, weights {args.weights.shape})")


def _check_args(args) -> None:
  _check_operands(args)
  _common.check_elementwise_fn("activation", args.activation)


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedLinearUnit(Op):
  """Fused GLU forward: both projections from one x tile, activation in the epilogue."""

  op_name = "gated_linear_unit"
  name = "mosaic_gpu"
  config_cls = GatedLinearUnitConfig
  # Grouped calls (MoE experts) run ragged_dot's kernels (`_grouped_forward`).
  supported_features = ("group_sizes",)
  # Whether a training forward stores the projections from the fused kernel
  # (True) or runs XLA's matmul for them (False, faster today; see forward).
  projections_in_kernel: bool = False

  def check_supported(self, args, device):
    _common.check_hopper_device(device)
    if args.group_sizes is not None:
      _check_grouped(args, ragged_dot.MosaicGpuRaggedDot(), device)
      return
    _check_args(args)

  def heuristic_config(self, args):
    return _heuristic(args)

  def search_space(self, args):
    if args.group_sizes is not None:  # runs ragged_dot's configs, not this one
      return (self.heuristic_config(args),)
    return _search_space(args)

  def forward(self, args, config):
    if args.group_sizes is not None:
      return _grouped_forward(args, self.residuals_wanted())
    if not self.residuals_wanted():
      return fused_glu(args.x, args.weights, args.activation, config), {}
    if not self.projections_in_kernel:
      # A training step's forward: the kernel that also stores the projections
      # runs 0.3-0.5 ms slower at the reference shape than XLA's matmul plus its
      # activation fusion (5.30-5.51 against ~5.03 ms; kernel sums on the H200,
      # notes/MEASUREMENTS.md sessions 7 and 10), and the step then loses to
      # the plain program. The plain program's forward keeps the step at parity.
      return args.forward_with_projections()
    out, projections = fused_glu(args.x, args.weights, args.activation,
                                 _room_for_projections(args, config),
                                 keep_projections=True)
    return out, {"projections": projections}


def _room_for_projections(args, config: GatedLinearUnitConfig) -> GatedLinearUnitConfig:
  """`config` (chosen for a forward without projections: tuned data is keyed by
  the call only) with fewer stages where the projections' staging tile needs the
  room; the heuristic's choice where no number of stages leaves enough."""
  itemsize = jnp.dtype(args.x.dtype).itemsize
  fits = lambda c: smem_bytes(c, itemsize, keep_projections=True) <= _common.SMEM_LIMIT
  for stages in range(config.num_stages, 1, -1):
    candidate = dataclasses.replace(config, num_stages=stages)
    if fits(candidate):
      return candidate
  return _heuristic(args, keep_projections=True)


# ----------------------------------------------------------------------------
# Backward.


def dh_smem_bytes(config: GatedLinearUnitConfig, itemsize: int) -> int:
  # Per compute warpgroup two [block_m / 2, block_n] tiles: dy in, then d_gate
  # out (the same buffer), and d_up out.
  stage = (config.block_m + 2 * config.block_n) * config.block_k * itemsize
  return config.num_stages * stage + 2 * config.block_m * config.block_n * itemsize


def _vjp_heuristic(args) -> GatedLinearUnitVjpConfig:
  itemsize = jnp.dtype(args.x.dtype).itemsize
  mm = ragged_dot.heuristic(0, 0, 0, 1, itemsize, itemsize)
  base = dict(matmul_block_n=mm.block_n, matmul_num_stages=mm.num_stages)
  for block_n, stages in ((128, 3), (64, 4)):
    config = GatedLinearUnitVjpConfig(block_n=block_n, num_stages=stages, **base)
    if dh_smem_bytes(config.dh_config(), itemsize) <= _common.SMEM_LIMIT:
      return config
  return GatedLinearUnitVjpConfig(block_n=64, block_k=32, num_stages=3, **base)


def _vjp_search_space(args):
  itemsize = jnp.dtype(args.x.dtype).itemsize
  base = _vjp_heuristic(args)
  out = []
  for c in _search_space(args):
    if dh_smem_bytes(c, itemsize) <= _common.SMEM_LIMIT:
      out.append(dataclasses.replace(
          base, block_m=c.block_m, block_n=c.block_n, block_k=c.block_k,
          num_stages=c.num_stages, grid_tile_width=c.grid_tile_width))
  for bn, stages in ((128, 2), (128, 3), (64, 4), (64, 5)):
    for width in (4, 8, 16):
      mm = ragged_dot.RaggedDotConfig(block_n=bn, num_stages=stages)
      if ragged_dot.smem_bytes(mm, itemsize, itemsize) <= _common.SMEM_LIMIT:
        out.append(dataclasses.replace(base, matmul_block_n=bn,
                                       matmul_num_stages=stages,
                                       matmul_grid_tile_width=width))
  out.append(dataclasses.replace(base, fuse_activation=False))
  return tuple(dict.fromkeys(out))


def _check_vjp_args(args) -> None:
  _check_operands(args)
  # Any elementwise activation: one the epilogue cannot lower is differentiated
  # in XLA instead (`glu_backward`).
  tokamax.plugin.check_elementwise_activation(args.activation)
  try:
    vjp_jaxpr(args.activation)
  except Exception as e:  # whatever tracing raised: no VJP to run
    raise NotImplementedError(
        f"activation {args.activation!r} has no VJP on float32: "
        f"{type(e).__name__}: {e}") from e


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedLinearUnitVjp(VjpOp):
  """Backward. From a training forward's projections: dh in one pass
  (`glu_dh_from_projections`), then XLA's two matmuls. Without them: dh from the
  forward's kernel with a VJP epilogue, then dx and dw by ragged_dot's
  dense-capable kernel. Grouped: `_grouped_backward` (see the module docstring)."""

  op_name = "gated_linear_unit"
  name = "mosaic_gpu"
  config_cls = GatedLinearUnitVjpConfig
  supported_features = ("group_sizes",)
  recomputes_without = frozenset({"projections"})

  def check_supported(self, args, device, residuals=None):
    del residuals  # Recomputes the projections where the forward kept none.
    _common.check_hopper_device(device)
    _check_vjp_args(args)
    if args.group_sizes is not None:
      _check_grouped(args, ragged_dot.MosaicGpuRaggedDotVjp(), device)

  def heuristic_config(self, args):
    return _vjp_heuristic(args)

  def search_space(self, args):
    if args.group_sizes is not None:  # runs ragged_dot's configs, not this one
      return (self.heuristic_config(args),)
    return _vjp_search_space(args)

  def backward(self, args, residuals, out, dout, config):
    del out
    if args.group_sizes is not None:
      return _grouped_backward(args, residuals.get("projections"), dout)
    if "projections" in residuals:
      # The forward kept the projections: dh is elementwise and dx, dw are two
      # dense matmuls, which XLA's (cuBLAS) runs faster than our grouped-matmul
      # kernel at one group (notes/MEASUREMENTS.md, session 7).
      return args.backward_from_dh(_projection_gradient(args, residuals["projections"],
                                                        dout))
    config = config or self.heuristic_config(args)
    needed = dh_smem_bytes(config.dh_config(), jnp.dtype(args.x.dtype).itemsize)
    if needed > _common.SMEM_LIMIT:
      raise ValueError(
          f"config {config} does not fit: its dh kernel needs {needed} bytes of "
          f"shared memory (limit {_common.SMEM_LIMIT}); use fewer num_stages or a "
          "smaller block_n or block_k")
    dx, dw = glu_backward(args.x, args.weights, dout, args.activation, config)
    return {"x": dx, "weights": dw}


def _projection_gradient(args, projections, dout):
  """dh from the projections: `glu_dh_from_projections` (one pass, each input read
  once) where it takes the shape and lowers the activation's VJP, else XLA's."""
  m, _, n = projections.shape
  if dh_tile(m, n) is not None and epilogue_can_fuse(args.activation):
    return glu_dh_from_projections(projections.reshape(m, 2 * n), dout,
                                   args.activation)
  return args.projection_gradient(projections, dout)


# ----------------------------------------------------------------------------
# Grouped (MoE experts): ragged_dot's Mosaic GPU kernels (an inference forward's
# with the activation in its epilogue).


def _ragged_args(args, lhs=None):
  """ragged_dot's args for the projections ``x @ [G, K, 2N]`` (or `lhs` @ them)."""
  g, k, _, n = args.weights.shape
  return tokamax.RaggedDotArgs(lhs=args.x if lhs is None else lhs,
                               rhs=args.weights.reshape(g, k, 2 * n),
                               group_sizes=args.group_sizes, precision=args.precision)


def _check_grouped(args, ragged_op, device) -> None:
  """What a grouped call needs: an elementwise activation (in XLA, or in
  `grouped_glu`'s epilogue where it lowers) and ragged_dot's kernel taking the
  projections' matmul. Asked with shapes only: a
  check must not compute (dispatch may check in a trace other than the call's,
  and an array made there from the call's operands would escape it)."""
  _check_operands(args)
  tokamax.plugin.check_elementwise_activation(args.activation)
  g, k, _, n = args.weights.shape
  shape = lambda x, shape=None: jax.ShapeDtypeStruct(shape or x.shape, x.dtype)
  ragged_op.check_supported(tokamax.RaggedDotArgs(
      lhs=shape(args.x), rhs=shape(args.weights, (g, k, 2 * n)),
      group_sizes=shape(args.group_sizes), precision=args.precision), device)


def _grouped_projections(args):
  """``h = x @ w[g]`` per group, ``[M, 2N]`` in x's dtype (0 past the groups), by
  ragged_dot's forward kernel at the config it would run with."""
  op = ragged_dot.MosaicGpuRaggedDot()
  rd_args = _ragged_args(args)
  h, _ = op.forward(rd_args, tokamax.plugin.resolve_config(op, rd_args))
  return h


def _activation_in_epilogue(activation) -> bool:
  """Whether a kernel epilogue can lower `activation` (`_common.check_elementwise_fn`,
  strict: not where this JAX's table of lowerable primitives cannot be read; the
  grouped forward then keeps XLA's activation, which takes any)."""
  try:
    _common.check_elementwise_fn("activation", activation, strict=True)
  except NotImplementedError:
    return False
  return True


def _grouped_forward(args, keep_projections: bool):
  """Without residuals (inference), `grouped_glu`: ragged_dot's forward kernel
  at the projections' config with the activation in its epilogue. In a training
  step, ragged_dot's kernel for the projections (kept for the backward), then
  the activation in XLA (one elementwise pass, as the plain program's), as for
  an activation the epilogue cannot lower.

  H200, the MoE step's gate/up shape (M16384 K4096 N2x14336 G8, CUPTI,
  notes/MEASUREMENTS.md session 25): `grouped_glu` without the projections
  5.70 ms against 5.93 for the projections and XLA's activation. Writing the
  projections too it ran 5.90 ms, and the training step 0.34-0.46 ms slower
  than with XLA's activation pass. (Its mainloop issues two ``[64, 128]``
  wgmma per step where ragged_dot's issues one ``[64, 256]``, each reading the
  x tile from shared memory: without the projections it writes half of
  ragged_dot's output bytes and still ran 2% longer, 5.70 against 5.58 ms;
  Nsight Compute: 4.3% more cycles, the tensor pipe 88% busy against 92%.)"""
  m = args.x.shape[0]
  num_groups, _, _, n = args.weights.shape
  if keep_projections or not _activation_in_epilogue(args.activation):
    h = _grouped_projections(args)
    out = args.output_from_projections(h)
    return out, ({"projections": h.reshape(m, 2, n)} if keep_projections else {})
  op = ragged_dot.MosaicGpuRaggedDot()
  config = tokamax.plugin.resolve_config(op, _ragged_args(args))
  starts, ends = tokamax.plugin.held_row_ranges(args.group_sizes, None, num_groups, m)
  return grouped_glu(args.x, args.weights, starts, ends, args.activation, config), {}


def _grouped_backward(args, projections, dout):
  """dh from the projections (`_projection_gradient`: one Mosaic GPU pass), then
  ``dx = dh @ w[g]^T`` and ``dw[g] = x^T @ dh`` by ragged_dot's backward
  kernels. Rows past the groups have projections 0, so their dh is ``[0, dy *
  act(0)]``: nonzero for some activations, but ragged_dot's backward reads no
  row outside a group."""
  if projections is None:  # a forward that kept none: recompute them
    m, n = args.x.shape[0], args.weights.shape[3]
    projections = _grouped_projections(args).reshape(m, 2, n)
  dh = _projection_gradient(args, projections, dout)
  vjp = ragged_dot.MosaicGpuRaggedDotVjp()
  rd_args = _ragged_args(args)
  grads = vjp.backward(rd_args, {}, None, dh, tokamax.plugin.resolve_config(vjp, rd_args))
  return {"x": grads["lhs"], "weights": grads["rhs"].reshape(args.weights.shape)}
