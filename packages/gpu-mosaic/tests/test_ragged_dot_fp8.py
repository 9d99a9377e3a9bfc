"""Tests of the Mosaic GPU fp8 grouped matmul (ragged_dot on float8 operands with
block scales, `ragged_dot_kernel_fp8`).

Natively on Hopper: the kernel against the XLA reference on the same quantized
inputs (the reference dequantizes to float32 and multiplies at HIGHEST), with
empty, skewed and random groups, both float8 types, bf16 and f32 outputs, and
what `implementation=None` picks. On the CPU: the lowering to Mosaic GPU IR for
"cuda", the refusals with their reasons, and the scale expansion.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
import tokamax_xla_reference
from tokamax import testing
from tokamax._src.ops.ragged_dot import RaggedDotArgs
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import ragged_dot as rd
from tokamax_gpu_mosaic import ragged_dot_kernel as rdk
from tokamax_gpu_mosaic import ragged_dot_kernel_fp8 as fp8

_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))


def gpu(test):
  """A native test: skipped off a Hopper GPU, and marked `gpu` so that the
  native run of README.md (`pytest -m gpu`) selects it."""
  hopper_only = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
  return pytest.mark.gpu(hopper_only(test))


_H200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")

_seed = iter(range(1_000_000))


# 256-column tiles (two wgmma halves a step, each promoted into its own total),
# claimed in the group order.
_WIDE = rdk.RaggedDotConfig(block_m=128, block_n=128, block_k=128, num_stages=3,
                            out_pieces=2, item_order="group", claim_items=True)


def _quantized(m, k, n, num_held, dtype=jnp.float8_e4m3fn, lhs_tile=(1, 128),
               rhs_tile=(1, 128, 128)):
  rng = np.random.default_rng(next(_seed))
  # Rows and weight blocks of different magnitudes, so that wrong scales show.
  lhs = rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))
  rhs = rng.standard_normal((num_held, k, n)) / np.sqrt(k)
  rhs *= rng.uniform(0.2, 3.0, (num_held, k // 128, 1)).repeat(128, axis=1)
  lq = tokamax.quantize(jnp.asarray(lhs, jnp.bfloat16), lhs_tile, dtype)
  rq = tokamax.quantize(jnp.asarray(rhs, jnp.bfloat16), rhs_tile, dtype)
  return lq, rq


def _check(m, k, n, sizes, *, num_held=None, group_offset=None,
           dtype=jnp.float8_e4m3fn, out_dtype=None, config=None,
           rhs_tile=(1, 128, 128), lhs_tile=(1, 128)):
  num_held = num_held or len(sizes)
  lq, rq = _quantized(m, k, n, num_held, dtype, lhs_tile, rhs_tile)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  impl = rd.MosaicGpuRaggedDot(config) if config else "mosaic_gpu"
  call = lambda impl: jax.jit(lambda l, r, g: tokamax.ragged_dot(
      l, r, g, group_offset=group_offset, preferred_element_type=out_dtype,
      implementation=impl))(lq, rq, group_sizes)
  with tokamax.record_dispatch() as records:
    out = call(impl)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "mosaic_gpu")], records
  ref = call("xla")
  assert out.dtype == jnp.dtype(out_dtype or jnp.bfloat16)
  testing.assert_close(out, ref, jnp.bfloat16, what="fp8 forward", gpu=True)
  # Rows outside the held groups are exactly zero (never left unwritten).
  ends = np.cumsum(sizes)
  starts = ends - np.asarray(sizes)
  offset = group_offset or 0
  held = np.zeros(m, bool)
  for g in range(offset, offset + num_held):
    held[starts[g]:ends[g]] = True
  assert not np.asarray(out, np.float32)[~held].any()


@gpu
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_awkward_groups(dtype, out_dtype):
  # An empty group, groups that do not start on a tile, rows past the total, N
  # not a multiple of the tile.
  _check(1000, 512, 320, [300, 0, 201, 399], dtype=dtype, out_dtype=out_dtype,
         rhs_tile=(1, 128, 64))


@gpu
def test_group_offset_and_tiny_groups():
  _check(200, 256, 128, [5, 9, 0, 3, 60, 1], num_held=3, group_offset=2)


@gpu
def test_many_random_groups():
  rng = np.random.default_rng(5)
  sizes = rng.multinomial(8000, rng.dirichlet(np.ones(64) * 0.5))
  _check(8192, 1024, 512, sizes.tolist())


@gpu
@pytest.mark.parametrize("wide", [False, True])
def test_per_channel_and_wide_k_tiles(wide):
  # rhs scales per column (tile N of 1), lhs scales per 256 columns: both
  # expanded to one scale per 128-deep step and column / row.
  _check(640, 768, 256, [100, 400, 140], rhs_tile=(1, 128, 1), lhs_tile=(1, 256),
         config=_WIDE if wide else None)


@gpu
@pytest.mark.parametrize("config", [
    rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=128, num_stages=3),
    rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=128, num_stages=6,
                        out_pieces=2, item_order="group"),
    # 256-column tiles: two wgmma halves a step, each promoted into its total.
    _WIDE,
], ids=["3stages", "6stages_pieces_group", "wide"])
def test_configs(config):
  _check(1500, 1024, 640, [700, 0, 50, 750], config=config)


@gpu
def test_k_major_weights_are_read_without_a_transpose():
  """Weights quantized with ``minor_axis=1`` (stored [G, N, K]) give the same
  result, and the compiled call moves no weights: XLA cancels the transpose of
  the stored values against the kernel wrapper's."""
  m, k, n, g = 1024, 512, 768, 4
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
  sizes = jnp.asarray([256, 0, 512, 256], jnp.int32)
  lq = tokamax.quantize(x, (1, 128))
  plain = tokamax.quantize(w, (1, 128, 128))
  k_major = tokamax.quantize(w, (1, 128, 128), minor_axis=1)
  assert k_major.values.shape == (g, n, k)
  f = jax.jit(lambda l, r, s: tokamax.ragged_dot(l, r, s, implementation="mosaic_gpu"))
  np.testing.assert_array_equal(np.asarray(f(lq, k_major, sizes), np.float32),
                                np.asarray(f(lq, plain, sizes), np.float32))

  def weight_moves(rq):
    hlo = f.lower(lq, rq, sizes).compile().as_text()
    # A transpose of the weights shows as a transpose or a copy (a layout
    # change) of an f8 [G, ...] array.
    return [line for line in hlo.splitlines()
            if f"f8e4m3fn[{g}," in line and (" transpose(" in line or " copy(" in line
                                            or "fusion(" in line)]
  assert weight_moves(plain), "the check must see the transpose of [G, K, N] weights"
  assert not weight_moves(k_major), weight_moves(k_major)


