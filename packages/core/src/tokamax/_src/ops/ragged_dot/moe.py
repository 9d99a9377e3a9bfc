"""Expert parallelism by all-to-all: the usual MoE layout inside `shard_map`.

Every device holds its own tokens and ``E / n`` of the ``E`` experts (device d
holds experts ``[d * E_local, (d + 1) * E_local)``). Each token goes to the
device of its expert, the local experts run on what arrived (one grouped
computation, e.g. `ragged_dot`), and the results come back to the token's
device, in the token's place.

Data movement is four row gathers (no sorts of data, no scatters): the tokens
into per-destination send buffers, what arrived into expert groups, the expert
outputs back into the slots they came from, and the returned slots into token
order. Each gather's transpose is the inverse gather (the index maps are
one-to-one), so the backward pass moves data the same way instead of with
scatter-adds. Only the routing indices are sorted (one argsort of the expert
ids).

Overlap (``chunks > 1``): the send buffers are cut into ``chunks`` pieces along
their slots. Each piece crosses the devices, is computed on and comes back
independently of the others, so that XLA's scheduler may run the all-to-alls of
one piece while the experts compute another. Every piece re-reads the local
expert weights and runs smaller matmuls; on 4 H200s this cost more than the
overlap gained (docs/sharding.md), hence the default of 1.

Ring exchange (``exchange="ring"``): instead of one all-to-all each way, the
buffer for the device ``r`` steps ahead travels by one collective permute per
step ``r = 1 .. n-1``, and its results come back by the inverse permute. The
experts run on this device's own tokens first (nothing to wait for) and then on
each arrival, once per source (no regrouping across sources: a source's slots
for one destination are already sorted by expert), so the transfers of later
steps can run under the compute of earlier ones. Routing is rotated by this
device's index (destination ``r`` means "``r`` devices ahead") so that every
step's buffer is a static slice.

Capacity: ``capacity`` slots per destination device and source device; tokens
past a full buffer are dropped (their output rows are 0). With ``capacity=None``
nothing is dropped (the buffers hold every token of the device).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tokamax._src.ops import _checks
from tokamax._src.ops.ragged_dot import api as ragged_dot_op

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]


def moe_all_to_all(x: jax.Array, expert_ids: jax.Array,
                   experts: jax.Array | ExpertFn, *, axis_name: str,
                   num_local_experts: int | None = None,
                   capacity: int | None = None, chunks: int = 1,
                   combine_weights: jax.Array | None = None,
                   exchange: str = "all_to_all") -> jax.Array:
  """Routes tokens to the devices of their experts and their outputs back.

  Call inside `jax.shard_map` over `axis_name` (n devices).

  Args:
    x: ``[m, K]`` this device's tokens.
    expert_ids: ``[m]`` (top-1) or ``[m, top_k]`` integer experts in ``[0, E)``,
      ``E = n * num_local_experts``; an id outside that range is dropped
      (output 0), like an assignment past the capacity.
    experts: this device's experts. Either their weights ``[E_local, K, N]``
      (each token is multiplied by its expert's matrix with `tokamax.ragged_dot`)
      or a function ``(tokens [R, K], group_sizes [E_local] int32) -> [R, N]``
      applying expert e to rows ``[sum(group_sizes[:e]), sum(group_sizes[:e+1]))``
      (rows past ``sum(group_sizes)`` are padding; their outputs are discarded),
      e.g. a whole FFN of ragged_dots.
    axis_name: the mesh axis the experts are sharded over.
    num_local_experts: ``E_local``; taken from the weights when `experts` is an
      array, required for a function.
    capacity: slots per (source, destination) device pair; assignments past a
      full buffer are dropped (output 0). None: ``m * top_k`` (none dropped).
      Rounded up to a multiple of `chunks`.
    chunks: pieces the buffers are cut into so that communication overlaps
      compute (1: no overlap).
    combine_weights: optional, shaped like `expert_ids` (the router's gates):
      each token's outputs are summed with these weights (in float32).
    exchange: ``"all_to_all"`` (one all-to-all each way, optionally in `chunks`)
      or ``"ring"`` (one collective permute per other device, each source's
      tokens computed as they arrive; `chunks` must then be 1).

  Returns:
    ``[m, N]`` for 1-D `expert_ids`, ``[m, top_k, N]`` for 2-D: each token's
    output from each of its experts; ``[m, N]`` with `combine_weights`.
  """
  chunks, capacity = _check(x, expert_ids, chunks, capacity, exchange)
  expert_fn, e_local = _expert_fn(experts, num_local_experts, x.shape[1])
  if combine_weights is not None and combine_weights.shape != expert_ids.shape:
    raise ValueError(f"combine_weights must be shaped like expert_ids "
                     f"{expert_ids.shape}; got {combine_weights.shape}")
  n = _checks.mesh_axis_size("moe_all_to_all", "moves tokens between", axis_name)
  top_k = 1 if expert_ids.ndim == 1 else expert_ids.shape[1]
  assignments = x.shape[0] * top_k
  cap = assignments if capacity is None else capacity
  cap = -(-cap // chunks) * chunks
  ids = expert_ids.reshape(-1).astype(jnp.int32)
  if exchange == "ring":
    ids = _rotate(ids, jax.lax.axis_index(axis_name) * e_local, n * e_local)
  routing = route(ids, n, e_local, cap, top_k)
  send = take_rows(x, routing.token_of_slot, routing.slot_of_assignment, top_k)
  send = send.reshape(n, cap, x.shape[1])
  if exchange == "ring":
    back = _ring_exchange(send, routing.sent_counts, expert_fn, axis_name)
  else:
    back = _all_to_all_exchange(send, routing.sent_counts, expert_fn, axis_name,
                                chunks)
  out = take_rows(back.reshape(n * cap, -1), routing.slot_of_assignment,
                   routing.assignment_of_slot, 1)
  out = out.reshape(*expert_ids.shape, -1)
  if combine_weights is None:
    return out
  weighted = out.astype(jnp.float32) * combine_weights.astype(jnp.float32)[..., None]
  return (weighted.sum(axis=1) if expert_ids.ndim == 2 else weighted).astype(out.dtype)


def _rotate(ids, first_local, num_experts):
  """Expert ids counted from this device's first expert (valid ids only), so that
  destination r of the routing is the device r steps ahead on the ring."""
  valid = (ids >= 0) & (ids < num_experts)
  return jnp.where(valid, (ids - first_local) % num_experts, ids)


def _ring_exchange(send, sent_counts, expert_fn, axis_name):
  """Step r sends ``send[r]`` r devices ahead, computes what came from r devices
  behind and sends the results back; returns them in ``send``'s layout."""
  n = send.shape[0]
  me = jax.lax.axis_index(axis_name)
  # counts[s, r]: rows source s sent (per local expert) r devices ahead of it.
  counts = jax.lax.all_gather(sent_counts, axis_name)
  pieces = [send[0]] + [
      jax.lax.ppermute(send[r], axis_name, [(j, (j + r) % n) for j in range(n)])
      for r in range(1, n)]
  outs = []
  for r, piece in enumerate(pieces):
    if outs:
      # As in the all-to-all path: keeps XLA from fusing the steps' elementwise
      # work into one kernel that would wait for every transfer.
      outs[-1], piece = jax.lax.optimization_barrier((outs[-1], piece))
    # This device's own tokens (r = 0) need no collective for their sizes either.
    sizes = sent_counts[0] if r == 0 else counts[(me - r) % n, r]
    outs.append(_run_experts(expert_fn, piece, sizes))
  back = [out if r == 0 else
          jax.lax.ppermute(out, axis_name, [(j, (j - r) % n) for j in range(n)])
          for r, out in enumerate(outs)]
  return jnp.stack(back)


def _all_to_all_exchange(send, sent_counts, expert_fn, axis_name, chunks):
  """One all-to-all each way (per piece of ``chunks``); results in ``send``'s
  layout."""
  cap = send.shape[1]
  recv_counts = jax.lax.all_to_all(sent_counts, axis_name, 0, 0, tiled=True)
  width = cap // chunks
  pieces = [jax.lax.all_to_all(send[:, c * width:(c + 1) * width], axis_name, 0, 0,
                               tiled=True) for c in range(chunks)]
  outs = []
  for c, piece in enumerate(pieces):
    if outs:
      # Piece c is used only once piece c-1's experts have run. Without this
      # XLA fuses the pieces' row gathers into one kernel, so that every piece
      # waits for all the transfers and nothing overlaps.
      outs[-1], piece = jax.lax.optimization_barrier((outs[-1], piece))
    outs.append(_compute_piece(piece, recv_counts, c * width, expert_fn))
  back = [jax.lax.all_to_all(out, axis_name, 0, 0, tiled=True) for out in outs]
  return jnp.concatenate(back, axis=1) if chunks > 1 else back[0]


def _expert_fn(experts, num_local_experts, features: int) -> tuple[ExpertFn, int]:
  if callable(experts):
    if num_local_experts is None:
      raise ValueError("num_local_experts is required when experts is a function")
    return experts, num_local_experts
  w = jnp.asarray(experts)
  if w.ndim != 3:
    raise ValueError(f"experts must be weights [E_local, K, N] or a function; got "
                     f"an array of shape {w.shape}")
  if w.shape[1] != features:
    # Checked here, or ragged_dot's error would name its own lhs and rhs.
    raise ValueError(f"experts' weights [E_local, K, N] must have K = x's {features} "
                     f"features; got weights of shape {w.shape}")
  if num_local_experts not in (None, w.shape[0]):
    raise ValueError(f"num_local_experts={num_local_experts} does not match the "
                     f"weights' {w.shape[0]} experts")
  return (lambda rows, sizes: ragged_dot_op.ragged_dot(rows, w, sizes)), w.shape[0]


def _check(x, expert_ids, chunks, capacity, exchange) -> tuple[int, int | None]:
  """The call's checks; returns `chunks` and `capacity` as Python ints (a
  concrete 0-d integer array is taken by value: `_checks.static_int`)."""
  chunks = _checks.static_int("chunks", chunks, "an int >= 1")
  if chunks < 1:
    raise ValueError(f"chunks must be >= 1; got {chunks}")
  if capacity is not None:
    capacity = _checks.static_int("capacity", capacity, "None or an int >= 1")
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1 or None; got {capacity}")
  if exchange not in ("all_to_all", "ring"):
    raise ValueError(f"exchange must be 'all_to_all' or 'ring'; got {exchange!r}")
  if exchange == "ring" and chunks != 1:
    raise ValueError(f"exchange='ring' already overlaps per source device; chunks "
                     f"must be 1, got {chunks}")
  if x.ndim != 2:
    raise ValueError(f"x must be [tokens, features]; got shape {x.shape}")
  if expert_ids.ndim not in (1, 2) or expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"expert_ids must be [{x.shape[0]}] or [{x.shape[0]}, top_k] "
                     f"(one row per token of x); got shape {expert_ids.shape}")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"expert_ids must be integers; got {expert_ids.dtype}")
  return chunks, capacity


