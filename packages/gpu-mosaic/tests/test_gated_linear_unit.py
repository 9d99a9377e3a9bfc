"""Tests of the Mosaic GPU gated_linear_unit forward and backward.

Numerical tests here run natively on a Hopper GPU (on a CPU with JAX >= 0.12 the
kernels also run in the Mosaic GPU interpreter: test_interpret.py); on the CPU the
registration, the refusals and the lowering to Mosaic GPU IR for "cuda" are
checked.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src import op as op_lib
from tokamax._src.ops.gated_linear_unit import GatedLinearUnitArgs
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import gated_linear_unit as glu
from tokamax_gpu_mosaic import gated_linear_unit_kernel as glk
from tokamax_gpu_mosaic import ragged_dot_kernel as rdk

HIGHEST = jax.lax.Precision.HIGHEST
_ON_HOPPER = (jax.default_backend() == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "").startswith("9."))


def gpu(test):
  """A native test: skipped off a Hopper GPU, and marked `gpu` so that the
  native run of README.md (`pytest -m gpu`) selects it."""
  hopper_only = pytest.mark.skipif(not _ON_HOPPER, reason="needs an NVIDIA Hopper GPU")
  return pytest.mark.gpu(hopper_only(test))


_seed = iter(range(1_000_000))


def _inputs(m, k, n, dtype):
  rng = np.random.default_rng(next(_seed))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), dtype)
  return x, w


def _custom_activation(v):
  return jnp.tanh(v) * v + 0.5 * v


def _check(m, k, n, activation, dtype=jnp.bfloat16, config=None, grads=True,
           lead=(), bwd_impl="mosaic_gpu"):
  x, w = _inputs(m, k, n, dtype)
  x = x.reshape(*lead, m // max(1, int(np.prod(lead))), k) if lead else x
  impl = glu.MosaicGpuGatedLinearUnit(config) if config else "mosaic_gpu"
  with tokamax.record_dispatch() as records:
    out = jax.jit(lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=activation, implementation=impl))(x, w)
  assert any(r.implementation == "mosaic_gpu" for r in records)
  ref = tokamax.gated_linear_unit(x.astype(jnp.float32), w.astype(jnp.float32),
                                  activation=activation, precision=HIGHEST,
                                  implementation="xla")
  assert out.dtype == dtype
  testing.assert_close(out, ref, dtype, what="forward", gpu=True)
  if grads:
    _check_grads(x, w, activation, dtype, bwd_impl=bwd_impl)


def _check_grads(x, w, activation, dtype, impl=None, bwd_impl="mosaic_gpu"):
  """dx, dw against XLA on float32 upcasts at HIGHEST, with a random cotangent;
  `bwd_impl`: the backward that must have run (None: any)."""
  out_shape = (*x.shape[:-1], w.shape[-1])
  cot = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal(out_shape),
                    jnp.float32)

  def loss(x, w, impl, precision=None):
    y = tokamax.gated_linear_unit(x, w, activation=activation, precision=precision,
                                  implementation=impl)
    return jnp.sum(y.astype(jnp.float32) * cot)
  with tokamax.record_dispatch() as records:
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, impl)
  if bwd_impl is not None:
    assert any(r.implementation == bwd_impl and r.direction == "backward"
               for r in records), records
  rx, rw = jax.grad(loss, argnums=(0, 1))(x.astype(jnp.float32),
                                          w.astype(jnp.float32), "xla", HIGHEST)
  assert dx.dtype == dtype and dw.dtype == dtype
  testing.assert_close(dx, rx, dtype, what="dx", scale=2, gpu=True)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2, gpu=True)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", [jax.nn.silu, None, jax.nn.gelu, jax.nn.relu])
def test_forward(dtype, activation):
  _check(1000, 384, 520, activation, dtype)


@gpu
def test_odd_shapes():
  _check(37, 40, 24, jax.nn.silu, grads=False)
  _check(300, 200, 136, jax.nn.silu, grads=False)


@gpu
@pytest.mark.parametrize("config", [
    glu.GatedLinearUnitConfig(block_m=128, block_n=64, block_k=32, num_stages=3,
                              grid_tile_width=3),
    glu.GatedLinearUnitConfig(block_m=256, block_n=64, block_k=64, num_stages=3),
])
def test_configs(config):
  _check(1100, 512, 640, jax.nn.silu, config=config, grads=False)


def test_registered():
  names = {(s.op, s.name) for s in tokamax.implementations()}
  assert ("gated_linear_unit", "mosaic_gpu") in names


def test_refusals():
  x, w = _inputs(16, 16, 16, jnp.bfloat16)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=jax.nn.silu)
  with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
    glu.MosaicGpuGatedLinearUnit().check_supported(args, tokamax.DeviceInfo("cpu", "cpu"))
  h200 = tokamax.DeviceInfo("gpu", "NVIDIA H200", compute_capability="9.0")
  glu.MosaicGpuGatedLinearUnit().check_supported(args, h200)
  x32, w32 = _inputs(16, 16, 16, jnp.float32)
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x32, weights=w32), h200)
  with pytest.raises(NotImplementedError, match="not elementwise"):
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x, weights=w, activation=jnp.sort), h200)
  with pytest.raises(NotImplementedError, match="cannot lower"):  # elementwise
    glu.MosaicGpuGatedLinearUnit().check_supported(
        GatedLinearUnitArgs(x=x, weights=w, activation=jax.lax.lgamma), h200)
  vjp = glu.MosaicGpuGatedLinearUnitVjp()
  vjp.check_supported(args, h200)
  for device in (tokamax.DeviceInfo("cpu", "cpu"),
                 tokamax.DeviceInfo("gpu", "NVIDIA A100", compute_capability="8.0")):
    with pytest.raises(NotImplementedError, match="needs an NVIDIA Hopper GPU"):
      vjp.check_supported(args, device)
  with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
    vjp.check_supported(GatedLinearUnitArgs(x=x32, weights=w32), h200)
  with pytest.raises(NotImplementedError, match="not elementwise"):
    vjp.check_supported(GatedLinearUnitArgs(x=x, weights=w, activation=jnp.sort), h200)
  with pytest.raises(NotImplementedError, match="empty"):
    vjp.check_supported(GatedLinearUnitArgs(x=x[:0], weights=w), h200)
  with pytest.raises(NotImplementedError, match="dot algorithm"):
    vjp.check_supported(GatedLinearUnitArgs(
        x=x, weights=w, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3), h200)
  # What the epilogue cannot lower is differentiated in XLA: accepted.
  for activation in (jax.lax.lgamma, lambda v: jax.nn.gelu(v, approximate=False)):
    vjp.check_supported(GatedLinearUnitArgs(x=x, weights=w, activation=activation),
                        h200)


def test_epilogue_fusion_choice():
  assert glk.epilogue_can_fuse(None)
  assert glk.epilogue_can_fuse(jax.nn.silu)
  assert glk.epilogue_can_fuse(jax.nn.relu)  # custom_jvp: inlined
  assert glk.epilogue_can_fuse(jax.nn.gelu)
  assert not glk.epilogue_can_fuse(lambda v: jax.nn.gelu(v, approximate=False))
  assert not glk.epilogue_can_fuse(jax.lax.lgamma)


def test_vjp_configs_fit():
  x, w = _inputs(16, 16, 16, jnp.bfloat16)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=jax.nn.silu)
  vjp = glu.MosaicGpuGatedLinearUnitVjp()
  configs = vjp.search_space(args)
  assert vjp.heuristic_config(args) in configs
  for c in configs:
    assert glu.dh_smem_bytes(c.dh_config(), 2) <= glu._common.SMEM_LIMIT
  with pytest.raises(ValueError):
    glu.GatedLinearUnitVjpConfig(block_n=96)
  with pytest.raises(ValueError):
    glu.GatedLinearUnitVjpConfig(matmul_block_n=96)


@pytest.mark.smoke
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.relu])
def test_lowers_for_cuda(activation):
  pytest.importorskip("absl")
  config = glu.GatedLinearUnitConfig(block_n=64, num_stages=2)
  exported = jax.export.export(
      jax.jit(lambda x, w: glu.fused_glu(x, w, activation, config)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((300, 200), jnp.bfloat16),
                          jax.ShapeDtypeStruct((200, 2, 136), jnp.bfloat16))
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("stages", [2, 3])
def test_forward_with_projections_lowers_for_cuda(stages):
  pytest.importorskip("absl")
  config = glu.GatedLinearUnitConfig(num_stages=stages)
  exported = jax.export.export(
      jax.jit(lambda x, w: glu.fused_glu(x, w, jax.nn.silu, config,
                                         keep_projections=True)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((300, 200), jnp.bfloat16),
                          jax.ShapeDtypeStruct((200, 2, 136), jnp.bfloat16))
  assert "mosaic_gpu" in exported.mlir_module()
  out, projections = exported.out_avals
  assert out.shape == (300, 136) and projections.shape == (300, 2, 136)


def test_a_tuned_config_makes_room_for_projections():
  args = GatedLinearUnitArgs(jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
                             jax.ShapeDtypeStruct((4096, 2, 14336), jnp.bfloat16))
  config = glu._room_for_projections(args, glu.GatedLinearUnitConfig(num_stages=4))
  assert config == glu.GatedLinearUnitConfig(num_stages=3)
  assert glu.smem_bytes(config, 2, keep_projections=True) <= glu._common.SMEM_LIMIT


@gpu
@pytest.mark.parametrize("shape", [(1000, 384, 520), (4096, 512, 1024), (37, 72, 24)])
def test_forward_with_projections(shape):
  m, k, n = shape
  x, w = _inputs(m, k, n, jnp.bfloat16)
  out, projections = jax.jit(lambda x, w: glu.fused_glu(
      x, w, jax.nn.silu, glu.GatedLinearUnitConfig(num_stages=3),
      keep_projections=True))(x, w)
  ref_h = jnp.einsum("mk,kpn->mpn", x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=HIGHEST)
  ref = jax.nn.silu(ref_h[:, 0]) * ref_h[:, 1]
  testing.assert_close(projections, ref_h, jnp.bfloat16, what="projections", gpu=True)
  testing.assert_close(out, ref, jnp.bfloat16, what="forward", gpu=True)


@gpu
@pytest.mark.parametrize("in_kernel", [False, True])
def test_training_keeps_projections_and_skips_the_recompute(in_kernel):
  x, w = _inputs(512, 256, 384, jnp.bfloat16)
  impl = glu.MosaicGpuGatedLinearUnit(projections_in_kernel=in_kernel)
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(tokamax.gated_linear_unit(
      x, w, activation=jax.nn.silu, implementation=impl).astype(jnp.float32)),
      argnums=(0, 1)))
  kernels = re.findall(r"@mosaic_gpu\w*", grad.lower(x, w).as_text())
  # No dh recompute kernel either way: the forward's projections come from the
  # fused kernel (in_kernel) or from XLA's matmul (the default, faster today),
  # and the backward's one kernel is the elementwise dh from them.
  assert len(kernels) == (2 if in_kernel else 1), kernels
  _check_grads(x, w, jax.nn.silu, jnp.bfloat16, impl=impl)


@pytest.mark.parametrize("m,n,tile", [
    ((16384, 14336, (8, 256))), ((48, 384, (16, 128))), ((64, 192, (32, 64))),
    ((30, 384, None)), ((64, 100, None)), ((8, 512, (8, 256)))])
def test_dh_tile_is_the_widest_that_tiles_the_shape(m, n, tile):
  assert glk.dh_tile(m, n) == tile


def test_dh_from_projections_refuses_a_shape_without_a_tile():
  with pytest.raises(ValueError, match="no block of 2048 elements"):
    glk.glu_dh_from_projections(jnp.zeros((30, 768)), jnp.zeros((30, 384)), None)
  with pytest.raises(ValueError, match=r"projections must be \[16, 1024\]"):
    glk.glu_dh_from_projections(jnp.zeros((16, 512)), jnp.zeros((16, 512)), None)


@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu, None])
@pytest.mark.parametrize("shape,dtype", [((16384, 14336), jnp.bfloat16),
                                         ((48, 384), jnp.float16),
                                         ((64, 192), jnp.float32)])
def test_dh_from_projections_lowers_for_cuda(activation, shape, dtype):
  pytest.importorskip("absl")
  m, n = shape
  exported = jax.export.export(
      jax.jit(lambda h, dy: glk.glu_dh_from_projections(h, dy, activation)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((m, 2 * n), dtype),
                          jax.ShapeDtypeStruct((m, n), dtype))
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (m, 2 * n)


def _reference_dh(h, dy, activation):
  """dh of ``activation(gate) * up`` by autodiff on float32 upcasts."""
  n = dy.shape[1]
  _, vjp = jax.vjp(lambda h: (activation or (lambda g: g))(h[:, :n]) * h[:, n:],
                   h.astype(jnp.float32))
  return vjp(dy.astype(jnp.float32))[0]


@gpu
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu, jax.nn.relu, None,
                                        _custom_activation])
@pytest.mark.parametrize("shape,dtype", [((4096, 14336), jnp.bfloat16),
                                         ((48, 384), jnp.float16),
                                         ((96, 1408), jnp.bfloat16),
                                         ((64, 192), jnp.float32)])
def test_dh_from_projections(activation, shape, dtype):
  m, n = shape
  rng = np.random.default_rng(next(_seed))
  h = jnp.asarray(rng.standard_normal((m, 2 * n)) * 2, dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  dh = jax.jit(lambda h, dy: glk.glu_dh_from_projections(h, dy, activation))(h, dy)
  assert dh.dtype == dtype and dh.shape == (m, 2 * n)
  testing.assert_close(dh, _reference_dh(h, dy, activation), dtype, what="dh", gpu=True)


def _exact_gelu(v):
  return jax.nn.gelu(v, approximate=False)


def test_grouped_glu_deals_round_robin():
  # ragged_dot's heuristics claim items; the grouped GLU kernel's claims have
  # not run on a GPU yet, so its config turns them off.
  config = rdk.RaggedDotConfig(item_order="group", claim_items=True)
  assert not glk.grouped_glu_config(config, 2).claim_items


def test_which_activations_the_grouped_epilogue_takes():
  assert glu._activation_in_epilogue(jax.nn.silu)
  assert glu._activation_in_epilogue(None)
  assert not glu._activation_in_epilogue(_exact_gelu)  # erfc: no Lane lowering


def test_the_grouped_epilogue_refuses_where_the_lowering_table_is_unreadable(
    monkeypatch):
  monkeypatch.setattr(_common, "lowerable_primitives", lambda: None)
  _common.check_elementwise_fn("activation", jax.nn.silu)  # the kernel decides
  with pytest.raises(NotImplementedError, match="cannot be read"):
    _common.check_elementwise_fn("activation", jax.nn.silu, strict=True)
  assert not glu._activation_in_epilogue(jax.nn.silu)  # XLA's activation then
  assert glu._activation_in_epilogue(None)


@gpu
@pytest.mark.parametrize("activation", [
    jax.nn.silu, jax.nn.gelu,
    _exact_gelu])  # erfc: no epilogue lowering, so the forward applies it in XLA
@pytest.mark.parametrize("m,k,n,sizes", [
    (4096, 512, 1024, (1000, 0, 1900, 900)),  # an empty group, 296 rows past them
    (1000, 384, 520, (333, 667))])  # no dh_tile: dh by XLA
def test_grouped(activation, m, k, n, sizes):
  rng = np.random.default_rng(next(_seed))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, 2, n)) / np.sqrt(k), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def output_and_grads(implementation, precision=None):
    """The training forward's output and the gradients for cotangent dy. (Not a
    scalar loss: a sum of millions of random-signed terms cancels to a value whose
    relative error says little about the output's.)"""
    def glu(x, w):
      return tokamax.gated_linear_unit(
          x, w, activation=activation, group_sizes=gs, precision=precision,
          implementation=implementation)
    def run(x, w):
      out, vjp = jax.vjp(glu, x, w)
      return out, vjp(dy.astype(out.dtype))
    return run
  with tokamax.record_dispatch() as records:
    out, grads = jax.jit(output_and_grads("mosaic_gpu"))(x, w)
    # An inference forward: the activation in the kernel's epilogue where it lowers.
    inference = jax.jit(lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=activation, group_sizes=gs, implementation="mosaic_gpu"))(x, w)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "mosaic_gpu"), ("backward", "mosaic_gpu")}
  up = (x.astype(jnp.float32), w.astype(jnp.float32))
  ref, ref_grads = output_and_grads("xla", HIGHEST)(*up)
  testing.assert_close(out, ref, jnp.bfloat16, what="training output", gpu=True)
  for got, want, what in zip(grads, ref_grads, ("dx", "dw")):
    testing.assert_close(got, want, jnp.bfloat16, what=what, scale=2, gpu=True)
  testing.assert_close(inference, tokamax.gated_linear_unit(
      *up, activation=activation, group_sizes=gs, precision=HIGHEST,
      implementation="xla"), jnp.bfloat16, what="inference output", gpu=True)


