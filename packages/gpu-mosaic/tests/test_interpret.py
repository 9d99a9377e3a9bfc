"""Every Mosaic GPU kernel on the CPU, in JAX's Mosaic GPU interpreter.

From JAX 0.12 the interpreter runs these kernels (warp-specialized producers and
consumers, barriers, TMA copies, wgmma), so under `tokamax.interpret()` the ops
run the very kernels they run on a Hopper GPU, at small awkward shapes: each
test checks the output and the gradients for a random cotangent against the
XLA reference on float32 upcasts, within the dtype's tolerance, and that
mosaic_gpu ran both directions (the fp8 ragged_dot and the norms: their
forward, the only direction they have a kernel for). What the interpreter
lacks is covered by small shims (`_common.accumulate`; a persistent grid of
`INTERPRET_SMS` programs); the `overlap_qk` attention schedule, which stores
into a WGMMA accumulator, does not run there (the heuristic takes the plain
schedule).

On older JAX (the CPU CI's 0.10.2) these tests skip; `nox -s tests_jax_newest`
runs them.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops import attention as attention_op
from tokamax_gpu_mosaic import _common
from tokamax_gpu_mosaic import _pipeline
from tokamax_gpu_mosaic import attention as mat
from tokamax_gpu_mosaic import gated_linear_unit_kernel as glk
from tokamax_gpu_mosaic import layer_norm as mln
from tokamax_gpu_mosaic import ragged_dot as mosaic_ragged_dot
from tokamax_gpu_mosaic import ragged_dot_kernel as rdk
from tokamax_gpu_mosaic import ragged_dot_kernel_drhs as rdd

pytestmark = pytest.mark.skipif(
    not _common.interpreter_runs_these_kernels(),
    reason=f"JAX's Mosaic GPU interpreter runs these kernels from JAX 0.12; this is "
           f"{jax.__version__}")

_seed = iter(range(1_000_000))


def _normal(shape, dtype, scale=1.0):
  key = jax.random.key(next(_seed))
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _check(call, operands, dtype, implementation="mosaic_gpu"):
  """`call(implementation)(*operands)` and its VJP: mosaic_gpu interpreted
  against the XLA reference on float32 upcasts (gradients at twice the
  forward's tolerance, as the conformance suite); mosaic_gpu must run both
  directions."""
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    out, vjp = jax.vjp(call(implementation), *operands)
    cotangent = _normal(out.shape, out.dtype)
    grads = vjp(cotangent)
  ran = {(r.direction, r.implementation) for r in records}
  assert ran == {("forward", "mosaic_gpu"), ("backward", "mosaic_gpu")}, ran
  upcast = [x.astype(jnp.float32) for x in operands]
  ref_out, ref_vjp = jax.vjp(call("xla"), *upcast)
  testing.assert_close(out, ref_out, dtype, what="output")
  for i, (g, r) in enumerate(zip(grads, ref_vjp(cotangent.astype(jnp.float32)))):
    testing.assert_close(g, r, dtype, what=f"gradient {i}", scale=2.0)


def _as_arrays(options: dict) -> dict:
  """`options` with the array arguments given as tuples made arrays."""
  dtypes = dict(key_value_seq_lengths=jnp.int32, q_segment_ids=jnp.int32,
                kv_segment_ids=jnp.int32, sinks=jnp.float32)
  return {name: jnp.asarray(value, dtypes[name]) if name in dtypes else value
          for name, value in options.items()}


def _attention(**options):
  def call(implementation):
    return lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, implementation=implementation, **options)
  return call


def test_attention_wide_key_steps():
  """The H64 heuristic's config from 8192 keys (`attention._long_plain_h64`):
  192-key steps, a block a query tile; here S % 192 = 16 (the last key tile
  mostly padding) and T no multiple of 128, GQA."""
  config = mat.AttentionConfig(block_kv=192, num_stages=2)
  args = attention_op.canonical_args(*(jax.ShapeDtypeStruct((1, 8192, 2, 64), jnp.bfloat16)
                                       for _ in range(3)), None, None)[0]
  assert mat.MosaicGpuAttention().heuristic_config(args) == config

  def call(implementation):
    if implementation == "mosaic_gpu":
      implementation = mat.MosaicGpuAttention(config)
    return _attention()(implementation)
  operands = (_normal((1, 300, 2, 64), jnp.bfloat16), _normal((1, 400, 1, 64), jnp.bfloat16),
              _normal((1, 400, 1, 64), jnp.bfloat16))
  _check(call, operands, jnp.bfloat16)


@pytest.mark.parametrize("b,t,s,n,k,h,dtype,options", [
    # GQA, causal, lengths that are not tile multiples, T > S. (One batch row and
    # one KV head: the interpreter's time grows with both, and the window case
    # below has two batch rows.)
    (1, 300, 257, 2, 1, 64, jnp.bfloat16, dict(is_causal=True)),
    # MHA at H128 in float16, a soft cap.
    (1, 200, 200, 2, 2, 128, jnp.float16, dict(logits_soft_cap=20.0)),
    # The dynamic features: a two-sided window, key lengths (the second batch
    # row has 40 valid keys).
    (2, 256, 320, 2, 1, 64, jnp.bfloat16,
     dict(local_window_size=(96, 32), key_value_seq_lengths=(320, 40))),
    # H128's 64-row dK/dV steps under a causal window, and two documents whose
    # boundary (row 96) gives a block's two warpgroups different ranges: each
    # consumer computes its own steps of the union (`_DkvKernel.takes_own_steps`,
    # `_DqKernel`'s).
    (1, 256, 256, 2, 1, 128, jnp.bfloat16,
     dict(is_causal=True, local_window_size=(100, 0), q_segment_ids=((1,) * 96 + (2,) * 160,),
          kv_segment_ids=((1,) * 96 + (2,) * 160,))),
], ids=["gqa-causal-odd", "h128-f16-softcap", "window-lengths", "h128-window-documents"])
def test_attention(b, t, s, n, k, h, dtype, options):
  options = _as_arrays(options)
  operands = (_normal((b, t, n, h), dtype), _normal((b, s, k, h), dtype),
              _normal((b, s, k, h), dtype))
  _check(_attention(**options), operands, dtype)


@pytest.mark.parametrize("t,s,options", [
    (200, 333, dict(is_causal=True)),
    # Gemma-like: a sliding window, a soft cap, key lengths.
    (256, 256, dict(is_causal=True, local_window_size=(100, 0), logits_soft_cap=30.0,
                    key_value_seq_lengths=(256, 150))),
    # Three packed documents (segment ids), and sinks.
    (256, 256, dict(is_causal=True, q_segment_ids=((1,) * 100 + (2,) * 60 + (3,) * 96,),
                    kv_segment_ids=((1,) * 100 + (2,) * 60 + (3,) * 96,),
                    sinks=(0.5, -1.0))),
], ids=["causal-odd", "window-softcap-lengths", "segments-sinks"])
def test_attention_head_dim_256(t, s, options):
  """H256: the backward's dK and dV in two passes, 32-row steps (64-byte swizzle)."""
  options = _as_arrays(options)
  b = 2 if "key_value_seq_lengths" in options else 1
  operands = (_normal((b, t, 2, 256), jnp.bfloat16), _normal((b, s, 1, 256), jnp.bfloat16),
              _normal((b, s, 1, 256), jnp.bfloat16))
  _check(_attention(**options), operands, jnp.bfloat16)


def _reference_vjp(q, k, v, scale, causal, **kw):
  """The XLA reference attention on float32 upcasts: its output and lse, a
  random bfloat16 cotangent of the output, and its gradients for that
  cotangent (the backward kernels' inputs and expected results)."""
  import tokamax_xla_reference  # the reference package (a test dependency)
  upcast = [x.astype(jnp.float32) for x in (q, k, v)]
  (out, lse), vjp = jax.vjp(
      lambda *a: tokamax_xla_reference.attention(
          *a, scale=scale, is_causal=causal, precision=jax.lax.Precision.HIGHEST, **kw),
      *upcast)
  dout = _normal(out.shape, jnp.bfloat16)
  return out, lse, dout, vjp((dout.astype(jnp.float32), jnp.zeros_like(lse)))


def _features_kw(t, s, q_splits, kv_splits, window, kv_lengths):
  """A causal window, two segments a batch row (the first `split` rows of row
  b in segment 1, the rest in 2) and key lengths: the backward's dynamic
  features at once, as `_check_backward`'s keywords."""
  def ids(splits, rows):
    return jnp.asarray([[1] * c + [2] * (rows - c) for c in splits], jnp.int32)
  return dict(local_window=(window, 0), q_segment_ids=ids(q_splits, t),
              kv_segment_ids=ids(kv_splits, s),
              key_value_seq_lengths=jnp.asarray(kv_lengths, jnp.int32))


def _check_backward(q, k, v, config, causal=True, **kw):
  """`mosaic_attention_bwd` with `config` (scale 1/sqrt(H)), interpreted,
  against the XLA reference's VJP on float32 upcasts (`_reference_vjp`), fed
  the reference's output and lse."""
  scale = q.shape[-1]**-0.5
  out, lse, dout, want = _reference_vjp(q, k, v, scale, causal, **kw)
  with tokamax.interpret():
    got = mat.mosaic_attention_bwd(q, k, v, out.astype(jnp.bfloat16), dout, lse,
                                   scale=scale, causal=causal, config=config, **kw)
  for i, (g, w) in enumerate(zip(got, want)):
    testing.assert_close(g, w, jnp.bfloat16, what=f"gradient {i}", scale=2.0)


@pytest.mark.parametrize("ping_pong,block_q_dv,features", [
    (False, None, False), (True, None, False), (False, 64, False), (True, 64, True),
], ids=["plain", "ping-pong", "dv-64", "ping-pong-dv-64-features"])
def test_attention_backward_split_dkv_configs(ping_pong, block_q_dv, features):
  """The H256 backward called with a config (the ping-pong schedules, 64-row
  steps in the dV pass, whose segment tile table differs from the dK pass's),
  against the XLA reference's VJP on float32 upcasts."""
  config = mat.AttentionVjpConfig(32, 32, 2, ping_pong=ping_pong, ping_pong_dq=ping_pong,
                                  split_dkv=True, block_q_dv=block_q_dv)
  b = 2 if features else 1
  q, k, v = (_normal((b, 200, 2, 256), jnp.bfloat16),
             _normal((b, 200, 1, 256), jnp.bfloat16),
             _normal((b, 200, 1, 256), jnp.bfloat16))
  kw = _features_kw(200, 200, (128, 30), (128, 30), 120, [200, 150]) if features else {}
  _check_backward(q, k, v, config, **kw)


@pytest.mark.parametrize("features", [False, True], ids=["plain", "features"])
def test_attention_backward_h128_split_dkv(features):
  """H128's backward where the register split is lost (JAX >= 0.12 compiled
  natively: dK and dV in two passes, 64-key dQ steps, the heuristic's
  `_SPLIT_LOST_H128_BACKWARD`), GQA with T and S not tile multiples, against
  the XLA reference's VJP on float32 upcasts."""
  config = mat.AttentionVjpConfig(block_q=64, num_stages=2, **mat._SPLIT_LOST_H128_BACKWARD)
  b = 2 if features else 1
  q, k, v = (_normal((b, 200, 2, 128), jnp.bfloat16),
             _normal((b, 230, 1, 128), jnp.bfloat16),
             _normal((b, 230, 1, 128), jnp.bfloat16))
  kw = _features_kw(200, 230, (128, 30), (128, 30), 120, [230, 150]) if features else {}
  _check_backward(q, k, v, config, **kw)


@pytest.mark.parametrize("h,n,k,t,s,block_q,ping_pong,soft_cap,overlap", [
    # GQA, T and S not multiples of the tile (T < S), two query heads a step
    # loop (its dQ additions overlapped: GQA H128's default).
    (128, 4, 2, 300, 330, 64, False, None, None),
    (128, 2, 1, 384, 384, 64, True, 20.0, None),  # ping-pong, a soft cap
    (128, 2, 2, 200, 128, 64, False, None, None),  # T > S (S a tile multiple)
    # H64's 128-row steps (they hung here before the test run's PJRT_NPROC:
    # notes/MOSAIC_GPU.md, session 36).
    (64, 2, 1, 256, 256, 128, False, None, None),
    # MHA with its dQ additions overlapped (the H100's heuristic), T off the tile.
    (128, 2, 2, 300, 300, 64, False, None, True),
], ids=["gqa-odd", "ping-pong-cap", "t-gt-s", "h64-128-row-steps", "mha-overlap"])
def test_attention_backward_fuse_dq(h, n, k, t, s, block_q, ping_pong, soft_cap, overlap):
  """dQ from the dK/dV kernel (`fuse_dq`): each step's dQ tile added in rank
  order (here by read, add, store: the interpreter runs the blocks one at a time
  in grid order, which is the rank order), against the XLA reference's VJP."""
  config = mat.AttentionVjpConfig(block_q, 128, 2, ping_pong=ping_pong, fuse_dq=True,
                                  overlap_dq_adds=overlap)
  q, key, v = (_normal((2, t, n, h), jnp.bfloat16), _normal((2, s, k, h), jnp.bfloat16),
               _normal((2, s, k, h), jnp.bfloat16))
  kw = {} if soft_cap is None else dict(logits_soft_cap=soft_cap)
  _check_backward(q, key, v, config, **kw)


@pytest.mark.parametrize("h,n,k,t,s,block_q,rings", [
    (128, 2, 2, 384, 384, 64, 1),  # MHA: three key blocks, each wrapping around
    (128, 4, 2, 300, 256, 64, 1),  # GQA, T > S, T not a multiple of the tile
    (64, 2, 1, 256, 256, 128, 1),  # H64's 128-row steps, MQA
    (128, 2, 2, 512, 512, 64, 2),  # two rings of two blocks, a launch each
    (128, 4, 2, 400, 384, 64, 3),  # GQA, T > S, a block a ring
], ids=["mha", "gqa-t-gt-s", "h64-mqa", "mha-rings", "gqa-rings"])
def test_attention_backward_fuse_dq_without_causal(h, n, k, t, s, block_q, rings):
  """The fused backward without causal (`_DkvKernel.rotated`: each key block
  visits every query tile from its diagonal on, wrapping around; here the
  blocks run one at a time, the first of each tile in its ring storing), in
  one ring or several (`key_rings`: a launch each), against the XLA
  reference's VJP."""
  config = mat.AttentionVjpConfig(block_q, 128, 2, fuse_dq=True, key_rings=rings)
  q, key, v = (_normal((2, t, n, h), jnp.bfloat16), _normal((2, s, k, h), jnp.bfloat16),
               _normal((2, s, k, h), jnp.bfloat16))
  _check_backward(q, key, v, config, causal=False)


@pytest.mark.parametrize("h,t,s,window,q_offset", [
    (64, 200, 260, (70, 30), 37),
    (128, 230, 200, (90, 40), -20),
], ids=["h64-offset-37", "h128-offset-minus-20"])
def test_attention_backward_window_with_offset(h, t, s, window, q_offset):
  """The two kernels' dynamic masks (dQ: bounds per query row on the key
  columns; dK/dV: bounds per key row on the query columns, the window's sides
  exchanged and the offset's sign flipped) under a two-sided window that
  q_offset moves, T != S, against the XLA reference's VJP."""
  q, k, v = (_normal((2, t, 2, h), jnp.bfloat16), _normal((2, s, 2, h), jnp.bfloat16),
             _normal((2, s, 2, h), jnp.bfloat16))
  config = mat.AttentionVjpConfig(64, 128, 2)
  _check_backward(q, k, v, config, causal=False, local_window=window,
                  q_offset=jnp.asarray(q_offset, jnp.int32))


@pytest.mark.parametrize("h,t,s,causal,window,q_offset,lengths", [
    (64, 200, 260, False, (None, 17), 37, None),
    (64, 230, 200, False, (60, None), -50, "key"),
    (128, 200, 300, True, None, 100, "key"),
    (64, 256, 256, False, (50, 10), None, "query"),
], ids=["right-side-offset-37", "left-side-offset-minus-50-key-lengths",
        "h128-causal-offset-100-key-lengths", "two-sided-query-lengths"])
def test_attention_forward_dynamic_masks(h, t, s, causal, window, q_offset, lengths):
  """The forward's dynamic mask (bounds per query row on the key columns; a
  two-sided window as one unsigned compare, a one-sided one as one compare)
  under q_offset, one-sided windows and lengths, T != S, called directly (the
  public op's tests reach q_offset only on a GPU): output and lse against the
  XLA reference on float32 upcasts."""
  q, k, v = (_normal((2, t, 2, h), jnp.bfloat16), _normal((2, s, 1, h), jnp.bfloat16),
             _normal((2, s, 1, h), jnp.bfloat16))
  kw = {}
  if window is not None:
    kw["local_window"] = window
  if q_offset is not None:
    kw["q_offset"] = jnp.asarray(q_offset, jnp.int32)
  if lengths == "key":
    kw["key_value_seq_lengths"] = jnp.asarray([s, s - 70], jnp.int32)
  elif lengths == "query":
    kw["query_seq_lengths"] = jnp.asarray([t - 30, t], jnp.int32)
  scale = h**-0.5
  out, lse, _, _ = _reference_vjp(q, k, v, scale, causal, **kw)
  with tokamax.interpret():
    got_out, got_lse = mat.mosaic_attention(
        q, k, v, scale=scale, causal=causal,
        config=mat.AttentionConfig(block_kv=64, num_stages=2), **kw)
  if lengths == "query":  # rows past a query length: unspecified, not compared
    valid = (jnp.arange(t)[None, :] < kw["query_seq_lengths"][:, None])
    got_out = jnp.where(valid[:, :, None, None], got_out, 0)
    out = jnp.where(valid[:, :, None, None], out, 0)
    got_lse = jnp.where(valid[:, None, :], got_lse, 0)
    lse = jnp.where(valid[:, None, :], lse, 0)
  testing.assert_close(got_out, out, jnp.bfloat16, what="output")
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), rtol=2e-2, atol=2e-2)


