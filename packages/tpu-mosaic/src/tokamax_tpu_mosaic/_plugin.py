"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

BACKEND = plugin.Backend(
    name="tpu_mosaic",
    api_version=1,  # a literal, see plugin.Backend
    implementations=plugin.implementations(
        name="mosaic_tpu", platforms=("tpu",), priority=100,
        ops={
            "layer_norm": ("tokamax_tpu_mosaic.layer_norm:MosaicTpuLayerNorm",
                           "tokamax_tpu_mosaic.layer_norm:MosaicTpuLayerNormVjp"),
            "gated_linear_unit": (
                "tokamax_tpu_mosaic.gated_linear_unit:MosaicTpuGatedLinearUnit",
                "tokamax_tpu_mosaic.gated_linear_unit:MosaicTpuGatedLinearUnitVjp"),
            "ragged_dot": ("tokamax_tpu_mosaic.ragged_dot:MosaicTpuRaggedDot",
                           "tokamax_tpu_mosaic.ragged_dot:MosaicTpuRaggedDotVjp"),
            "dot_product_attention": ("tokamax_tpu_mosaic.attention:MosaicTpuAttention",
                                      "tokamax_tpu_mosaic.attention:MosaicTpuAttentionVjp"),
        }),
)