@gpu
def test_moe_sized_and_picked_by_default():
  rng = np.random.default_rng(7)
  sizes = rng.multinomial(8192, np.ones(8) / 8).tolist()
  lq, rq = _quantized(8192, 2048, 4096, 8)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  with tokamax.record_dispatch() as records:
    out = jax.jit(lambda l, r, g: tokamax.ragged_dot(l, r, g))(lq, rq, group_sizes)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "mosaic_gpu")], records
  ref = tokamax.ragged_dot(lq, rq, group_sizes, implementation="xla")
  testing.assert_close(out, ref, jnp.bfloat16, what="fp8 forward", gpu=True)


@gpu
def test_training_step_takes_the_fp8_forward_and_a_kernel_backward():
  """Activations and weights quantized inside the step (fp8 training): the
  forward runs the fp8 kernel; the backward (straight-through, core's
  `_quantized_call`) runs the plain ragged_dot's backward kernels on the
  dequantized operands, not the reference; the gradients reach x and w and
  equal the reference's."""
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 512, 256)) / np.sqrt(512), jnp.bfloat16)
  sizes = jnp.asarray([300, 200, 0, 500], jnp.int32)
  dy = jnp.asarray(rng.standard_normal((1024, 256)) * 1e-3, jnp.float32)

  def loss(x, w, impl):
    xq = tokamax.quantize(x, (1, 128))
    wq = tokamax.quantize(w, (1, 128, 128), minor_axis=1)
    y = tokamax.ragged_dot(xq, wq, sizes, implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * dy), y

  step = lambda impl: jax.jit(jax.value_and_grad(
      lambda x, w: loss(x, w, impl), argnums=(0, 1), has_aux=True))
  with tokamax.record_dispatch() as records:
    (_, y), (dx, dw) = step(None)(x, w)
  assert (records[0].direction, records[0].implementation) == ("forward", "mosaic_gpu")
  backward = [r.implementation for r in records if r.direction == "backward"]
  assert backward and "xla" not in backward, records
  (_, want_y), (want_dx, want_dw) = step("xla")(x, w)
  # (The loss itself, a sum of products of random signs, cancels: its relative
  # error says nothing about the kernel's.)
  testing.assert_close(y, want_y, jnp.bfloat16, what="output", gpu=True)
  testing.assert_close(dx, want_dx, jnp.bfloat16, what="dx", gpu=True)
  testing.assert_close(dw, want_dw, jnp.bfloat16, what="dw", gpu=True)
  assert float(jnp.linalg.norm(dx.astype(jnp.float32))) > 0


