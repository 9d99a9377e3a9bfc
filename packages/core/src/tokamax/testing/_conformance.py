"""Conformance cases and checks (see `tokamax.testing`)."""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax._src import dispatch
from tokamax._src.ops import attention as attention_op

HIGHEST = jax.lax.Precision.HIGHEST
DTYPES = ("float32", "bfloat16", "float16")

# (relative L2 error, max abs error relative to the reference's max abs value).
TOLERANCES = {
    "float32": (2e-5, 1e-4),
    "bfloat16": (2e-2, 6e-2),
    "float16": (3e-3, 1e-2),
}
# Kernels on a GPU may compute float32 matmuls in TF32 unless asked otherwise.
_GPU_F32_TOLERANCE = (1e-3, 4e-3)


@dataclasses.dataclass(frozen=True)
class Case:
  """One conformance case: an op, input shapes and the call's options.

  Attributes:
    op: the op name.
    name: a short description, part of the test id.
    shapes: shapes of the inputs (op-specific keys).
    options: keyword arguments of the public op function (besides inputs).
    quick: part of the quick subset (used where a full run is too slow, e.g.
      Pallas interpret mode in CI).
    tolerance_scale: widens the tolerance for long reductions.
    tf32_scale: widens the float32 tolerance on a GPU only, whose default matmul
      precision is TF32: where the output has a handful of elements, its relative
      L2 error is one element's, not an average of TF32's rounding.
  """

  op: str
  name: str
  shapes: dict[str, Any]
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  quick: bool = False
  tolerance_scale: float = 1.0
  tf32_scale: float = 1.0

  def __str__(self):
    return f"{self.op}-{self.name}"


def _attention_cases() -> list[Case]:
  def c(name, b=2, t=37, s=37, n=4, k=4, h=32, hv=None, quick=False, bias=None,
        mask=None, **options):
    shapes = dict(b=b, t=t, s=s, n=n, k=k, h=h, hv=hv or h, bias=bias, mask=mask)
    return Case("dot_product_attention", name, shapes, options, quick)

  return [
      c("base", quick=True),
      c("causal", is_causal=True, quick=True),
      c("cross_t_lt_s", t=17, s=45),
      c("causal_t_gt_s", t=45, s=17, is_causal=True),
      c("gqa", n=4, k=2, is_causal=True, quick=True),
      c("mqa", n=4, k=1),
      c("head_dim_64", h=64, t=20, s=20),
      c("head_dim_80", h=80, t=20, s=20, quick=True),
      c("head_dim_96", h=96, t=20, s=20),
      c("head_dim_128", h=128, t=20, s=20, n=2, k=2),
      c("head_dim_256", h=256, t=16, s=16, n=2, k=2, b=1),
      c("value_dim_differs", h=32, hv=16),
      c("bias_full", bias=(2, 4, 37, 37), quick=True),
      c("bias_broadcast_heads_queries", bias=(1, 4, 1, 37)),
      c("bias_2d", bias=(37, 37), is_causal=True),
      c("mask_bool", mask=(2, 1, 37, 37), quick=True),
      c("seq_lengths", query_seq_lengths=(30, 0), key_value_seq_lengths=(5, 37),
        quick=True),
      c("local_window", local_window_size=(8, 3), quick=True),
      c("local_window_causal_int", local_window_size=5, is_causal=True),
      c("local_window_left_only", local_window_size=(6, None)),
      c("soft_cap", logits_soft_cap=5.0, quick=True),
      c("segments", q_segment_ids=True, quick=True),
      c("scale", scale=0.3),
      c("combined", n=4, k=2, is_causal=True, logits_soft_cap=8.0,
        local_window_size=(10, 0), q_segment_ids=True, key_value_seq_lengths=(33, 20),
        quick=True),
      c("decode_t1", t=1, s=29),
      c("single_key", t=5, s=1),
      c("prime_lengths", t=131, s=67, n=2, k=1, b=1, is_causal=True),
      c("extra_batch_dims", b=(2, 3), t=9, s=11, n=2, k=1),
      # q_offset (set by the SPMD rules and ring attention, not public): the
      # queries are a slice of a longer sequence; only implementations that list
      # "q_offset" in supported_features run these (others: skipped).
      c("q_offset_causal", t=20, s=53, is_causal=True, q_offset=29, quick=True),
      c("q_offset_causal_negative", t=37, s=21, is_causal=True, q_offset=-9),
      c("q_offset_window", t=19, s=61, local_window_size=(7, 4), q_offset=24,
        quick=True),
      c("q_offset_window_gqa_segments_lengths", n=4, k=2, t=26, s=50,
        local_window_size=(12, 0), q_offset=17, q_segment_ids=True,
        key_value_seq_lengths=(44, 30), query_seq_lengths=(21, 26)),
      c("q_offset_no_window", t=16, s=16, q_offset=100),
      # Attention sinks (opt-in: implementations without "sinks" are skipped).
      c("sinks", sinks=True, quick=True),
      c("sinks_causal_gqa", n=4, k=2, is_causal=True, sinks=True),
      c("sinks_window_lengths_mqa", n=4, k=1, local_window_size=(9, 0),
        is_causal=True, query_seq_lengths=(30, 0), key_value_seq_lengths=(5, 37),
        sinks=True, quick=True),
      c("sinks_segments_soft_cap", q_segment_ids=True, logits_soft_cap=5.0, sinks=True),
      c("sinks_q_offset", t=20, s=53, is_causal=True, q_offset=29, sinks=True),
  ]