_SAVERS = dict(stats_in_accumulators=True)


@pytest.mark.parametrize("causal,config,n,t,s,h,features", [
    # The one-kernel backward, MHA H128, T and S off the tile: causal, with dK
    # from the staged dS^T too; without causal in two rings, ping-pong.
    (True, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, dk_from_smem=True, **_SAVERS),
     2, 300, 330, 128, False),
    (False, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, key_rings=2, ping_pong=True,
                                   dk_from_smem=True, **_SAVERS), 2, 512, 512, 128, False),
    # H64's 128-row steps, P from the first product while the second runs.
    (False, mat.AttentionVjpConfig(128, 128, 2, fuse_dq=True, **_SAVERS), 2, 384, 384, 64,
     False),
    # The two kernels, GQA, with a window, segments and key lengths.
    (True, mat.AttentionVjpConfig(64, 128, 2, **_SAVERS), 4, 200, 230, 128, True),
    # The one kernel from zero (the statistics are its default).
    (True, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, stats_in_accumulators=False),
     2, 300, 330, 128, False),
], ids=["fused-causal", "fused-rings-ping-pong", "fused-h64-early-probs",
        "two-kernels-gqa-features", "fused-plain-products"])
def test_attention_backward_register_savers(causal, config, n, t, s, h, features):
  """The dK/dV kernel with its score products started from -lse2 / c and
  -delta (`stats_in_accumulators`; and once from zero, where the one kernel
  takes them by default) and, one kernel, dK's product reading the staged dS^T
  (`dk_from_smem`), against the XLA reference's VJP."""
  k = 1 if n > 2 else n
  q, key, v = (_normal((2, t, n, h), jnp.bfloat16), _normal((2, s, k, h), jnp.bfloat16),
               _normal((2, s, k, h), jnp.bfloat16))
  kw = _features_kw(t, s, (100, 30), (110, 40), 90, [230, 170]) if features else {}
  _check_backward(q, key, v, config, causal=causal, **kw)


