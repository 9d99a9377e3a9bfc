"""Gated linear unit, ``activation(x @ w_gate) * (x @ w_up)``, as Pallas Triton kernels.

Forward: one matmul kernel. Weights ``[K, 2, N]`` are viewed (free reshape) as
``[K, 2N]`` with the gate projection in columns ``[0, N)`` and the up projection in
``[N, 2N)``. Each program owns a ``[block_m, block_n]`` output tile and keeps two
float32 accumulators, one per projection, fed from the same x tile at every K
step (x is read once for both). The activation runs in the epilogue on the f32
gate tile, then the product is stored in x's dtype. Programs are numbered in
groups of ``group_m`` row blocks (all N tiles of a group of M tiles run close in
time) so x tiles and weight tiles are reused from L2.

Backward: a second kernel recomputes both projections for a tile, loads the
output cotangent and writes ``d_gate = dout * up * act'(gate)`` and
``d_up = dout * act(gate)`` into a ``[M, 2N]`` array laid out like the weights
(so no transposes or concatenations are needed); ``act`` and ``act'`` come from
one ``jax.vjp`` of the user's callable, traced inside the kernel. Then
``dx = [d_gate, d_up] @ W^T`` and ``dW = x^T @ [d_gate, d_up]`` are two plain XLA
matmuls with float32 accumulation.

The user's activation is traced to a jaxpr and re-evaluated inside the kernel
with ``erf`` / ``erfc`` replaced by a float32 rational approximation (max error
about 4e-7), because the Triton lowering has no rule for them (exact GELU). The
activation must be elementwise: ``check_supported`` refuses callables whose
jaxpr reduces, reorders or reshapes (tiles would silently change their meaning).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

import tokamax
from tokamax import plugin
from tokamax_gpu_triton import _common

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class GatedLinearUnitConfig:
  """Tiling of the (forward or backward) GLU matmul kernel; block sizes powers of 2.

  ``block_n`` is per projection: a program computes ``block_m x 2*block_n``.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3
  # Interleave the weights per block_n columns ([K, N/bn, 2, bn], one XLA copy of
  # the weights) so each K step is one [block_k, 2*block_n] load and one dot of
  # twice the width: on Hopper that is a wgmma with N = 2*block_n, which reads the
  # x tile from shared memory once instead of twice.
  fuse_weights: bool = False


# ----------------------------------------------------------------------------
# The activation inside a kernel.
# ----------------------------------------------------------------------------

# Primitives that are not elementwise although they may keep the shape: applied to
# a tile instead of the whole array they would silently compute something else.
_NON_ELEMENTWISE_NAMES = frozenset((
    "sort", "rev", "iota", "dot_general", "transpose", "gather", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "fft", "top_k",
    "reshape", "squeeze", "expand_dims", "split", "scan", "while", "psum", "pmax",
    "pmin", "ppermute", "axis_index", "pbroadcast", "argsort", "approx_top_k"))
_NON_ELEMENTWISE_PREFIXES = ("reduce_", "cum", "arg", "scatter", "all_", "rng",
                             "random", "conv_general", "select_and_")
_ELEMENTWISE_EXCEPTIONS = frozenset(("reduce_precision",))
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _erf(x):
  """float32 erf (the rational approximation XLA uses), |error| < 5e-7."""
  x = jnp.clip(x, -4.0, 4.0)
  x2 = x * x
  p = jnp.float32(-2.72614225801306e-10)
  for c in (2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02):
    p = p * x2 + c
  q = jnp.float32(-1.45660718464996e-05)
  for c in (-2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02):
    q = q * x2 + c
  return x * p / q


def _horner(x, *coeffs):
  """``coeffs[0] + x * (coeffs[1] + x * (...))``: `lax.polynomial` in plain ops."""
  out = coeffs[-1]
  for c in reversed(coeffs[:-1]):
    out = out * x + c
  return jnp.broadcast_to(out, x.shape).astype(x.dtype)