@gpu
@pytest.mark.parametrize("config", [
    rdk.RaggedDotConfig(block_n=128, num_stages=4, out_pieces=2, item_order="group"),
    rdk.RaggedDotConfig(block_n=128, num_stages=3, chain_items=False),
    rdk.RaggedDotConfig(block_n=64, num_stages=4),
    # Tilings the kernel does not run, taken as 128-row group items.
    rdk.RaggedDotConfig(block_m=256, block_n=128, num_stages=3, item_order="group"),
    rdk.RaggedDotConfig(block_m=64, block_n=128, num_stages=6, row_tiling="fixed")],
    ids=["group-order", "unchained", "block_n64", "from-tall", "from-fixed"])
@pytest.mark.parametrize("keep_projections", [False, True])
@pytest.mark.parametrize("activation", [jax.nn.silu, None])
def test_grouped_glu_kernel(config, keep_projections, activation):
  """The grouped forward kernel (activation in the epilogue) against the float32
  reference: held groups from the second (offset 1), an empty group, a group
  ending mid-tile, rows past the last group, N not a multiple of the tile. K
  is 4 steps: the 4-stage configs chain their items in one ring."""
  m, k, n = 3000, 256, 700
  sizes = jnp.asarray([200, 900, 0, 1333, 250, 17], jnp.int32)
  rng = np.random.default_rng(next(_seed))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((5, k, 2, n)) / np.sqrt(k), jnp.bfloat16)
  starts, ends = tokamax.plugin.held_row_ranges(sizes, jnp.int32(1), 5, m)
  got = jax.jit(lambda x, w: glk.grouped_glu(
      x, w, starts, ends, activation, config, keep_projections))(x, w)
  projections = tokamax.ragged_dot(
      x.astype(jnp.float32), w.astype(jnp.float32).reshape(5, k, 2 * n), sizes,
      group_offset=jnp.int32(1), precision=HIGHEST, implementation="xla")
  rounded = projections.astype(jnp.bfloat16).astype(jnp.float32)
  want = (activation or (lambda g: g))(rounded[:, :n]) * rounded[:, n:]
  out = got[0] if keep_projections else got
  testing.assert_close(out, want, jnp.bfloat16, what="output", gpu=True)
  if keep_projections:
    assert got[1].shape == (m, 2, n)
    testing.assert_close(got[1].reshape(m, 2 * n), projections, jnp.bfloat16,
                         what="projections", gpu=True)