def _layer_norm_cases() -> list[Case]:
  def c(name, shape, quick=False, scale=True, offset=True, **options):
    return Case("layer_norm", name, dict(x=shape, scale=scale, offset=offset), options,
                quick)

  return [
      c("base", (6, 64), quick=True),
      c("rms", (6, 64), subtract_mean=False, offset=False, quick=True),
      c("odd_width", (5, 37), quick=True),
      c("single_row", (1, 100)),
      c("width_1", (7, 1)),
      c("no_params", (9, 48), scale=False, offset=False),
      c("scale_only_rms", (3, 5, 40), subtract_mean=False, offset=False),
      c("axis_not_last", (4, 24, 3), axis=1, quick=True),
      c("wide_rows", (3, 5000)),
      c("epsilon", (4, 32), epsilon=1e-2),
      c("many_rows", (257, 24)),
  ]


def _glu_cases() -> list[Case]:
  def c(name, m=13, k=40, n=24, quick=False, pair=False, tf32_scale=1.0, sizes=None,
        **options):
    return Case("gated_linear_unit", name, dict(m=m, k=k, n=n, pair=pair, sizes=sizes),
                options, quick, tf32_scale=tf32_scale)

  return [
      c("swiglu", activation=jax.nn.silu, quick=True),
      c("geglu_tanh", activation=jax.nn.gelu, quick=True),
      c("geglu_exact", activation=lambda x: jax.nn.gelu(x, approximate=False)),
      c("sigmoid", activation=jax.nn.sigmoid),
      c("relu", activation=jax.nn.relu),
      c("bilinear", activation=None, quick=True),
      c("custom_callable", activation=lambda x: x * jnp.tanh(x)),
      c("weights_pair", activation=jax.nn.silu, pair=True),
      # Three outputs of 7-term dot products: on an H200 at float32, triton's TF32
      # matmuls give a relative L2 error of 1.18e-3 here, against 3.3e-4 to 6.0e-4
      # (equal to XLA's own TF32 result) in the cases above.
      c("odd_shapes", m=1, k=7, n=3, activation=jax.nn.silu, tf32_scale=2.0),
      c("leading_dims", m=(2, 3, 5), activation=jax.nn.silu),
      c("larger", m=67, k=130, n=72, activation=jax.nn.silu),
      # Not elementwise: a kernel applying it per output tile would be wrong, so
      # kernels must refuse it (skipped) or handle it (checked).
      c("activation_centering_not_elementwise", n=40,
        activation=lambda x: x - jnp.mean(x, axis=-1, keepdims=True), quick=True),
      # Grouped (MoE experts, the "group_sizes" opt-in): an empty group and rows
      # past the groups.
      c("grouped", m=21, sizes=(5, 0, 9), activation=jax.nn.silu),
      c("grouped_pair", m=14, sizes=(6, 8), pair=True, activation=jax.nn.gelu),
  ]


