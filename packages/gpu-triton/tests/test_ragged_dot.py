"""Tests of the Pallas Triton ragged_dot kernels, in Pallas interpret mode on the CPU.

Interpret mode starts every output buffer as NaN, so a row the kernels forget to
write (rows past the total, rows of groups rhs does not hold) fails the comparison.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
import tokamax_xla_reference as xla_ref
from tokamax_gpu_triton import ragged_dot as rd

HIGHEST = jax.lax.Precision.HIGHEST
_SMALL = rd.RaggedDotConfig(block_m=16, block_n=16, block_k=16, group_m=2,
                            num_warps=4, num_stages=2)
# Unequal block sizes catch axis mix-ups (drhs tiles K x N and contracts rows).
_UNEQUAL = rd.RaggedDotConfig(block_m=32, block_n=16, block_k=64, group_m=3,
                              num_warps=4, num_stages=2)

_seed = iter(range(1_000_000))


def _with_config(config):
  """The triton forward AND backward, both running `config`."""

  class Vjp(rd.TritonRaggedDotVjp):

    def heuristic_config(self, args):
      return config

  class Forward(rd.TritonRaggedDot):
    vjp = Vjp

  return Forward(config)


def _key():
  return jax.random.key(next(_seed))


def _inputs(m, k, n, num_held, dtype):
  k1, k2 = jax.random.split(_key())
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
  rhs = jax.random.normal(k2, (num_held, k, n), jnp.float32).astype(dtype)
  return lhs, rhs


def _assert_close(actual, expected, dtype, what):
  testing.assert_close(actual, expected, dtype, what=what,
                       gpu=jax.default_backend() == "gpu")


def _check(lhs, rhs, group_sizes, *, group_offset=None, preferred_element_type=None,
           precision=None, implementation="triton"):
  """Compares forward and gradients (random cotangent) with the XLA reference.

  Everything runs under one `jax.jit` (forward, dlhs, drhs kernels together), with
  group_sizes and group_offset traced, so each case compiles once. Dispatch records
  prove the triton forward and backward ran (with `implementation`'s config).
  """
  dtype = lhs.dtype.type
  if preferred_element_type is not None and jnp.dtype(
      preferred_element_type).itemsize < lhs.dtype.itemsize:
    dtype = jnp.dtype(preferred_element_type).type  # output rounding dominates
  group_sizes = jnp.asarray(group_sizes, jnp.int32)
  if group_offset is not None:
    group_offset = jnp.asarray(group_offset, jnp.int32)
  cot = jax.random.normal(_key(), (lhs.shape[0], rhs.shape[2]), jnp.float32)

  def ours(lhs, rhs, group_sizes, group_offset):
    return tokamax.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset,
                              preferred_element_type=preferred_element_type,
                              precision=precision, implementation=implementation)

  def reference(lhs, rhs, group_sizes, group_offset):
    return xla_ref.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset,
                              precision=HIGHEST)

  @functools.partial(jax.jit, static_argnums=0)
  def forward_and_grads(fn, lhs, rhs, group_sizes, group_offset):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes, group_offset), lhs, rhs)
    return (out, *vjp(cot.astype(out.dtype)))

  # Natively on a GPU, in interpret mode on the CPU.
  with tokamax.interpret(jax.default_backend() == "cpu"), \
      tokamax.record_dispatch() as records:
    out, dlhs, drhs = forward_and_grads(ours, lhs, rhs, group_sizes, group_offset)
  ran = {(r.direction, r.implementation) for r in records}
  assert ran == {("forward", "triton"), ("backward", "triton")}, ran
  if isinstance(implementation, rd.TritonRaggedDot):
    assert all(r.config == implementation.config for r in records), records
  expected = forward_and_grads(reference, lhs.astype(jnp.float32),
                               rhs.astype(jnp.float32), group_sizes, group_offset)

  assert out.dtype == jnp.dtype(preferred_element_type or lhs.dtype)
  assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
  for name, actual, exp in zip(("out", "dlhs", "drhs"), (out, dlhs, drhs), expected):
    _assert_close(actual, exp, dtype, name)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype,m,k,n,group_sizes", [
    (jnp.float32, 37, 20, 24, [5, 0, 17, 3]),       # rows past the total, empty group
    (jnp.bfloat16, 37, 20, 24, [5, 0, 17, 3]),
    (jnp.float16, 100, 33, 47, [31, 0, 40, 0, 29]),  # G=5, empty groups, sum == M
    (jnp.float32, 100, 33, 47, [31, 0, 40, 0, 29]),
    (jnp.bfloat16, 1, 1, 1, [1]),                    # G=1, every dimension 1
    (jnp.float16, 64, 64, 64, [64]),                 # G=1, block-aligned
])
def test_heuristic_config(dtype, m, k, n, group_sizes):
  lhs, rhs = _inputs(m, k, n, len(group_sizes), dtype)
  _check(lhs, rhs, group_sizes)


@pytest.mark.parametrize("dtype,m,k,n,group_sizes,config", [
    # Several groups per 16-row tile, rows past the total.
    (jnp.bfloat16, 97, 45, 53, [0, 13, 2, 1, 38], _SMALL),
    (jnp.float32, 97, 45, 53, [0, 13, 2, 1, 38], _UNEQUAL),
    (jnp.float16, 64, 17, 31, [16, 16, 0, 32], _SMALL),  # tile-aligned boundaries
    (jnp.float32, 50, 64, 64, [0, 0, 0], _UNEQUAL),      # no rows at all: zeros
])
def test_small_tiles(dtype, m, k, n, group_sizes, config):
  """Small tiles: several visits share output tiles; swizzled program order."""
  lhs, rhs = _inputs(m, k, n, len(group_sizes), dtype)
  _check(lhs, rhs, group_sizes, implementation=_with_config(config))


@pytest.mark.parametrize("offset,group_sizes,num_held", [
    (1, [7, 20, 0, 11, 30], 3),   # held groups 1..3, zeros before and after
    (0, [9, 21, 4], 2),           # first groups held, rows past the total
    (2, [9, 21, 4], 1),           # last group held
    (1, [40, 0, 0, 13, 7], 2),    # held groups are empty: output all zeros
])
def test_group_offset(offset, group_sizes, num_held):
  lhs, rhs = _inputs(83, 29, 37, num_held, jnp.float32)
  _check(lhs, rhs, group_sizes, group_offset=offset,
         implementation=_with_config(_SMALL))


@pytest.mark.parametrize("dtype,precision", [
    (jnp.bfloat16, None), (jnp.float32, "highest")])
def test_group_offset_heuristic_config(dtype, precision):
  lhs, rhs = _inputs(70, 24, 40, 2, dtype)
  _check(lhs, rhs, [10, 3, 25, 12, 9], group_offset=2, precision=precision)


@pytest.mark.parametrize("dtype,out_dtype", [
    (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32),
    (jnp.float32, jnp.bfloat16)])
def test_preferred_element_type(dtype, out_dtype):
  lhs, rhs = _inputs(45, 40, 19, 3, dtype)
  _check(lhs, rhs, [12, 0, 30], preferred_element_type=jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _schedule(group_sizes, offset, num_held, m, block_m):
  return rd._visit_schedule(group_sizes, offset, num_held, m, block_m)


def _schedule_coverage(group_sizes, offset, num_held, m, block_m):
  meta = np.asarray(_schedule(jnp.asarray(group_sizes, jnp.int32),
                              None if offset is None else jnp.int32(offset),
                              num_held, m, block_m))
  ends = np.minimum(np.cumsum(group_sizes), m)
  starts = ends - np.asarray(group_sizes)
  off = offset or 0
  held = np.zeros(m, bool)
  held[starts[off]:ends[off + num_held - 1]] = True
  writes = np.zeros(m, int)
  product_group = np.full(m, -1)
  for tile, group, row_lo, row_hi, zero_lo, zero_hi, *_ in meta:
    rows = np.arange(tile * block_m, min(tile * block_m + block_m, m))
    mine = (rows >= row_lo) & (rows < row_hi)
    zeros = (rows < zero_lo) | (rows >= zero_hi)
    assert not np.any(mine & zeros)
    writes[rows[mine | zeros]] += 1
    product_group[rows[mine]] = group
  assert np.all(writes == 1), writes  # every row written exactly once
  expected_group = np.searchsorted(ends, np.arange(m), side="right") - off
  np.testing.assert_array_equal(product_group[held], expected_group[held])
  assert np.all(product_group[~held] == -1)
  assert meta.shape[0] == -(-m // block_m) + num_held - 1


@pytest.mark.parametrize("num_groups,num_held,m,block_m", [
    (1, 1, 1, 16), (5, 5, 100, 16), (8, 3, 150, 32), (6, 6, 64, 64), (4, 1, 77, 16)])
def test_visit_schedule_covers_every_row_once(num_groups, num_held, m, block_m):
  rng = np.random.default_rng(m + num_groups)
  for _ in range(25):
    total = int(rng.integers(0, m + 1))
    sizes = rng.multinomial(total, np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    offset = int(rng.integers(0, num_groups - num_held + 1))
    if num_held == num_groups and rng.random() < 0.5:
      offset = None
    _schedule_coverage(sizes, offset, num_held, m, block_m)


@pytest.mark.smoke
def test_check_supported_refuses():
  lhs, rhs = _inputs(8, 16, 16, 2, jnp.float32)
  args = tokamax.RaggedDotArgs(lhs=lhs, rhs=rhs,
                               group_sizes=jnp.asarray([3, 4], jnp.int32))
  interp = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=True)
  cpu = tokamax.DeviceInfo(platform="cpu", device_kind="cpu", interpret=False)
  op, vjp = rd.TritonRaggedDot(), rd.TritonRaggedDotVjp()
  op.check_supported(args, interp)
  vjp.check_supported(args, interp, {})
  refused = [
      (args, cpu),
      (dataclasses.replace(args, preferred_element_type=jnp.dtype(jnp.int32)), interp),
      (dataclasses.replace(
          args, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3), interp),
      (dataclasses.replace(args, lhs=lhs[:0]), interp),
  ]
  for bad_args, device in refused:
    with pytest.raises(NotImplementedError):
      op.check_supported(bad_args, device)
    with pytest.raises(NotImplementedError):
      vjp.check_supported(bad_args, device, {})
  if jax.default_backend() == "gpu":
    return
  with tokamax.interpret(False), pytest.raises(NotImplementedError,
                                               match="need an NVIDIA GPU"):
    tokamax.ragged_dot(lhs, rhs, jnp.asarray([3, 4], jnp.int32),
                       implementation="triton")


def test_configs():
  lhs, rhs = _inputs(48, 32, 40, 3, jnp.bfloat16)
  args = tokamax.RaggedDotArgs(lhs=lhs, rhs=rhs,
                               group_sizes=jnp.asarray([10, 20, 18], jnp.int32))
  space = rd.TritonRaggedDot().search_space(args)
  assert space and all(isinstance(c, rd.RaggedDotConfig) for c in space)
  assert rd.TritonRaggedDot().heuristic_config(args) is not None
  assert rd.TritonRaggedDotVjp().heuristic_config(args) is not None
  with pytest.raises(ValueError):
    rd.RaggedDotConfig(block_m=48)