@gpu
@pytest.mark.parametrize("minor_axis", [None, 1])
def test_quantized_lhs_gradient_runs_the_fp8_kernel(minor_axis):
  """The opt-in fp8 backward (`quantized_lhs_gradient`): dx is an fp8 ragged_dot
  of the quantized cotangent and the transposed weights, run by this kernel, and
  equal to the reference's on the same quantized operands."""
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 512, 256)) / np.sqrt(512), jnp.bfloat16)
  sizes = jnp.asarray([300, 200, 0, 500], jnp.int32)
  dy = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
  spec = tokamax.GradientQuantization()

  def dx(impl):
    def loss(x):
      y = tokamax.ragged_dot(
          tokamax.quantize(x, (1, 128)),
          tokamax.quantize(w, (1, 128, 128), minor_axis=minor_axis), sizes,
          implementation=impl, quantized_lhs_gradient=spec)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return jax.jit(jax.grad(loss))(x)

  with tokamax.record_dispatch() as records:
    got = dx(None)
  # The fp8 forward, the fp8 dx call, and the plain ragged_dot whose backward
  # gives dw: all kernels (only mosaic_gpu takes fp8 operands), none the reference.
  ran = [r.implementation for r in records]
  assert ran.count("mosaic_gpu") >= 2 and "xla" not in ran, records
  testing.assert_close(got, dx("xla"), jnp.bfloat16, what="dx", gpu=True)


# ----------------------------------------------------------------------------
# CPU: lowering, refusals, scales.


def _args(lq, rq, sizes):
  def parts(q):
    return (q.values, q.scales) if isinstance(q, tokamax.QuantizedArray) else (q, None)
  (lhs, ls), (rhs, rs) = parts(lq), parts(rq)
  return RaggedDotArgs(lhs=lhs, rhs=rhs, group_sizes=jnp.asarray(sizes, jnp.int32),
                       preferred_element_type=jnp.bfloat16, lhs_scales=ls,
                       rhs_scales=rs)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype,out_dtype,config", [
    (jnp.float8_e4m3fn, jnp.bfloat16, rdk.RaggedDotConfig(
        block_m=128, block_n=64, block_k=128, num_stages=4)),
    (jnp.float8_e5m2, jnp.float32, rdk.RaggedDotConfig(
        block_m=128, block_n=64, block_k=128, num_stages=3)),
    (jnp.float8_e4m3fn, jnp.bfloat16, rdk.RaggedDotConfig(
        block_m=128, block_n=64, block_k=128, num_stages=6, out_pieces=2,
        item_order="group")),
    (jnp.float8_e4m3fn, jnp.bfloat16, _WIDE),
    (jnp.float8_e5m2, jnp.float32, _WIDE),
])
@pytest.mark.parametrize("n,rhs_tile_n", [(200, 1), (256, 128), (512, 256)],
                         ids=["per_column", "block128", "block256"])
