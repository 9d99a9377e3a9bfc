"""Tests of the Pallas Triton layer / RMS norm.

Native kernels when a GPU is present, Pallas interpret mode on the CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax import testing
import tokamax_xla_reference
from tokamax_gpu_triton import _common
from tokamax_gpu_triton import layer_norm as ln


def _forward(op, args):
  """`op`'s forward with the config dispatch would resolve for it."""
  return op.forward(args, dispatch.resolve_config(op, args))


def _backward(op, args, residuals, out, dout):
  """`op`'s backward with the config dispatch would resolve for it."""
  return op.backward(args, residuals, out, dout, dispatch.resolve_config(op, args))

_HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
_INTERPRET = jax.default_backend() == "cpu"
gpu_only = pytest.mark.skipif(not _HAS_GPU, reason="needs a GPU")
_seed = iter(range(10_000))


def _key():
  return jax.random.key(next(_seed))


def _assert_close(name, got, want, dtype):
  testing.assert_close(got, want, dtype, what=name, gpu=not _INTERPRET)


def _inputs(r, d, dtype, with_scale, with_offset):
  ks = jax.random.split(_key(), 4)
  # An offset mean makes the LayerNorm centering matter.
  x = (jax.random.normal(ks[0], (r, d)) * 1.5 + 0.7).astype(dtype)
  scale = (1.0 + 0.5 * jax.random.normal(ks[1], (d,))).astype(dtype) if with_scale \
      else None
  offset = jax.random.normal(ks[2], (d,)).astype(dtype) if with_offset else None
  dy = jax.random.normal(ks[3], (r, d)).astype(dtype)
  return x, scale, offset, dy


def _f32(a):
  return None if a is None else a.astype(jnp.float32)


def _reference(x, scale, offset, dy, subtract_mean, eps):
  """Output and gradients on float32 upcasts."""
  def f(x, scale, offset):
    return tokamax_xla_reference.layer_norm(
        x, scale, offset, epsilon=eps, subtract_mean=subtract_mean)[0]
  y, vjp = jax.vjp(f, _f32(x), _f32(scale), _f32(offset))
  return y, vjp(_f32(dy))


def _check(x, scale, offset, dy, subtract_mean, eps=1e-6, implementation="triton",
           interpret=_INTERPRET):
  dtype = x.dtype.type

  def f(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, subtract_mean=subtract_mean,
                              epsilon=eps, implementation=implementation)

  with tokamax.interpret(interpret), tokamax.record_dispatch() as records:
    y, vjp = jax.vjp(f, x, scale, offset)
    grads = vjp(dy)
  y_ref, grads_ref = _reference(x, scale, offset, dy, subtract_mean, eps)
  assert y.dtype == x.dtype
  _assert_close("y", y, y_ref, dtype)
  for name, g, g_ref in zip(("dx", "dscale", "doffset"), grads, grads_ref):
    if g_ref is None:
      assert g is None
    else:
      _assert_close(name, g, g_ref, dtype)
  return records