def test_grouped_lowers_for_cuda():
  pytest.importorskip("absl")
  s = jax.ShapeDtypeStruct
  args = GatedLinearUnitArgs(x=s((1000, 384), jnp.bfloat16),
                             weights=s((3, 384, 2, 512), jnp.bfloat16),
                             activation=jax.nn.silu, group_sizes=s((3,), jnp.int32))
  fwd, vjp = glu.MosaicGpuGatedLinearUnit(), glu.MosaicGpuGatedLinearUnitVjp()

  def kernels(*training):
    def step(args, dy):  # a new function per call: jit's trace cache ignores the context
      out, residuals = fwd.forward(args, None)
      return out, vjp.backward(args, residuals, out, dy, None)
    with op_lib.forward_for_backward(*training):
      exported = jax.export.export(jax.jit(step), platforms=["cuda"])(
          args, s((1000, 512), jnp.bfloat16))
    return re.findall(r"@mosaic_gpu\w*", exported.mlir_module())
  # Outside dispatch a forward keeps no residuals: `grouped_glu` (the activation
  # in its epilogue), then the backward's recompute of the projections, dh,
  # dlhs and drhs.
  assert len(kernels(False)) == 5, kernels(False)
  # A training forward: the projections kernel (kept; XLA's activation), then
  # dh, dlhs and drhs.
  assert len(kernels()) == 4, kernels()