def test_lowers_for_cuda(dtype, out_dtype, config, n, rhs_tile_n):
  """The whole kernel traces and lowers to Mosaic GPU for "cuda" without a GPU,
  with rhs scales per column and per block of columns."""
  pytest.importorskip("absl")
  m, k, g = 300, 256, 3

  def f(lhs, lhs_scales, rhs, rhs_scales, sizes):
    starts, ends = tokamax.plugin.held_row_ranges(sizes, None, g, m)
    return fp8.grouped_matmul_fp8(lhs, lhs_scales, rhs, rhs_scales, starts, ends,
                                  out_dtype=out_dtype, config=config)

  shapes = (((m, k), dtype), ((m, k // 128), jnp.float32), ((g, k, n), dtype),
            ((g, k // 128, n // rhs_tile_n), jnp.float32), ((g,), jnp.int32))
  exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
      *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
  assert "mosaic_gpu" in exported.mlir_module()


def test_takes_fp8_operands_with_scales():
  lq, rq = _quantized(64, 256, 128, 2)
  rd.MosaicGpuRaggedDot().check_supported(_args(lq, rq, [30, 34]), _H200)
  assert "block_scales" in rd.MosaicGpuRaggedDot.supported_features
  # The backward has no fp8 kernel: it never sees such a call.
  assert "block_scales" not in rd.MosaicGpuRaggedDotVjp.supported_features


@pytest.mark.smoke
def test_refusals_say_why():
  lq, rq = _quantized(64, 256, 128, 2)
  op = rd.MosaicGpuRaggedDot()
  plain_lhs = lq.values.astype(jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="one operand only"):
    op.check_supported(_args(plain_lhs, rq, [30, 34]), _H200)
  lhs8, rhs8 = _quantized(64, 256, 128, 2, dtype=jnp.int8)
  with pytest.raises(NotImplementedError, match="float8_e4m3fn or float8_e5m2"):
    op.check_supported(_args(lhs8, rhs8, [30, 34]), _H200)
  _, rq5 = _quantized(64, 256, 128, 2, dtype=jnp.float8_e5m2)
  with pytest.raises(NotImplementedError, match="the same for both"):
    op.check_supported(_args(lq, rq5, [30, 34]), _H200)
  lq64, rq64 = _quantized(64, 256, 128, 2, lhs_tile=(1, 64))
  with pytest.raises(NotImplementedError, match="lhs scales cover K in tiles of 64"):
    op.check_supported(_args(lq64, rq64, [30, 34]), _H200)


def test_scales_per_step_match_the_per_element_scales():
  """Each expanded scale is the one the reference applies to the step's first
  element (tokamax_xla_reference.per_element defines the tiles)."""
  rng = np.random.default_rng(3)
  shape = (6, 3, 512)  # [G, K, N]-like with K on axis 2 here
  scales = jnp.asarray(rng.uniform(0.5, 2.0, (3, 3, 2)), jnp.float32)  # tiles (2, 1, 256)
  per_step = fp8.scales_per_step(scales, shape, 2, "rhs")
  assert per_step.shape == (6, 3, 4)
  every = np.asarray(tokamax_xla_reference.per_element(scales, shape))
  np.testing.assert_array_equal(np.asarray(per_step), every[:, :, ::128])
  kept = fp8.scales_per_step(scales, shape, 2, "rhs", keep_axis=0)
  np.testing.assert_array_equal(np.asarray(kept), every[::2, :, ::128])


@pytest.mark.parametrize("tile_n,col_block", [(1, False), (64, False), (128, True),
                                              (256, True)])
def test_column_scales_as_streamed(tile_n, col_block):
  """Per block of 128 columns (repeated to 128 bytes) where the rhs tile is a
  multiple of 128 columns, else per column: each column's scale where it is read."""
  rng = np.random.default_rng(4)
  n = 512
  scales = jnp.asarray(rng.uniform(0.5, 2.0, (2, 3, n // tile_n)), jnp.float32)
  streamed, block = fp8._column_scales(scales, n, 128)
  assert block == col_block
  every = np.repeat(np.asarray(scales), tile_n, axis=2)  # [G, steps, N]
  if block:
    # Column block j's scale is read at position j * BLOCK_SCALE_WIDTH.
    width = fp8.BLOCK_SCALE_WIDTH
    assert streamed.shape == (2, 3, n // 128 * width)
    np.testing.assert_array_equal(np.asarray(streamed)[:, :, ::width],
                                  every[:, :, ::128])
  else:
    np.testing.assert_array_equal(np.asarray(streamed), every)


def test_config_checks():
  with pytest.raises(ValueError, match="block_k=128"):
    fp8.check_config(rdk.RaggedDotConfig(block_n=64, block_k=64))
  with pytest.raises(ValueError, match="block_n 64 or 128"):
    fp8.check_config(rdk.RaggedDotConfig(block_n=192, block_k=128))
  with pytest.raises(ValueError, match="256-column tiles take out_pieces=2"):
    fp8.check_config(rdk.RaggedDotConfig(block_n=128, block_k=128))
  with pytest.raises(ValueError, match="block_m=128"):
    fp8.check_config(rdk.RaggedDotConfig(block_m=256, block_n=64, block_k=128))
  for out_itemsize in (2, 4):
    heuristics = tuple(rd._fp8_heuristic(n, out_itemsize) for n in (128, 640, 2048))
    for c in rd._fp8_search_space(out_itemsize) + heuristics:
      fp8.check_config(c)
      assert fp8.fits(c, out_itemsize)


@pytest.mark.parametrize("n,wide", [(2048, True), (16384, True), (200, True),
                                    (448, True), (384, False), (640, False),
                                    (128, False)])
def test_heuristic_takes_wide_tiles_without_extra_columns(n, wide, monkeypatch):
  """256-column tiles where they compute no more columns than 128-column ones
  (N in whole 256-column tiles, or a last tile of over 128 columns), with the
  warpgroups' register split kept (JAX 0.11's compile)."""
  monkeypatch.setattr(_common, "register_split_lost", lambda: None)
  assert (rd._fp8_heuristic(n, 2).block_n == 128) == wide


@pytest.mark.parametrize("out_itemsize", [2, 4])
@pytest.mark.parametrize("n", [200, 2048, 16384])
def test_heuristic_without_the_register_split_takes_narrow_tiles(
    n, out_itemsize, monkeypatch):
  """Where JAX's compile ignores `setmaxnreg` (JAX 0.12), the wide tiles'
  total and accumulator (192 registers) spill at the 168 a consumer keeps:
  128 x 128 tiles instead, at a config the kernel takes."""
  monkeypatch.setattr(_common, "register_split_lost", lambda: "lost")
  config = rd._fp8_heuristic(n, out_itemsize)
  assert config.block_n == 64, config
  fp8.check_config(config)
  assert fp8.fits(config, out_itemsize)


@gpu
def test_moe_ffn_with_qwix_quantized_operands():
  """A small MoE FFN (top-1 routing, tokens sorted by expert, SwiGLU experts)
  whose expert weights and activations are quantized with Qwix's own arrays
  (fp8, 1x128 activation tiles, 128x128 weight blocks): `None` runs the fp8
  kernel for each of its three grouped matmuls, and the output equals the XLA
  definition's on the same quantized inputs. (A model quantized by
  `qwix.quantize_model`: `test_moe_quantized_by_qwix_ptq_runs_the_fp8_kernel`.)"""
  qwix = pytest.importorskip("qwix")
  rng = np.random.default_rng(13)
  tokens, d, f, experts = 2048, 512, 768, 8
  x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((d, experts)) / np.sqrt(d), jnp.bfloat16)
  weights = [jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16)
             for shape in ((experts, d, f), (experts, d, f), (experts, f, d))]
  w_gate, w_up, w_down = [
      qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=[0],
                    tiled_axes={1: 128, 2: 128}) for w in weights]

  def acts(a):
    return qwix.quantize(a, jnp.float8_e4m3fn, channelwise_axes=[0],
                         tiled_axes={1: 128})

  def moe(x, impl):
    """The layer's output, and each grouped matmul's quantized inputs and
    output (to check each against the definition on the same inputs)."""
    expert = jnp.argmax(x @ router, axis=-1)
    order = jnp.argsort(expert)
    sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
    xs = acts(x[order])
    gate = tokamax.ragged_dot(xs, w_gate, sizes, implementation=impl)
    up = tokamax.ragged_dot(xs, w_up, sizes, implementation=impl)
    h = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    hs = acts(h.astype(jnp.bfloat16))
    y = tokamax.ragged_dot(hs, w_down, sizes, implementation=impl)
    stages = {"gate": (xs, w_gate, gate), "up": (xs, w_up, up), "down": (hs, w_down, y)}
    return jnp.zeros_like(y).at[order].set(y), sizes, stages

  with tokamax.record_dispatch() as records:
    _, sizes, stages = jax.jit(lambda x: moe(x, None))(x)
  assert [(r.op, r.implementation) for r in records] == [
      ("ragged_dot", "mosaic_gpu")] * 3, records
  for name, (lhs, rhs, out) in stages.items():
    want = jax.jit(lambda l, r: tokamax.ragged_dot(l, r, sizes, implementation="xla"))(
        lhs, rhs)
    testing.assert_close(out, want, jnp.bfloat16, what=f"MoE {name}", gpu=True)


@gpu
def test_moe_quantized_by_qwix_ptq_runs_the_fp8_kernel():
  """A model holding `tokamax.flax.MoE`, quantized by `qwix.quantize_model` with
  a PTQ rule for ``ragged_dot`` (fp8 weights and activations, 128-deep tiles:
  per row and 128 of K for the rows, per expert, 128 of K and column for the
  weights): `None` runs the fp8 kernel for both expert matmuls, and each one's
  output equals the XLA definition's on the same quantized operands."""
  qwix = pytest.importorskip("qwix")
  nnx = pytest.importorskip("flax.nnx")
  import tokamax.flax
  from tokamax._src import qwix_ptq

  class Block(nnx.Module):
    def __init__(self):
      self.moe = tokamax.flax.MoE(512, 768, 8, param_dtype=jnp.bfloat16,
                                  rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.moe(x)

  x = jnp.asarray(np.random.default_rng(5).standard_normal((2048, 512)), jnp.bfloat16)
  rule = qwix.QuantizationRule(module_path="moe", op_names=("ragged_dot",),
                               weight_qtype=jnp.float8_e4m3fn,
                               act_qtype=jnp.float8_e4m3fn, tile_size=128)
  model = qwix.quantize_model(Block(), qwix.PtqProvider([rule]), x)
  stages = []
  quantize_operands = qwix_ptq.quantize_operands
  def operands_spy(*args, **kw):
    stages.append(quantize_operands(*args, **kw))
    return stages[-1]
  with pytest.MonkeyPatch.context() as patch, tokamax.record_dispatch() as records:
    patch.setattr(qwix_ptq, "quantize_operands", operands_spy)
    model(x)
  assert [(r.op, r.implementation) for r in records] == [
      ("ragged_dot", "mosaic_gpu")] * 2, records
  sizes = []
  real = tokamax.flax._moe.ragged_dot
  def sizes_spy(lhs, rhs, group_sizes, **kw):
    sizes.append(group_sizes)
    return real(lhs, rhs, group_sizes, **kw)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(tokamax.flax._moe, "ragged_dot", sizes_spy)
    model(x)
  for (lhs, rhs), group_sizes in zip(stages, sizes, strict=True):
    got = tokamax.ragged_dot(lhs, rhs, group_sizes)
    want = tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="xla")
    testing.assert_close(got, want, jnp.bfloat16, what="expert matmul", gpu=True)