class Route(NamedTuple):
  """Index maps of the sending side. Invalid entries are out of range (dropped)."""
  token_of_slot: jax.Array       # [n * cap] -> token of x
  slot_of_assignment: jax.Array  # [m * top_k] -> send slot
  assignment_of_slot: jax.Array  # [n * cap] -> assignment
  sent_counts: jax.Array         # [n, E_local] rows sent per local expert


def route(ids, n, e_local, cap, top_k) -> Route:
  """Slots of the send buffers: destination-major, expert-sorted within one.

  `ids` lists the assignments token-major: assignment a is token ``a // top_k``.
  """
  num = ids.shape[0]
  # An id outside [0, E) becomes E: it sorts last, is counted nowhere and dropped.
  ids = jnp.where((ids >= 0) & (ids < n * e_local), ids, n * e_local)
  order = jnp.argsort(ids, stable=True)
  count_e = jnp.zeros((n * e_local,), jnp.int32).at[ids].add(1, mode="drop")
  start_e = jnp.cumsum(count_e) - count_e
  count_d = count_e.reshape(n, e_local).sum(axis=1)
  start_d = start_e[::e_local]
  # Sorted position p: destination and rank there; a rank past cap is dropped.
  dest = ids[order] // e_local
  rank = jnp.arange(num) - start_d[dest]
  slot_sorted = jnp.where((rank < cap) & (dest < n), dest * cap + rank, n * cap)
  slot_of_assignment = jnp.zeros((num,), jnp.int32).at[order].set(slot_sorted)
  # Slot (d, r) holds the sorted position start_d[d] + r, if d got that many.
  d_s, r_s = jnp.divmod(jnp.arange(n * cap), cap)
  used = r_s < count_d[d_s]
  assignment_of_slot = jnp.where(
      used, order[jnp.clip(start_d[d_s] + r_s, 0, max(num - 1, 0))], num)
  token_of_slot = jnp.where(used, assignment_of_slot // top_k, num // top_k)
  # Expert e's run starts at offset start_e - start_d[dest] in its destination's
  # buffer; the first `cap` slots are kept.
  offset = (start_e - jnp.repeat(start_d, e_local)).reshape(n, e_local)
  sent = jnp.clip(cap - offset, 0, count_e.reshape(n, e_local))
  return Route(token_of_slot, slot_of_assignment, assignment_of_slot, sent)


def _compute_piece(piece, recv_counts, first_slot, expert_fn):
  """Groups one received piece by local expert, runs the experts, ungroups."""
  n, width = piece.shape[:2]
  slot_to_row, row_to_slot, group_sizes = _piece_layout(recv_counts, first_slot,
                                                        width)
  rows = take_rows(piece.reshape(n * width, -1), row_to_slot, slot_to_row, 1)
  out = _run_experts(expert_fn, rows, group_sizes)
  return take_rows(out, slot_to_row, row_to_slot, 1).reshape(n, width, -1)


def _run_experts(expert_fn, rows, group_sizes):
  out = expert_fn(rows, group_sizes.astype(jnp.int32))
  if out.ndim != 2 or out.shape[0] != rows.shape[0]:
    raise ValueError(f"the experts function must map [R, K] rows to [R, N]; it "
                     f"returned shape {out.shape} for {rows.shape}")
  return out


def _piece_layout(recv_counts, first_slot, width):
  """Where each slot of a piece goes when its rows are grouped by expert.

  Source s sent expert e's rows in slots ``[o[s, e], o[s, e] + recv_counts[s, e])``
  (o the running sum over e). The piece holds slots ``[first_slot, first_slot +
  width)`` of every source; grouped, expert e's rows of source s follow those of
  sources before s.
  """
  n, _ = recv_counts.shape
  ends = jnp.cumsum(recv_counts, axis=1)
  lo = jnp.clip(ends - recv_counts, first_slot, first_slot + width)
  hi = jnp.clip(ends, first_slot, first_slot + width)
  lens = hi - lo                                       # [n, E_local] in this piece
  group_sizes = lens.sum(axis=0)
  group_start = jnp.cumsum(group_sizes) - group_sizes
  before = jnp.cumsum(lens, axis=0) - lens             # earlier sources' rows
  base = group_start[None, :] + before - lo            # row = base + slot
  slot = first_slot + jnp.arange(width)
  expert = jnp.sum(ends[:, None, :] <= slot[None, :, None], axis=-1)  # [n, width]
  filled = slot[None, :] < ends[:, -1:]
  row = jnp.take_along_axis(base, jnp.minimum(expert, ends.shape[1] - 1), axis=1)
  total = n * width
  slot_to_row = jnp.where(filled, row + slot[None, :], total).reshape(-1)
  row_to_slot = jnp.full((total,), total, jnp.int32).at[slot_to_row].set(
      jnp.arange(total, dtype=jnp.int32), mode="drop")
  return slot_to_row, row_to_slot, group_sizes.astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_rows(x, idx, inverse, replicas):
  """``x[idx]`` with 0 for out-of-range indices; `inverse` maps back.

  Each row of x appears ``replicas`` times in inverse (``inverse[i * replicas +
  j]`` is where its j-th copy went, out of range if nowhere), so the cotangent is
  a gather too.
  """
  del inverse, replicas
  return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, idx, inverse, replicas):
  return take_rows(x, idx, inverse, replicas), inverse


def _take_rows_bwd(replicas, inverse, dy):
  dx = jnp.take(dy, inverse, axis=0, mode="fill", fill_value=0)
  if replicas > 1:
    dx = dx.reshape(-1, replicas, *dy.shape[1:]).astype(jnp.float32).sum(axis=1)
    dx = dx.astype(dy.dtype)
  return dx, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