@gpu
@pytest.mark.parametrize("activation", [jax.nn.silu, None])
def test_backward_without_projections_recomputes_them(activation):
  # What a forward that kept no projections gets: the dh kernel and the matmuls.
  x, w = _inputs(300, 200, 136, jnp.bfloat16)
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((300, 136)),
                   jnp.bfloat16)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=activation)
  vjp = glu.MosaicGpuGatedLinearUnitVjp()
  grads = jax.jit(lambda a, dy: vjp.backward(a, {}, None, dy, None))(args, dy)
  _, ref_vjp = jax.vjp(lambda x, w: tokamax.gated_linear_unit(
      x, w, activation=activation, precision=HIGHEST, implementation="xla"),
      x.astype(jnp.float32), w.astype(jnp.float32))
  rx, rw = ref_vjp(dy.astype(jnp.float32))
  testing.assert_close(grads["x"], rx, jnp.bfloat16, what="dx", scale=2, gpu=True)
  testing.assert_close(grads["weights"], rw, jnp.bfloat16, what="dw", scale=2, gpu=True)


@pytest.mark.smoke
@pytest.mark.parametrize("activation,fuse,shape", [
    (jax.nn.silu, True, (300, 200, 136)),
    (None, True, (37, 40, 24)),
    (jax.nn.relu, True, (1000, 384, 520)),
    (jax.nn.gelu, True, (128, 128, 128)),
    (_custom_activation, True, (300, 200, 136)),
    (lambda v: jax.nn.gelu(v, approximate=False), True, (300, 200, 136)),  # XLA VJP
    (jax.nn.silu, False, (300, 200, 136)),
])
def test_backward_lowers_for_cuda(activation, fuse, shape):
  pytest.importorskip("absl")
  m, k, n = shape
  config = glu.GatedLinearUnitVjpConfig(fuse_activation=fuse)
  exported = jax.export.export(
      jax.jit(lambda x, w, dy: glu.glu_backward(x, w, dy, activation, config)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                          jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16),
                          jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
  assert "mosaic_gpu" in exported.mlir_module()
  assert [a.shape for a in exported.out_avals] == [(m, k), (k, 2, n)]


@pytest.mark.parametrize("config", [
    glu.GatedLinearUnitVjpConfig(block_m=256, block_n=64, num_stages=3),
    glu.GatedLinearUnitVjpConfig(block_n=64, block_k=32, num_stages=4,
                                 matmul_block_n=64, matmul_num_stages=4),
])
def test_backward_configs_lower_for_cuda(config):
  pytest.importorskip("absl")
  exported = jax.export.export(
      jax.jit(lambda x, w, dy: glu.glu_backward(x, w, dy, jax.nn.silu, config)),
      platforms=["cuda"])(jax.ShapeDtypeStruct((520, 136), jnp.float16),
                          jax.ShapeDtypeStruct((136, 2, 200), jnp.float16),
                          jax.ShapeDtypeStruct((520, 200), jnp.float16))
  assert "mosaic_gpu" in exported.mlir_module()


def test_backward_has_no_copies_when_aligned():
  # At tile-aligned shapes the only extra pass is x's transpose (for dw).
  config = glu.GatedLinearUnitVjpConfig()
  jaxpr = jax.make_jaxpr(
      lambda x, w, dy: glu.glu_backward(x, w, dy, jax.nn.silu, config))(
          jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
          jax.ShapeDtypeStruct((512, 2, 768), jnp.bfloat16),
          jax.ShapeDtypeStruct((1024, 768), jnp.bfloat16))
  names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert "pad" not in names and "concatenate" not in names, names
  assert names.count("transpose") == 1, names


# ---------------------------------------------------------------- backward (GPU)


@gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu, None, _custom_activation])
def test_backward(dtype, activation):
  x, w = _inputs(1000, 384, 520, dtype)
  _check_grads(x, w, activation, dtype)