@pytest.mark.parametrize("causal,config,features", [
    (True, mat.AttentionVjpConfig(64, 128, 2, kv_split=4), False),
    (False, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, kv_split=2), False),
    # The causal one kernel on one query head a copy (as under MHA), in groups.
    (True, mat.AttentionVjpConfig(64, 128, 2, fuse_dq=True, kv_split=4, head_group=2),
     False),
    # The H128 backward where the register split is lost (JAX >= 0.12).
    (True, mat.AttentionVjpConfig(block_q=64, num_stages=2, kv_split=4,
                                  **mat._SPLIT_LOST_H128_BACKWARD), False),
    # Dynamic features (the heuristic splits causal MQA/GQA at few blocks
    # whatever the features): a window, segment ids and key lengths.
    (True, mat.AttentionVjpConfig(64, 128, 2, kv_split=2), True),
], ids=["causal-full", "fused-half", "fused-causal-full-grouped", "split-dkv-full",
        "causal-half-features"])
def test_attention_backward_kv_split(causal, config, features):
  """`kv_split`: each key/value head's 4 query heads served by as many heads
  read from it (all four, or two a head; no copies), their dK/dV summed,
  against the XLA reference's VJP; T and S off the tile where causal, S 256 in
  the fused case without causal (its kernel needs S a multiple of 128 there)."""
  t, s = (300, 330) if causal else (300, 256)
  q, key, v = (_normal((2, t, 8, 128), jnp.bfloat16), _normal((2, s, 2, 128), jnp.bfloat16),
               _normal((2, s, 2, 128), jnp.bfloat16))
  kw = _features_kw(t, s, (200, 40), (220, 50), 120, [330, 250]) if features else {}
  _check_backward(q, key, v, config, causal=causal, **kw)


@pytest.mark.parametrize("causal,h,t", [(True, 128, 384), (False, 128, 512),
                                         (False, 64, 512)])
