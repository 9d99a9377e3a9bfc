"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

BACKEND = plugin.Backend(
    name="gpu_mosaic",
    api_version=1,  # a literal, see plugin.Backend
    implementations=plugin.implementations(
        # Above gpu-triton (100): where both run, the Mosaic GPU kernels are the
        # Hopper ones. Each op's check_supported refuses everything but Hopper GPUs.
        # Below cuDNN's attention (150): implementation=None prefers cuDNN where it
        # applies unless tuned data says otherwise.
        name="mosaic_gpu", platforms=("gpu",), priority=110,
        ops={
            "ragged_dot": ("tokamax_gpu_mosaic.ragged_dot:MosaicGpuRaggedDot",
                           "tokamax_gpu_mosaic.ragged_dot:MosaicGpuRaggedDotVjp"),
            "gated_linear_unit": (
                "tokamax_gpu_mosaic.gated_linear_unit:MosaicGpuGatedLinearUnit",
                "tokamax_gpu_mosaic.gated_linear_unit:MosaicGpuGatedLinearUnitVjp"),
            "dot_product_attention": (
                "tokamax_gpu_mosaic.attention:MosaicGpuAttention",
                "tokamax_gpu_mosaic.attention:MosaicGpuAttentionVjp"),
            "layer_norm": ("tokamax_gpu_mosaic.layer_norm:MosaicGpuLayerNorm",
                           "tokamax_gpu_mosaic.layer_norm:MosaicGpuLayerNormVjp"),
        }),
    # Measured with every GPU backend installed (tools/h200_retune.sh), so that
    # implementation=None picks between these kernels and the others by time.
    tuned_data="tokamax_gpu_mosaic.tuned",
)