@gpu
@pytest.mark.parametrize("shape", [(37, 40, 24), (300, 200, 136), (129, 72, 65),
                                   (64, 64, 64), (1, 130, 300)])
def test_backward_awkward_shapes(shape):
  x, w = _inputs(*shape, jnp.bfloat16)
  _check_grads(x, w, jax.nn.silu, jnp.bfloat16)


@gpu
def test_backward_leading_batch_dims():
  _check(2 * 3 * 50, 192, 136, jax.nn.silu, lead=(2, 3))


@gpu
def test_backward_activation_only_xla_can_differentiate():
  # erf has no Lane lowering: the backward differentiates it in XLA. (Through
  # dispatch the forward would be triton's, whose own backward comes first.)
  exact_gelu = lambda v: jax.nn.gelu(v, approximate=False)
  dtype = jnp.bfloat16
  x, w = _inputs(300, 200, 136, dtype)
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((300, 136)),
                   dtype)
  dx, dw = jax.jit(lambda x, w, dy: glu.glu_backward(
      x, w, dy, exact_gelu, glu.GatedLinearUnitVjpConfig()))(x, w, dy)
  rx, rw = _reference_grads(x, w, dy, exact_gelu)
  testing.assert_close(dx, rx, dtype, what="dx", scale=2, gpu=True)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2, gpu=True)


