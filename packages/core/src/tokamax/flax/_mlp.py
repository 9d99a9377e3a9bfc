"""`GatedMLP` (`SwiGLU`, `GeGLU`): a Flax NNX gated MLP by `tokamax.gated_linear_unit`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from tokamax._src import dispatch
from tokamax._src.ops.gated_linear_unit import gated_linear_unit
from tokamax.flax._norms import as_static

# nnx.Linear's default kernel initializer.
default_kernel_init = nnx.initializers.lecun_normal()

Initializer = Callable[..., jax.Array]


def matrices(init: Initializer, key: jax.Array, count: int, shape: tuple[int, int],
             dtype: Any) -> jax.Array:
  """``[count, *shape]``: `count` matrices from `init`, each drawn as nnx.Linear
  draws its kernel (its own key, fan-in and fan-out from its own ``[in, out]``).

  Stacking first and initializing the stack would not do: an initializer reads
  the fans from the trailing axes, so ``[K, 2, N]`` would get fan-in 2K.
  """
  return jax.vmap(lambda k: init(k, shape, dtype))(jax.random.split(key, count))


def promote(*arrays, dtype):
  """The arrays in `dtype`, or (None) their common dtype: Flax's `promote_dtype`."""
  dtype = jnp.result_type(*arrays) if dtype is None else jnp.dtype(dtype)
  return tuple(a.astype(dtype) for a in arrays)


class GatedMLP(nnx.Module):
  """``down(activation(x @ w_gate) * (x @ w_up))``, by `tokamax.gated_linear_unit`.

  Parameters:

  * ``gate_up``: ``[in_features, 2, hidden_features]``, the layout the op takes:
    ``gate_up[:, 0]`` is the gate kernel, ``gate_up[:, 1]`` the up kernel, each
    ``[in, out]`` as `flax.nnx.Linear` stores its kernel.
  * ``down``: an `nnx.Linear` ``(hidden_features -> out_features)`` without bias.

  No biases: the op adds none (Llama, Mistral and Gemma MLPs have none). A model
  with separate gate and up `nnx.Linear` layers loads with `load_linears`.

  Example:
    >>> mlp = tokamax.flax.SwiGLU(512, 1536, rngs=nnx.Rngs(0))
    >>> y = mlp(x)  # [..., 512] -> [..., 512]
  """

  def __init__(self, in_features: int, hidden_features: int, *,
               out_features: int | None = None,
               activation: Callable[[jax.Array], jax.Array] | None = jax.nn.silu,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               kernel_init: Initializer = default_kernel_init,
               implementation: dispatch.Implementation = None, rngs: nnx.Rngs):
    """Args:
      in_features: K, the input's last axis.
      hidden_features: N, the width of the gated hidden layer.
      out_features: the output's last axis (default: `in_features`).
      activation: applied to the gate (SwiGLU: silu; GeGLU: gelu; None: bilinear).
      dtype: the computation dtype (None: the common dtype of input and params).
      param_dtype: the parameters' dtype.
      precision: of the matmuls, as `jax.lax.dot_general` takes it.
      kernel_init: an initializer of one ``[in, out]`` kernel, as `nnx.Linear`'s
        (default: lecun normal); the gate, up and down kernels get one draw each.
      implementation: of `tokamax.gated_linear_unit` (None: dispatch chooses).
      rngs: the ``params`` stream initializes the kernels.
    """
    out_features = in_features if out_features is None else out_features
    for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                        ("out_features", out_features)):
      if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    gate_up = matrices(kernel_init, rngs.params(), 2, (in_features, hidden_features),
                       param_dtype)
    self.gate_up = nnx.Param(jnp.transpose(gate_up, (1, 0, 2)))  # [K, 2, N]
    self.down = nnx.Linear(hidden_features, out_features, use_bias=False, dtype=dtype,
                           param_dtype=param_dtype, precision=precision,
                           kernel_init=kernel_init, rngs=rngs)
    self.activation = activation
    self.dtype = dtype
    self.precision = precision
    self.implementation = as_static(implementation)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., in_features] -> [..., out_features]``."""
    x, w = promote(x, self.gate_up[...], dtype=self.dtype)
    hidden = gated_linear_unit(x, w, activation=self.activation, precision=self.precision,
                               implementation=self.implementation)
    return self.down(hidden)

  def load_linears(self, gate: nnx.Linear, up: nnx.Linear, down: nnx.Linear) -> None:
    """Copies the kernels of a Flax MLP's three `nnx.Linear` layers into this one.

    ``gate_up[:, 0] = gate.kernel``, ``gate_up[:, 1] = up.kernel``,
    ``down.kernel = down.kernel`` (as arrays: ``jnp.stack([w_gate, w_up], axis=1)``).
    The values are cast to this module's parameter dtype.

    Raises:
      ValueError: a layer has a bias (this module has none) or a kernel shape
        that is not this module's.
    """
    k, _, n = self.gate_up.shape
    expected = {"gate": (k, n), "up": (k, n), "down": self.down.kernel.shape}
    for name, layer in (("gate", gate), ("up", up), ("down", down)):
      if getattr(layer, "bias", None) is not None:
        raise ValueError(f"{name} has a bias; GatedMLP has none (the GLU op adds no "
                         "bias): only bias-free layers (use_bias=False) load")
      if layer.kernel.shape != expected[name]:
        raise ValueError(f"{name}.kernel must be {expected[name]} for this module; got "
                         f"{layer.kernel.shape}")
    self.gate_up[...] = jnp.stack([gate.kernel[...], up.kernel[...]], axis=1)
    self.down.kernel[...] = down.kernel[...]


class SwiGLU(GatedMLP):
  """`GatedMLP` with ``activation=jax.nn.silu`` (Llama, Mistral)."""

  def __init__(self, in_features: int, hidden_features: int, **kwargs):
    super().__init__(in_features, hidden_features, activation=jax.nn.silu, **kwargs)


class GeGLU(GatedMLP):
  """`GatedMLP` with ``activation=jax.nn.gelu`` (tanh approximation, as Gemma's)."""

  def __init__(self, in_features: int, hidden_features: int, **kwargs):
    super().__init__(in_features, hidden_features, activation=jax.nn.gelu, **kwargs)
