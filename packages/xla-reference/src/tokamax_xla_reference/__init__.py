"""XLA reference implementations of the tokamax ops.

Plain `jax.numpy` / `jax.lax` code with float32 accumulation: the numerical
oracle every kernel is checked against, and the fallback that always runs. This
package has no dependency on tokamax-core; core loads it and registers these
functions as the "xla", "xla_chunked" and "cudnn" implementations.
"""

import importlib.metadata

from tokamax_xla_reference.attention import attention
from tokamax_xla_reference.attention import attention_chunked
from tokamax_xla_reference.attention import attention_chunked_backward
from tokamax_xla_reference.attention import cudnn_attention
from tokamax_xla_reference.attention import cudnn_unsupported_reason
from tokamax_xla_reference.attention import cudnn_window
from tokamax_xla_reference.attention import visibility
from tokamax_xla_reference.attention import zero_rows_without_keys
from tokamax_xla_reference.gated_linear_unit import gated_linear_unit
from tokamax_xla_reference.layer_norm import layer_norm
from tokamax_xla_reference.ragged_dot import dequantize
from tokamax_xla_reference.ragged_dot import per_element
from tokamax_xla_reference.ragged_dot import ragged_dot

# pyproject.toml holds the version (tools/release.py bumps it there only).
try:
  __version__ = importlib.metadata.version("tokamax-xla-reference")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
  __version__ = "unknown"

__all__ = [
    "attention",
    "attention_chunked",
    "attention_chunked_backward",
    "cudnn_attention",
    "cudnn_unsupported_reason",
    "cudnn_window",
    "dequantize",
    "gated_linear_unit",
    "layer_norm",
    "per_element",
    "ragged_dot",
    "visibility",
    "zero_rows_without_keys",
]