def _reference_grads(x, w, dy, activation):
  def f(x, w):
    return tokamax.gated_linear_unit(x, w, activation=activation, precision=HIGHEST,
                                     implementation="xla")
  _, pullback = jax.vjp(f, x.astype(jnp.float32), w.astype(jnp.float32))
  return pullback(dy.astype(jnp.float32))


@gpu
@pytest.mark.parametrize("config", [
    glu.GatedLinearUnitVjpConfig(fuse_activation=False),
    glu.GatedLinearUnitVjpConfig(block_m=256, block_n=64, num_stages=3),
    glu.GatedLinearUnitVjpConfig(block_n=64, block_k=32, num_stages=4,
                                 grid_tile_width=3, matmul_block_n=64,
                                 matmul_num_stages=4, matmul_grid_tile_width=4),
])
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.relu])
def test_backward_configs(config, activation):
  dtype = jnp.bfloat16
  x, w = _inputs(1100, 512, 640, dtype)
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((1100, 640)),
                   dtype)
  dx, dw = jax.jit(lambda x, w, dy: glu.glu_backward(x, w, dy, activation, config))(
      x, w, dy)
  rx, rw = _reference_grads(x, w, dy, activation)
  testing.assert_close(dx, rx, dtype, what="dx", scale=2, gpu=True)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2, gpu=True)


