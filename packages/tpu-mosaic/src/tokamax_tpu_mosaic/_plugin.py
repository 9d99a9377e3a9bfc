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
    # The plugin API this package was written against, as a literal: read from
    # tokamax.plugin it would always match, and a core that changed the API
    # could not refuse this release (pyproject.toml's tokamax-core range says
    # the same to pip).
    api_version=1,
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
