"""Tests of the Mosaic TPU ragged_dot kernels (gmm, tgmm) in TPU interpret mode.

Interpret mode starts output buffers as NaN, so a row the kernels forget to write
(rows past the total, rows of groups rhs does not hold) fails the comparison.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import dispatch
from tokamax import testing
import tokamax_xla_reference as xla_ref
from tokamax_tpu_mosaic import ragged_dot as rd


def _forward(op, args):
  """`op`'s forward with the config dispatch would resolve for it."""
  return op.forward(args, dispatch.resolve_config(op, args))


def _backward(op, args, residuals, out, dout):
  """`op`'s backward with the config dispatch would resolve for it."""
  return op.backward(args, residuals, out, dout, dispatch.resolve_config(op, args))

HIGHEST = jax.lax.Precision.HIGHEST
_INTERPRET = jax.default_backend() != "tpu"
_SMALL = rd.RaggedDotConfig(block_m=16, block_k=128, block_n=128)
_seed = iter(range(1_000_000))


def _key():
  return jax.random.key(next(_seed))


def _inputs(m, k, n, num_held, dtype):
  k1, k2 = jax.random.split(_key())
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
  rhs = jax.random.normal(k2, (num_held, k, n), jnp.float32).astype(dtype)
  return lhs, rhs


def _check(lhs, rhs, group_sizes, *, group_offset=None, preferred_element_type=None,
           config=_SMALL):
  """Forward and gradients (random cotangent) vs the XLA reference, one jit."""
  dtype = lhs.dtype.type
  if preferred_element_type is not None and jnp.dtype(
      preferred_element_type).itemsize < lhs.dtype.itemsize:
    dtype = jnp.dtype(preferred_element_type).type
  group_sizes = jnp.asarray(group_sizes, jnp.int32)
  if group_offset is not None:
    group_offset = jnp.asarray(group_offset, jnp.int32)
  cot = jax.random.normal(_key(), (lhs.shape[0], rhs.shape[2]), jnp.float32)
  impl = rd.MosaicTpuRaggedDot(config) if config else "mosaic_tpu"

  def ours(lhs, rhs, group_sizes, group_offset):
    return tokamax.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset,
                              preferred_element_type=preferred_element_type,
                              implementation=impl)

  def reference(lhs, rhs, group_sizes, group_offset):
    return xla_ref.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset,
                              precision=HIGHEST)

  @functools.partial(jax.jit, static_argnums=0)
  def forward_and_grads(fn, lhs, rhs, group_sizes, group_offset):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes, group_offset), lhs, rhs)
    return (out, *vjp(cot.astype(out.dtype)))

  with tokamax.interpret(_INTERPRET), tokamax.record_dispatch() as records:
    out, dlhs, drhs = forward_and_grads(ours, lhs, rhs, group_sizes, group_offset)
  ran = {(r.direction, r.implementation) for r in records}
  assert ran == {("forward", "mosaic_tpu"), ("backward", "mosaic_tpu")}, ran
  expected = forward_and_grads(reference, lhs.astype(jnp.float32),
                               rhs.astype(jnp.float32), group_sizes, group_offset)
  assert out.dtype == jnp.dtype(preferred_element_type or lhs.dtype)
  assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
  for name, actual, exp in zip(("out", "dlhs", "drhs"), (out, dlhs, drhs), expected):
    testing.assert_close(actual, exp, dtype, what=name)


@pytest.mark.parametrize("dtype,m,k,n,group_sizes", [
    (jnp.float32, 37, 20, 24, [5, 0, 17, 3]),      # rows past the total, empty group
    (jnp.bfloat16, 37, 20, 24, [5, 0, 17, 3]),
    (jnp.float32, 50, 300, 200, [0, 13, 2, 1, 30]),  # padded K, edge N tile, 5 groups
    (jnp.bfloat16, 1, 1, 1, [1]),                  # every dimension 1
    (jnp.float32, 40, 20, 24, [0, 0, 0]),          # no rows at all: zeros
])
def test_small_tiles(dtype, m, k, n, group_sizes):
  lhs, rhs = _inputs(m, k, n, len(group_sizes), dtype)
  _check(lhs, rhs, group_sizes)


