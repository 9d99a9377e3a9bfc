"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

_PRIORITY = 100


def _impl(op: str, module: str, fwd: str, bwd: str) -> plugin.Implementation:
  return plugin.Implementation(
      op=op, name="mosaic_tpu", forward=f"tokamax_tpu_mosaic.{module}:{fwd}",
      backward=f"tokamax_tpu_mosaic.{module}:{bwd}", platforms=("tpu",),
      priority=_PRIORITY)


BACKEND = plugin.Backend(
    name="tpu_mosaic",
    api_version=plugin.PLUGIN_API_VERSION,
    implementations=(
        _impl("layer_norm", "layer_norm", "MosaicTpuLayerNorm",
              "MosaicTpuLayerNormVjp"),
        _impl("gated_linear_unit", "gated_linear_unit", "MosaicTpuGatedLinearUnit",
              "MosaicTpuGatedLinearUnitVjp"),
        _impl("ragged_dot", "ragged_dot", "MosaicTpuRaggedDot", "MosaicTpuRaggedDotVjp"),
        _impl("dot_product_attention", "attention", "MosaicTpuAttention",
              "MosaicTpuAttentionVjp"),
    ),
)