def test_attention_backward_heuristic_fused(causal, h, t, monkeypatch):
  """The backward heuristic's config at MHA H128 (the one-kernel backward;
  causal in head groups: `attention._fuses_dq_by_default`) and at MHA H64
  without causal (at a power of two of key blocks), with three or four key
  blocks a head adding into each query tile, against the XLA reference's VJP.
  The causal rule's 2048 dK/dV blocks are left out: the interpreter's calls
  are small."""
  monkeypatch.setattr(mat, "_FUSED_CAUSAL_BLOCKS", 0)
  q, k, v = (_normal((2, t, 2, h), jnp.bfloat16) for _ in range(3))
  args = attention_op.canonical_args(q, k, v, None, None, is_causal=causal)[0]
  with tokamax.interpret():
    config = mat.MosaicGpuAttentionVjp().heuristic_config(args)
  assert config.fuse_dq and (config.head_group or not causal), config
  _check_backward(q, k, v, config, causal=causal)


def test_kernels_of_more_warpgroups_than_interpreter_threads_are_refused(monkeypatch):
  """The interpreter runs a block's warpgroups as computations of XLA's CPU
  client at once: with fewer threads it could hang, so it is refused, naming
  PJRT_NPROC (which the client reads when JAX starts: here the check reads
  the variable, the client keeps the test run's threads)."""
  monkeypatch.setenv("PJRT_NPROC", "3")
  x = jnp.zeros((4, 4096), jnp.bfloat16)
  args = tokamax.LayerNormArgs(x=x, scale=jnp.ones(4096), offset=None)
  rows = jnp.zeros(4, jnp.float32)
  with tokamax.interpret():
    mln.layer_norm_backward(args, rows, rows, x, mln.LayerNormVjpConfig(1, 2, 2))
    with pytest.raises(NotImplementedError,
                       match=r"4 warpgroups a block .* runs 3 \(PJRT_NPROC=3\): set "
                             "PJRT_NPROC=4"):
      mln.layer_norm_backward(args, rows, rows, x, mln.LayerNormVjpConfig(1, 2, 4))
  monkeypatch.setenv("PJRT_NPROC", "2")
  q = _normal((1, 128, 1, 64), jnp.bfloat16)
  with tokamax.interpret(), pytest.raises(NotImplementedError, match="3 warpgroups"):
    mat.mosaic_attention(q, q, q, scale=0.125, causal=False,
                         config=mat.AttentionConfig())


def test_interpreter_threads_are_read_as_xla_reads_them(monkeypatch):
  """PJRT_NPROC, else NPROC (each an integer, blanks allowed, at least 0; an
  unreadable one skipped), else the CPUs; a one-warpgroup kernel runs inline
  and is never refused."""
  monkeypatch.setenv("PJRT_NPROC", " 6 ")
  monkeypatch.setenv("NPROC", "5")
  assert _common.interpreter_threads() == 6
  monkeypatch.setenv("PJRT_NPROC", "many")
  assert _common.interpreter_threads() == 5
  monkeypatch.setenv("PJRT_NPROC", "-2")
  assert _common.interpreter_threads() == 0
  _common.check_interpreter_threads(1)
  with pytest.raises(NotImplementedError, match="runs 0"):
    _common.check_interpreter_threads(2)
  monkeypatch.delenv("PJRT_NPROC")
  monkeypatch.delenv("NPROC")
  assert _common.interpreter_threads() == len(os.sched_getaffinity(0))


def test_too_few_interpreter_threads_let_dispatch_move_on(monkeypatch):
  """Refused in `check_supported`, so that `implementation=None` (or a list)
  runs another implementation; the norms' forward (one warpgroup) still runs
  here, and their backward keeps one warpgroup a block (its split needs two
  threads)."""
  monkeypatch.setenv("PJRT_NPROC", "1")
  q = _normal((1, 128, 2, 64), jnp.bfloat16)
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    tokamax.dot_product_attention(q, q, q, implementation=["mosaic_gpu", "xla"])
  assert {r.implementation for r in records} == {"xla"}
  vec = jax.ShapeDtypeStruct((16384,), jnp.bfloat16)
  wide = tokamax.LayerNormArgs(x=jax.ShapeDtypeStruct((64, 16384), jnp.bfloat16),
                               scale=vec, offset=vec)
  with tokamax.interpret():
    assert mln.heuristic_vjp_config(wide).warpgroups == 1
  monkeypatch.setenv("PJRT_NPROC", "2")
  with tokamax.interpret():
    assert mln.heuristic_vjp_config(wide).warpgroups == 2
  monkeypatch.setenv("PJRT_NPROC", "1")
  x = _normal((8, 1024), jnp.bfloat16)
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    tokamax.layer_norm(x, None, None, implementation="mosaic_gpu")
  assert {r.implementation for r in records} == {"mosaic_gpu"}


@pytest.mark.parametrize("causal,features,persistent", [
    (True, False, False), (False, True, False), (True, False, True)],
    ids=["causal", "window-lengths", "causal-persistent"])
def test_attention_head_group(causal, features, persistent):
  """Blocks in groups of (batch row, head) pairs (`head_group`), the last group
  short: the forward (6 pairs in groups of 4; or persistent, in groups of 5,
  the 18 tiles dealt by `_Forward.deal` to the interpreter's 2 "SMs" out of
  round-robin order), the dQ kernel (6 pairs in groups of 2) and the dK/dV
  kernel (3 key/value pairs in groups of 2), called with configs, against the
  XLA reference on float32 upcasts."""
  q, k, v = (_normal((3, 300, 2, 64), jnp.bfloat16), _normal((3, 300, 1, 64), jnp.bfloat16),
             _normal((3, 300, 1, 64), jnp.bfloat16))
  kw = {}
  if features:
    kw = dict(local_window=(100, 30), key_value_seq_lengths=jnp.asarray(
        [300, 120, 260], jnp.int32))
  scale = 64**-0.5
  out, lse, dout, want = _reference_vjp(q, k, v, scale, causal, **kw)
  with tokamax.interpret():
    got_out, got_lse = mat.mosaic_attention(
        q, k, v, scale=scale, causal=causal,
        config=mat.AttentionConfig(block_kv=64, head_group=5 if persistent else 4,
                                   persistent=persistent),
        **kw)
    got = mat.mosaic_attention_bwd(
        q, k, v, out.astype(jnp.bfloat16), dout, lse, scale=scale, causal=causal,
        config=mat.AttentionVjpConfig(64, 64, 2, head_group=2), **kw)
  testing.assert_close(got_out, out, jnp.bfloat16, what="output")
  # Rows that see no key (the window past the second row's 120 keys): +inf both.
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), rtol=2e-2, atol=2e-2)
  for i, (g, w) in enumerate(zip(got, want)):
    testing.assert_close(g, w, jnp.bfloat16, what=f"gradient {i}", scale=2.0)


def test_attention_sinks():
  sinks = _normal((4,), jnp.float32, 2.0)
  operands = (_normal((1, 192, 4, 64), jnp.bfloat16),
              _normal((1, 192, 2, 64), jnp.bfloat16),
              _normal((1, 192, 2, 64), jnp.bfloat16))
  _check(_attention(is_causal=True, sinks=sinks), operands, jnp.bfloat16)


