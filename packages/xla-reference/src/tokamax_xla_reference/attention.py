"""Dot-product attention: the dense oracle, a chunked variant, and cuDNN.

Layouts: q ``[B, T, N, H]``, k ``[B, S, K, H]``, v ``[B, S, K, Hv]``, N % K == 0;
bias / mask ``[B|1, N|1, T|1, S|1]``; lengths ``[B]``; segment ids ``[B, T]`` and
``[B, S]``. Grouped heads are computed as ``[B, K, N // K, ...]`` so K/V are never
repeated.
"""


import jax
import jax.numpy as jnp
import numpy as np


def visibility(q_pos, k_pos, *, is_causal=False, local_window=None, mask=None,
               query_seq_lengths=None, key_value_seq_lengths=None, q_segment_ids=None,
               kv_segment_ids=None, q_offset=None):
  """Which (query, key) pairs may attend: bool ``[B|1, N|1, T, S]``.

  Args:
    q_pos: int ``[T]`` query positions; k_pos: int ``[S]`` key positions.
    is_causal, local_window: as in the attention functions.
    mask: None or bool ``[B|1, N|1, T|1, S|1]`` already sliced to these positions.
    query_seq_lengths, key_value_seq_lengths: None or ``[B]``.
    q_segment_ids, kv_segment_ids: None or ``[B, T]`` / ``[B, S]`` for these positions.
    q_offset: None or an int scalar added to the query positions for
      ``is_causal`` and ``local_window`` only (a query block that starts
      ``q_offset`` positions after the key block).
  """
  t, s = q_pos[:, None], k_pos[None, :]
  tc = t if q_offset is None else t + q_offset
  vis = jnp.ones((1, 1, q_pos.shape[0], k_pos.shape[0]), bool)
  if is_causal:
    vis &= s <= tc
  if local_window is not None:
    left, right = local_window
    if left is not None:
      vis &= s >= tc - left
    if right is not None:
      vis &= s <= tc + right
  if mask is not None:
    vis = vis & mask
  if query_seq_lengths is not None:
    vis = vis & (t < query_seq_lengths[:, None, None, None])
  if key_value_seq_lengths is not None:
    vis = vis & (s < key_value_seq_lengths[:, None, None, None])
  if q_segment_ids is not None:
    vis = vis & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  return vis


