"""tokamax: custom accelerator kernels for JAX, one function per operation.

Example:
  >>> import jax, jax.numpy as jnp, tokamax
  >>> q = jax.random.normal(jax.random.key(0), (2, 256, 8, 64), jnp.bfloat16)
  >>> k = v = jax.random.normal(jax.random.key(1), (2, 256, 2, 64), jnp.bfloat16)
  >>> out = tokamax.dot_product_attention(q, k, v, is_causal=True)
"""

import importlib.metadata

from tokamax._src import plugin
from tokamax._src.autotuning import AutotuningResult
from tokamax._src.autotuning import autotune
from tokamax._src.benchmarking import BenchmarkData
from tokamax._src.benchmarking import benchmark
from tokamax._src.benchmarking import standardize_function
from tokamax._src.dispatch import DispatchRecord
from tokamax._src.dispatch import record_dispatch
from tokamax._src.export_checks import DISABLE_JAX_EXPORT_CHECKS
from tokamax._src.introspection import implementations
from tokamax._src.op import HIGHER_ORDER_AUTODIFF
from tokamax._src.op import SYMBOLIC_SHAPES
from tokamax._src.op import DeviceInfo
from tokamax._src.op import Op
from tokamax._src.op import VjpOp
from tokamax._src.ops.attention import AttentionArgs
from tokamax._src.ops.attention import dot_product_attention
from tokamax._src.ops.attention import ring_attention
from tokamax._src.ops.attention import zigzag_permutation
from tokamax._src.ops.gated_linear_unit import GatedLinearUnitArgs
from tokamax._src.ops.gated_linear_unit import gated_linear_unit
from tokamax._src.ops.layer_norm import LayerNormArgs
from tokamax._src.ops.layer_norm import layer_norm
from tokamax._src.ops.layer_norm import rms_norm
from tokamax._src.ops.ragged_dot import RaggedDotArgs
from tokamax._src.ops.ragged_dot import moe_all_to_all
from tokamax._src.ops.ragged_dot import ragged_dot
from tokamax._src.quantization import GradientQuantization
from tokamax._src.quantization import QuantizedArray
from tokamax._src.quantization import quantize
from tokamax._src.registry import BackendError
from tokamax._src.registry import BackendInfo
from tokamax._src.registry import ImplementationNotInstalledError
from tokamax._src.registry import PluginWarning
from tokamax._src.registry import backend_errors
from tokamax._src.registry import backends
from tokamax._src.settings import interpret
from tokamax._src.settings import interpret_mode
from tokamax._src.sharding import spmd_partitioning

# pyproject.toml holds the version (tools/release.py bumps it there only).
try:
  __version__ = importlib.metadata.version("tokamax-core")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
  __version__ = "unknown"

__all__ = [
    "AttentionArgs",
    "AutotuningResult",
    "DISABLE_JAX_EXPORT_CHECKS",
    "BackendError",
    "BackendInfo",
    "BenchmarkData",
    "DeviceInfo",
    "DispatchRecord",
    "HIGHER_ORDER_AUTODIFF",
    "GatedLinearUnitArgs",
    "GradientQuantization",
    "ImplementationNotInstalledError",
    "LayerNormArgs",
    "Op",
    "PluginWarning",
    "QuantizedArray",
    "RaggedDotArgs",
    "SYMBOLIC_SHAPES",
    "VjpOp",
    "autotune",
    "backend_errors",
    "backends",
    "benchmark",
    "dot_product_attention",
    "gated_linear_unit",
    "implementations",
    "interpret",
    "interpret_mode",
    "layer_norm",
    "moe_all_to_all",
    "plugin",
    "quantize",
    "ragged_dot",
    "record_dispatch",
    "ring_attention",
    "rms_norm",
    "spmd_partitioning",
    "standardize_function",
    "zigzag_permutation",
]