@pytest.mark.parametrize("options,b,t,tiles", [
    # 3 causal query tiles over 2 blocks: one block has no second tile; the
    # ring's 3 slots wrap across the tiles at uneven key counts.
    (dict(is_causal=True), 1, 300, dict(tiles_per_block=2)),
    # One block runs a head's 3 tiles (the dynamic key ranges of a window).
    (dict(local_window_size=(96, 32)), 1, 384, dict(tiles_per_block=3)),
    # Persistent: the interpreter's 2 SMs deal out 3 tiles x 2 heads x 2 batch
    # rows, whose key lengths differ (a block's tiles cross batch rows).
    (dict(local_window_size=(64, 0), is_causal=True,
          key_value_seq_lengths=(320, 100)), 2, 320, dict(persistent=True)),
    # Persistent, causal: 5 tiles x 2 heads of falling length, which the deal
    # gives the 2 SMs unevenly (6 and 4 tiles: the second's last rounds -1).
    (dict(is_causal=True), 1, 640, dict(persistent=True)),
], ids=["causal-odd", "window", "persistent", "causal-persistent"])
def test_attention_tiles_per_block(options, b, t, tiles):
  """Several query tiles a block: Q in two buffers, the ring counted on."""
  options = _as_arrays(options)
  config = mat.AttentionConfig(block_kv=64, num_stages=3, **tiles)

  def call(implementation):
    if implementation == "mosaic_gpu":
      implementation = mat.MosaicGpuAttention(config)
    return _attention(**options)(implementation)
  operands = (_normal((b, t, 2, 64), jnp.bfloat16), _normal((b, t, 1, 64), jnp.bfloat16),
              _normal((b, t, 1, 64), jnp.bfloat16))
  _check(call, operands, jnp.bfloat16)


def test_ragged_dot():
  """Empty groups, a group that ends mid-tile, rows past the last group."""
  sizes = jnp.asarray([100, 0, 150, 37, 0], jnp.int32)
  operands = (_normal((300, 256), jnp.bfloat16), _normal((5, 256, 192), jnp.bfloat16,
                                                         256**-0.5))

  def call(implementation):
    return lambda x, w: tokamax.ragged_dot(x, w, sizes, implementation=implementation)
  _check(call, operands, jnp.bfloat16)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "dlhs"])
@pytest.mark.parametrize("config,k,offset", [
    # 128-row items, 4 K steps in a 2-deep ring (two ring laps per item).
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=2), 256, 0),
    # 256-row items in the group order, the whole K loop in one ring lap; the
    # held groups start at the third (the rows before them get zero items).
    (rdk.RaggedDotConfig(block_m=256, block_n=128, block_k=64, num_stages=4,
                         item_order="group", out_pieces=2), 256, 2),
    # 2 K steps under 3 stages: the ring shrinks to the loop's 2.
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=3), 128, 0),
    # 128-row items in the group order (the heuristics' item order and rows
    # under 512 rows a group), forward and dlhs.
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=2,
                         item_order="group", grid_tile_width=2), 256, 1),
    # Items claimed through the slots and barriers of `claimed_loop` (here in
    # the round-robin deal's order), 128-row and tall items, forward and dlhs.
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=2,
                         item_order="group", grid_tile_width=2,
                         claim_items=True), 256, 1),
    (rdk.RaggedDotConfig(block_m=256, block_n=128, block_k=64, num_stages=4,
                         out_pieces=2, claim_items=True), 256, 0),
    # Half-depth K steps in an 8-deep ring (the same shared memory as 4 full
    # ones), claimed, output in two pieces.
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=32, num_stages=8,
                         out_pieces=2, item_order="group", claim_items=True),
     256, 1),
    # Partial tiles staged in plain shared memory, not in swizzled strips.
    (rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=2,
                         item_order="group", claim_items=True, strip_staging=False),
     256, 1),
], ids=["wide", "tall-offset", "short-k", "wide-group", "claimed",
        "claimed-tall", "claimed-k32", "claimed-plain"])
def test_ragged_dot_chained_items(config, k, offset, transpose_rhs):
  """Work items chained in one ring (`_pipeline.ChainedPipeline`): each of the
  2 interpreted SMs runs many items (zero items, empty groups, warpgroups
  without rows among them) through one ring, against the reference."""
  assert _pipeline.ChainedPipeline.ring_depth(k // config.block_k, config.num_stages)
  _check_grouped_matmul(config, k, offset, transpose_rhs, "chained output")


_CLAIM_ORDERS = {
    # Block 0 claims every item (one ring runs them all); the others claim
    # past the table at once and run none.
    "one-block": lambda j, sm, num_sms: jnp.where(sm == 0, j, 1 << 30),
    # Each wave of claims rotated over the blocks.
    "rotated": lambda j, sm, num_sms: j * num_sms + lax.rem(sm + j, num_sms),
}


@pytest.mark.parametrize("order", sorted(_CLAIM_ORDERS))
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "dlhs"])
@pytest.mark.parametrize("k", [256, 320], ids=["chained", "ring-per-item"])
def test_ragged_dot_claim_orders(order, transpose_rhs, k, monkeypatch):
  """Whichever block claims which item, the output is the reference's (the
  interpreter's claims replaced by other orders than the round-robin one),
  with the items chained in one ring (4 K steps, 2 stages) or each filling the
  ring anew (5 K steps)."""
  monkeypatch.setattr(rdk, "_interpreted_claim", _CLAIM_ORDERS[order])
  config = rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64, num_stages=2,
                               item_order="group", grid_tile_width=2,
                               claim_items=True)
  _check_grouped_matmul(config, k, 1, transpose_rhs, f"claims {order}")


def _check_grouped_matmul(config, k, offset, transpose_rhs, what):
  """`rdk.grouped_matmul` in the interpreter at M420 N256 (groups 60, 0, 150, 37,
  0, 120, 3; those from `offset` held) against the float32 reference."""
  m, n = 420, 256
  sizes = jnp.asarray([60, 0, 150, 37, 0, 120, 3], jnp.int32)
  held = 7 - offset
  lhs = _normal((m, k), jnp.bfloat16)
  rhs_shape = (held, n, k) if transpose_rhs else (held, k, n)
  rhs = _normal(rhs_shape, jnp.bfloat16, k**-0.5)
  starts, ends = tokamax.plugin.held_row_ranges(sizes, jnp.int32(offset), held, m)
  with tokamax.interpret():
    out = rdk.grouped_matmul(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs,
                             out_dtype=jnp.bfloat16, config=config)
  rhs_kn = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  want = tokamax.ragged_dot(lhs.astype(jnp.float32), rhs_kn.astype(jnp.float32), sizes,
                            group_offset=jnp.int32(offset),
                            precision=jax.lax.Precision.HIGHEST, implementation="xla")
  testing.assert_close(out, want, jnp.bfloat16, what=what)