# Primitives the Triton lowering lacks. For erfc, the absolute error of 1 - erf
# (not a relative one) is what GELU-like uses need. `copy` comes from autodiff.
# `polynomial` (JAX >= 0.12) comes from jax.nn.gelu's exact derivative.
_REPLACEMENTS = {
    jax.lax.copy_p: lambda x: x,
    jax.lax.erf_p: lambda x: _erf(x.astype(jnp.float32)).astype(x.dtype),
    jax.lax.erfc_p: lambda x: (1.0 - _erf(x.astype(jnp.float32))).astype(x.dtype),
}
if hasattr(jax.lax, "polynomial_p"):
  _REPLACEMENTS[jax.lax.polynomial_p] = _horner


def _inner_jaxpr(eqn):
  for key in _CALL_PARAMS:
    sub = eqn.params.get(key)
    if isinstance(sub, jex_core.ClosedJaxpr):
      return sub.jaxpr, sub.consts
    if isinstance(sub, jex_core.Jaxpr):
      return sub, ()
  return None


def _eval_jaxpr(jaxpr, consts, *args):
  """Evaluates `jaxpr`, inlining calls and replacing primitives Triton lacks."""
  env = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, map(_as_literal, consts)))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    inner = _inner_jaxpr(eqn)
    if eqn.primitive in _REPLACEMENTS:
      outs = [_REPLACEMENTS[eqn.primitive](*invals)]
    elif inner is not None:
      # custom_jvp_call / custom_vjp_call / jit / remat: their primal is the body.
      outs = _eval_jaxpr(inner[0], inner[1], *invals[len(invals) -
                                                       len(inner[0].invars):])
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _value_and_derivative(activation):
  """``x -> (act(x), act'(x))`` for an elementwise `activation`, in float32.

  A VJP with a cotangent of ones gives the elementwise derivative, and unlike a
  JVP it also works for activations with a `jax.custom_vjp` rule.
  """
  def fn(x):
    y, pullback = jax.vjp(activation, x)
    (dy,) = pullback(jnp.ones_like(y))
    return y.astype(jnp.float32), dy.astype(jnp.float32)
  return fn


def _in_kernel(fn, x):
  """Applies `fn` (f32 tile -> tuple of f32 tiles) to `x` in a kernel body."""
  closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(x.shape, jnp.float32))
  return _eval_jaxpr(closed.jaxpr, closed.consts, x)


def _as_literal(const):
  """A scalar the activation closed over (``c = jnp.float32(1.7)``), as a NumPy
  scalar of its dtype: the kernel's trace inlines that as a literal, where it
  would capture a JAX array, which `pallas_call` refuses. `_check_activation`
  refuses every other constant."""
  return np.asarray(const)[()]


def _value_only(activation):
  """``x -> (act(x),)`` in float32: what the forward kernel traces of it."""
  return lambda g: (activation(g).astype(jnp.float32),)


def _walk(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from _walk(sub)


def _check_activation(activation: Callable | None) -> None:
  if activation is None:
    return
  tokamax.plugin.check_elementwise_activation(activation)
  # And what the kernel itself needs: a traceable derivative, no captured arrays.
  shape = (3, 5)
  try:
    forward, closed = (jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(shape, jnp.float32))
                       for fn in (_value_only(activation),
                                  _value_and_derivative(activation)))
  except Exception as e:  # any failure: the kernel cannot apply it, so refuse it
    raise NotImplementedError(
        f"activation {activation!r} cannot be traced and differentiated on a "
        f"float32 array: {type(e).__name__}: {e}") from e
  for out in closed.out_avals:
    if out.shape != shape:
      raise NotImplementedError(f"activation {activation!r} is not elementwise "
                                f"(f32{list(shape)} -> {out.shape})")
  captured = [*plugin.closed_over_arrays(forward), *plugin.closed_over_arrays(closed)]
  if any(isinstance(c, jax.core.Tracer) or np.shape(c) != () for c in captured):
    raise NotImplementedError(f"activation {activation!r} closes over non-scalar or "
                              "traced arrays, which a kernel cannot capture")
  for eqn in _walk(closed.jaxpr):
    name = eqn.primitive.name
    shapes = {getattr(v.aval, "shape", ()) for v in (*eqn.invars, *eqn.outvars)}
    banned = name in _NON_ELEMENTWISE_NAMES or (
        name.startswith(_NON_ELEMENTWISE_PREFIXES)
        and name not in _ELEMENTWISE_EXCEPTIONS)
    if banned or not shapes <= {(), shape}:
      raise NotImplementedError(f"activation {activation!r} is not elementwise "
                                f"(it uses {name!r}), so it cannot be applied to "
                                "output tiles")


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