def _group_heads(x, num_kv_heads):
  """``[B|1, N|1, ...] -> [B|1, K|1, N//K|1, ...]`` for broadcasting with grouped logits."""
  if x.shape[1] == 1:
    return x[:, :, None]
  # Sizes spelled out: -1 cannot be inferred when another dim is 0 (an empty input).
  return x.reshape(x.shape[0], num_kv_heads, x.shape[1] // num_kv_heads, *x.shape[2:])


def _logits(q, k, bias, *, scale, logits_soft_cap, precision):
  """Grouped float32 logits ``[B, K, G, T, S]``."""
  b, t, n, h = q.shape
  num_kv = k.shape[2]
  qg = q.reshape(b, t, num_kv, n // num_kv, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=precision,
                      preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + _group_heads(bias.astype(jnp.float32), num_kv)
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  return logits


def _softmax_stats(logits, vis, sinks=None):
  """Row max (finite, no gradient), unnormalized probabilities, row sums, and
  whether each row sees a key.

  With sinks (``[K, G, 1]``, see `_grouped_sinks`), each row's sum also
  holds ``exp(sink)`` (a logit that takes no value), and the max takes the sink
  in so that a sink far above the logits cannot overflow the sum.
  """
  masked = jnp.where(vis, logits, -jnp.inf)
  row_max = jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf)  # S may be 0
  nonempty = jnp.isfinite(row_max)
  if sinks is not None:
    row_max = jnp.maximum(row_max, sinks[..., None])
  row_max = jax.lax.stop_gradient(jnp.where(nonempty, row_max, 0.0))
  p = jnp.exp(masked - row_max)
  row_sum = jnp.sum(p, axis=-1)
  if sinks is not None:
    # exp of -inf, not a masked exp: an empty row's max is 0, where exp(sink)
    # may overflow, and the gradient of a masked inf is NaN.
    row_sum = row_sum + jnp.exp(jnp.where(nonempty[..., 0], sinks - row_max[..., 0],
                                          -jnp.inf))
  return row_max[..., 0], p, row_sum, nonempty[..., 0]


def _grouped_sinks(sinks, num_kv):
  """``[N] -> [K, G, 1]`` float32, broadcasting with the grouped row statistics
  ``[B, K, G, T]``."""
  return sinks.astype(jnp.float32).reshape(num_kv, -1, 1)


def attention(q, k, v, bias=None, mask=None, *, scale, is_causal=False,
              local_window=None, logits_soft_cap=None, query_seq_lengths=None,
              key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None,
              precision=None, q_offset=None, sinks=None):
  """Dense attention, materializing the ``[B, N, T, S]`` logits in float32.

  `sinks` (None or float ``[N]``): a logit per query head in every row's softmax
  denominator that takes no value (see `AttentionArgs.sinks`).

  Returns:
    ``(out [B, T, N, Hv] in q's dtype, lse float32 [B, N, T])``; rows with no
    visible key have out 0 and lse +inf.
  """
  b, t, n, _ = q.shape
  s, num_kv = k.shape[1], k.shape[2]
  logits = _logits(q, k, bias, scale=scale, logits_soft_cap=logits_soft_cap,
                   precision=precision)
  vis = visibility(jnp.arange(t), jnp.arange(s), is_causal=is_causal,
                   local_window=local_window, mask=mask,
                   query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   q_offset=q_offset)
  grouped_sinks = None if sinks is None else _grouped_sinks(sinks, num_kv)
  row_max, p, row_sum, nonempty = _softmax_stats(logits, _group_heads(vis, num_kv),
                                                 grouped_sinks)
  out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), precision=precision,
                   preferred_element_type=jnp.float32)
  nonempty = nonempty & (row_sum > 0)
  denom = jnp.where(nonempty, row_sum, 1.0)
  out = out / jnp.moveaxis(denom, -1, 1)[..., None]
  lse = jnp.where(nonempty, row_max + jnp.log(denom), jnp.inf)
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse.reshape(b, n, t)


def _zero_from(*arrays):
  """A float32 0 that depends on every array given: inside `shard_map` the scan
  carries then vary over the same mesh axes as the inputs (its vma check)."""
  zero = jnp.float32(0)
  for x in arrays:
    if x is not None:
      zero = zero + jnp.sum(jnp.ravel(x)[:0].astype(jnp.float32))
  return zero


