"""`jax.export` support: the custom-call targets tokamax kernels lower to.

`jax.export` refuses custom calls it does not know to be stable. Kernels lower to
these targets; listing them lets functions using tokamax ops be exported:

    exported = jax.export.export(jax.jit(f),
                                 disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(x)

An exported kernel embeds its compiled code (Triton, Mosaic) and runs only on the
same kind of device.
"""

from jax import export

CUSTOM_CALL_TARGETS = (
    # Pallas Triton kernels (gpu-triton): the names JAX 0.10 and 0.11 lower them to.
    "triton_kernel_call",
    "triton_kernel_call_ffi",
    "__gpu$xla.gpu.triton",
    # Pallas Mosaic GPU kernels (gpu-mosaic).
    "mosaic_gpu",
    "mosaic_gpu_v2",
    # Pallas Mosaic TPU kernels (tpu-mosaic).
    "tpu_custom_call",
    # cuDNN fused attention ("cudnn" implementation through jax.nn).
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
    "__cudnn$fmhaSoftmaxDropout",
    "__cudnn$fmhaSoftmaxDropoutBackward",
    "__cudnn$fmhaScaleBiasSoftmaxDropout",
    "__cudnn$fmhaScaleBiasSoftmaxDropoutBackward",
)

DISABLE_JAX_EXPORT_CHECKS = tuple(
    export.DisabledSafetyCheck.custom_call(target) for target in CUSTOM_CALL_TARGETS)