def _tile_ids(num_m: int, num_n: int, group_m: int):
  """(pid_m, pid_n): groups of `group_m` row blocks sweep all column blocks."""
  # lax.div / lax.rem: truncating ops on non-negative ints, no floor-division fixups.
  pid = pl.program_id(0)
  per_group = group_m * num_n
  first_m = jax.lax.div(pid, per_group) * group_m
  size_m = jnp.minimum(num_m - first_m, group_m)
  in_group = jax.lax.rem(pid, per_group)
  return first_m + jax.lax.rem(in_group, size_m), jax.lax.div(in_group, size_m)


def _projections(x_ref, w_ref, m0, n0, *, n, block_m, block_n, block_k,
                 precision, fuse_weights):
  """f32 ``(x @ w_gate, x @ w_up)`` for the ``[block_m, block_n]`` tile at (m0, n0).

  Masks are emitted only for dimensions that are not block multiples (known
  statically), so aligned problems run unmasked loads. With `fuse_weights`,
  `w_ref` is the ``[K, 2 * N_padded]`` interleaved layout (padding columns are
  zeros, so no N mask is needed on its loads).
  """
  if fuse_weights:
    return _fused_projections(x_ref, w_ref, m0, n0, n=n, block_m=block_m,
                              block_n=block_n, block_k=block_k, precision=precision)
  m, k = x_ref.shape
  rows = pl.ds(m0, block_m)
  m_mask = m0 + jnp.arange(block_m) < m if m % block_m else None
  n_mask = n0 + jnp.arange(block_n) < n if n % block_n else None
  k_ragged = k % block_k != 0

  def body(i, acc):
    acc_gate, acc_up = acc
    k0 = pl.multiple_of(i * block_k, block_k)
    k_mask = k0 + jnp.arange(block_k) < k if k_ragged else None
    ks = pl.ds(k0, block_k)
    x = _common.load(x_ref.at[rows, ks], _common.block_mask(m_mask, k_mask))
    w_mask = _common.block_mask(k_mask, n_mask)
    w_gate = _common.load(w_ref.at[ks, pl.ds(n0, block_n)], w_mask)
    w_up = _common.load(w_ref.at[ks, pl.ds(n + n0, block_n)], w_mask)
    acc_gate += jnp.dot(x, w_gate, precision=precision,
                        preferred_element_type=jnp.float32)
    acc_up += jnp.dot(x, w_up, precision=precision,
                      preferred_element_type=jnp.float32)
    return acc_gate, acc_up

  zeros = jnp.zeros((block_m, block_n), jnp.float32)
  acc = jax.lax.fori_loop(0, pl.cdiv(k, block_k), body, (zeros, zeros))
  return acc, m_mask, n_mask


def _fused_projections(x_ref, w_ref, m0, n0, *, n, block_m, block_n, block_k,
                       precision):
  """`_projections` as one ``[block_m, 2 * block_n]`` dot per K step."""
  m, k = x_ref.shape
  rows = pl.ds(m0, block_m)
  w_cols = pl.ds(pl.multiple_of(2 * n0, 2 * block_n), 2 * block_n)
  m_mask = m0 + jnp.arange(block_m) < m if m % block_m else None
  n_mask = n0 + jnp.arange(block_n) < n if n % block_n else None
  k_ragged = k % block_k != 0

  def body(i, acc):
    k0 = pl.multiple_of(i * block_k, block_k)
    k_mask = k0 + jnp.arange(block_k) < k if k_ragged else None
    ks = pl.ds(k0, block_k)
    x = _common.load(x_ref.at[rows, ks], _common.block_mask(m_mask, k_mask))
    w = _common.load(w_ref.at[ks, w_cols], _common.block_mask(k_mask, None))
    return acc + jnp.dot(x, w, precision=precision,
                         preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, pl.cdiv(k, block_k), body,
                          jnp.zeros((block_m, 2 * block_n), jnp.float32))
  gate, up = jnp.split(acc, 2, axis=1)
  return (gate, up), m_mask, n_mask


