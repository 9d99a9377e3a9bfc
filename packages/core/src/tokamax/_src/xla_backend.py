"""The built-in backend: the XLA reference implementations as `Op`s, and the GLU
as the plain program (``ops/gated_linear_unit/composed.py``: XLA's matmul, or
`tokamax.ragged_dot` for grouped calls).

The functions live in the tokamax-xla-reference distribution (which does not
depend on core); each op's folder adapts them to the `Op` interface
(``tokamax._src.ops.<op>.xla``), and this declaration registers them exactly as
a plugin would.
"""

from __future__ import annotations

from tokamax._src import plugin

_ALL_PLATFORMS = ("cpu", "gpu", "tpu")


def _impl(op, folder, name, fwd, bwd, priority, platforms=_ALL_PLATFORMS):
  """`op`'s implementation `name`, from ``tokamax._src.ops.<folder>.xla``."""
  module = f"tokamax._src.ops.{folder}.xla"
  return plugin.Implementation(op=op, name=name, forward=f"{module}:{fwd}",
                               backward=f"{module}:{bwd}", platforms=platforms,
                               priority=priority)


BACKEND = plugin.Backend(
    name="xla_reference",
    api_version=plugin.PLUGIN_API_VERSION,
    implementations=(
        _impl("dot_product_attention", "attention", "xla", "XlaAttention",
              "XlaAttentionVjp", 0),
        _impl("dot_product_attention", "attention", "xla_chunked",
              "XlaChunkedAttention", "XlaChunkedAttentionVjp", -10),
        # Above our kernels where it applies: the forward and backward checks trace
        # jax.nn's cuDNN path abstractly, so calls it rejects fall back.
        _impl("dot_product_attention", "attention", "cudnn", "CudnnAttention",
              "CudnnAttentionVjp", 150, platforms=("gpu",)),
        _impl("layer_norm", "layer_norm", "xla", "XlaLayerNorm", "XlaLayerNormVjp", 0),
        _impl("gated_linear_unit", "gated_linear_unit", "xla", "XlaGatedLinearUnit",
              "XlaGatedLinearUnitVjp", 0),
        # After the kernels, ahead of the reference: the plain program's speed
        # where no kernel takes the call (see the module).
        plugin.Implementation(
            op="gated_linear_unit", name="composed",
            forward="tokamax._src.ops.gated_linear_unit.composed:ComposedGatedLinearUnit",
            backward=("tokamax._src.ops.gated_linear_unit.composed:"
                      "ComposedGatedLinearUnitVjp"),
            platforms=_ALL_PLATFORMS, priority=10),
        _impl("ragged_dot", "ragged_dot", "xla", "XlaRaggedDot", "XlaRaggedDotVjp", 0),
    ),
)