def _check_drhs(config, sizes, m, offset, k=256, n=256, out_dtype=jnp.float32,
                poison_outside=False):
  """The "ws" drhs kernel under `config` against the float32 reference's rhs
  gradient. `poison_outside`: the kernel's operands hold NaN (lhs) and inf
  (dout) in the rows no held group owns, which must not reach the result."""
  held = len(sizes) - offset
  lhs, dout = _normal((m, k), jnp.bfloat16), _normal((m, n), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  starts, ends = tokamax.plugin.held_row_ranges(gs, jnp.int32(offset), held, m)
  kernel_lhs, kernel_dout = lhs, dout
  if poison_outside:
    rows = jnp.arange(m)[:, None]
    outside = (rows < starts[0]) | (rows >= ends[-1])
    kernel_lhs = jnp.where(outside, jnp.nan, lhs).astype(lhs.dtype)
    kernel_dout = jnp.where(outside, jnp.inf, dout).astype(dout.dtype)
    # The reference's operands hold zeros there (what those rows contribute).
    lhs = jnp.where(outside, 0, lhs).astype(lhs.dtype)
    dout = jnp.where(outside, 0, dout).astype(dout.dtype)
  with tokamax.interpret():
    out = rdd.grouped_transposed_matmul(kernel_lhs, kernel_dout, starts, ends,
                                        out_dtype=out_dtype, config=config)
  # drhs is the gradient of the XLA reference with respect to rhs.
  rhs = jnp.zeros((held, k, n), jnp.float32)
  _, vjp = jax.vjp(lambda w: tokamax.ragged_dot(
      lhs.astype(jnp.float32), w, gs, group_offset=jnp.int32(offset),
      precision=jax.lax.Precision.HIGHEST, implementation="xla"), rhs)
  (want,) = vjp(dout.astype(jnp.float32))
  testing.assert_close(out.astype(jnp.float32), want, jnp.bfloat16, what="drhs")


@pytest.mark.parametrize("stages,block_n,sizes,m,offset", [
    # Chunk counts of 1-3 under a 3-deep ring (the slots of an item's chunks
    # shift from item to item), an empty group, rows past the last group.
    (3, 64, [60, 0, 150, 37, 0, 120, 3], 420, 0),
    # A 2-deep ring; held groups from the third on, the first of them empty.
    (2, 64, [100, 200, 0, 150, 30, 99], 600, 2),
], ids=["stages3", "stages2-offset"])
def test_ragged_dot_drhs_chained_items(stages, block_n, sizes, m, offset):
  """The "ws" drhs kernel's hand-rolled ring across a block's items (each of
  the 2 interpreted SMs runs 8-14 items), against the float32 reference."""
  config = rdk.RaggedDotConfig(block_m=128, block_n=block_n, block_k=64,
                               num_stages=stages, drhs_kernel="ws")
  _check_drhs(config, sizes, m, offset)


@pytest.mark.parametrize("chain_items", [False, True], ids=["per-item", "chained"])
def test_ragged_dot_drhs_wide_tiles(chain_items):
  """256-column tiles (each compute warpgroup's 64 K rows by all 256 columns),
  stored in two pieces, bf16 out, K and N no multiple of the tile: the
  per-item pipeline and the chained ring."""
  config = rdk.RaggedDotConfig(block_m=128, block_n=128, block_k=64,
                               num_stages=3, out_pieces=2, drhs_kernel="ws",
                               chain_items=chain_items)
  _check_drhs(config, [60, 0, 150, 37, 0, 120, 3], 420, 0, k=200, n=392,
              out_dtype=jnp.bfloat16)


@pytest.mark.parametrize("kernel,chain_items", [
    ("ws", False), ("ws", True), ("ring", True)], ids=["per-item", "chained", "ring"])
def test_ragged_dot_drhs_ignores_rows_outside_the_groups(kernel, chain_items):
  """NaN in lhs and inf in dout in the rows of groups not held (the first 160
  rows, before the held groups from the third) and past the groups (the last
  61): the drhs of the held groups is the reference's, finite."""
  config = rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=64,
                               num_stages=3, drhs_kernel=kernel,
                               chain_items=chain_items)
  _check_drhs(config, [100, 60, 37, 0, 120, 3], 320 + 61, 2, poison_outside=True)


def test_ragged_dot_rows_past_the_groups_add_nothing():
  """The op, forward and backward, with NaN in lhs's rows past the groups and
  inf in the cotangent's: the output and dlhs there are zeros, and every
  result matches the reference on the same operands with zeros there."""
  m, k, n, valid = 381, 256, 192, 320
  sizes = jnp.asarray([100, 60, 37, 0, 120, 3], jnp.int32)
  lhs, dy = _normal((m, k), jnp.bfloat16), _normal((m, n), jnp.bfloat16)
  rhs = _normal((6, k, n), jnp.bfloat16, k**-0.5)
  past = (jnp.arange(m) >= valid)[:, None]

  def fill(x, value):
    return jnp.where(past, value, x).astype(x.dtype)

  def call(implementation):
    return lambda x, w: tokamax.ragged_dot(x, w, sizes, implementation=implementation)
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    out, vjp = jax.vjp(call("mosaic_gpu"), fill(lhs, jnp.nan), rhs)
    dlhs, drhs = vjp(fill(dy, jnp.inf))
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "mosaic_gpu"), ("backward", "mosaic_gpu")]
  want, want_vjp = jax.vjp(call("xla"), fill(lhs, 0).astype(jnp.float32),
                           rhs.astype(jnp.float32))
  want_dlhs, want_drhs = want_vjp(fill(dy, 0).astype(jnp.float32))
  for name, got, ref in (("out", out, want), ("dlhs", dlhs, want_dlhs),
                         ("drhs", drhs, want_drhs)):
    testing.assert_close(got.astype(jnp.float32), ref, jnp.bfloat16, what=name)
  assert not jnp.any(out[valid:]) and not jnp.any(dlhs[valid:])


@pytest.mark.parametrize("config", [
    None,  # the heuristic's
    # Claimed items in the group order: the loop the kernel inherits from
    # `rdk._GroupTiles`.
    rdk.RaggedDotConfig(block_m=128, block_n=64, block_k=128, num_stages=3,
                        item_order="group", claim_items=True),
    # 256-column tiles: two wgmma halves a step, each with its own total.
    rdk.RaggedDotConfig(block_m=128, block_n=128, block_k=128, num_stages=3,
                        out_pieces=2, item_order="group", claim_items=True)],
    ids=["heuristic", "claimed", "wide"])
def test_fp8_ragged_dot(config):
  """The fp8 kernel (forward) against the reference on the same quantized
  inputs: rows and weight blocks of different magnitudes, so wrong scales show."""
  lhs = _normal((300, 256), jnp.float32) * jax.random.uniform(
      jax.random.key(next(_seed)), (300, 1), minval=0.1, maxval=4.0)
  # N of 640: several column tiles, the last one partial, so that each tile's
  # scales are read at its own columns.
  rhs = _normal((3, 256, 640), jnp.float32, 256**-0.5)
  lq = tokamax.quantize(lhs.astype(jnp.bfloat16), (1, 128), jnp.float8_e4m3fn)
  rq = tokamax.quantize(rhs.astype(jnp.bfloat16), (1, 128, 128), jnp.float8_e4m3fn)
  sizes = jnp.asarray([100, 0, 150], jnp.int32)
  implementation = ("mosaic_gpu" if config is None
                    else mosaic_ragged_dot.MosaicGpuRaggedDot(config))
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    out = tokamax.ragged_dot(lq, rq, sizes, implementation=implementation)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "mosaic_gpu")]
  want = tokamax.ragged_dot(lq, rq, sizes, implementation="xla")
  testing.assert_close(out, want, jnp.bfloat16, what="fp8 output")


@pytest.mark.parametrize("m,n", [(200, 192),  # dh by XLA (no dh_tile)
                                 (256, 384)])  # dh by glu_dh_from_projections