def _output_tile(x_ref, w_ref, n, *, block_m, block_n, block_k, group_m, precision,
                 fuse_weights):
  """This program's output tile: ``((gate, up), mask, rows, n0)``, the f32
  projections, the tile's store mask, its row slice and first column."""
  m = x_ref.shape[0]
  pid_m, pid_n = _tile_ids(pl.cdiv(m, block_m), pl.cdiv(n, block_n), group_m)
  m0 = pl.multiple_of(pid_m * block_m, block_m)
  n0 = pl.multiple_of(pid_n * block_n, block_n)
  projections, m_mask, n_mask = _projections(
      x_ref, w_ref, m0, n0, n=n, block_m=block_m, block_n=block_n,
      block_k=block_k, precision=precision, fuse_weights=fuse_weights)
  return projections, _common.block_mask(m_mask, n_mask), pl.ds(m0, block_m), n0


def _fwd_kernel(x_ref, w_ref, o_ref, *h_ref, activation, block_n, **tiling):
  """One output tile; with `h_ref` (a training forward), also the tile's gate and
  up projections, at columns ``[n0, n0 + block_n)`` and ``[N + n0, ...)`` of
  ``h [M, 2N]``."""
  n = o_ref.shape[1]
  (gate, up), mask, rows, n0 = _output_tile(x_ref, w_ref, n, block_n=block_n, **tiling)
  # The projections as the plain program keeps them: rounded to x's dtype, and the
  # output computed from the rounded values, so forward and backward agree.
  if h_ref:
    gate = gate.astype(o_ref.dtype)
    up = up.astype(o_ref.dtype)
    for col0, val in ((n0, gate), (n + n0, up)):
      _common.store(h_ref[0].at[rows, pl.ds(col0, block_n)], val, mask)
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
  if activation is not None:
    (gate,) = _in_kernel(_value_only(activation), gate)
  out = (gate * up).astype(o_ref.dtype)
  _common.store(o_ref.at[rows, pl.ds(n0, block_n)], out, mask)


def _bwd_kernel(x_ref, w_ref, dout_ref, dgu_ref, *, activation, block_n, **tiling):
  n = dout_ref.shape[1]
  (gate, up), mask, rows, n0 = _output_tile(x_ref, w_ref, n, block_n=block_n, **tiling)
  dout = _common.load(dout_ref.at[rows, pl.ds(n0, block_n)], mask).astype(jnp.float32)
  if activation is None:
    act, d_act = gate, None
  else:
    act, d_act = _in_kernel(_value_and_derivative(activation), gate)
  d_gate = dout * up if d_act is None else dout * up * d_act
  d_up = dout * act
  for col0, val in ((n0, d_gate), (n + n0, d_up)):
    view = dgu_ref.at[rows, pl.ds(col0, block_n)]
    _common.store(view, val.astype(dgu_ref.dtype), mask)


def _interleave_weights(weights, block_n: int):
  """``[K, 2, N]`` -> ``[K, 2 * N_padded]``: per block_n columns, gate then up."""
  k, _, n = weights.shape
  num_n = pl.cdiv(n, block_n)
  if num_n * block_n != n:
    weights = jnp.pad(weights, ((0, 0), (0, 0), (0, num_n * block_n - n)))
  w = weights.reshape(k, 2, num_n, block_n).transpose(0, 2, 1, 3)
  return w.reshape(k, 2 * num_n * block_n)