@gpu
def test_backward_dispatch_records_mosaic():
  x, w = _inputs(256, 256, 256, jnp.bfloat16)
  with tokamax.record_dispatch() as records:
    jax.grad(lambda x, w: jnp.sum(tokamax.gated_linear_unit(
        x, w, activation=jax.nn.silu).astype(jnp.float32)), argnums=(0, 1))(x, w)
  directions = {(r.direction, r.implementation) for r in records}
  assert ("forward", "mosaic_gpu") in directions, records
  assert ("backward", "mosaic_gpu") in directions, records


def _dense_grouped_matmul(lhs, rhs, starts, ends, *, transpose_rhs, out_dtype,
                          config):
  del config
  rows = jnp.arange(lhs.shape[0])
  mine = (rows >= starts[0]) & (rows < ends[0])
  b = jnp.swapaxes(rhs[0], 0, 1) if transpose_rhs else rhs[0]
  out = jnp.dot(lhs.astype(jnp.float32), b.astype(jnp.float32), precision=HIGHEST)
  return jnp.where(mine[:, None], out, 0).astype(out_dtype)


def _dense_dh(x, w2, dout, activation, config):
  del config
  n = dout.shape[1]
  h = jnp.dot(x.astype(jnp.float32), w2.astype(jnp.float32), precision=HIGHEST)
  # The epilogue's own evaluation of the VJP jaxpr (custom rules inlined).
  d_gate, d_up = glu._common.inline(glk.vjp_fn(activation))(
      h[:, :n], h[:, n:], dout.astype(jnp.float32))
  return jnp.concatenate([d_gate, d_up], axis=1).astype(x.dtype)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("activation", [jax.nn.silu, None, jax.nn.relu, _custom_activation])