@pytest.mark.smoke
def test_heuristic_config():
  lhs, rhs = _inputs(64, 48, 40, 3, jnp.bfloat16)
  _check(lhs, rhs, [20, 0, 30], config=None)


@pytest.mark.parametrize("offset,group_sizes,num_held", [
    (1, [7, 20, 0, 11, 30], 3),   # held groups 1..3, zeros before and after
    (2, [9, 21, 4], 1),           # last group held, rows past the total
    (1, [40, 0, 0, 13, 7], 2),    # held groups are empty: output all zeros
])
def test_group_offset(offset, group_sizes, num_held):
  lhs, rhs = _inputs(83, 29, 37, num_held, jnp.float32)
  _check(lhs, rhs, group_sizes, group_offset=offset)


def test_preferred_element_type():
  lhs, rhs = _inputs(45, 40, 19, 3, jnp.bfloat16)
  _check(lhs, rhs, [12, 0, 30], preferred_element_type=jnp.dtype(jnp.float32))


def _coverage(schedule_fn, sizes, offset, num_held, m, bm):
  tiles = -(-m // bm)
  ends = np.minimum(np.cumsum(sizes), m)
  starts = ends - np.minimum(np.asarray(sizes), ends)
  off = offset or 0
  fn = jax.jit(schedule_fn, static_argnums=(2, 3, 4))
  out = [np.asarray(a) for a in fn(jnp.asarray(sizes, jnp.int32),
                                   None if offset is None else jnp.int32(offset),
                                   num_held, m, bm)]
  tile, group, lo, hi = out[:4]
  assert tile.shape == (tiles + num_held - 1,)
  assert np.all((tile >= 0) & (tile < tiles)) and np.all((group >= 0) & (group < num_held))
  written = np.zeros(m, int)
  for t, g, a, b in zip(tile, group, lo, hi):
    if a < b:
      assert t * bm <= a and b <= (t + 1) * bm
      assert starts[off + g] <= a and b <= ends[off + g]
      written[a:b] += 1
  held = np.zeros(m, bool)
  held[starts[off]:ends[off + num_held - 1]] = True
  np.testing.assert_array_equal(written, held.astype(int))  # each held row once
  return out


@pytest.mark.parametrize("num_groups,num_held,m,bm", [
    (1, 1, 1, 16), (5, 5, 100, 16), (8, 3, 150, 32), (4, 1, 77, 16)])
def test_schedules_cover_every_row_once(num_groups, num_held, m, bm):
  rng = np.random.default_rng(m + num_groups)
  for _ in range(10):
    total = int(rng.integers(0, m + 1))
    sizes = rng.multinomial(total, np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    offset = int(rng.integers(0, num_groups - num_held + 1))
    if num_held == num_groups and rng.random() < 0.5:
      offset = None
    tile, _, _, _, first = _coverage(rd.gmm_schedule, sizes, offset, num_held, m, bm)
    # gmm: every tile is visited (so zeroed) and visits of a tile are consecutive.
    assert sorted(set(tile.tolist())) == list(range(-(-m // bm)))
    assert first.sum() == -(-m // bm) and np.all(np.diff(tile) >= 0)
    _, group, _, _, first, last = _coverage(rd.tgmm_schedule, sizes, offset, num_held,
                                            m, bm)
    # tgmm: every held group has one run of visits, in order (so it is written).
    assert np.all(np.diff(group) >= 0) and sorted(set(group.tolist())) == list(
        range(num_held))
    assert first.sum() == num_held and last.sum() == num_held


def test_check_supported_refuses():
  lhs, rhs = _inputs(8, 16, 16, 2, jnp.float32)
  args = tokamax.RaggedDotArgs(lhs=lhs, rhs=rhs,
                               group_sizes=jnp.asarray([3, 4], jnp.int32))
  interp = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=True)
  cpu = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=False)
  op, vjp = rd.MosaicTpuRaggedDot(), rd.MosaicTpuRaggedDotVjp()
  op.check_supported(args, interp)
  vjp.check_supported(args, interp, {})
  refused = [
      (args, cpu),
      (dataclasses.replace(args, lhs=lhs.astype(jnp.float16),
                           rhs=rhs.astype(jnp.float16)), interp),
      (dataclasses.replace(args, preferred_element_type=jnp.dtype(jnp.int32)), interp),
      (dataclasses.replace(
          args, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3), interp),
  ]
  for bad_args, device in refused:
    with pytest.raises(NotImplementedError):
      op.check_supported(bad_args, device)
    with pytest.raises(NotImplementedError):
      vjp.check_supported(bad_args, device, {})
  if jax.default_backend() != "tpu":
    with tokamax.interpret(False), pytest.raises(NotImplementedError, match="TPU"):
      tokamax.ragged_dot(lhs, rhs, jnp.asarray([3, 4], jnp.int32),
                         implementation="mosaic_tpu")


def test_configs():
  args = tokamax.RaggedDotArgs(
      lhs=jax.ShapeDtypeStruct((65536, 7168), jnp.bfloat16),
      rhs=jax.ShapeDtypeStruct((256, 7168, 2048), jnp.bfloat16),
      group_sizes=jax.ShapeDtypeStruct((256,), jnp.int32))
  config = rd.MosaicTpuRaggedDot().heuristic_config(args)
  assert config in rd.MosaicTpuRaggedDot().search_space(args)
  assert config.block_m == 256  # capped near the mean group size
  with pytest.raises(ValueError):
    rd.RaggedDotConfig(block_m=24)
  with pytest.raises(ValueError):
    rd.RaggedDotConfig(block_k=100)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_tpu(dtype):
  """gmm, dlhs and tgmm lower through Pallas' Mosaic TPU path (no TPU needed)."""
  for m, k, n, g in [(4096, 2048, 4096, 16), (37, 20, 24, 4), (1000, 300, 200, 3)]:
    s = jax.ShapeDtypeStruct

    def fwd_bwd(lhs, rhs, sizes, dout):
      args = tokamax.RaggedDotArgs(lhs, rhs, sizes)
      out, _ = _forward(rd.MosaicTpuRaggedDot(), args)
      return out, _backward(rd.MosaicTpuRaggedDotVjp(), args, {}, out, dout)

    with tokamax.interpret(False):
      text = jax.jit(fwd_bwd).trace(
          s((m, k), dtype), s((g, k, n), dtype), s((g,), jnp.int32),
          s((m, n), dtype)).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 3


@pytest.mark.parametrize("shape", [(0, 128, 128), (64, 0, 128), (64, 128, 0)],
                         ids=["m0", "k0", "n0"])
def test_empty_operands_give_zeros(shape):
  """An expert-parallel shard can hold no tokens: zeros, gradients included."""
  m, k, n = shape
  lhs = jnp.ones((m, k), jnp.bfloat16)
  rhs = jnp.ones((2, k, n), jnp.bfloat16)
  sizes = jnp.asarray([m // 2, m - m // 2], jnp.int32)
  f = lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, sizes, implementation="mosaic_tpu")
  with tokamax.interpret():
    out = f(lhs, rhs)
    grads = jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32)),
                     argnums=(0, 1))(lhs, rhs)
  assert out.shape == (m, n) and not np.any(np.asarray(out, np.float32))
  assert grads[0].shape == lhs.shape and grads[1].shape == rhs.shape
  assert not np.any(np.asarray(grads[1], np.float32))