def _grid_call(kernel, args, config, out_shape, name, *extra):
  x = args.x
  m = x.shape[0]
  k, _, n = args.weights.shape
  if config.fuse_weights:
    w = _interleave_weights(args.weights, config.block_n)
  else:
    w = args.weights.reshape(k, 2 * n)
  kernel = functools.partial(
      kernel, activation=args.activation, block_m=config.block_m,
      block_n=config.block_n, block_k=config.block_k, group_m=config.group_m,
      precision=args.precision, fuse_weights=config.fuse_weights)
  num_tiles = pl.cdiv(m, config.block_m) * pl.cdiv(n, config.block_n)
  out_specs = (tuple(pl.no_block_spec for _ in out_shape) if isinstance(out_shape, tuple)
               else pl.no_block_spec)
  return _common.pallas_call(
      kernel, out_shape=out_shape, grid=(num_tiles,),
      in_specs=[pl.no_block_spec] * (2 + len(extra)), out_specs=out_specs,
      num_warps=config.num_warps, num_stages=config.num_stages,
      interpret=tokamax.interpret_mode(), name=name,
  )(x, w, *extra)


# ----------------------------------------------------------------------------
# Configs and Ops.
# ----------------------------------------------------------------------------


def _clamp_block(block: int, dim: int) -> int:
  # Triton's dot needs every block dimension >= 16.
  return max(16, min(block, _common.next_power_of_2(dim)))


def _fit(config: GatedLinearUnitConfig, m: int, n: int, k: int):
  return dataclasses.replace(
      config, block_m=_clamp_block(config.block_m, m),
      block_n=_clamp_block(config.block_n, n), block_k=_clamp_block(config.block_k, k))


def _heuristic(args, backward: bool = False) -> GatedLinearUnitConfig:
  m, k = args.x.shape
  n = args.weights.shape[-1]
  if args.x.dtype == jnp.float32 or args.weights.dtype == jnp.float32:
    # f32 tiles take twice the shared memory per pipeline stage.
    config = GatedLinearUnitConfig(block_m=128, block_n=128, block_k=32, group_m=8,
                                   num_warps=8, num_stages=3)
  else:
    # A 128 x (2 * 128) output tile per program, one wgmma of N = 256 per K step
    # (Triton's best Hopper matmul shape), 3 x 48 KiB of pipelined tiles.
    config = GatedLinearUnitConfig(block_m=128, block_n=128, block_k=64, group_m=8,
                                   num_warps=8, num_stages=3,
                                   fuse_weights=n >= 128)
  config = _fit(config, m, n, k)
  if config.block_m * config.block_n <= 64 * 64:
    config = dataclasses.replace(config, num_warps=4)
  if backward and config.fuse_weights and config.num_stages == 3:
    # Measured on the H200 (docs/benchmarks.md): the recompute kernel gains from a
    # fourth stage, 16.6 ms vs 17.7 ms forward+backward at x16384x4096 w4096x2x14336.
    config = dataclasses.replace(config, num_stages=4)
  return config


def _search_space(args, backward: bool = False):
  del backward  # both kernels tile alike: one space, around the forward's heuristic
  m, k = args.x.shape
  n = args.weights.shape[-1]
  wide = args.x.dtype == jnp.float32 or args.weights.dtype == jnp.float32
  shapes = [  # (block_m, block_n, block_k, group_m, num_warps, num_stages, fused)
      (128, 128, 64, 8, 8, 3, True), (128, 128, 64, 8, 8, 4, True),
      (128, 128, 64, 16, 8, 3, True), (128, 128, 32, 8, 8, 4, True),
      (128, 128, 64, 8, 8, 3, False), (128, 128, 64, 16, 8, 4, False),
      (64, 128, 64, 8, 4, 4, True), (128, 64, 64, 8, 4, 4, True),
      (128, 64, 64, 8, 8, 4, True), (256, 64, 64, 8, 8, 3, True),
      (128, 64, 64, 8, 4, 4, False), (64, 64, 64, 8, 4, 4, False),
  ]
  configs = [_heuristic(args)]
  for bm, bn, bk, group_m, warps, stages, fused in shapes:
    if wide:
      bk = min(bk, 32)
      fused = False
    configs.append(_fit(GatedLinearUnitConfig(bm, bn, bk, group_m, warps, stages,
                                              fused), m, n, k))
  return list(dict.fromkeys(configs))