def _chunk_inputs(s, chunk_size, k, v, bias, mask, kv_segment_ids):
  """Pads the key axis to a chunk multiple and splits it into a leading chunk axis."""
  num_chunks = -(-s // chunk_size)
  pad = num_chunks * chunk_size - s

  def split(x, axis):
    if x is None:
      return None
    if x.shape[axis] == 1:  # broadcast along keys: same for every chunk
      return jnp.broadcast_to(x[None], (num_chunks, *x.shape))
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
    x = x.reshape(*x.shape[:axis], num_chunks, chunk_size, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  return num_chunks, dict(k=split(k, 1), v=split(v, 1), bias=split(bias, 3),
                          mask=split(mask, 3), kv_seg=split(kv_segment_ids, 1))


def _chunk_visibility(chunk, q_pos, k_pos, s, kw):
  vis = visibility(q_pos, k_pos, is_causal=kw["is_causal"],
                   local_window=kw["local_window"], mask=chunk["mask"],
                   query_seq_lengths=kw["query_seq_lengths"],
                   key_value_seq_lengths=kw["key_value_seq_lengths"],
                   q_segment_ids=kw["q_segment_ids"], kv_segment_ids=chunk["kv_seg"],
                   q_offset=kw.get("q_offset"))
  return vis & (k_pos < s)[None, None, None, :]


def _two_sum(a, b):
  """``(fl(a + b), the rounding error)``: ``a + b == hi + lo`` exactly (Knuth's
  TwoSum; float arithmetic is not reassociated by XLA)."""
  hi = a + b
  b_part = hi - a
  lo = (a - (hi - b_part)) + (b - b_part)
  return hi, lo


def attention_chunked(q, k, v, bias=None, mask=None, *, scale, is_causal=False,
                      local_window=None, logits_soft_cap=None, query_seq_lengths=None,
                      key_value_seq_lengths=None, q_segment_ids=None,
                      kv_segment_ids=None, precision=None, chunk_size=512,
                      q_offset=None, sinks=None, lse_tail=False, unroll=1):
  """Attention over key chunks with an online softmax: memory O(T * chunk_size).

  Same contract as :func:`attention`; the sinks join each row's sum after the
  last chunk. Differentiate it with
  :func:`attention_chunked_backward` (autodiff through the scan would store every
  chunk's probabilities, O(T * S) again).

  `lse_tail`: also return the rounding error of each row's lse (float32 ``[B, N,
  T]``, 0 for rows without a visible key): ``lse + tail`` is the row's
  log-sum-exp to about twice float32's precision. The backward needs it where
  the logits are huge: next to a bias of -1e9 the lse rounds away the log of
  the row's sum (the ulp there is 64), and weights recomputed from the lse
  alone come out up to S times too large.

  `unroll`: chunks per iteration of the loop over them (`jax.lax.scan`'s);
  True unrolls it whole, so the program holds no while loop for it (on a GPU,
  XLA can then capture a conditional around it in a CUDA graph).

  Returns:
    ``(out, lse)``, or ``(out, lse, tail)`` with `lse_tail`.
  """
  b, t, n, _ = q.shape
  s, num_kv, hv = k.shape[1], k.shape[2], v.shape[-1]
  num_chunks, chunks = _chunk_inputs(s, chunk_size, k, v, bias, mask, kv_segment_ids)
  kw = dict(is_causal=is_causal, local_window=local_window,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
            q_offset=q_offset)
  q_pos = jnp.arange(t)
  g = n // num_kv

  def step(carry, xs):
    acc, row_max, row_sum = carry
    index, chunk = xs
    k_pos = index * chunk_size + jnp.arange(chunk_size)
    logits = _logits(q, chunk["k"], chunk["bias"], scale=scale,
                     logits_soft_cap=logits_soft_cap, precision=precision)
    vis = _group_heads(_chunk_visibility(chunk, q_pos, k_pos, s, kw), num_kv)
    masked = jnp.where(vis, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(masked, axis=-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, safe_max) - safe_max)
    p = jnp.exp(masked - safe_max[..., None])
    row_sum = row_sum * correction + jnp.sum(p, axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgts,bskh->bkgth", p, chunk["v"].astype(jnp.float32), precision=precision,
        preferred_element_type=jnp.float32)
    return (acc, new_max, row_sum), None

  zero = _zero_from(q, k, v, bias, mask, query_seq_lengths, key_value_seq_lengths,
                    q_segment_ids, kv_segment_ids, q_offset)
  init = (jnp.zeros((b, num_kv, g, t, hv), jnp.float32) + zero,
          jnp.full((b, num_kv, g, t), -jnp.inf, jnp.float32) + zero,
          jnp.zeros((b, num_kv, g, t), jnp.float32) + zero)
  (acc, row_max, row_sum), _ = jax.lax.scan(step, init, (jnp.arange(num_chunks), chunks),
                                            unroll=unroll)
  nonempty = row_sum > 0
  denom = jnp.where(nonempty, row_sum, 1.0)
  out = acc / denom[..., None]
  lse, tail = _two_sum(jnp.where(nonempty, row_max, 0.0), jnp.log(denom))
  if sinks is not None:
    # The sink's share: row weights times sum / (sum + exp(sink)), in float32
    # before the output is rounded. Both terms relative to the larger exponent,
    # the keys' with their tail: next to huge logits the tail is the keys' whole
    # log-sum, and a sink tied with them keeps its share. A sink of +inf
    # saturates at float32's maximum (its share 1, no NaN from inf - inf).
    sink = jnp.minimum(_grouped_sinks(sinks, num_kv), jnp.finfo(jnp.float32).max)
    top = jnp.maximum(lse, sink)
    keys = jnp.exp((lse - top) + tail)
    denom = keys + jnp.exp(sink - top)
    out = out * (keys / denom)[..., None]
    lse, tail = _two_sum(top, jnp.log(denom))
  lse = jnp.where(nonempty, lse, jnp.inf)
  tail = jnp.where(nonempty, tail, 0.0)
  out = jnp.moveaxis(out, 3, 1).reshape(b, t, n, hv).astype(q.dtype)
  if lse_tail:
    return out, lse.reshape(b, n, t), tail.reshape(b, n, t)
  return out, lse.reshape(b, n, t)


def attention_chunked_backward(q, k, v, bias, mask, out, lse, dout, *, scale,
                               is_causal=False, local_window=None, logits_soft_cap=None,
                               query_seq_lengths=None, key_value_seq_lengths=None,
                               q_segment_ids=None, kv_segment_ids=None, precision=None,
                               chunk_size=512, q_offset=None, lse_tail=None, unroll=1):
  """Gradients of attention from the saved log-sum-exp, one key chunk at a time.

  With sinks, `lse` and `out` are the forward's (sinks included) and this is
  unchanged; the sinks' own gradient is `AttentionArgs.sinks_cotangent`'s.
  `lse_tail`: the lse's rounding error, as :func:`attention_chunked` returns it
  (None: taken as 0, which is exact unless the logits are huge). `unroll`: as
  :func:`attention_chunked`'s.

  Returns:
    ``(dq, dk, dv, dbias)`` (dbias None without bias), float32, memory
    O(T * chunk_size) beyond the inputs.
  """
  b, t, n, h = q.shape
  s, num_kv, hv = k.shape[1], k.shape[2], v.shape[-1]
  g = n // num_kv
  num_chunks, chunks = _chunk_inputs(s, chunk_size, k, v, bias, mask, kv_segment_ids)
  kw = dict(is_causal=is_causal, local_window=local_window,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
            q_offset=q_offset)
  q_pos = jnp.arange(t)
  qg = q.reshape(b, t, num_kv, g, h)
  do = dout.astype(jnp.float32).reshape(b, t, num_kv, g, hv)
  lse_g = lse.reshape(b, num_kv, g, t)
  tail_g = (jnp.zeros_like(lse_g) if lse_tail is None
            else lse_tail.astype(jnp.float32).reshape(b, num_kv, g, t))
  # delta = rowsum(dout * out): the softmax Jacobian's correction term.
  delta = jnp.einsum("btkgh,btkgh->bkgt", do,
                     out.astype(jnp.float32).reshape(b, t, num_kv, g, hv))

  def step(dq, xs):
    index, chunk = xs
    k_pos = index * chunk_size + jnp.arange(chunk_size)
    raw = jnp.einsum("btkgh,bskh->bkgts", qg, chunk["k"], precision=precision,
                     preferred_element_type=jnp.float32) * scale
    if chunk["bias"] is not None:
      raw = raw + _group_heads(chunk["bias"].astype(jnp.float32), num_kv)
    logits = raw
    if logits_soft_cap is not None:
      logits = logits_soft_cap * jnp.tanh(raw / logits_soft_cap)
    vis = _group_heads(_chunk_visibility(chunk, q_pos, k_pos, s, kw), num_kv)
    # Logits minus lse first: both huge next to a bias of -1e9, their difference
    # is exact (then the tail, the part of the lse they would round away). At
    # most 0, as a weight is at most 1: another forward's lse, converted between
    # bases, can sit 128 below such logits, and exp would give inf (then NaN
    # even where the cotangent is 0).
    z = jnp.minimum((logits - lse_g[..., None]) - tail_g[..., None], 0.0)
    p = jnp.where(vis, jnp.exp(z), 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, do, precision=precision)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, chunk["v"].astype(jnp.float32),
                    precision=precision)
    ds = p * (dp - delta[..., None])
    if logits_soft_cap is not None:
      ds = ds * (1.0 - jnp.square(jnp.tanh(raw / logits_soft_cap)))
    dbias = None
    if chunk["bias"] is not None:
      dbias = ds.reshape(b, n, t, chunk_size)
    ds = ds * scale
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, chunk["k"].astype(jnp.float32),
                         precision=precision)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, qg.astype(jnp.float32), precision=precision)
    return dq, (dk, dv, dbias)

  dq0 = jnp.zeros((b, t, num_kv, g, h), jnp.float32) + _zero_from(
      q, k, v, bias, mask, out, lse, dout, query_seq_lengths, key_value_seq_lengths,
      q_segment_ids, kv_segment_ids, q_offset)
  dq, (dk, dv, dbias) = jax.lax.scan(step, dq0, (jnp.arange(num_chunks), chunks),
                                     unroll=unroll)

  def unsplit(x):  # [C, B, chunk, ...] -> [B, S, ...]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :s]

  dk, dv = unsplit(dk), unsplit(dv)
  if bias is not None:
    dbias = jnp.moveaxis(dbias, 0, 3).reshape(b, n, t, num_chunks * chunk_size)[..., :s]
    dbias = _reduce_to_shape(dbias, bias.shape)
  return dq.reshape(b, t, n, h), dk, dv, dbias


