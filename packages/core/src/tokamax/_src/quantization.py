"""Quantized operands: values with block scales, and the adapters for Qwix's.

A quantized operand is ``values * scales``, each scale covering one tile of the
values (``tile[i] = values.shape[i] // scales.shape[i]``; the convention of Qwix's
``QArray``). tokamax takes three forms of it, as they come:

- `QuantizedArray` (ours): float8_e4m3fn, float8_e5m2 or int8 values, float32
  scales, and the dtype the operand stands for (``dtype``, e.g. bfloat16);
- a Qwix ``QArray`` (duck-typed: ``qvalue``, ``scale``, ``zero_point``, ``qtype``;
  core does not import Qwix), or a Qwix PTQ ``WithAux`` holding one (``.array``).

`split` turns an operand into (values, scales or None, the dtype it stands for,
its source or None). A Qwix scheme no kernel takes (zero points, int4 or other
values than float8 and int8, a logical qtype other than the stored dtype) is
dequantized there (a code JAX has no dtype for, such as nf4, by Qwix itself),
and the call runs as one on plain arrays: the "dequantize, then XLA" fallback.

Gradients: a float8 array cannot carry a gradient (its cotangent would be
rounded to float8: gradients of typical magnitudes vanish). An op on quantized
operands is differentiable as a straight-through estimator instead: the gradient
with respect to a `QuantizedArray`'s ``source`` (the array `quantize` was given)
is the gradient with respect to the array the operand stands for; values and
scales get none (`zero_cotangents`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Any

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import tokamax_xla_reference as xla_ref

from tokamax._src.ops import _checks

VALUE_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """``values * scales`` (block scales), standing for an array of ``dtype``.

  Attributes:
    values: float8_e4m3fn, float8_e5m2 or int8; stored with axis `minor_axis`
      of the array moved last, where one is given.
    scales: float32, the rank of the array; each dim divides the array's (one
      scale per tile: 1x128 per row for activations and 128x128 for weights is
      DeepSeek-V3's fp8 recipe). Always in the array's own axis order.
    dtype: the dtype the operand stands for (and the default output dtype of an
      op it enters).
    source: the array it was quantized from (`quantize` keeps it unless
      ``keep_source=False``), or None. Only gradients use it: they flow to it as
      if the operand were that array (straight-through); with None the operand
      gets no gradient (frozen quantized weights).
    minor_axis: None (`values` in the array's axis order), or the axis of the
      array that `values` holds last (contiguous): ``values`` is
      ``jnp.moveaxis(array, minor_axis, -1)``. Hopper's fp8 matmul reads both
      operands contraction-minor, so ragged_dot weights ``[G, K, N]`` stored
      with ``minor_axis=1`` (``[G, N, K]``, DeepGEMM's layout) reach the kernel
      without a transpose per call; with ``minor_axis=None`` the kernel's
      wrapper transposes them on every call.

  Example:
    >>> w = jax.random.normal(jax.random.key(0), (8, 256, 512), jnp.bfloat16)
    >>> wq = tokamax.quantize(w, tile_shape=(1, 128, 128))
    >>> wq.values.dtype, wq.scales.shape
    (dtype(float8_e4m3fn), (8, 2, 4))
    >>> tokamax.quantize(w, tile_shape=(1, 128, 128), minor_axis=1).values.shape
    (8, 512, 256)
  """

  values: jax.Array
  scales: jax.Array
  dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))
  minor_axis: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  source: jax.Array | None = None

  def without_source(self) -> QuantizedArray:
    """The same operand without its source (to store quantized weights alone)."""
    return dataclasses.replace(self, source=None)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the array it stands for."""
    shape = tuple(self.values.shape)
    if self.minor_axis is None:
      return shape
    axis = self.minor_axis % len(shape)
    return shape[:axis] + shape[-1:] + shape[axis:-1]

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def tile_shape(self) -> tuple[int, ...]:
    return tuple(v // s for v, s in zip(self.shape, self.scales.shape))

  def array_values(self) -> jax.Array:
    """`values` in the array's own axis order. Where `minor_axis` is set this is
    a transpose, which XLA cancels against a kernel's transpose back to the
    stored order (the fp8 ragged_dot's), so the kernel reads `values` as stored."""
    if self.minor_axis is None:
      return self.values
    return jnp.moveaxis(self.values, -1, self.minor_axis)

  def dequantize(self) -> jax.Array:
    """The array it stands for, in `dtype`."""
    return xla_ref.dequantize(self.array_values(), self.scales).astype(self.dtype)


def _static_fields_to_bytes(static: tuple) -> bytes:
  dtype, minor_axis = static
  return json.dumps([jnp.dtype(dtype).name,
                     None if minor_axis is None else int(minor_axis)]).encode()


def _static_fields_from_bytes(data: bytes) -> tuple:
  dtype, minor_axis = json.loads(data)
  return jnp.dtype(dtype), minor_axis


# So that `jax.export` serializes a function taking or returning quantized
# operands: the pytree's static fields (`dtype`, `minor_axis`) as JSON.
export.register_pytree_node_serialization(
    QuantizedArray, serialized_name="tokamax.QuantizedArray",
    serialize_auxdata=_static_fields_to_bytes,
    deserialize_auxdata=_static_fields_from_bytes)


@dataclasses.dataclass(frozen=True)
class GradientQuantization:
  """Opt-in: a backward matmul on quantized operands, as fp8 training runs it.

  `tokamax.ragged_dot(..., quantized_lhs_gradient=GradientQuantization())`
  computes the gradient with respect to lhs as the quantized ragged_dot of the
  output's cotangent, quantized per `tile_shape` to `dtype`, and rhs's own
  quantized values and scales, transposed (DeepSeek-V3's fp8 recipe: 1x128 tiles
  of the cotangent, the weights' 128x128 blocks). This changes the numbers (the
  cotangent is rounded to `dtype`); the XLA reference defines them: the product
  of the two dequantized operands. Without it the gradient is straight-through:
  the plain matmul of the cotangent and the dequantized rhs.

  Attributes:
    tile_shape: the tile of the ``[M, N]`` cotangent each scale covers.
    dtype: float8_e4m3fn, float8_e5m2 or int8.
  """

  tile_shape: tuple[int, int] = (1, 128)
  dtype: Any = jnp.float8_e4m3fn

  def check(self, name: str, shape: tuple[int, int]) -> None:
    """ValueError / TypeError naming `name` if this cannot quantize a cotangent
    of `shape`."""
    if jnp.dtype(self.dtype) not in [jnp.dtype(d) for d in VALUE_DTYPES]:
      raise TypeError(f"{name}.dtype must be float8_e4m3fn, float8_e5m2 or int8; "
                      f"got {jnp.dtype(self.dtype).name}")
    tile = tuple(self.tile_shape)
    if len(tile) != 2 or any(
        not isinstance(t, int) or t < 1 or size % t for size, t in zip(shape, tile)):
      raise ValueError(f"{name}.tile_shape must be two ints dividing the "
                       f"cotangent's shape {tuple(shape)} ([M, N]); got "
                       f"{self.tile_shape!r}")


def quantize(x: jax.Array, tile_shape: tuple[int, ...],
             dtype: Any = jnp.float8_e4m3fn, minor_axis: int | None = None,
             keep_source: bool = True) -> QuantizedArray:
  """`x` as a `QuantizedArray`: one scale per tile, ``max|tile| / max(dtype)``
  (absmax), values rounded to `dtype`.

  Args:
    x: a float array.
    tile_shape: the tile each scale covers, one entry per dim of `x`, each
      dividing it (e.g. ``(1, 128)`` for activations, ``(1, 128, 128)`` for a
      ``[G, K, N]`` weight).
    dtype: float8_e4m3fn, float8_e5m2 or int8.
    minor_axis: None, or the axis of `x` to store last in the values
      (`QuantizedArray.minor_axis`): 1 for ``[G, K, N]`` weights of the fp8
      ragged_dot, which then reads them without a transpose.
    keep_source: record `x` as the result's ``source``, so that gradients reach
      it (straight-through, as fp8 training takes them). Inside a jitted step
      this costs nothing; pass False (or use `QuantizedArray.without_source`)
      for quantized weights that are stored and not trained.
  """
  x = _checks.as_array("x", x)
  _checks.check_float("x", x)
  given = dtype
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in [jnp.dtype(d) for d in VALUE_DTYPES]:
    raise TypeError(f"dtype must be float8_e4m3fn, float8_e5m2 or int8; got {given!r}")
  if minor_axis is not None:
    minor_axis = _check_minor_axis(minor_axis, x.ndim)
  tile_shape = _tile_shape(tile_shape, x.shape)
  if not isinstance(keep_source, (bool, np.bool_)):
    raise TypeError(f"keep_source must be a bool; got {keep_source!r}")
  counts = tuple(size // t for size, t in zip(x.shape, tile_shape))
  # [c0, t0, c1, t1, ...]: each tile's absmax over its t axes, and the scaling
  # by a broadcast of it (one reduction and one elementwise pass for XLA).
  # Values and scales carry no gradient (a float8 cotangent would be rounded):
  # gradients reach `x` as the source, by the ops that take the result.
  tiled = jax.lax.stop_gradient(x).astype(jnp.float32).reshape(
      [d for c, t in zip(counts, tile_shape) for d in (c, t)])
  absmax = jnp.max(jnp.abs(tiled), axis=tuple(range(1, 2 * x.ndim, 2)), keepdims=True)
  largest = float(jnp.finfo(dtype).max if jnp.issubdtype(dtype, jnp.floating)
                  else jnp.iinfo(dtype).max)
  tile_scales = jnp.where(absmax > 0, absmax / largest, 1.0).astype(jnp.float32)
  scaled = (tiled / tile_scales).reshape(x.shape)
  scales = tile_scales.reshape(counts)
  if jnp.issubdtype(dtype, jnp.integer):
    scaled = jnp.round(scaled)
  values = scaled.astype(dtype)
  if minor_axis is not None:
    values = jnp.moveaxis(values, minor_axis, -1)
  return QuantizedArray(values, scales, jnp.dtype(x.dtype), minor_axis,
                        x if keep_source else None)


def _tile_shape(tile_shape: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
  """`tile_shape` as a tuple of ints, one per dim of `shape`, each dividing it
  (ValueError naming it otherwise)."""
  allowed = (f"a tuple of {len(shape)} ints, one per dim of x, each dividing it "
             f"(x has shape {tuple(shape)})")
  try:
    tiles = tuple(tile_shape)
  except TypeError:
    raise ValueError(f"tile_shape must be {allowed}; got {tile_shape!r}") from None
  if len(tiles) != len(shape) or any(
      isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
      or t < 1 or size % t for size, t in zip(shape, tiles)):
    raise ValueError(f"tile_shape must be {allowed}; got {tile_shape!r}")
  return tuple(int(t) for t in tiles)


def _check_minor_axis(minor_axis: Any, ndim: int, name: str = "minor_axis") -> int:
  """`minor_axis` as a non-negative axis of a rank-`ndim` array (ValueError
  naming `name` if it is not one)."""
  if (isinstance(minor_axis, (bool, np.bool_))
      or not isinstance(minor_axis, (int, np.integer))
      or not -ndim <= minor_axis < ndim):
    raise ValueError(f"{name} must be None or an axis of the {ndim}-d array "
                     f"(an int in [{-ndim}, {ndim})); got {minor_axis!r}")
  return int(minor_axis) % ndim


def _unwrap(x: Any) -> Any:
  """A Qwix PTQ ``WithAux`` -> the ``QArray`` it holds."""
  inner = getattr(x, "array", None)
  return inner if inner is not None and hasattr(inner, "qvalue") else x


def _is_qwix_array(x: Any) -> bool:
  """A Qwix ``QArray`` (duck-typed: module docstring)."""
  return hasattr(x, "qvalue") and hasattr(x, "scale")


def _qwix_qtype(x: Any) -> np.dtype | None:
  """A Qwix ``QArray``'s logical type as a dtype (its stored one where it names
  none); None for a type JAX has no dtype for (e.g. "nf4", a 4-bit code)."""
  qtype = getattr(x, "qtype", None)
  try:
    return jnp.dtype(x.qvalue.dtype if qtype is None else qtype)
  except TypeError:
    return None


def qwix_kernel_scheme(x: Any) -> bool:
  """Whether Qwix's `x` is values times scales as tokamax's kernels take them:
  no zero point, values stored as their logical type (not e.g. int4 or nf4 in
  a wider one), of a `VALUE_DTYPES` type. Else `split` dequantizes it."""
  values = jnp.dtype(x.qvalue.dtype)
  return (getattr(x, "zero_point", None) is None and _qwix_qtype(x) == values
          and values in [jnp.dtype(d) for d in VALUE_DTYPES])


def _dequantize_qwix(name: str, x: Any) -> jax.Array:
  """The array Qwix's `x` stands for, in float32 (at most; its scales' dtype
  for a logical type): the values as numbers, less the zero point, times the
  scales; a logical type without a dtype (nf4's code) decoded by Qwix itself,
  which made the array and so is loaded."""
  if _qwix_qtype(x) is None:
    qwix = sys.modules.get("qwix")
    if qwix is None:
      raise NotImplementedError(
          f"{name}: quantized values of logical type {x.qtype!r} are decoded by "
          "Qwix, which is not imported")
    return qwix.dequantize(x)
  shifted = x.qvalue.astype(jnp.float32)
  if getattr(x, "zero_point", None) is not None:
    shifted = shifted - xla_ref.per_element(x.zero_point, x.qvalue.shape)
  return xla_ref.dequantize(shifted, x.scale)


def is_quantized(x: Any) -> bool:
  """Whether `x` is a quantized operand: a `QuantizedArray`, a Qwix ``QArray``
  or a PTQ ``WithAux`` holding one."""
  x = _unwrap(x)
  return isinstance(x, QuantizedArray) or _is_qwix_array(x)


def stands_for(x: Any) -> tuple[tuple[int, ...], Any]:
  """(shape, dtype) of the array operand `x` stands for (a plain array's own),
  read without dequantizing (as `split` does Qwix's zero-point schemes)."""
  x = _unwrap(x)
  if isinstance(x, QuantizedArray):
    return tuple(x.shape), jnp.dtype(x.dtype)
  if _is_qwix_array(x):
    return tuple(x.qvalue.shape), jnp.dtype(x.scale.dtype)
  return tuple(x.shape), jnp.dtype(x.dtype)


def split(name: str, x: Any) -> tuple[Any, jax.Array | None, Any, jax.Array | None]:
  """``(values, scales, dtype, source)`` of operand `x`; ``scales`` None for a
  plain array (``dtype`` then its own) or for a scheme dequantized here (module
  docstring); ``source`` that of a `QuantizedArray`, else None."""
  x = _unwrap(x)
  source = None
  if isinstance(x, QuantizedArray):
    if x.minor_axis is not None:
      _check_minor_axis(x.minor_axis, x.values.ndim, f"{name}: minor_axis")
    values, scales, dtype = x.array_values(), x.scales, jnp.dtype(x.dtype)
    source = x.source
    if source is not None and tuple(source.shape) != tuple(values.shape):
      raise ValueError(f"{name}: source must have the shape of the array the "
                       f"operand stands for, {tuple(values.shape)}; got "
                       f"{tuple(source.shape)}")
  elif _is_qwix_array(x):
    values, scales, dtype = x.qvalue, x.scale, jnp.dtype(x.scale.dtype)
    if not qwix_kernel_scheme(x):
      return _dequantize_qwix(name, x).astype(dtype), None, dtype, None
  else:
    return x, None, getattr(x, "dtype", None), None
  values_dtype = jnp.dtype(values.dtype)
  if values_dtype not in [jnp.dtype(d) for d in VALUE_DTYPES]:
    raise TypeError(f"{name}: quantized values must be float8_e4m3fn, float8_e5m2 "
                    f"or int8; got {values_dtype.name}")
  # An empty axis has no tiles: no scales along it (`quantize`'s) or any count
  # that divides it.
  if scales.ndim != values.ndim or any(
      (s < 1 or v % s) and not v == s == 0 for v, s in zip(values.shape, scales.shape)):
    raise ValueError(f"{name}: scales must have the values' rank, each dim dividing "
                     f"the values' (one scale per tile); got scales "
                     f"{tuple(scales.shape)} for values {tuple(values.shape)}")
  if not jnp.issubdtype(scales.dtype, jnp.floating):
    raise TypeError(f"{name}: scales must be a float array; got "
                    f"{jnp.dtype(scales.dtype).name}")
  if dtype not in [jnp.dtype(d) for d in _checks.FLOAT_DTYPES]:
    what = "its scales' dtype" if _is_qwix_array(x) else "its `dtype`"
    raise TypeError(f"{name}: a quantized operand must stand for float32, bfloat16 "
                    f"or float16 ({what}); got {dtype.name}")
  if not values.size:
    # Nothing to scale: the empty array it stands for (its gradient is empty too).
    return jnp.zeros(values.shape, dtype), None, dtype, None
  return values, scales.astype(jnp.float32), dtype, source


def dequantized(name: str, x: Any) -> Any:
  """Operand `x` of an op without quantized kernels (the "dequantize, then run"
  fallback): a quantized operand as the array it stands for, whose gradient goes
  straight through to its source (none without one); any other as it is."""
  values, scales, dtype, source = split(name, x)
  if scales is None:
    return values
  array = jax.lax.stop_gradient(xla_ref.dequantize(values, scales).astype(dtype))
  if source is None:
    return array
  return _straight_through(jnp.dtype(source.dtype), array, source)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through(source_dtype, array, source):
  """`array`, with the gradient going to `source` instead (straight-through)."""
  del source_dtype, source
  return array


def _straight_through_fwd(source_dtype, array, source):
  del source_dtype, source
  return array, None


def _straight_through_bwd(source_dtype, _, cotangent):
  return jnp.zeros_like(cotangent), cotangent.astype(source_dtype)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def zero_cotangents(tree: Any) -> Any:
  """Zero cotangents for every leaf of `tree` (float0 for integer leaves)."""
  def zero(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.zeros_like(x)  # keeps shard_map's per-device type of x
    return np.zeros(x.shape, jax.dtypes.float0)
  return jax.tree_util.tree_map(zero, tree)