def _ragged_dot_cases() -> list[Case]:
  def c(name, sizes, m=None, k=32, n=24, g_rhs=None, quick=False,
        not_finite_outside=False, **options):
    m = sum(sizes) if m is None else m
    return Case("ragged_dot", name,
                dict(m=m, k=k, n=n, sizes=tuple(sizes), g_rhs=g_rhs,
                     not_finite_outside=not_finite_outside), options, quick)

  return [
      c("equal_groups", (10, 10, 10), quick=True),
      c("uneven_with_empty", (7, 0, 13, 1, 0), quick=True),
      c("rows_past_total", (5, 9), m=21, quick=True),
      c("single_group", (17,)),
      c("all_empty", (0, 0), m=6),
      c("single_row", (0, 1)),
      c("group_offset", (4, 6, 5, 3), g_rhs=2, group_offset=1, quick=True),
      c("group_offset_last", (4, 6, 5, 3), g_rhs=1, group_offset=3),
      c("preferred_float32", (6, 11), preferred_element_type=jnp.float32),
      c("odd_dims", (3, 8, 2), k=13, n=5),
      c("larger", (40, 0, 70, 33), k=96, n=80),
      # NaN in lhs and inf in the output's cotangent in the rows no held group
      # owns (of groups rhs does not hold, and past the groups: padding): they
      # must reach no output or gradient (`_outside_held_rows`).
      c("rows_outside_not_finite", (5, 7, 0, 9, 3), m=40, k=72, n=40, g_rhs=3,
        group_offset=1, not_finite_outside=True, quick=True),
  ]


def all_cases(op: str | None = None, quick: bool = False) -> list[Case]:
  """Every conformance case (of `op`), or only the quick subset."""
  cases = (_attention_cases() + _layer_norm_cases() + _glu_cases() +
           _ragged_dot_cases())
  return [c for c in cases if (op is None or c.op == op) and (c.quick or not quick)]


# ---------------------------------------------------------------- inputs