@pytest.mark.parametrize("subtract_mean", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_and_modes(dtype, subtract_mean):
  _check(*_inputs(13, 96, dtype, True, True), subtract_mean)


@pytest.mark.parametrize("with_scale,with_offset", [(False, False), (True, False),
                                                    (False, True)])
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_optional_params(with_scale, with_offset, subtract_mean):
  _check(*_inputs(6, 40, jnp.float32, with_scale, with_offset), subtract_mean)


@pytest.mark.parametrize("r,d", [(1, 1), (1, 7), (2, 1), (17, 33), (3, 257),
                                 (129, 8)])
def test_awkward_shapes(r, d):
  _check(*_inputs(r, d, jnp.float32, True, True), subtract_mean=True)


# Shapes no other test traces, so that no cached trace skips the patched path.
@pytest.mark.parametrize("r,d", [(13, 45), (5, 300)])
def test_index_arrays_for_a_block_past_the_row(monkeypatch, r, d):
  """JAX 0.12's form of a column block that runs past a short row (index arrays
  instead of slices, `_common.at`), forced on whatever JAX runs the test."""
  monkeypatch.setattr(_common, "_static_slices_bounds_checked", lambda: True)
  runs_past, converted = _common._runs_past, []

  def spy(index, dim):  # counts the accesses that take the index-array form
    converted.append(runs_past(index, dim))
    return converted[-1]
  monkeypatch.setattr(_common, "_runs_past", spy)
  records = _check(*_inputs(r, d, jnp.float32, True, True), subtract_mean=True)
  assert {(rec.direction, rec.implementation) for rec in records} == {
      ("forward", "triton"), ("backward", "triton")}
  # The forward's x, y, scale, offset and the backward's x, dy, dx, dscale, doffset.
  assert sum(converted) >= 9, converted


@pytest.mark.smoke
def test_dispatch_runs_triton_both_directions():
  records = _check(*_inputs(5, 24, jnp.bfloat16, True, True), subtract_mean=True)
  got = {(r.op, r.direction, r.implementation) for r in records}
  assert got == {("layer_norm", "forward", "triton"),
                 ("layer_norm", "backward", "triton")}


def test_rms_norm_nd_axis():
  ks = jax.random.split(_key(), 3)
  x = jax.random.normal(ks[0], (3, 10, 4))
  scale = jax.random.normal(ks[1], (10,))
  dy = jax.random.normal(ks[2], (3, 10, 4))

  def f(impl):
    return lambda x, s: tokamax.rms_norm(x, s, axis=1, implementation=impl)

  with tokamax.interpret(_INTERPRET):
    y, vjp = jax.vjp(f("triton"), x, scale)
    grads = vjp(dy)
  y_ref, vjp_ref = jax.vjp(f("xla"), x, scale)
  _assert_close("y", y, y_ref, jnp.float32)
  for name, g, g_ref in zip(("dx", "dscale"), grads, vjp_ref(dy)):
    _assert_close(name, g, g_ref, jnp.float32)


# Explicit configs reach the wide-row paths (block_d < D: Chan-merged forward
# statistics, the row-sums kernel and a 2-D backward grid), several rows per
# program, more programs than row blocks, persistent programs with padding rows
# (7 row blocks over 4 programs) and fully aligned, unmasked tiles.
_CONFIGS = [
    (5, 100, ln.LayerNormConfig(2, 32, 1), ln.LayerNormVjpConfig(2, 32, 1, 2)),
    (7, 70, ln.LayerNormConfig(4, 16, 1), ln.LayerNormVjpConfig(1, 64, 1, 4)),
    (8, 64, ln.LayerNormConfig(4, 64, 2), ln.LayerNormVjpConfig(2, 32, 1, 2)),
    (11, 20, ln.LayerNormConfig(8, 32, 2), ln.LayerNormVjpConfig(4, 32, 1, 100)),
    # Whole-row backward over several trips: prefetching with padding programs
    # (7 row blocks, 3 programs x 3 trips), without prefetch, and fully aligned.
    (13, 40, ln.LayerNormConfig(2, 64, 1), ln.LayerNormVjpConfig(2, 64, 1, 3)),
    (13, 40, ln.LayerNormConfig(2, 64, 1),
     ln.LayerNormVjpConfig(2, 64, 1, 3, prefetch=False)),
    (8, 64, ln.LayerNormConfig(2, 64, 2), ln.LayerNormVjpConfig(2, 64, 2, 2)),
    # The backward recomputing the statistics instead of reading the saved ones.
    (13, 40, ln.LayerNormConfig(2, 64, 1),
     ln.LayerNormVjpConfig(2, 64, 1, 3, saved_stats=False)),
    (13, 40, ln.LayerNormConfig(2, 64, 2),
     ln.LayerNormVjpConfig(2, 64, 1, 3, prefetch=False, saved_stats=False)),
]


@pytest.mark.parametrize("r,d,fwd_config,bwd_config", _CONFIGS)
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_explicit_configs(r, d, fwd_config, bwd_config, subtract_mean):
  x, scale, offset, dy = _inputs(r, d, jnp.float32, True, True)
  args = tokamax.LayerNormArgs(x, scale, offset, 1e-5, subtract_mean)
  with tokamax.interpret(_INTERPRET):
    y, residuals = _forward(ln.TritonLayerNorm(config=fwd_config), args)
    grads = _backward(ln.TritonLayerNormVjp(config=bwd_config), args, residuals, y, dy)
  y_ref, mean_ref, rstd_ref = tokamax_xla_reference.layer_norm(
      x, scale, offset, epsilon=1e-5, subtract_mean=subtract_mean)
  _assert_close("y", y, y_ref, jnp.float32)
  _assert_close("rstd", residuals["rstd"], rstd_ref, jnp.float32)
  if subtract_mean:
    _assert_close("mean", residuals["mean"], mean_ref, jnp.float32)
  else:
    np.testing.assert_array_equal(residuals["mean"], 0.0)
  _, grads_ref = _reference(x, scale, offset, dy, subtract_mean, 1e-5)
  for name, g_ref in zip(("x", "scale", "offset"), grads_ref):
    _assert_close(name, grads[name], g_ref, jnp.float32)


@pytest.mark.parametrize("subtract_mean", [True, False])
def test_zero_epsilon_with_padding_rows(subtract_mean):
  """Padding rows (rstd of an all-zero row is inf at eps = 0) must add no NaNs."""
  x, scale, offset, dy = _inputs(5, 16, jnp.float32, True, True)
  args = tokamax.LayerNormArgs(x, scale, offset, 0.0, subtract_mean)
  bwd = ln.TritonLayerNormVjp(config=ln.LayerNormVjpConfig(2, 16, 1, 2))
  with tokamax.interpret(_INTERPRET):
    _, saved = _forward(ln.TritonLayerNorm(config=ln.LayerNormConfig(2, 16, 1)), args)
    # Recomputed statistics, and the forward's (padding rows load rstd = 0).
    all_grads = [_backward(bwd, args, residuals, None, dy) for residuals in ({}, saved)]
  _, grads_ref = _reference(x, scale, offset, dy, subtract_mean, 0.0)
  for grads in all_grads:
    for name, g_ref in zip(("x", "scale", "offset"), grads_ref):
      _assert_close(name, grads[name], g_ref, jnp.float32)


def test_backward_without_residuals():
  """A backward after another implementation's forward recomputes the statistics."""
  x, scale, offset, dy = _inputs(7, 50, jnp.float32, True, True)
  args = tokamax.LayerNormArgs(x, scale, offset, 1e-6, True)
  with tokamax.interpret(_INTERPRET):
    grads = _backward(ln.TritonLayerNormVjp(), args, {}, None, dy)
  _, grads_ref = _reference(x, scale, offset, dy, True, 1e-6)
  for name, g_ref in zip(("x", "scale", "offset"), grads_ref):
    _assert_close(name, grads[name], g_ref, jnp.float32)


def test_check_supported_refuses():
  x = jnp.ones((4, 8))
  cpu = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=False)
  with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
    ln.TritonLayerNorm().check_supported(tokamax.LayerNormArgs(x), cpu)
  interp = dataclasses.replace(cpu, interpret=True)
  ln.TritonLayerNorm().check_supported(tokamax.LayerNormArgs(x), interp)
  with pytest.raises(NotImplementedError, match=r"x must be non-empty \[R, D\] rows"):
    ln.TritonLayerNorm().check_supported(
        tokamax.LayerNormArgs(jnp.ones((0, 8))), interp)
  with pytest.raises(NotImplementedError, match=r"x must be non-empty \[R, D\] rows"):
    ln.TritonLayerNormVjp().check_supported(
        tokamax.LayerNormArgs(jnp.ones((4, 0))), interp)