def test_gated_linear_unit(m, n):
  operands = (_normal((m, 256), jnp.bfloat16), _normal((256, 2, n), jnp.bfloat16,
                                                       256**-0.5))

  def call(implementation):
    return lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                                  implementation=implementation)
  _check(call, operands, jnp.bfloat16)


@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.gelu, None])
@pytest.mark.parametrize("m,n,dtype", [(16, 512, jnp.bfloat16),  # 8 x 256 blocks
                                       (48, 384, jnp.float16),  # 16 x 128
                                       (64, 192, jnp.float32)])  # 32 x 64
def test_glu_dh_from_projections(activation, m, n, dtype):
  h = _normal((m, 2 * n), dtype, 2.0)
  dy = _normal((m, n), dtype)
  with tokamax.interpret():
    dh = glk.glu_dh_from_projections(h, dy, activation)
  _, vjp = jax.vjp(lambda h: (activation or (lambda g: g))(h[:, :n]) * h[:, n:],
                   h.astype(jnp.float32))
  testing.assert_close(dh, vjp(dy.astype(jnp.float32))[0], dtype, what="dh")


def test_grouped_gated_linear_unit():
  # An empty group, 26 rows past the groups, and dh by glu_dh_from_projections.
  operands = (_normal((256, 256), jnp.bfloat16),
              _normal((3, 256, 2, 384), jnp.bfloat16, 256**-0.5))
  group_sizes = jnp.asarray([100, 0, 130], jnp.int32)

  def call(implementation):
    return lambda x, w: tokamax.gated_linear_unit(
        x, w, activation=jax.nn.silu, group_sizes=group_sizes,
        implementation=implementation)
  _check(call, operands, jnp.bfloat16)


@pytest.mark.parametrize("config,keep_projections,offset", [
    # The MoE step's kind of config (group order, chained ring), projections kept.
    (rdk.RaggedDotConfig(block_n=128, num_stages=2, item_order="group"), True, 0),
    # 64-column tiles, held groups from the third (zero items before them); 4 K
    # steps under 3 stages: each item fills the ring anew.
    (rdk.RaggedDotConfig(block_n=64, num_stages=3), False, 2)])
def test_grouped_glu_kernel(config, keep_projections, offset):
  """The grouped forward kernel (activation in the epilogue): empty groups, a
  group ending mid-tile, rows past the last group, against the float32
  reference on the projections rounded to bfloat16 (as the kernel rounds)."""
  m, k, n = 420, 256, 384
  sizes = jnp.asarray([60, 0, 150, 37, 0, 120, 3], jnp.int32)
  held = 7 - offset
  x = _normal((m, k), jnp.bfloat16)
  w = _normal((held, k, 2, n), jnp.bfloat16, k**-0.5)
  starts, ends = tokamax.plugin.held_row_ranges(sizes, jnp.int32(offset), held, m)
  with tokamax.interpret():
    got = glk.grouped_glu(x, w, starts, ends, jax.nn.silu, config, keep_projections)
  projections = tokamax.ragged_dot(
      x.astype(jnp.float32), w.astype(jnp.float32).reshape(held, k, 2 * n), sizes,
      group_offset=jnp.int32(offset), precision=jax.lax.Precision.HIGHEST,
      implementation="xla")
  rounded = projections.astype(jnp.bfloat16).astype(jnp.float32)
  want = jax.nn.silu(rounded[:, :n]) * rounded[:, n:]
  testing.assert_close(got[0] if keep_projections else got, want, jnp.bfloat16,
                       what="output")
  if keep_projections:
    testing.assert_close(got[1].reshape(m, 2 * n), projections, jnp.bfloat16,
                         what="projections")


def test_grouped_gated_linear_unit_chosen_by_dispatch_with_traced_sizes():
  # As in an MoE step: implementation=None, group sizes computed in the traced
  # function (a router's counts), weights reshaped there. Dispatch checks the
  # candidates in a trace of its own; a check that computed on the operands
  # leaked a tracer out of it (found on the H200 in `bench --model moe`).
  x = _normal((64, 128), jnp.bfloat16)
  w = _normal((2, 128, 256), jnp.bfloat16, 128**-0.5)
  cotangent = _normal((64, 128), jnp.float32)

  def glu(x, w, implementation):
    sizes = jnp.stack([jnp.sum(x[:, 0] > 0).astype(jnp.int32) // 2, jnp.int32(24)])
    return tokamax.gated_linear_unit(x, w.reshape(2, 128, 2, 128), activation=jax.nn.silu,
                                     group_sizes=sizes, implementation=implementation)

  def out_and_grads(x, w, implementation):
    loss = lambda x, w: jnp.sum(glu(x, w, implementation).astype(jnp.float32) * cotangent)
    return glu(x, w, implementation), jax.grad(loss, argnums=(0, 1))(x, w)
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    out, grads = jax.jit(lambda x, w: out_and_grads(x, w, None))(x, w)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "mosaic_gpu"), ("backward", "mosaic_gpu")}
  want, want_grads = out_and_grads(x.astype(jnp.float32), w.astype(jnp.float32), "xla")
  testing.assert_close(out, want, jnp.bfloat16, what="output")
  for g, r in zip(grads, want_grads):
    testing.assert_close(g, r, jnp.bfloat16, what="gradient", scale=2.0)


_RING = lambda stages, blocks: mln.LayerNormConfig(num_stages=stages, blocks_per_sm=blocks)


@pytest.mark.parametrize("r,d,subtract_mean,dtype,config,vjp_config", [
    (6, 2048, True, jnp.bfloat16, mln.LayerNormConfig(2), mln.LayerNormVjpConfig(1, 2)),
    (5, 1024, False, jnp.float32, mln.LayerNormConfig(1), mln.LayerNormVjpConfig(2, 3)),
    (9, 3072, True, jnp.float16, mln.LayerNormConfig(1), mln.LayerNormVjpConfig(1, 2)),
    (11, 1024, True, jnp.bfloat16, mln.LayerNormConfig(1), mln.LayerNormVjpConfig(1, 4)),
    # Above 8192 columns the offset's gradient sums live in shared memory.
    (5, 9216, True, jnp.bfloat16, mln.LayerNormConfig(1), mln.LayerNormVjpConfig(1, 2)),
    # The ring forward: more rows a block than slots (6 and 5 rows, 7 and 6),
    # fewer (3 rows a block, 4 slots).
    (11, 1024, True, jnp.bfloat16, _RING(2, 1), mln.LayerNormVjpConfig(1, 2)),
    (9, 3072, False, jnp.float16, _RING(4, 2), mln.LayerNormVjpConfig(1, 2)),
    (13, 2048, True, jnp.float32, _RING(3, 1), mln.LayerNormVjpConfig(2, 3)),
    # Tail pieces (`mln.row_pieces`): 1024 + 512 columns; 512 + 256 + 128
    # (every tail, float32's vectors); 2048 + 256 through the ring.
    (8, 1536, True, jnp.bfloat16, mln.LayerNormConfig(2), mln.LayerNormVjpConfig(1, 2)),
    (5, 896, False, jnp.float32, mln.LayerNormConfig(1), mln.LayerNormVjpConfig(2, 3)),
    (9, 2304, True, jnp.float16, _RING(2, 1), mln.LayerNormVjpConfig(1, 3))])
