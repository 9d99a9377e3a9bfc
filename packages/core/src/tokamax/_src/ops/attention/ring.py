"""Ring attention: context parallelism for sequence-sharded q, k and v.

Used inside `jax.shard_map`: every device holds one block of the query sequence
and one block of the key/value sequence. Key/value blocks travel around the ring
of devices (`jax.lax.ppermute`, issued before the block's compute so the two
overlap); each device attends its queries to every block it sees, with a
per-block attention call that returns the log-sum-exp, and merges the partial
results by their log-sum-exps. The backward is a second ring pass: dq stays
home, dk/dv accumulators travel with their key/value block and arrive home
after the last step.

Causal load balancing (``load_balanced=True``): with contiguous blocks, device i
has work only for blocks ``j <= i`` (the last device does n times the first's).
The zig-zag layout splits the sequence into 2n chunks and gives device i chunks
``i`` and ``2n - 1 - i``; every device then does the same work at every step
(half a block-pair off the diagonal, the diagonal at step 0).
`zigzag_permutation` gives the reordering to apply to the sequence beforehand
(and its inverse afterwards).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import dispatch
from tokamax._src import vma
from tokamax._src.ops import _checks
from tokamax._src.ops.attention import api as attention_op


def zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
  """Indices that reorder a sequence into the causal load-balanced layout.

  Chunk the sequence into ``2 * num_shards`` equal chunks; shard i (the i-th
  contiguous block of the reordered sequence) holds chunks ``i`` and
  ``2 * num_shards - 1 - i``.

  Example:
    >>> perm = tokamax.zigzag_permutation(T, n)
    >>> q_zz = q[:, perm]                      # then shard axis 1 over n devices
    >>> out = out_zz[:, np.argsort(perm)]      # back to the natural order
  """
  seq_len = _checks.static_int("seq_len", seq_len, "an int >= 0")
  num_shards = _checks.static_int("num_shards", num_shards, "an int >= 1")
  if seq_len < 0 or num_shards < 1:
    raise ValueError(f"zigzag_permutation takes seq_len >= 0 and num_shards >= 1; got "
                     f"seq_len={seq_len}, num_shards={num_shards}")
  if seq_len % (2 * num_shards):
    raise ValueError(f"seq_len {seq_len} must be a multiple of 2 * num_shards "
                     f"= {2 * num_shards}")
  chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
  order = [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]
  return chunks[order].reshape(-1)


def _lse_for_merge(lse):
  return jnp.where(lse == jnp.inf, -jnp.inf, lse)  # contract: +inf for empty rows


def _merge(acc, part):
  """Merges two (out float32, lse) partial results for the same query rows."""
  out_a, lse_a = acc
  out_b, lse_b = part
  lse_b = _lse_for_merge(lse_b)
  new = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(new), new, 0.0)
  wa = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
  wb = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
  def rows(w):  # [B, N, T] -> [B, T, N, 1]
    return jnp.moveaxis(w, 2, 1)[..., None]
  return out_a * rows(wa) + out_b.astype(jnp.float32) * rows(wb), new


@dataclasses.dataclass(frozen=True)
class _Static:
  axis_name: Any
  is_causal: bool
  scale: float
  precision: Any
  load_balanced: bool
  implementation: Any


def _args(q, k, v, causal, s: _Static):
  return attention_op.AttentionArgs(query=q, key=k, value=v, scale=s.scale,
                                    is_causal=causal, precision=s.precision)


# The implementation a block runs with under automatic choice when none of the
# others returns (or computes from) the log-sum-exp: the XLA chunked one always does.
_FALLBACK = "xla_chunked"


def _block_forward(q, k, v, causal, s: _Static):
  """(out float32 [B, T, N, Hv], lse [B, N, T] with -inf for empty rows)."""
  out, residuals = dispatch.forward_with_residuals(
      attention_op.OP_NAME, _args(q, k, v, causal, s), s.implementation, ("lse",),
      fallback=_FALLBACK)
  return out.astype(jnp.float32), _lse_for_merge(residuals["lse"])


def _block_backward(q, k, v, causal, lse, out, dout, s: _Static):
  """(dq, dk, dv) float32 of one block pair, from the global lse and output: a
  backward that computes from the given log-sum-exp (the forward's implementation
  when it has one, else the XLA chunked one)."""
  grads = dispatch.backward_with_residuals(
      attention_op.OP_NAME, _args(q, k, v, causal, s),
      {"lse": jnp.where(lse == -jnp.inf, jnp.inf, lse)}, out, dout, s.implementation,
      consumes=("lse",), fallback=_FALLBACK)
  return tuple(grads[f].astype(jnp.float32) for f in ("query", "key", "value"))


def _zero(*arrays):
  """A float32 0 depending on `arrays`: inside shard_map it varies over the same
  mesh axes as they do, so that both branches of a cond agree."""
  return sum(jnp.sum(jnp.ravel(x)[:0].astype(jnp.float32)) for x in arrays)


def _empty(q, v, *others):
  b, t, n, _ = q.shape
  zero = _zero(q, v, *others)
  return (jnp.zeros((b, t, n, v.shape[-1]), jnp.float32) + zero,
          jnp.full((b, n, t), -jnp.inf, jnp.float32) + zero)


def _halves(x, axis):
  h = x.shape[axis] // 2
  return (jax.lax.slice_in_dim(x, 0, h, axis=axis),
          jax.lax.slice_in_dim(x, h, 2 * h, axis=axis))


def _cat(a, b, axis):
  return jnp.concatenate([a, b], axis=axis)


def _step_forward(q, k, v, rel, s: _Static):
  """Attention of the local queries to one key/value block.

  rel: None on the diagonal (step 0, static), else a traced bool: whether the
  block comes from an earlier device (j < i).
  """
  if not s.is_causal:
    return _block_forward(q, k, v, False, s)
  if not s.load_balanced:
    if rel is None:
      return _block_forward(q, k, v, True, s)
    return jax.lax.cond(rel, lambda: _block_forward(q, k, v, False, s),
                        lambda: _empty(q, v, k))
  q0, q1 = _halves(q, 1)
  k0, k1 = _halves(k, 1)
  v0, v1 = _halves(v, 1)
  if rel is None:  # chunks (i, 2n-1-i) against themselves
    o0, l0 = _block_forward(q0, k0, v0, True, s)
    o1, l1 = _merge(_block_forward(q1, k0, v0, False, s),
                    _block_forward(q1, k1, v1, True, s))
    return _cat(o0, o1, 1), _cat(l0, l1, 2)

  def earlier():  # j < i: every local query sees chunk j, none sees 2n-1-j
    return _block_forward(q, k0, v0, False, s)

  def later():  # j > i: only chunk 2n-1-i sees both chunks j and 2n-1-j
    o1, l1 = _block_forward(q1, k, v, False, s)
    o0, l0 = _empty(q0, v, k)
    return _cat(o0, o1, 1), _cat(l0, l1, 2)

  return jax.lax.cond(rel, earlier, later)


def _step_backward(q, k, v, lse, out, dout, rel, s: _Static):
  """(dq, dk, dv) float32 of the local queries against one key/value block."""
  def full(qq, kk, vv, causal, lse_, out_, dout_):
    return _block_backward(qq, kk, vv, causal, lse_, out_, dout_, s)

  def zeros():
    zero = _zero(q, k, v, lse, out, dout)
    return (jnp.zeros(q.shape, jnp.float32) + zero, jnp.zeros(k.shape, jnp.float32) + zero,
            jnp.zeros(v.shape, jnp.float32) + zero)

  if not s.is_causal:
    return full(q, k, v, False, lse, out, dout)
  if not s.load_balanced:
    if rel is None:
      return full(q, k, v, True, lse, out, dout)
    return jax.lax.cond(rel, lambda: full(q, k, v, False, lse, out, dout), zeros)
  q0, q1 = _halves(q, 1)
  k0, k1 = _halves(k, 1)
  v0, v1 = _halves(v, 1)
  l0, l1 = _halves(lse, 2)
  o0, o1 = _halves(out, 1)
  d0, d1 = _halves(dout, 1)
  if rel is None:
    dq0, dk0, dv0 = full(q0, k0, v0, True, l0, o0, d0)
    dq1a, dk0b, dv0b = full(q1, k0, v0, False, l1, o1, d1)
    dq1b, dk1, dv1 = full(q1, k1, v1, True, l1, o1, d1)
    return (_cat(dq0, dq1a + dq1b, 1), _cat(dk0 + dk0b, dk1, 1),
            _cat(dv0 + dv0b, dv1, 1))

  def earlier():
    dq, dk0, dv0 = full(q, k0, v0, False, lse, out, dout)
    return dq, _cat(dk0, jnp.zeros_like(dk0), 1), _cat(dv0, jnp.zeros_like(dv0), 1)

  def later():
    dq1, dk, dv = full(q1, k, v, False, l1, o1, d1)
    return _cat(jnp.zeros_like(dq1), dq1, 1), dk, dv

  return jax.lax.cond(rel, earlier, later)


def _ring_info(axis_name):
  n = jax.lax.axis_size(axis_name)
  index = jax.lax.axis_index(axis_name)
  perm = [(i, (i + 1) % n) for i in range(n)]
  return n, index, perm


def _shift(x, axis_name, perm):
  return jax.lax.ppermute(x, axis_name, perm)


def _forward(q, k, v, sinks, s: _Static):
  """(out [B, T, N, Hv] in q's dtype, lse [B, N, T] with -inf for empty rows),
  sinks joined once, after every block is merged (in float32, before rounding)."""
  n, index, perm = _ring_info(s.axis_name)
  acc = _empty(q, v, k)
  for step in range(n):
    # Issue the next block's transfer before this block's compute: no data
    # dependence between them, so the collective overlaps the attention.
    nxt = (_shift(k, s.axis_name, perm), _shift(v, s.axis_name, perm)) if step < n - 1 else None
    source = (index - step) % n
    rel = None if step == 0 else source < index
    acc = _merge(acc, _step_forward(q, k, v, rel, s))
    if nxt is not None:
      k, v = nxt
  out, lse = acc
  if sinks is not None:
    out, lse = attention_op.apply_sinks(sinks, out, lse)
  return out.astype(q.dtype), lse


def _backward(q, k, v, out, lse, dout, s: _Static):
  n, index, perm = _ring_info(s.axis_name)
  zero = _zero(q, k, v, out, lse, dout)
  dq = jnp.zeros(q.shape, jnp.float32) + zero
  dk = jnp.zeros(k.shape, jnp.float32) + zero
  dv = jnp.zeros(v.shape, jnp.float32) + zero
  for step in range(n):
    nxt = (_shift(k, s.axis_name, perm), _shift(v, s.axis_name, perm)) if step < n - 1 else None
    source = (index - step) % n
    rel = None if step == 0 else source < index
    gq, gk, gv = _step_backward(q, k, v, lse, out, dout, rel, s)
    dq = dq + gq
    # The accumulators travel with their block; after the last step one more
    # shift brings each home.
    dk = _shift(dk + gk, s.axis_name, perm)
    dv = _shift(dv + gv, s.axis_name, perm)
    if nxt is not None:
      k, v = nxt
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, sinks, s: _Static):
  return _forward(q, k, v, sinks, s)[0]


def _ring_fwd(q, k, v, sinks, s):
  out, lse = _forward(q, k, v, sinks, s)
  return out, (q, k, v, sinks, out, lse)


def _ring_bwd(s, saved, dout):
  q, k, v, sinks, out, lse = saved
  # The blocks' backwards read the global lse and output (sinks in): unchanged.
  dq, dk, dv = _backward(q, k, v, out, lse, dout, s)
  dsinks = None
  if sinks is not None:
    # Every device holds all heads' sinks and its own query rows: the sum over
    # the ring (and over any other axis the rows are split on, where the sinks
    # are not) is the gradient of the sinks every device was given.
    dsinks = jax.lax.psum(attention_op.sinks_cotangent(sinks, lse, out, dout),
                          s.axis_name)
    dsinks = vma.match_varying(dsinks, vma.varying_axes(sinks))
  return dq, dk, dv, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: Any,
    is_causal: bool = False,
    scale: float | None = None,
    load_balanced: bool = False,
    sinks: jax.Array | None = None,
    precision: Any = None,
    implementation: dispatch.Implementation = None,
) -> jax.Array:
  """Attention over a sequence split across the devices of `axis_name` (ring).

  Call it inside `jax.shard_map` with q, k and v split along their sequence
  axis over `axis_name` (the local blocks are passed here). Equal to
  `tokamax.dot_product_attention` on the whole sequence.

  Args:
    query: local ``[B, T/n, N, H]``.
    key: local ``[B, S/n, K, H]``.
    value: local ``[B, S/n, K, Hv]``.
    axis_name: the mesh axis (or tuple of axes) the sequence is split over.
    is_causal: causal masking on the global positions (needs T == S).
    scale: logit scale; default ``1 / sqrt(H)``.
    load_balanced: the sequence is in the zig-zag layout of
      `zigzag_permutation` (causal only): equal work on every device.
    sinks: optional float ``[N]`` (every device the same, not split), as in
      `tokamax.dot_product_attention`: joined once, after the ring's blocks are
      merged; its gradient is summed over the ring.
    precision: matmul precision.
    implementation: the per-block implementation(s). The forward must return
      the log-sum-exp residual and the backward must compute from it (with None:
      the first that does, e.g. the Triton kernels on a GPU, else "xla_chunked").

  Returns:
    The local ``[B, T/n, N, Hv]`` output block.

  Example:
    >>> f = jax.shard_map(
    ...     lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name="sp",
    ...                                            is_causal=True),
    ...     mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  """
  # dot_product_attention's checks (dtypes, shapes, scale, is_causal, sinks,
  # precision), then the ring's own.
  args, _ = attention_op.canonical_args(query, key, value, scale=scale,
                                        is_causal=is_causal, sinks=sinks,
                                        precision=precision, merge_batch=False)
  if args.query.ndim != 4:
    raise ValueError(f"ring_attention takes [B, T, N, H] blocks; got query "
                     f"{_checks.describe(args.query)}")
  if args.is_causal and query.shape[1] != key.shape[1]:
    raise ValueError(f"causal ring attention needs equal query and key blocks; got "
                     f"T={query.shape[1]} and S={key.shape[1]}")
  if load_balanced and (not args.is_causal or query.shape[1] % 2):
    raise ValueError(f"load_balanced needs is_causal and an even block length; got "
                     f"is_causal={args.is_causal}, T={query.shape[1]}")
  _checks.mesh_axis_size("ring_attention", "passes key/value blocks between", axis_name)
  static = _Static(axis_name=axis_name, is_causal=args.is_causal, scale=args.scale,
                   precision=args.precision, load_balanced=load_balanced,
                   implementation=implementation)
  return _ring(args.query, args.key, args.value, args.sinks, static)