def _check_args(args, device) -> None:
  _common.check_triton_device(device)
  for name in ("x", "weights"):
    dtype = getattr(args, name).dtype
    if dtype not in _SUPPORTED_DTYPES:
      raise NotImplementedError(f"{name} dtype {dtype} is not supported "
                                "(float32, bfloat16, float16 are)")
  m, k = args.x.shape
  n = args.weights.shape[-1]
  if 0 in (m, k, n):
    raise NotImplementedError(f"empty problem (M={m}, K={k}, N={n})")
  if max(m * k, 2 * k * n, 2 * m * n) >= 2**31:
    raise NotImplementedError("an operand has 2**31 elements or more (int32 offsets)")
  _check_activation(args.activation)


def _check_config(config: GatedLinearUnitConfig) -> None:
  for field in ("block_m", "block_n", "block_k", "num_warps"):
    v = getattr(config, field)
    if v < 1 or v & (v - 1):
      raise ValueError(f"GatedLinearUnitConfig.{field} must be a power of 2; got {v}")
  if min(config.block_m, config.block_n, config.block_k) < 16:
    raise ValueError(f"GatedLinearUnitConfig blocks must be >= 16; got {config}")


class _GluFunctions(plugin.OpFunctions):
  """What the forward and backward ops share."""

  op_name = "gated_linear_unit"
  name = "triton"
  config_cls = GatedLinearUnitConfig
  check_args = staticmethod(_check_args)
  heuristic = staticmethod(_heuristic)
  configs = staticmethod(_search_space)


@dataclasses.dataclass(frozen=True)
class TritonGatedLinearUnit(_GluFunctions, tokamax.Op):
  """GLU forward: one Pallas Triton matmul kernel for both projections."""

  def forward(self, args, config):
    _check_config(config)
    m = args.x.shape[0]
    n = args.weights.shape[-1]
    out_shape = jax.ShapeDtypeStruct((m, n), args.x.dtype)
    if not self.residuals_wanted():
      return _grid_call(_fwd_kernel, args, config, out_shape, "tokamax_glu_fwd"), {}
    # A training forward keeps the projections: the backward then skips its
    # recompute kernel (`GatedLinearUnitArgs.backward_from_projections`).
    out, h = _grid_call(_fwd_kernel, args, config,
                        (out_shape, jax.ShapeDtypeStruct((m, 2 * n), args.x.dtype)),
                        "tokamax_glu_fwd")
    return out, {"projections": h.reshape(m, 2, n)}


@dataclasses.dataclass(frozen=True)
class TritonGatedLinearUnitVjp(_GluFunctions, tokamax.VjpOp):
  """GLU backward: from the forward's projections where it kept them, else a fused
  recompute + activation derivative kernel; XLA matmuls."""

  recomputes_without = frozenset({"projections"})

  def backward(self, args, residuals, out, dout, config):
    del out
    if "projections" in residuals:
      # The forward kept the projections: no recompute kernel is needed, only the
      # elementwise dh and the two XLA matmuls.
      return args.backward_from_projections(residuals["projections"], dout)
    _check_config(config)
    x = args.x
    m, k = x.shape
    n = args.weights.shape[-1]
    dgu = _grid_call(_bwd_kernel, args, config,
                     jax.ShapeDtypeStruct((m, 2 * n), x.dtype), "tokamax_glu_bwd",
                     dout.astype(x.dtype))
    w = args.weights.reshape(k, 2 * n)
    dx = jax.lax.dot_general(dgu, w, (((1,), (1,)), ((), ())),
                             precision=args.precision,
                             preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(x, dgu, (((0,), (0,)), ((), ())),
                             precision=args.precision,
                             preferred_element_type=jnp.float32)
    return {"x": dx.astype(x.dtype),
            "weights": dw.reshape(k, 2, n).astype(args.weights.dtype)}