def test_configs_are_sane():
  for r, d in [(32768, 8192), (1, 100000), (4096, 128), (7, 3)]:
    args = tokamax.LayerNormArgs(jax.ShapeDtypeStruct((r, d), jnp.bfloat16))
    for op in (ln.TritonLayerNorm(), ln.TritonLayerNormVjp()):
      configs = op.search_space(args)
      assert op.heuristic_config(args) in configs
      for c in configs:
        for v in (c.block_rows, c.block_d, c.num_warps):
          assert v >= 1 and v & (v - 1) == 0, c
        assert c.block_rows <= max(1, 2 * r), c
  big = tokamax.LayerNormArgs(jax.ShapeDtypeStruct((32768, 8192), jnp.bfloat16))
  assert ln.TritonLayerNorm().heuristic_config(big).block_d == 8192


@pytest.mark.smoke
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_lowers_to_triton(subtract_mean, lower_for_cuda):
  """The kernels lower through Pallas' Triton path (no GPU needed to lower)."""
  for r, d in [(64, 8192), (4, 40000), (1000, 96)]:
    x = jax.ShapeDtypeStruct((r, d), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((d,), jnp.float32)

    def fwd_bwd(x, s, o, dy):
      args = tokamax.LayerNormArgs(x, s, o, 1e-6, subtract_mean)
      y, res = _forward(ln.TritonLayerNorm(), args)
      return y, _backward(ln.TritonLayerNormVjp(), args, res, y, dy)

    assert "triton" in lower_for_cuda(fwd_bwd, x, s, s, x)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_gpu_matches_reference(subtract_mean):
  for r, d in [(4096, 8192), (300, 40000), (1000, 96)]:
    x, scale, offset, dy = _inputs(r, d, jnp.bfloat16, True, True)
    _check(x, scale, offset, dy, subtract_mean, interpret=False)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("subtract_mean", [True, False])
def test_gpu_search_space_configs(subtract_mean):
  """Every backward config the tuner may pick compiles and is right."""
  x, scale, offset, dy = _inputs(1030, 8192, jnp.bfloat16, True, not subtract_mean)
  args = tokamax.LayerNormArgs(x, scale, offset, 1e-6, subtract_mean)
  _, grads_ref = _reference(x, scale, offset, dy, subtract_mean, 1e-6)
  for config in ln.TritonLayerNormVjp().search_space(args):
    grads = _backward(ln.TritonLayerNormVjp(config=config), args, {}, None, dy)
    for name, g_ref in zip(("x", "scale", "offset"), grads_ref):
      if g_ref is not None:
        _assert_close(f"{name} {config}", grads[name], g_ref, jnp.bfloat16)


def test_wide_rms_backward_declines_under_automatic_choice():
  """RMS rows wider than one backward block: None's training step keeps triton's
  forward and runs another backward on its residuals (on a GPU XLA's, measured
  faster; interpreted on a CPU, mosaic_tpu's interpreter takes them first); a
  user who names triton still gets triton both ways, with the same gradients."""
  # Just past the kernel's (private) widest backward block.
  x, scale, _, _ = _inputs(3, ln._MAX_BLOCK_D_BWD + 8, jnp.float32, True, False)

  def grads(implementation):
    loss = lambda x, s: jnp.sum(jnp.sin(tokamax.rms_norm(
        x, s, implementation=implementation)))
    with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
      g = jax.grad(loss, argnums=(0, 1))(x, scale)
    return g, [(r.direction, r.implementation) for r in records]

  auto, auto_ran = grads(None)
  named, named_ran = grads("triton")
  assert auto_ran[0] == ("forward", "triton"), auto_ran
  assert auto_ran[1][0] == "backward" and auto_ran[1][1] != "triton", auto_ran
  assert named_ran == [("forward", "triton"), ("backward", "triton")], named_ran
  for a, n in zip(auto, named):
    _assert_close("grad", a, n, jnp.float32)
  # Layer norm (with the mean) at the same width keeps triton's backward.
  op = ln.TritonLayerNormVjp()
  args = tokamax.LayerNormArgs(x, scale, None, subtract_mean=True)
  assert op.declines(args) is None
  assert "slower than XLA" in op.declines(
      tokamax.LayerNormArgs(x, scale, None, subtract_mean=False))
