"""The built-in backend: the XLA reference implementations as `Op`s.

The functions live in the tokamax-xla-reference distribution (which does not
depend on core); this module adapts them to the `Op` interface and registers them
exactly as a plugin would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import op as op_lib
from tokamax._src import plugin
from tokamax._src.op import Op, VjpOp

_HERE = __name__
_ALL_PLATFORMS = ("cpu", "gpu", "tpu")


def _impl(op, name, fwd, bwd, priority, platforms=_ALL_PLATFORMS):
  return plugin.Implementation(op=op, name=name, forward=f"{_HERE}:{fwd}",
                               backward=f"{_HERE}:{bwd}", platforms=platforms,
                               priority=priority)


BACKEND = plugin.Backend(
    name="xla_reference",
    api_version=plugin.PLUGIN_API_VERSION,
    implementations=(
        _impl("dot_product_attention", "xla", "XlaAttention", "XlaAttentionVjp", 0),
        _impl("dot_product_attention", "xla_chunked", "XlaChunkedAttention",
              "XlaChunkedAttentionVjp", -10),
        # Above our kernels where it applies: the forward and backward checks trace
        # jax.nn's cuDNN path abstractly, so calls it rejects fall back.
        _impl("dot_product_attention", "cudnn", "CudnnAttention", "CudnnAttentionVjp",
              150, platforms=("gpu",)),
        _impl("layer_norm", "xla", "XlaLayerNorm", "XlaLayerNormVjp", 0),
        _impl("gated_linear_unit", "xla", "XlaGatedLinearUnit",
              "XlaGatedLinearUnitVjp", 0),
        _impl("ragged_dot", "xla", "XlaRaggedDot", "XlaRaggedDotVjp", 0),
    ),
)


def _ref():
  import tokamax_xla_reference  # pylint: disable=g-import-not-at-top
  return tokamax_xla_reference


def _attention_kwargs(args):
  return dict(scale=args.scale, is_causal=args.is_causal,
              local_window=args.local_window, logits_soft_cap=args.logits_soft_cap,
              query_seq_lengths=args.query_seq_lengths,
              key_value_seq_lengths=args.key_value_seq_lengths,
              q_segment_ids=args.q_segment_ids, kv_segment_ids=args.kv_segment_ids,
              precision=args.precision, q_offset=args.q_offset)


def _attention_kwargs_with_sinks(args):
  return dict(_attention_kwargs(args), sinks=args.sinks)


def _vjp(fn, args, diff_fields):
  """``(fn(args), vjp)`` with `vjp` mapping a cotangent to ``{field: grad}``."""
  primals = {f: getattr(args, f) for f in diff_fields if getattr(args, f) is not None}
  out, vjp = jax.vjp(lambda p: fn(dataclasses.replace(args, **p)), primals)
  return out, vjp


def _apply_vjp(vjp, out_dtype, dout):
  (grads,) = vjp(dout.astype(out_dtype))
  return grads


def _autodiff_backward(fn, args, diff_fields, dout):
  """Cotangents of `fn(args)` for `diff_fields` by JAX autodiff (recomputes fn)."""
  out, vjp = _vjp(fn, args, diff_fields)
  return _apply_vjp(vjp, out.dtype, dout)


@dataclasses.dataclass(frozen=True)
class XlaAttention(Op):
  """Dense attention in XLA: materializes the ``[B, N, T, S]`` logits."""

  op_name = "dot_product_attention"
  name = "xla"
  supported_features = ("q_offset", "sinks")

  def forward(self, args, config):
    out, lse = _ref().attention(args.query, args.key, args.value, args.bias, args.mask,
                                **_attention_kwargs_with_sinks(args))
    return out, {"lse": lse}


@dataclasses.dataclass(frozen=True)
class XlaAttentionVjp(VjpOp):
  op_name = "dot_product_attention"
  name = "xla"
  supported_features = ("q_offset", "sinks")

  def backward(self, args, residuals, out, dout, config):
    def fn(a):
      return _ref().attention(a.query, a.key, a.value, a.bias, a.mask,
                              **_attention_kwargs_with_sinks(a))[0]
    return _autodiff_backward(fn, args, ("query", "key", "value", "bias", "sinks"),
                              dout)


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
  chunk_size: int = 512


@dataclasses.dataclass(frozen=True)
class XlaChunkedAttention(Op):
  """Attention over key chunks with an online softmax: O(T * chunk) memory."""

  op_name = "dot_product_attention"
  name = "xla_chunked"
  supported_features = ("q_offset", "sinks")
  config_cls = ChunkConfig

  def heuristic_config(self, args):
    return ChunkConfig(chunk_size=min(512, max(16, args.key.shape[1])))

  def search_space(self, args):
    fitting = tuple(ChunkConfig(c) for c in (128, 256, 512, 1024) if c <= args.key.shape[1])
    return fitting or (self.heuristic_config(args),)

  def forward(self, args, config):
    out, lse = _ref().attention_chunked(
        args.query, args.key, args.value, args.bias, args.mask,
        chunk_size=config.chunk_size, **_attention_kwargs_with_sinks(args))
    return out, {"lse": lse}


@dataclasses.dataclass(frozen=True)
class XlaChunkedAttentionVjp(VjpOp):
  op_name = "dot_product_attention"
  name = "xla_chunked"
  supported_features = ("q_offset", "sinks")
  config_cls = ChunkConfig

  def heuristic_config(self, args):
    return ChunkConfig(chunk_size=min(512, max(16, args.key.shape[1])))

  def check_supported(self, args, device, residuals=None):
    if residuals is not None and "lse" not in residuals:
      raise NotImplementedError("needs the forward's log-sum-exp residual")

  def backward(self, args, residuals, out, dout, config):
    dq, dk, dv, dbias = _ref().attention_chunked_backward(
        args.query, args.key, args.value, args.bias, args.mask, out,
        residuals["lse"], dout, chunk_size=config.chunk_size, **_attention_kwargs(args))
    return {"query": dq, "key": dk, "value": dv, "bias": dbias,
            "sinks": args.sinks_cotangent(residuals["lse"], out, dout)}


_ATTENTION_GRAD_FIELDS = ("query", "key", "value", "bias")
_CUDNN_VJP = "cudnn_vjp"  # residual of the cuDNN forward: its jax.vjp function


def _cudnn_check(args, device, backward: bool = False):
  reason = _ref().cudnn_unsupported_reason(
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
    return _autodiff_backward(_cudnn_forward, a, _ATTENTION_GRAD_FIELDS, dout)
  try:
    jax.eval_shape(probe, abstract)
  except (NotImplementedError, ValueError) as e:
    raise NotImplementedError(f"cuDNN refuses this call: {e}") from e


def _cudnn_forward(args):
  return _ref().cudnn_attention(
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
    if not op_lib.opaque_residuals_allowed():
      return _cudnn_forward(args), {}
    # jax.vjp's residuals (cuDNN's softmax statistics among them) let the
    # backward skip a second cuDNN forward.
    try:
      out, vjp = _vjp(_cudnn_forward, args, _ATTENTION_GRAD_FIELDS)
    except (NotImplementedError, ValueError):
      # cuDNN's training path refuses calls its inference path takes (e.g. some
      # sequence lengths): another implementation's backward will run.
      return _cudnn_forward(args), {}
    return out, {_CUDNN_VJP: vjp}


@dataclasses.dataclass(frozen=True)
class CudnnAttentionVjp(VjpOp):
  """cuDNN's own backward: jax.vjp's, from the forward's residuals where it left
  them (else it reruns the cuDNN forward: a partitioned call)."""

  op_name = "dot_product_attention"
  name = "cudnn"

  def check_supported(self, args, device, residuals=None):
    _cudnn_check(args, device, backward=True)

  def backward(self, args, residuals, out, dout, config):
    vjp = (residuals or {}).get(_CUDNN_VJP)
    if vjp is not None:
      return _apply_vjp(vjp, out.dtype, dout)
    return _autodiff_backward(_cudnn_forward, args, _ATTENTION_GRAD_FIELDS, dout)


def _layer_norm(args):
  return _ref().layer_norm(args.x, args.scale, args.offset, epsilon=args.epsilon,
                           subtract_mean=args.subtract_mean)


@dataclasses.dataclass(frozen=True)
class XlaLayerNorm(Op):
  op_name = "layer_norm"
  name = "xla"

  def forward(self, args, config):
    y, mean, rstd = _layer_norm(args)
    return y, {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class XlaLayerNormVjp(VjpOp):
  op_name = "layer_norm"
  name = "xla"

  def backward(self, args, residuals, out, dout, config):
    return _autodiff_backward(lambda a: _layer_norm(a)[0], args,
                              ("x", "scale", "offset"), dout)


def _glu(args):
  return _ref().gated_linear_unit(args.x, args.weights, activation=args.activation,
                                  precision=args.precision)


@dataclasses.dataclass(frozen=True)
class XlaGatedLinearUnit(Op):
  op_name = "gated_linear_unit"
  name = "xla"

  def forward(self, args, config):
    return _glu(args), {}


@dataclasses.dataclass(frozen=True)
class XlaGatedLinearUnitVjp(VjpOp):
  """The oracle's backward: JAX autodiff of the reference (it recomputes the
  projections, and ignores a kernel forward's `projections` residual), so that
  the kernels' backwards, which use that residual, are checked against code
  they do not share."""

  op_name = "gated_linear_unit"
  name = "xla"

  def backward(self, args, residuals, out, dout, config):
    return _autodiff_backward(_glu, args, ("x", "weights"), dout)


def _ragged_dot(args):
  return _ref().ragged_dot(args.lhs, args.rhs, args.group_sizes,
                           group_offset=args.group_offset,
                           preferred_element_type=args.preferred_element_type,
                           precision=args.precision)


@dataclasses.dataclass(frozen=True)
class XlaRaggedDot(Op):
  op_name = "ragged_dot"
  name = "xla"

  def forward(self, args, config):
    return _ragged_dot(args), {}


@dataclasses.dataclass(frozen=True)
class XlaRaggedDotVjp(VjpOp):
  op_name = "ragged_dot"
  name = "xla"

  def backward(self, args, residuals, out, dout, config):
    return _autodiff_backward(_ragged_dot, args, ("lhs", "rhs"), dout)