@pytest.mark.parametrize("shape", [(37, 40, 24), (300, 200, 136)])
def test_backward_wrapper_math(monkeypatch, fuse, activation, shape):
  """Padding, layout and the VJP math of `glu_backward` on the CPU, with the
  kernels replaced by dense jnp equivalents of what they compute."""
  monkeypatch.setattr(glk.ragged_dot_kernel, "grouped_matmul", _dense_grouped_matmul)
  monkeypatch.setattr(glk, "glu_dh", _dense_dh)
  m, k, n = shape
  dtype = jnp.float16
  x, w = _inputs(m, k, n, dtype)
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((m, n)), dtype)
  config = glu.GatedLinearUnitVjpConfig(fuse_activation=fuse)
  dx, dw = glu.glu_backward(x, w, dy, activation, config)
  rx, rw = _reference_grads(x, w, dy, activation)
  assert dx.dtype == dtype and dw.dtype == dtype
  testing.assert_close(dx, rx, dtype, what="dx", scale=2)
  testing.assert_close(dw, rw, dtype, what="dw", scale=2)


@pytest.mark.parametrize("fuse", [True, False])
def test_backward_padding_with_an_infinite_derivative_at_zero(monkeypatch, fuse):
  """Padded rows and columns have gate 0; sqrt|g|'s derivative there is infinite,
  and 0 * inf must not leak NaN into dx and dw through the matmuls. (Not log|g|:
  its derivative 1/g overflows float16 at a real gate below ~1e-4, which some
  random inputs hold: 1 of 60 seeds. sqrt|g|'s is at most ~2000 at a nonzero
  float16 gate.)"""
  monkeypatch.setattr(glk.ragged_dot_kernel, "grouped_matmul", _dense_grouped_matmul)
  monkeypatch.setattr(glk, "glu_dh", _dense_dh)
  activation = lambda g: jnp.sqrt(jnp.abs(g))
  m, k, n = 37, 40, 24  # pads M, K and N
  x, w = _inputs(m, k, n, jnp.float16)
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((m, n)),
                   jnp.float16)
  dx, dw = glu.glu_backward(x, w, dy, activation,
                            glu.GatedLinearUnitVjpConfig(fuse_activation=fuse))
  assert np.isfinite(np.asarray(dx, np.float32)).all()
  assert np.isfinite(np.asarray(dw, np.float32)).all()
  rx, rw = _reference_grads(x, w, dy, activation)
  testing.assert_close(dx, rx, jnp.float16, what="dx", scale=2)
  testing.assert_close(dw, rw, jnp.float16, what="dw", scale=2)


def test_an_explicit_backward_config_that_does_not_fit_is_named():
  x, w = _inputs(256, 256, 256, jnp.bfloat16)
  args = GatedLinearUnitArgs(x=x, weights=w, activation=jax.nn.silu)
  too_big = glu.GatedLinearUnitVjpConfig(block_n=128, block_k=64, num_stages=4)
  with pytest.raises(ValueError, match=r"does not fit: its dh kernel needs \d+ bytes"):
    glu.MosaicGpuGatedLinearUnitVjp().backward(args, {}, None, x[:, :256], too_big)
