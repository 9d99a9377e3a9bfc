"""Backwards that recompute the softmax weights as ``exp(logit - lse)`` from a
float32 lse, and the calls where that is wrong.

Where a row's visible logits are huge (a bias of -1e9 masking every key of a
query row, the "additive mask" of older code), float32 cannot hold the lse to
within the log of the row's sum: next to -1e9 its ulp is 64, so ``log(S)`` is
rounded away and each recomputed weight comes out 1 instead of 1 / S. The
forward is right there (its row max and sum are exact), the gradients of those
rows S times too large. cuDNN's backward (through jax.nn) and the Triton one do
this (measured on an H200: 200x the reference's gradient norm at S=1024, bf16,
`None` picking cuDNN). Whether a call has such a row depends on the bias's
values, so no implementation can refuse it when traced: `guard` checks the
values (the forward's lse where the backward has it, else the bias) and, where
some row needs it, runs the XLA chunked backward instead, whose lse carries its
rounding error (``lse_tail``) and is exact there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import tokamax_xla_reference as xla_ref

# A row whose largest visible logit is this large in magnitude may lose its
# weights to the lse's rounding: float32's ulp at 2**14 is 2**-9, so each
# weight is off by up to 2**-10 relative, below bf16's own rounding (2**-8).
# (The "-10000" mask of some older code stays below it: up to 5e-4 there.)
LARGE_LOGIT = 2.0**14
# The exact branch's loops over key chunks are unrolled up to this many chunks
# (keys up to 8192 at 512 a chunk): a branch without while loops lets XLA keep
# the conditional on the GPU (a CUDA graph's conditional node) instead of
# reading its predicate on the host between kernels. On an H200 (calls issued
# back to back, B2 T4096 N16 H128, tools/guard_cost.py) the check cost the
# Triton forward+backward 1.1-1.2% unrolled against 2.2-2.5% with the loops,
# and the cuDNN one ran 7-11% faster than without a check (its kernels then
# run inside a CUDA graph; 1.8% slower than an unchecked call XLA is told to
# capture too). notes/MEASUREMENTS.md, session 64, item 4.
# Longer keys keep the loops: the unrolled program grows with them.
UNROLLED_CHUNKS = 16


def has_large_logit_rows(args, dout: jax.Array,
                         lse: jax.Array | None = None) -> jax.Array | None:
  """Whether some query row with a nonzero cotangent has visible logits of
  magnitude `LARGE_LOGIT` or more (a bool scalar); None for a call that cannot
  have one (no bias, or a soft cap below `LARGE_LOGIT`), which is not checked.

  The logits' size comes from the forward's `lse` where one is given (``[B, N,
  T]``, about the row's largest logit, +inf on rows that see no key as
  `AttentionArgs` defines it; `lse_with_empty_rows` makes it so for a forward
  whose lse is not: reading it costs nothing next to the attention), else from
  the bias, whose largest visible entry per row stands for it (one read of the
  bias). A row whose cotangent is zero (a padded query
  whose loss is masked: the usual reason a whole row is masked) adds nothing to
  any gradient, whatever its weights, so it needs no check. Under `jax.vmap` the
  answer covers every example of the batch (`_any_over_vmap`), so that
  `guard`'s `lax.cond` stays a branch rather than running both sides.

  Only calls with a bias: without one, logits that large would take queries and
  keys of norms far beyond a trained model's, and a call whose lse another
  computation combines (ring attention's blocks: a global lse, no bias) must not
  be sent to a backward that computes its own."""
  cap = args.logits_soft_cap
  if args.bias is None or (cap is not None and abs(cap) < LARGE_LOGIT):
    return None
  if lse is not None:
    size = lse.astype(jnp.float32)
  else:
    size = jnp.max(jnp.where(_visible(args), args.bias.astype(jnp.float32), -jnp.inf),
                   axis=-1)
  large = jnp.isfinite(size) & (jnp.abs(size) >= LARGE_LOGIT)  # [B|1, N|1, T|1]
  needs_gradient = jnp.moveaxis(jnp.any(dout != 0, axis=-1), 1, 2)  # [B, N, T]
  return _any_over_vmap(jnp.any(large & needs_gradient))


def lse_with_empty_rows(args, lse: jax.Array) -> jax.Array:
  """`lse` ``[B, N, T]`` with +inf on the rows that see no key, as
  `AttentionArgs` defines the residual, for a forward whose lse is finite there
  (cuDNN's: -2.2e12 for rows a mask hides, measured on the H200): such a row
  has no logits to lose (its output is 0 and so are its gradients), and a
  finite lse there would look like a row of huge logits. From positions,
  lengths and segments (no memory read), and the mask where one is given."""
  has_key = jnp.any(_visible(args), axis=-1)  # [B|1, N|1, T]
  return jnp.where(has_key, lse, jnp.inf)


def _visible(args) -> jax.Array:
  """Which keys each query row sees, bool ``[B|1, N|1, T, S]``."""
  t, s = args.query.shape[1], args.key.shape[1]
  return xla_ref.visibility(
      jnp.arange(t), jnp.arange(s), is_causal=args.is_causal,
      local_window=args.local_window, mask=args.mask,
      query_seq_lengths=args.query_seq_lengths,
      key_value_seq_lengths=args.key_value_seq_lengths,
      q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
      q_offset=args.q_offset)


@jax.custom_batching.custom_vmap
def _any_over_vmap(flag):
  return flag


@_any_over_vmap.def_vmap
def _any_over_vmap_rule(axis_size, in_batched, flag):
  del axis_size
  (batched,) = in_batched
  return (_any_over_vmap(jnp.any(flag)) if batched else flag), False


def guard(args, dout: jax.Array, backward: Callable[[], dict],
          lse: jax.Array | None = None) -> dict:
  """``backward()`` (a dict of cotangents, as `VjpOp.backward` returns it),
  except where `has_large_logit_rows` (from the forward's `lse` where given):
  then the XLA chunked forward and backward on `dout`, in the same dtypes.
  Both are compiled; one runs.

  The exact path computes its own forward on `args`: for backwards whose lse
  and output are those of `args`' own forward (not a block's share of a
  combined softmax, as ring attention's: those calls have no bias and are not
  checked)."""
  needed = has_large_logit_rows(args, dout, lse)
  if needed is None:
    return backward()
  # The exact branch must return the same types; tracing `backward` for them
  # costs a second trace (compile time only).
  expected = jax.eval_shape(backward)

  def exact():
    grads = _chunked_grads(args, dout)
    return {k: None if want is None else grads[k].astype(want.dtype)
            for k, want in expected.items()}

  return jax.lax.cond(needed, exact, backward)


def _chunked_grads(args, dout) -> dict:
  # Here, not at the top: xla.py's cuDNN backward imports this module.
  from tokamax._src.ops.attention import xla  # pylint: disable=g-import-not-at-top
  config = xla.XlaChunkedAttention().heuristic_config(args)
  keys = args.key.shape[1]
  # A symbolic key length (`jax.export`) runs as one chunk (`xla._chunk_size`).
  unroll = not isinstance(keys, int) or -(-keys // config.chunk_size) <= UNROLLED_CHUNKS
  forward = xla.XlaChunkedAttention(unroll=unroll)
  backward = xla.XlaChunkedAttentionVjp(unroll=unroll)
  out, residuals = forward.forward(args, config)
  return backward.backward(args, residuals, out, dout, config)