def test_layer_norm(r, d, subtract_mean, dtype, config, vjp_config):
  """Both kernels, with a shifted x and a float32 scale for a 16-bit x; the
  ring forward's and the backward's blocks walk several rows each (the
  interpreter's grid is `INTERPRET_SMS` x blocks_per_sm blocks)."""
  x = _normal((r, d), dtype, 3.0) + jnp.asarray(2.0, dtype)
  scale, offset = _normal((d,), jnp.float32), _normal((d,), dtype)

  @dataclasses.dataclass(frozen=True)
  class LayerNorm(mln.MosaicGpuLayerNorm):
    vjp = functools.partial(mln.MosaicGpuLayerNormVjp, vjp_config)

  op = LayerNorm(config)
  call = lambda impl: lambda x, s, o: tokamax.layer_norm(
      x, s, o, subtract_mean=subtract_mean, implementation=impl)
  _check(call, (x, scale, offset), dtype, implementation=op)


@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("scale,offset", [(False, False), (True, False), (False, True)])
def test_layer_norm_ring_forward_alone(scale, offset, with_stats):
  """The ring forward by itself (an inference call writes no statistics), with
  and without each parameter, against the XLA reference on float32 upcasts."""
  r, d = 7, 2048
  x = _normal((r, d), jnp.bfloat16, 3.0) + jnp.asarray(2.0, jnp.bfloat16)
  s = _normal((d,), jnp.float32) if scale else None
  o = _normal((d,), jnp.bfloat16) if offset else None
  args = tokamax.LayerNormArgs(x=x, scale=s, offset=o)
  with tokamax.interpret():
    y, stats = mln.layer_norm_forward(
        args, mln.LayerNormConfig(num_stages=2, blocks_per_sm=1), with_stats=with_stats)
  upcast = lambda a: None if a is None else a.astype(jnp.float32)
  want = tokamax.layer_norm(upcast(x), upcast(s), upcast(o), implementation="xla")
  testing.assert_close(y, want, jnp.bfloat16, what="y")
  assert set(stats) == ({"mean", "rstd"} if with_stats else set())
  if with_stats:
    x32 = np.asarray(x, np.float32)
    np.testing.assert_allclose(stats["mean"], x32.mean(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["rstd"], 1 / np.sqrt(x32.var(axis=1) + 1e-6),
                               rtol=1e-4)


def _layer_norm_backward_check(r, d, subtract_mean, config, dtype):
  """The backward kernel alone (interpreted) against the XLA reference, on
  inputs whose row means matter and differ by row and by column range: a
  positive scale rising across the columns, and a cotangent that follows x
  with a random mean per row. With a random-signed scale and a centred
  cotangent both means are near zero: a kernel that used one warpgroup's
  share of them passed at 1% error. Here it fails, and so does one that
  takes its own share for every warpgroup's (passed at 3-4% on a constant
  scale) or a row's means for another row."""
  x = _normal((r, d), dtype, 2.0) + jnp.asarray(1.0, dtype)
  scale = (1.0 + _normal((d,), jnp.float32, 0.1)) * jnp.linspace(0.2, 2.0, d)
  offset = _normal((d,), dtype)
  dy = (_normal((r, d), jnp.float32) + 0.5 * x.astype(jnp.float32)
        + _normal((r, 1), jnp.float32, 3.0)).astype(dtype)
  args = tokamax.LayerNormArgs(x=x, scale=scale, offset=offset,
                               subtract_mean=subtract_mean)
  with tokamax.interpret():
    _, res = mln.layer_norm_forward(args, mln.heuristic_config(args), with_stats=True)
    grads = mln.layer_norm_backward(args, res["mean"], res["rstd"], dy, config)
  upcast = [a.astype(jnp.float32) for a in (x, scale, offset)]
  _, ref_vjp = jax.vjp(lambda *a: tokamax.layer_norm(
      *a, subtract_mean=subtract_mean, implementation="xla"), *upcast)
  for name, ref in zip(("x", "scale", "offset"), ref_vjp(dy.astype(jnp.float32))):
    testing.assert_close(grads[name], ref, dtype, what=f"d{name}", scale=2.0)


@pytest.mark.parametrize("r,d,subtract_mean,config,dtype", [
    (9, 8192, True, mln.LayerNormVjpConfig(2, 2, warpgroups=2), jnp.bfloat16),
    (7, 2048, False, mln.LayerNormVjpConfig(1, 3, warpgroups=2), jnp.float32),
    (6, 4096, True, mln.LayerNormVjpConfig(1, 2, warpgroups=2), jnp.float16),
    # Four (it hung here before the test run's PJRT_NPROC: notes/MOSAIC_GPU.md,
    # session 36).
    (7, 12288, True, mln.LayerNormVjpConfig(1, 2, warpgroups=4), jnp.bfloat16),
    # One warpgroup: the same check.
    (5, 3072, True, mln.LayerNormVjpConfig(1, 2), jnp.bfloat16),
    # The scale read from the block's copy in shared memory.
    (9, 4096, True, mln.LayerNormVjpConfig(1, 2, 2, scale_in_smem=True), jnp.bfloat16),
    (5, 3072, False, mln.LayerNormVjpConfig(2, 3, scale_in_smem=True), jnp.float16),
    # With Pallas' auto barriers, opt-in (the interpreter runs a warpgroup as
    # one thread: this checks that it takes the flag, not the kernel's ordering).
    (9, 4096, True, mln.LayerNormVjpConfig(1, 2, 2, auto_barriers=True), jnp.bfloat16)])
def test_layer_norm_backward_warpgroups(r, d, subtract_mean, config, dtype):
  """Rows split over a block's warpgroups, their row sums added through shared
  memory; blocks walk several rows (fewer than the slots, for one)."""
  _layer_norm_backward_check(r, d, subtract_mean, config, dtype)


def test_overlap_qk_is_refused_in_the_interpreter():
  q = _normal((1, 128, 2, 128), jnp.bfloat16)
  config = mat.AttentionConfig(block_kv=128, num_stages=2, overlap_qk=True)
  with tokamax.interpret():
    with pytest.raises(NotImplementedError, match="overlap_qk in the Mosaic GPU"):
      mat.mosaic_attention(q, q, q, scale=0.1, causal=False, config=config)


def test_interpreter_is_asked_for_only_under_interpret():
  with tokamax.interpret(False):
    assert _common.interpret_params() is None
  with tokamax.interpret():
    assert _common.interpret_params() is not None
    assert _common.num_sms() == _common.INTERPRET_SMS


def test_head_group_with_32_row_steps_and_segments():
  """The split H256 backward in head groups (a one-axis grid) with segment ids,
  against the reference. It hung here before the test run's PJRT_NPROC
  (notes/MOSAIC_GPU.md, sessions 31 and 36): a refusal until then, and the
  heuristic took no head groups in the interpreter; now it takes them as on a
  GPU."""
  q, k, v = (_normal((1, 256, 2, 256), jnp.bfloat16) for _ in range(3))
  ids = jnp.asarray([[1] * 128 + [2] * 128], jnp.int32)
  config = mat.AttentionVjpConfig(32, 32, 2, split_dkv=True, head_group=1)
  _check_backward(q, k, v, config, q_segment_ids=ids, kv_segment_ids=ids)
  args = attention_op.canonical_args(q, q, q, None, None, is_causal=True,
                                     q_segment_ids=ids, kv_segment_ids=ids)[0]
  with tokamax.interpret():
    assert mat.MosaicGpuAttentionVjp().heuristic_config(args).head_group > 0
