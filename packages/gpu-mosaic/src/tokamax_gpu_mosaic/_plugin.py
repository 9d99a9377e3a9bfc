"""Registration of this backend's implementations (imports no kernel module)."""

from tokamax import plugin

# Above gpu-triton (100): where both run, the Mosaic GPU kernels are the Hopper
# ones. Each op's check_supported refuses everything but Hopper GPUs.
_PRIORITY = 110


def _impl(op: str, module: str, fwd: str, bwd: str) -> plugin.Implementation:
  return plugin.Implementation(
      op=op, name="mosaic_gpu", forward=f"tokamax_gpu_mosaic.{module}:{fwd}",
      backward=f"tokamax_gpu_mosaic.{module}:{bwd}", platforms=("gpu",),
      priority=_PRIORITY)


BACKEND = plugin.Backend(
    name="gpu_mosaic",
    # The plugin API this package was written against, as a literal: read from
    # tokamax.plugin it would always match, and a core that changed the API
    # could not refuse this release (pyproject.toml's tokamax-core range says
    # the same to pip).
    api_version=1,
    implementations=(
        _impl("ragged_dot", "ragged_dot", "MosaicGpuRaggedDot",
              "MosaicGpuRaggedDotVjp"),
        _impl("gated_linear_unit", "gated_linear_unit", "MosaicGpuGatedLinearUnit",
              "MosaicGpuGatedLinearUnitVjp"),
        # Below cuDNN's attention (150): implementation=None prefers cuDNN where
        # it applies unless tuned data says otherwise.
        _impl("dot_product_attention", "attention", "MosaicGpuAttention",
              "MosaicGpuAttentionVjp"),
    ),
    # Measured with every GPU backend installed (tools/h200_retune.sh), so that
    # implementation=None picks between these kernels and the others by time.
    tuned_data="tokamax_gpu_mosaic.tuned",
)