def _normal(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _attention_inputs(case: Case, rng, dtype):
  sh = case.shapes
  batch = sh["b"] if isinstance(sh["b"], tuple) else (sh["b"],)
  t, s, n, k, h, hv = sh["t"], sh["s"], sh["n"], sh["k"], sh["h"], sh["hv"]
  floats = dict(query=_normal(rng, (*batch, t, n, h), dtype),
                key=_normal(rng, (*batch, s, k, h), dtype),
                value=_normal(rng, (*batch, s, k, hv), dtype))
  if sh["bias"] is not None:
    floats["bias"] = _normal(rng, sh["bias"], dtype)
  options = dict(case.options)
  if options.pop("sinks", False):
    # Spread so that some sinks outweigh a row's keys and some do not.
    floats["sinks"] = _normal(rng, (n,), dtype) * 3
  mask = None
  if sh["mask"] is not None:
    mask = rng.random(sh["mask"]) < 0.7
    mask[..., 0, :] = False  # a query row with no visible key
    mask = jnp.asarray(mask)
  if options.get("q_segment_ids"):
    options["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (*batch, t)), -1))
    options["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (*batch, s)), -1))
  for key in ("query_seq_lengths", "key_value_seq_lengths"):
    if key in options:
      options[key] = jnp.asarray(options[key], jnp.int32)

  q_offset = options.pop("q_offset", None)

  def fn(f, implementation, precision):
    return call_attention(f, mask, options, q_offset, implementation, precision)
  return fn, floats


def call_attention(floats: dict, mask, options: dict, q_offset: int | None,
                   implementation: Any, precision):
  """`tokamax.dot_product_attention` on ``floats`` (query, key, value, bias?,
  sinks?); with a `q_offset` (not a public argument) through the canonical args."""
  f = floats
  if q_offset is None:
    return tokamax.dot_product_attention(
        f["query"], f["key"], f["value"], f.get("bias"), mask, precision=precision,
        sinks=f.get("sinks"), implementation=implementation, **options)
  args, batch_shape = attention_op.canonical_args(
      f["query"], f["key"], f["value"], f.get("bias"), mask, precision=precision,
      sinks=f.get("sinks"), **options)
  args = dataclasses.replace(args, q_offset=jnp.int32(q_offset))
  out = dispatch.call(attention_op.DEFINITION, args, implementation)
  return out.reshape(*batch_shape, *out.shape[1:])


def _layer_norm_inputs(case: Case, rng, dtype):
  sh = case.shapes
  axis = case.options.get("axis", -1)
  d = sh["x"][axis]
  floats = dict(x=_normal(rng, sh["x"], dtype) * 2 + 0.5)
  if sh["scale"]:
    floats["scale"] = _normal(rng, (d,), dtype)
  if sh["offset"]:
    floats["offset"] = _normal(rng, (d,), dtype)

  def fn(f, implementation, precision):
    del precision
    return tokamax.layer_norm(f["x"], f.get("scale"), f.get("offset"),
                              implementation=implementation, **case.options)
  return fn, floats


def _glu_inputs(case: Case, rng, dtype):
  sh = case.shapes
  m = sh["m"] if isinstance(sh["m"], tuple) else (sh["m"],)
  k, n, sizes = sh["k"], sh["n"], sh.get("sizes")
  groups = () if sizes is None else (len(sizes),)
  floats = dict(x=_normal(rng, (*m, k), dtype),
                weights=_normal(rng, (*groups, k, 2, n), dtype) / float(np.sqrt(k)))
  grouped = {} if sizes is None else dict(group_sizes=jnp.asarray(sizes, jnp.int32))

  def fn(f, implementation, precision):
    w = f["weights"]
    if sh["pair"]:
      w = (w[..., 0, :], w[..., 1, :])
    return tokamax.gated_linear_unit(f["x"], w, precision=precision,
                                     implementation=implementation, **grouped,
                                     **case.options)
  return fn, floats


def _ragged_dot_inputs(case: Case, rng, dtype):
  sh = case.shapes
  sizes = sh["sizes"]
  g_rhs = sh["g_rhs"] or len(sizes)
  floats = dict(lhs=_normal(rng, (sh["m"], sh["k"]), dtype),
                rhs=_normal(rng, (g_rhs, sh["k"], sh["n"]), dtype) / float(np.sqrt(sh["k"])))
  group_sizes = jnp.asarray(sizes, jnp.int32)
  outside = (_outside_held_rows(case) if sh.get("not_finite_outside") else None)

  def fn(f, implementation, precision):
    lhs = f["lhs"]
    if outside is not None:
      lhs = jnp.where(outside, jnp.nan, lhs).astype(lhs.dtype)
    out = tokamax.ragged_dot(lhs, f["rhs"], group_sizes, precision=precision,
                             implementation=implementation, **case.options)
    return out if outside is None else _cotangent_inf_where(outside)(out)
  return fn, floats


def _outside_held_rows(case: Case) -> np.ndarray:
  """``[M, 1]`` bool: the rows no group that rhs holds owns (the groups before
  ``group_offset``, and the rows past the groups)."""
  sh = case.shapes
  ends = np.cumsum(sh["sizes"])
  offset = case.options.get("group_offset", 0)
  held_end = ends[offset + (sh["g_rhs"] or len(sh["sizes"])) - 1]
  held_start = ends[offset - 1] if offset else 0
  rows = np.arange(sh["m"])[:, None]
  return (rows < held_start) | (rows >= held_end)


def _cotangent_inf_where(rows: np.ndarray) -> Callable[[jax.Array], jax.Array]:
  """The identity, whose cotangent gets inf in `rows` on its way back (as from
  a loss that is not finite in rows that must add nothing)."""
  @jax.custom_vjp
  def identity(out):
    return out

  def backward(_, g):
    return (jnp.where(rows, jnp.inf, g).astype(g.dtype),)

  identity.defvjp(lambda out: (out, None), backward)
  return identity


_INPUTS = {
    "dot_product_attention": _attention_inputs,
    "layer_norm": _layer_norm_inputs,
    "gated_linear_unit": _glu_inputs,
    "ragged_dot": _ragged_dot_inputs,
}


# ---------------------------------------------------------------- comparing


def relative_l2_error(actual, expected) -> float:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  norm = np.linalg.norm(expected)
  diff = np.linalg.norm(actual - expected)
  return float(diff / norm) if norm > 0 else float(diff)


def tolerance(dtype, *, gpu: bool = False) -> tuple[float, float]:
  """``(relative L2, max abs relative to max |reference|)`` allowed for `dtype`
  (float32 on a GPU: TF32 matmuls)."""
  name = jnp.dtype(dtype).name
  return _GPU_F32_TOLERANCE if gpu and name == "float32" else TOLERANCES[name]


def assert_close(actual, expected, dtype, *, what: str = "output", scale: float = 1.0,
                 gpu: bool = False) -> None:
  """Relative L2 error and max-abs error (relative to max |expected|) within the
  dtype's tolerance; shapes equal; no NaN/inf where the reference is finite."""
  name = jnp.dtype(dtype).name
  rel_tol, abs_tol = tolerance(dtype, gpu=gpu)
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  assert actual.shape == expected.shape, (
      f"{what}: shape {actual.shape}, expected {expected.shape}")
  bad = ~np.isfinite(actual) & np.isfinite(expected)
  assert not bad.any(), f"{what}: {bad.sum()} non-finite values where the reference is finite"
  rel = relative_l2_error(actual, expected)
  peak = float(np.max(np.abs(expected))) if expected.size else 0.0
  max_abs = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
  rms = float(np.sqrt(np.mean(np.square(expected)))) if expected.size else 0.0
  # A reference that is (numerically) zero, e.g. dq when each query sees one key,
  # has no meaningful relative error; the max-abs check below still applies.
  assert rms < 1e-3 or rel <= rel_tol * scale, (
      f"{what}: relative L2 error {rel:.3g} > {rel_tol * scale:.3g} ({name})")
  assert max_abs <= abs_tol * scale * max(peak, 1.0), (
      f"{what}: max abs error {max_abs:.3g} > {abs_tol * scale * max(peak, 1.0):.3g} "
      f"({name}, max |reference| {peak:.3g})")


def default_seed(test_id: str) -> int:
  """A seed fixed per test, so that a failure reproduces and CI does not flake.

  ``TOKAMAX_TEST_SEED=<int>`` shifts every test to other inputs (to look for
  input-dependent failures); the failing seed is part of each assertion message.
  """
  shift = int(os.environ.get("TOKAMAX_TEST_SEED", "0"))
  return (zlib.crc32(test_id.encode()) + shift) % 2**31


def _upcast(tree):
  return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), tree)


def check_case(case: Case, implementation: Any, dtype: str = "float32", *,
               gradients: bool = True, seed: int | None = None) -> None:
  """Checks one case against the XLA reference; forward, then gradients.

  Raises:
    NotImplementedError: the implementation does not support the case.
    AssertionError: the results differ from the reference beyond tolerance.
  """
  if seed is None:
    seed = default_seed(f"{case} {dtype}")
  rng = np.random.default_rng(seed)
  fn, floats = _INPUTS[case.op](case, rng, jnp.dtype(dtype))
  gpu = jax.default_backend() == "gpu"
  note = f"{case} {dtype} seed={seed}"
  scale = case.tolerance_scale * (case.tf32_scale if gpu and dtype == "float32" else 1.0)

  def forward(precision, impl):
    return lambda f: fn(f, impl, precision)

  # Tracing decides the implementation: one that cannot run the case raises here,
  # before anything is compiled.
  out_shape = jax.eval_shape(forward(None, implementation), floats).shape
  # The cotangent is made exact in `dtype`: the implementation receives it rounded
  # to its output dtype while the float32 reference does not, and a gradient that is
  # a sum over few rows (doffset of a 7-row layer norm) can cancel down to the size
  # of that rounding.
  cotangent = (jnp.asarray(jnp.asarray(rng.standard_normal(out_shape), dtype),
                           jnp.float32) if gradients else None)
  ref, ref_grads = _reference(case, dtype, seed, forward(HIGHEST, "xla"),
                              _upcast(floats), cotangent)
  if case.shapes.get("not_finite_outside"):
    # The check below lets non-finite values through where the reference has
    # them: here it must have none.
    for name, value in (("forward", ref), *(ref_grads or {}).items()):
      assert np.isfinite(np.asarray(value)).all(), (
          f"{note}: the reference's {name} is not finite")
  try:
    out, grads = _jitted_results(forward(None, implementation), floats, cotangent)
  except NotImplementedError:
    # No backward for this case: the forward must still be right.
    out, _ = _jitted_results(forward(None, implementation), floats, None)
    _check_forward(out, ref, dtype, case, note, scale, gpu)
    raise
  _check_forward(out, ref, dtype, case, note, scale, gpu)
  for name in grads or ():
    assert grads[name].dtype == floats[name].dtype, f"{note}: d{name} dtype"
    assert_close(grads[name], ref_grads[name], dtype, what=f"{note}: d{name}",
                 scale=scale * 2, gpu=gpu)


def _check_forward(out, ref, dtype, case, note, scale, gpu):
  assert out.dtype == ref.dtype or case.op == "ragged_dot" or dtype != "float32"
  assert_close(out, ref, dtype, what=f"{note}: forward", scale=scale, gpu=gpu)


def _jitted_results(forward: Callable, floats: dict, cotangent):
  """``(output, gradients of sum(output * cotangent))`` from one jitted computation
  (gradients None without a cotangent).

  Jitted: run eagerly, every primitive of the reference and of the custom_vjp
  plumbing would compile on its own (over a hundred compilations per case);
  jit-against-eager parity has tests of its own (test_transforms.py). One
  computation for both: the gradient's compilation contains the forward's.
  """
  if cotangent is None:
    return jax.jit(forward)(floats), None

  def loss(f):
    out = forward(f)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(floats)
  return out, grads


# The reference's results per case, dtype and seed: the same inputs are checked
# against several implementations (the conformance tests of every installed
# backend), and the reference's float32 computation is half of each check. The key
# holds everything the inputs and the call are made from (an option that is a
# function is keyed by its identity: a rebuilt case recomputes, it never reuses).
_REFERENCE_CACHE: dict[tuple, tuple] = {}
_REFERENCE_CACHE_SIZE = 256


def _reference(case: Case, dtype: str, seed: int, forward: Callable, floats: dict,
               cotangent):
  key = (case.op, case.name, repr(case.shapes), repr(case.options), dtype, seed,
         cotangent is not None)
  if key not in _REFERENCE_CACHE:
    if len(_REFERENCE_CACHE) >= _REFERENCE_CACHE_SIZE:
      _REFERENCE_CACHE.pop(next(iter(_REFERENCE_CACHE)))
    _REFERENCE_CACHE[key] = _jitted_results(forward, floats, cotangent)
  return _REFERENCE_CACHE[key]


# ---------------------------------------------------------------- errors


def error_cases() -> list[tuple[str, Callable[[Any], Any], type, str]]:
  """Malformed calls: (name, call(implementation), exception type, text in message)."""
  f32 = jnp.float32
  q = jnp.ones((1, 4, 4, 8), f32)
  kv = jnp.ones((1, 4, 2, 8), f32)
  x = jnp.ones((3, 8), f32)
  w = jnp.ones((8, 2, 4), f32)
  lhs = jnp.ones((6, 8), f32)
  rhs = jnp.ones((2, 8, 4), f32)
  gs = jnp.asarray([3, 3], jnp.int32)
  att = tokamax.dot_product_attention
  return [
      ("attention_rank", lambda i: att(q[0], kv[0], kv[0], implementation=i),
       ValueError, "rank"),
      ("attention_heads_not_multiple",
       lambda i: att(jnp.ones((1, 4, 3, 8)), kv, kv, implementation=i),
       ValueError, "multiple"),
      ("attention_dtype_mismatch",
       lambda i: att(q, kv.astype(jnp.bfloat16), kv, implementation=i), TypeError,
       "dtype"),
      ("attention_head_dim", lambda i: att(q, jnp.ones((1, 4, 2, 6)), kv,
                                           implementation=i), ValueError, "head dim"),
      ("attention_mask_not_bool",
       lambda i: att(q, kv, kv, mask=jnp.ones((4, 4)), implementation=i), TypeError,
       "mask"),
      ("attention_bias_shape",
       lambda i: att(q, kv, kv, bias=jnp.ones((3, 4)), implementation=i), ValueError,
       "bias"),
      ("attention_sinks_shape",
       lambda i: att(q, kv, kv, sinks=jnp.zeros((2,)), implementation=i), ValueError,
       "sinks"),
      ("attention_segments_alone",
       lambda i: att(q, kv, kv, q_segment_ids=jnp.zeros((1, 4), jnp.int32),
                     implementation=i), ValueError, "kv_segment_ids"),
      ("attention_lengths_range",
       lambda i: att(q, kv, kv, key_value_seq_lengths=jnp.asarray([9]),
                     implementation=i), ValueError, "key_value_seq_lengths"),
      ("attention_window", lambda i: att(q, kv, kv, local_window_size=(-1, 2),
                                         implementation=i), ValueError,
       "local_window_size"),
      ("layer_norm_scale_shape",
       lambda i: tokamax.layer_norm(x, jnp.ones((7,)), None, implementation=i),
       ValueError, "scale"),
      ("layer_norm_axis", lambda i: tokamax.layer_norm(x, None, None, axis=2,
                                                       implementation=i), ValueError,
       "axis"),
      ("layer_norm_int_input",
       lambda i: tokamax.layer_norm(jnp.ones((3, 8), jnp.int32), None, None,
                                    implementation=i), TypeError, "x"),
      ("glu_weights_shape",
       lambda i: tokamax.gated_linear_unit(x, jnp.ones((8, 3, 4)), implementation=i),
       ValueError, "weights"),
      ("glu_k_mismatch",
       lambda i: tokamax.gated_linear_unit(x, jnp.ones((9, 2, 4)), implementation=i),
       ValueError, "K=8"),
      ("glu_activation", lambda i: tokamax.gated_linear_unit(x, w, activation="silu",
                                                             implementation=i),
       TypeError, "activation"),
      ("ragged_negative_sizes",
       lambda i: tokamax.ragged_dot(lhs, rhs, jnp.asarray([-1, 3], jnp.int32),
                                    implementation=i), ValueError, "non-negative"),
      ("ragged_sizes_too_large",
       lambda i: tokamax.ragged_dot(lhs, rhs, jnp.asarray([4, 3], jnp.int32),
                                    implementation=i), ValueError, "at most M=6"),
      ("ragged_group_count",
       lambda i: tokamax.ragged_dot(lhs, rhs, jnp.asarray([6], jnp.int32),
                                    implementation=i), ValueError, "group_sizes"),
      ("ragged_float_sizes",
       lambda i: tokamax.ragged_dot(lhs, rhs, gs.astype(f32), implementation=i),
       TypeError, "group_sizes"),
      ("ragged_group_offset_range",
       lambda i: tokamax.ragged_dot(lhs, rhs[:1], gs, group_offset=2,
                                    implementation=i), ValueError, "group_offset"),
  ]


def check_errors(implementation: Any) -> None:
  """Every malformed call raises its error type with a message naming the problem."""
  import pytest  # only the test helpers need it, not tokamax.testing itself
  for name, call, error, text in error_cases():
    with pytest.raises(error, match=text):
      call(implementation)
    del name


# ---------------------------------------------------------------- pytest glue


def define_conformance_tests(implementation: Any, namespace: dict, *,
                             ops: Sequence[str] | None = None,
                             dtypes: Sequence[str] = DTYPES,
                             quick: bool | None = None,
                             gradients: bool = True) -> None:
  """Defines the conformance tests for `implementation` in a pytest module.

  Args:
    implementation: what to pass as ``implementation=`` (a name or an Op).
    namespace: the test module's ``globals()``.
    ops: restrict to these ops (default: all four).
    dtypes: dtypes to check.
    quick: only the quick subset; default from ``TOKAMAX_CONFORMANCE_QUICK=1``.
    gradients: check gradients too.
  """
  import pytest  # only the test helpers need it, not tokamax.testing itself
  if quick is None:
    quick = os.environ.get("TOKAMAX_CONFORMANCE_QUICK", "") == "1"
  for op in ops or tokamax.plugin.OP_NAMES:
    cases = all_cases(op, quick=quick)

    @pytest.mark.parametrize("dtype", list(dtypes))
    @pytest.mark.parametrize("case", cases, ids=str)
    def test(case, dtype):
      try:
        check_case(case, implementation, dtype, gradients=gradients)
      except NotImplementedError as e:
        pytest.skip(f"not supported: {e}")

    test.__name__ = f"test_conformance_{op}"
    namespace[test.__name__] = test

  def test_conformance_errors():
    check_errors(implementation)

  namespace["test_conformance_errors"] = test_conformance_errors
