"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

_PRIORITY = 100


def _impl(op: str, module: str, fwd: str, bwd: str) -> plugin.Implementation:
  return plugin.Implementation(
      op=op, name="triton", forward=f"tokamax_gpu_triton.{module}:{fwd}",
      backward=f"tokamax_gpu_triton.{module}:{bwd}", platforms=("gpu",),
      priority=_PRIORITY)


BACKEND = plugin.Backend(
    name="gpu_triton",
    # The plugin API this package was written against, as a literal: read from
    # tokamax.plugin it would always match, and a core that changed the API
    # could not refuse this release (pyproject.toml's tokamax-core range says
    # the same to pip).
    api_version=1,
    implementations=(
        _impl("layer_norm", "layer_norm", "TritonLayerNorm", "TritonLayerNormVjp"),
        _impl("gated_linear_unit", "gated_linear_unit", "TritonGatedLinearUnit",
              "TritonGatedLinearUnitVjp"),
        _impl("ragged_dot", "ragged_dot", "TritonRaggedDot", "TritonRaggedDotVjp"),
        _impl("dot_product_attention", "attention", "TritonAttention",
              "TritonAttentionVjp"),
    ),
    tuned_data="tokamax_gpu_triton.tuned",
)