def _reduce_to_shape(x, shape):
  """Sums the broadcast dims of x down to `shape` (bias gradients)."""
  axes = tuple(i for i, (have, want) in enumerate(zip(x.shape, shape))
               if want == 1 and have != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def cudnn_window(is_causal, local_window):
  """``(is_causal, sliding_window_length)`` for jax.nn's cuDNN path, or a reason
  string when cuDNN cannot express this visibility.

  cuDNN knows one window shape: the causal mask narrowed to the last
  ``sliding_window_length`` keys. Given a window without ``is_causal``, jax.nn
  passes the length but no causal mask, and cuDNN then computes something else
  (relative L2 error ~0.9 measured on the H200 for ``(L, 0)``); so every window is
  rewritten here into causal form or refused. ``(L, 0)`` equals causal with the
  left window L, and a right window is void under causal.
  """
  left, right = local_window if local_window is not None else (None, None)
  if is_causal:
    right = 0 if right is None else min(right, 0)
  if right is None:
    if left is None:
      return False, None
    return ("cuDNN attention has no left-only window without is_causal (a window "
            f"(left, right) with right unbounded); got local_window={local_window}")
  if right != 0:
    return ("cuDNN attention takes a window only in causal form (right = 0, or "
            f"is_causal=True with right >= 0); got local_window={local_window}, "
            f"is_causal={is_causal}")
  if left is not None and left < 0:
    return f"cuDNN attention needs a left window >= 0; got local_window={local_window}"
  return True, None if left is None else left + 1


def cudnn_unsupported_reason(q, k, v, *, logits_soft_cap, q_segment_ids, platform,
                             bias=None, mask=None, is_causal=False,
                             local_window=None) -> str | None:
  """Why `jax.nn.dot_product_attention(implementation="cudnn")` can't run, or None."""
  if platform != "gpu":
    return f"cuDNN attention needs an NVIDIA GPU; this device is {platform}"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN attention takes bfloat16 or float16, not {jnp.dtype(q.dtype).name}"
  if logits_soft_cap is not None:
    return "cuDNN attention through jax.nn has no logits soft cap"
  if q_segment_ids is not None:
    return "cuDNN attention through jax.nn has no segment ids"
  if q.shape[-1] != v.shape[-1]:
    return "cuDNN attention through jax.nn needs equal query and value head dims"
  for name, x in (("bias", bias), ("mask", mask)):
    if x is not None and tuple(x.shape[-2:]) != (q.shape[1], k.shape[1]):
      return (f"cuDNN attention needs the {name} to span [T, S] = "
              f"{(q.shape[1], k.shape[1])} (no broadcasting there); got {tuple(x.shape)}")
  if q.shape[-1] > 256 or q.shape[-1] % 8:
    return f"cuDNN attention needs a head dim <= 256 and a multiple of 8, got {q.shape[-1]}"
  window = cudnn_window(is_causal, local_window)
  if isinstance(window, str):
    return window
  if window[1] is not None and q.shape[1] > k.shape[1]:
    # Measured on the H200: cuDNN's graph check fails at run time ("Sliding
    # window attention is only supported with max_s_q <= max_s_kv").
    return (f"cuDNN's sliding window needs T <= S; got T={q.shape[1]}, "
            f"S={k.shape[1]} with local_window={local_window}")
  return None


def cudnn_attention(q, k, v, bias=None, mask=None, *, scale, is_causal=False,
                    local_window=None, query_seq_lengths=None, key_value_seq_lengths=None):
  """Attention through cuDNN (`jax.nn.dot_product_attention`), rows with no
  visible key set to 0 (our contract). Call `cudnn_unsupported_reason` first."""
  window = cudnn_window(is_causal, local_window)
  if isinstance(window, str):
    raise NotImplementedError(window)
  cudnn_causal, sliding_window_length = window
  out = jax.nn.dot_product_attention(
      q, k, v, bias, mask, scale=scale, is_causal=cudnn_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      # jax.nn turns (L, 0) into cuDNN's sliding_window_length L + 1.
      local_window_size=(None if sliding_window_length is None
                         else (sliding_window_length - 1, 0)),
      implementation="cudnn")
  return zero_rows_without_keys(
      out, k.shape[1], is_causal=is_causal, local_window=local_window, mask=mask,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths).astype(q.dtype)


def zero_rows_without_keys(out, s, *, is_causal=False, local_window=None, mask=None,
                           query_seq_lengths=None, key_value_seq_lengths=None):
  """`out` ``[B, T, N, Hv]`` with the rows that see no key (of S) set to 0.

  Our contract zeroes them; cuDNN's output there is not ours to trust. Which rows
  those are follows from positions and lengths alone (O(T) work, and none at all
  when no row can be empty: the common causal and sliding-window calls), from the
  mask only with an O(T * S) pass.
  """
  t = out.shape[1]
  if mask is not None:
    vis = visibility(jnp.arange(t), jnp.arange(s), is_causal=is_causal,
                     local_window=local_window, mask=mask,
                     query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths)
    row_ok = jnp.moveaxis(jnp.any(vis, axis=-1), 1, 2)[..., None]  # [B|1, T, N|1, 1]
    return jnp.where(row_ok, out, 0)
  first, last = _visible_key_span(t, s, is_causal, local_window)
  if query_seq_lengths is None and key_value_seq_lengths is None and np.all(
      first <= last):
    return out
  row_ok = jnp.asarray(first <= last)[None, :]  # [1|B, T]
  if key_value_seq_lengths is not None:
    row_ok = row_ok & (jnp.asarray(first)[None, :] < key_value_seq_lengths[:, None])
  if query_seq_lengths is not None:
    row_ok = row_ok & (jnp.arange(t)[None, :] < query_seq_lengths[:, None])
  return jnp.where(row_ok[:, :, None, None], out, 0)


def _visible_key_span(t, s, is_causal, local_window):
  """Per query row (numpy int ``[T]``), the first and last key its position may
  see: the row sees none when first > last."""
  left, right = local_window if local_window is not None else (None, None)
  if is_causal:
    right = 0 if right is None else min(right, 0)
  rows = np.arange(t)
  first = np.zeros(t, np.int64) if left is None else np.maximum(rows - left, 0)
  last = np.full(t, s - 1) if right is None else np.minimum(rows + right, s - 1)
  return first, last
