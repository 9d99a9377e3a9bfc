"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

BACKEND = plugin.Backend(
    name="gpu_triton",
    api_version=1,  # a literal, see plugin.Backend
    implementations=plugin.implementations(
        name="triton", platforms=("gpu",), priority=100,
        ops={
            "layer_norm": ("tokamax_gpu_triton.layer_norm:TritonLayerNorm",
                           "tokamax_gpu_triton.layer_norm:TritonLayerNormVjp"),
            "gated_linear_unit": (
                "tokamax_gpu_triton.gated_linear_unit:TritonGatedLinearUnit",
                "tokamax_gpu_triton.gated_linear_unit:TritonGatedLinearUnitVjp"),
            "ragged_dot": ("tokamax_gpu_triton.ragged_dot:TritonRaggedDot",
                           "tokamax_gpu_triton.ragged_dot:TritonRaggedDotVjp"),
            "dot_product_attention": ("tokamax_gpu_triton.attention:TritonAttention",
                                      "tokamax_gpu_triton.attention:TritonAttentionVjp"),
        }),
    tuned_data="tokamax_gpu_triton.tuned",
)
