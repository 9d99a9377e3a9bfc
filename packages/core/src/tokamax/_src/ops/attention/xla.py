"""Attention's XLA implementations as `Op`s: dense ("xla"), chunked with an
online softmax ("xla_chunked"), and cuDNN through `jax.nn` ("cudnn"). The
functions live in tokamax-xla-reference, which does not depend on core."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import tokamax_xla_reference as xla_ref

from tokamax._src.op import (HIGHER_ORDER_AUTODIFF, SYMBOLIC_SHAPES, Op, VjpOp,
                             opaque_residuals_allowed)
from tokamax._src.ops import _autodiff
from tokamax._src.ops.attention import large_logits


def _attention_kwargs(args):
  return dict(scale=args.scale, is_causal=args.is_causal,
              local_window=args.local_window, logits_soft_cap=args.logits_soft_cap,
              query_seq_lengths=args.query_seq_lengths,
              key_value_seq_lengths=args.key_value_seq_lengths,
              q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
              precision=args.precision, q_offset=args.q_offset)


def _attention_kwargs_with_sinks(args):
  return dict(_attention_kwargs(args), sinks=args.sinks)


@dataclasses.dataclass(frozen=True)
class XlaAttention(Op):
  """Dense attention in XLA: materializes the ``[B, N, T, S]`` logits."""

  op_name = "dot_product_attention"
  name = "xla"
  supported_features = ("q_offset", "sinks", SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def forward(self, args, config):
    out, lse = xla_ref.attention(args.query, args.key, args.value, args.bias, args.mask,
                                **_attention_kwargs_with_sinks(args))
    return out, {"lse": lse}


@dataclasses.dataclass(frozen=True)
class XlaAttentionVjp(VjpOp):
  op_name = "dot_product_attention"
  name = "xla"
  supported_features = ("q_offset", "sinks", SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)

  def backward(self, args, residuals, out, dout, config):
    def fn(a):
      return xla_ref.attention(a.query, a.key, a.value, a.bias, a.mask,
                              **_attention_kwargs_with_sinks(a))[0]
    return _autodiff.backward(fn, args, ("query", "key", "value", "bias", "sinks"),
                              dout)


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
  chunk_size: int = 512


def _chunk_heuristic(args) -> ChunkConfig:
  """Chunks of 512 keys, fewer when the keys are fewer (16 at the least)."""
  keys = args.key.shape[1]
  if not isinstance(keys, int):
    return ChunkConfig()  # unused: one chunk (`_chunk_size`)
  return ChunkConfig(chunk_size=min(512, max(16, keys)))


def _chunk_size(args, config: ChunkConfig):
  """The config's chunk, or at a symbolic key length (`jax.export`) one chunk of
  every key: the chunks split the keys at trace time, their count static. Memory
  is then O(T * S), as the dense implementation's; the backward still computes
  from a given log-sum-exp, which the dense one cannot."""
  keys = args.key.shape[1]
  return config.chunk_size if isinstance(keys, int) else keys


class _Chunked:
  """What the chunked forward and its backward share: the name, the features,
  what they refuse and the chunk-size heuristic (autotuning searches the
  forward's chunk only)."""

  op_name = "dot_product_attention"
  name = "xla_chunked"
  supported_features = ("q_offset", "sinks", SYMBOLIC_SHAPES, HIGHER_ORDER_AUTODIFF)
  config_cls = ChunkConfig

  def check_supported(self, args, device, residuals=None):
    del device  # any
    if residuals is not None and "lse" not in residuals:
      raise NotImplementedError("needs the forward's log-sum-exp residual")

  def heuristic_config(self, args):
    return _chunk_heuristic(args)


@dataclasses.dataclass(frozen=True)
class XlaChunkedAttention(_Chunked, Op):
  """Attention over key chunks with an online softmax: O(T * chunk) memory.

  `unroll`: run the loop over chunks unrolled (no while loop in the program; the
  large-logit check's exact branch asks for it, `large_logits`)."""

  unroll: bool = False

  def search_space(self, args):
    if not isinstance(args.key.shape[1], int):
      return (self.heuristic_config(args),)
    fitting = tuple(ChunkConfig(c) for c in (128, 256, 512, 1024) if c <= args.key.shape[1])
    return fitting or (self.heuristic_config(args),)

  def forward(self, args, config):
    out, lse, tail = xla_ref.attention_chunked(
        args.query, args.key, args.value, args.bias, args.mask,
        chunk_size=_chunk_size(args, config), lse_tail=True, unroll=self.unroll,
        **_attention_kwargs_with_sinks(args))
    return out, {"lse": lse, "lse_tail": tail}


@dataclasses.dataclass(frozen=True)
class XlaChunkedAttentionVjp(_Chunked, VjpOp):
  """The chunked backward: recomputes each chunk's scores from the forward's lse
  (and its tail, where the forward gave one). `unroll`: as the forward's."""

  unroll: bool = False

  def backward(self, args, residuals, out, dout, config):
    def chunked():
      dq, dk, dv, dbias = xla_ref.attention_chunked_backward(
          args.query, args.key, args.value, args.bias, args.mask, out,
          residuals["lse"], dout, chunk_size=_chunk_size(args, config),
          lse_tail=residuals.get("lse_tail"), unroll=self.unroll, **_attention_kwargs(args))
      return {"query": dq, "key": dk, "value": dv, "bias": dbias,
              "sinks": args.sinks_cotangent(residuals["lse"], out, dout,
                                            residuals.get("lse_tail"))}
    if "lse_tail" in residuals:
      return chunked()
    # Another forward's lse, without its rounding error: exact only where the
    # logits are not huge (`large_logits`).
    return large_logits.guard(args, dout, chunked, residuals["lse"])


_ATTENTION_GRAD_FIELDS = ("query", "key", "value", "bias")
_CUDNN_VJP = "cudnn_vjp"  # residual of the cuDNN forward: its jax.vjp function


def _cudnn_check(args, device, backward: bool = False):
  reason = xla_ref.cudnn_unsupported_reason(
      args.query, args.key, args.value, logits_soft_cap=args.logits_soft_cap,
      q_segment_ids=args.q_segment_ids, platform=device.platform, bias=args.bias,
      mask=args.mask, is_causal=args.is_causal, local_window=args.local_window)
  if reason is None and not device.is_nvidia_gpu:
    reason = "cuDNN attention needs an NVIDIA GPU"
  if reason is not None:
    raise NotImplementedError(reason)
  # jax.nn's cuDNN path has more shape rules (sequence lengths, windows...) than
  # we mirror; trace it abstractly so that any it refuses is a refusal here, and
  # dispatch can fall back instead of failing.
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  def probe(a):
    if not backward:
      return _cudnn_forward(a)
    dout = jnp.zeros(a.query.shape[:-1] + a.value.shape[-1:], a.query.dtype)
    return _autodiff.backward(_cudnn_forward, a, _ATTENTION_GRAD_FIELDS, dout)
  try:
    jax.eval_shape(probe, abstract)
  except (NotImplementedError, ValueError) as e:
    raise NotImplementedError(f"cuDNN refuses this call: {e}") from e


def _cudnn_forward(args):
  return xla_ref.cudnn_attention(
      args.query, args.key, args.value, args.bias, args.mask, scale=args.scale,
      is_causal=args.is_causal, local_window=args.local_window,
      query_seq_lengths=args.query_seq_lengths,
      key_value_seq_lengths=args.key_value_seq_lengths)


@dataclasses.dataclass(frozen=True)
class CudnnAttention(Op):
  """cuDNN flash attention through `jax.nn.dot_product_attention`."""

  op_name = "dot_product_attention"
  name = "cudnn"

  def check_supported(self, args, device):
    _cudnn_check(args, device)

  def forward(self, args, config):
    if not opaque_residuals_allowed():
      return _cudnn_forward(args), {}
    # jax.vjp's residuals (cuDNN's softmax statistics among them) let the
    # backward skip a second cuDNN forward.
    try:
      out, vjp = _autodiff.vjp(_cudnn_forward, args, _ATTENTION_GRAD_FIELDS)
    except (NotImplementedError, ValueError):
      # cuDNN's training path refuses calls its inference path takes (e.g. some
      # sequence lengths): another implementation's backward will run.
      return _cudnn_forward(args), {}
    return out, {_CUDNN_VJP: vjp}


@dataclasses.dataclass(frozen=True)
class CudnnAttentionVjp(VjpOp):
  """cuDNN's own backward: jax.vjp's, from the forward's residuals where it left
  them (else it reruns the cuDNN forward: a partitioned call, or another
  implementation's forward)."""

  op_name = "dot_product_attention"
  name = "cudnn"
  reruns_forward_without_own_residuals = True

  def check_supported(self, args, device, residuals=None):
    _cudnn_check(args, device, backward=True)

  def backward(self, args, residuals, out, dout, config):
    vjp = (residuals or {}).get(_CUDNN_VJP)

    def cudnn():
      if vjp is not None:
        grads = _autodiff.apply_vjp(vjp, out.dtype, dout)
      else:
        grads = _autodiff.backward(_cudnn_forward, args, _ATTENTION_GRAD_FIELDS, dout)
      return _zero_grads_past_lengths(args, grads)
    # cuDNN recomputes the weights from a float32 lse: wrong for rows a huge bias
    # masks whole (`large_logits`), which no check at trace time can see. Its
    # own lse, where the forward left it, makes the check free; else the check
    # reads the bias.
    lse = None if vjp is None else _cudnn_lse(vjp, args)
    return large_logits.guard(args, dout, cudnn, lse)


def _zero_grads_past_lengths(args, grads):
  """The gradients set to 0 where the sequence lengths leave a position out of
  the call: dq on query rows past the batch row's query length or in a batch row
  with no key (such rows output 0 whatever the query), dk and dv on key rows past
  its key length or in a batch row with no query, and the bias on every (query,
  key) pair of those (for a bias broadcast over an axis, only where every
  position it stands for is left out).

  cuDNN's backward can leave non-zero values there (H200, JAX 0.11.2, B1 T128
  S8192 H256 float16 with a key length of 0: dk off by up to 5.5 and dv by up
  to 512, max abs, dv right in two of three repeat runs; notes/MEASUREMENTS.md,
  session 72).
  """
  q_lengths, kv_lengths = args.query_seq_lengths, args.key_value_seq_lengths
  if q_lengths is None and kv_lengths is None:
    return grads
  q_seen = _positions_within(grads["query"].shape[:2], q_lengths)   # [B, T]
  kv_seen = _positions_within(grads["key"].shape[:2], kv_lengths)   # [B, S]
  q_live = q_seen & jnp.any(kv_seen, axis=1, keepdims=True)
  kv_live = kv_seen & jnp.any(q_seen, axis=1, keepdims=True)

  def keep(g, live):
    return jnp.where(live, g, 0).astype(g.dtype)
  out = dict(grads, query=keep(grads["query"], q_live[:, :, None, None]),
             key=keep(grads["key"], kv_live[:, :, None, None]),
             value=keep(grads["value"], kv_live[:, :, None, None]))
  bias = grads.get("bias")
  if bias is not None:
    pair_live = q_live[:, None, :, None] & kv_live[:, None, None, :]  # [B, 1, T, S]
    # A broadcast axis (size 1) holds the sum over the positions it stands for.
    broadcast = tuple(a for a in range(4) if bias.shape[a] == 1 and pair_live.shape[a] > 1)
    out["bias"] = keep(bias, jnp.any(pair_live, axis=broadcast, keepdims=True))
  return out


def _positions_within(shape: tuple[int, int], lengths) -> jax.Array:
  """``[B, L]`` bool: whether each position is below its batch row's length
  (all True where `lengths` is None)."""
  b, l = shape
  if lengths is None:
    return jnp.ones((b, l), bool)
  return jnp.arange(l)[None, :] < lengths[:, None]


def _cudnn_lse(vjp, args) -> jax.Array | None:
  """cuDNN's softmax statistics among the residuals of jax.nn's cuDNN vjp: the
  natural lse of each row's scaled, biased logits, float32 ``[B, N, T]`` (the
  only float32 residual of that shape: the others are the bf16/f16 operands,
  bias and output, lengths, placeholders; measured on the H200, JAX 0.11.2,
  equal to the reference's lse within 2e-6), with +inf on rows that see no key
  as our lse has it. None where no single residual has that shape and dtype
  (another JAX version may keep them otherwise): the caller then reads the bias."""
  b, t, n = args.query.shape[:3]
  stats = [x for x in jax.tree_util.tree_leaves(vjp)
           if getattr(x, "dtype", None) == jnp.float32 and x.shape == (b, n, t)]
  if len(stats) != 1:
    return None
  return large_logits.lse_with_empty_rows(args, stats[0])
