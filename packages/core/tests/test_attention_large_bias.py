"""Query rows whose every key carries a large finite negative bias (the "-1e9
additive mask" of older code): the forward gives such a row uniform weights
over its keys (the softmax of equal logits), and the gradients must follow from
those weights. The XLA reference does (autodiff). Backwards that recompute the
weights as exp(s - lse) from a float32 lse do not by themselves: -1e9 + log(S)
rounds to -1e9 there, so each weight came out 1 (chunked) or the row's
gradients 0 (Triton in interpret mode), S times the reference's gradient norm
(cuDNN and Triton on an H200, bf16; found by an outside fuzz, session 59). The
chunked backward now reads the lse's rounding error (``lse_tail``); cuDNN's and
Triton's go through `large_logits.guard`, which runs the chunked one where a row
needs it. Triton runs in interpret mode on the CPU; cuDNN on a GPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
import tokamax_xla_reference as xla_ref
from tokamax._src import op as op_base
from tokamax._src.ops.attention import api as attention_api
from tokamax._src.ops.attention import large_logits
from tokamax._src.ops.attention import xla as attention_xla

_ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """The expected values are exact in float32; a GPU's default float32 matmuls
  (TF32-class) would miss the tolerance by design, not by a bug."""
  with jax.default_matmul_precision("highest"):
    yield


def _call(b, t, s, n, h, whole_rows, dtype=jnp.float32, seed=0):
  """q, k, v, a bias of -1e9 on the last quarter of the keys (padding) and, with
  `whole_rows`, on every key of the first rows; a random cotangent on every row."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((b, m, n, h)), dtype) for m in (t, s, s))
  bias = np.zeros((b, n, t, s), np.float32)
  bias[..., s - s // 4:] = -1e9
  bias[:, :, :whole_rows, :] = -1e9
  ct = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  return q, k, v, jnp.asarray(bias, dtype), ct


def _grads(implementation, q, k, v, bias, ct, sinks=None):
  """The output and the gradients of q, k, v, the bias (and the sinks, if given)."""
  def attend(q, k, v, bias, *sinks):
    return tokamax.dot_product_attention(q, k, v, bias, sinks=sinks[0] if sinks else None,
                                         implementation=implementation)
  with tokamax.interpret(implementation == "triton" and not _ON_GPU):
    primals = (q, k, v, bias) if sinks is None else (q, k, v, bias, sinks)
    out, vjp = jax.vjp(attend, *primals)
    return (out, *vjp(ct))


def _implementations(cudnn: bool = True):
  """The implementations under test; cuDNN (GPU only) where the shapes are
  ones it takes."""
  names = {i.name for i in tokamax.implementations("dot_product_attention")}
  params = [pytest.param("xla_chunked")]
  params.append(pytest.param("triton", marks=pytest.mark.skipif(
      "triton" not in names, reason="tokamax-gpu-triton is not installed")))
  if cudnn:
    params.append(pytest.param("cudnn", marks=pytest.mark.skipif(
        not _ON_GPU, reason="cuDNN runs on NVIDIA GPUs only")))
  return params


def _relative(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_row_masked_by_large_bias(implementation):
  """One row, every key at -1e9: out is the mean of v, and dv[j] = ct / S."""
  q, k, v, bias, _ = _call(1, 4, 8, 1, 16, whole_rows=1)
  ct = np.zeros(q.shape, np.float32)
  ct[:, 0] = np.random.default_rng(1).standard_normal(ct[:, 0].shape)
  out, _, _, dv, _ = _grads(implementation, q, k, v, bias, jnp.asarray(ct))
  np.testing.assert_allclose(out[0, 0], v[0].mean(0), rtol=1e-5, atol=1e-6)
  want = np.broadcast_to(ct[0, 0] / 8, dv[0].shape)
  np.testing.assert_allclose(dv[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", _implementations())
def test_realistic_rows_masked_by_large_bias(implementation):
  """Against the float32 reference at a size cuDNN takes: output and every
  gradient (q, k, v and the bias), a random cotangent on every row."""
  dtype = jnp.bfloat16 if implementation == "cudnn" else jnp.float32
  shape = (2, 256, 256, 2, 64) if _ON_GPU else (1, 64, 96, 2, 16)
  args = _call(*shape, whole_rows=shape[1] // 8, dtype=dtype)
  want = _grads("xla", *(a.astype(jnp.float32) for a in args))
  got = _grads(implementation, *args)
  tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert _relative(g, w) < tolerance, (name, _relative(g, w))


def test_the_guard_sees_whole_rows_only():
  """Key padding by -1e9 leaves every row a visible key of ordinary size: no
  guard. A row whose visible keys all carry -1e9 needs it, also when causal
  masking is what hides its other keys; not where its cotangent is zero (a
  padded query whose loss is masked: no gradient to get wrong), nor under a
  soft cap that bounds the logits, nor without a bias."""
  q, k, v, bias, ct = _call(1, 8, 8, 1, 16, whole_rows=0)
  check = large_logits.has_large_logit_rows
  assert not bool(check(_canonical(q, k, v, bias), ct))
  _, _, _, whole, _ = _call(1, 8, 8, 1, 16, whole_rows=2)
  assert bool(check(_canonical(q, k, v, whole), ct))
  assert not bool(check(_canonical(q, k, v, whole), ct.at[:, :2].set(0)))
  assert bool(check(_canonical(q, k, v, whole), ct.at[:, :1].set(0)))
  # Causal: row 0 sees key 0 only; a bias of -1e9 there alone masks it whole.
  first_key = np.zeros((1, 1, 8, 8), np.float32)
  first_key[..., 0] = -1e9
  assert bool(check(_canonical(q, k, v, jnp.asarray(first_key), is_causal=True), ct))
  assert check(_canonical(q, k, v, whole, soft_cap=30.0), ct) is None
  assert check(_canonical(q, k, v, None), ct) is None


def test_the_guard_reads_the_forward_lse_where_given():
  """From the lse, a backward's own residual: the same answer without reading
  the bias (the bias given here is all zeros, so it cannot be what answers).
  Without a bias there is no check (ring attention's blocks pass a global lse)."""
  q, k, v, padded, ct = _call(1, 8, 8, 1, 16, whole_rows=0)
  _, _, _, whole, _ = _call(1, 8, 8, 1, 16, whole_rows=2)
  zero_bias = _canonical(q, k, v, jnp.zeros_like(padded))
  for bias, expected in ((padded, False), (whole, True)):
    _, lse = xla_ref.attention(q, k, v, bias, scale=16**-0.5)
    assert bool(large_logits.has_large_logit_rows(zero_bias, ct, lse)) == expected
    assert large_logits.has_large_logit_rows(_canonical(q, k, v, None), ct, lse) is None


def test_the_chunked_backward_from_an_lse_without_its_tail():
  """Another forward's lse (no ``lse_tail``): the chunked backward goes through
  the guard, and is right for rows masked whole."""
  q, k, v, bias, ct = _call(1, 16, 24, 2, 16, whole_rows=3)
  args = _canonical(q, k, v, bias)
  out, lse = xla_ref.attention(q, k, v, bias, scale=args.scale)
  backward = attention_xla.XlaChunkedAttentionVjp()
  grads = backward.backward(args, {"lse": lse}, out, ct,
                            backward.heuristic_config(args))
  _, want_dq, want_dk, want_dv, want_dbias = _grads("xla", q, k, v, bias, ct)
  for name, g, w in (("dq", grads["query"], want_dq), ("dk", grads["key"], want_dk),
                     ("dv", grads["value"], want_dv), ("dbias", grads["bias"], want_dbias)):
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_masked_rows_with_a_zero_cotangent(implementation):
  """Padded queries whose loss is masked: the guard does not fire, and the
  gradients are still the reference's (those rows add nothing)."""
  q, k, v, bias, ct = _call(1, 64, 96, 2, 16, whole_rows=8)
  ct = ct.at[:, :8].set(0)
  args = _canonical(q, k, v, bias)
  assert not bool(large_logits.has_large_logit_rows(args, ct))
  want = _grads("xla", q, k, v, bias, ct)
  got = _grads(implementation, q, k, v, bias, ct)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


_F32_MAX = float(np.finfo(np.float32).max)


def _extreme_bias(bias, kind):
  """`bias` (-1e9 where `_call` masks) with the masked entries set by `kind`."""
  masked = bias < 0
  if kind == "mixed":
    # jax.nn's own mask value on the first half of the keys, float32's minimum
    # on the rest: the first half takes all the weight.
    half = jnp.arange(bias.shape[-1]) < bias.shape[-1] // 2
    return jnp.where(masked, jnp.where(half, -0.7 * _F32_MAX, -_F32_MAX), 0.0)
  if kind == "adjacent":
    # -3e38 on every masked key but the first two, one ulp above it: those two
    # take all the weight (a base-2 map of logits this large may merge them).
    near = np.nextafter(np.float32(-3e38), np.float32(0))
    return jnp.where(masked, jnp.where(jnp.arange(bias.shape[-1]) < 2, near, -3e38), 0.0)
  if kind == "positive":
    # Three keys of every row far above the rest: they take all the weight.
    return jnp.broadcast_to(jnp.where(jnp.arange(bias.shape[-1]) < 3, 3e38, 0.0),
                            bias.shape)
  return jnp.where(masked, float(kind), 0.0)


@pytest.mark.parametrize("kind", ["-1e10", str(-_F32_MAX), "-inf", "mixed", "adjacent",
                                  "positive"],
                         ids=["-1e10", "f32_min", "-inf", "mixed", "adjacent", "positive"])
@pytest.mark.parametrize("zero_masked_cotangent", [False, True])
@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_rows_masked_by_extreme_biases(implementation, zero_masked_cotangent, kind):
  """Beyond -1e9: -1e10, float32's minimum (which overflows to -inf once a
  kernel scales logits to base 2), -inf (keys not visible: the row outputs 0),
  rows mixing two such values or keys one ulp apart at -3e38, and a bias of
  +3e38 on a few keys; with and without a cotangent on the masked rows:
  finite, and the reference's output and gradients."""
  q, k, v, bias, ct = _call(1, 64, 96, 2, 16, whole_rows=8)
  bias = _extreme_bias(bias, kind).astype(jnp.float32)
  if zero_masked_cotangent:
    ct = ct.at[:, :8].set(0)
  want = _grads("xla", q, k, v, bias, ct)
  got = _grads(implementation, q, k, v, bias, ct)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
    assert np.all(np.isfinite(g)), name
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


@pytest.mark.parametrize("cotangent", ["random", "zero"])
@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_sinks_against_extreme_logits(implementation, cotangent):
  """Sinks and keys both beyond 1e38: head 0's sink (2.5e38) lies above three
  keys at 2e38 and takes every row's weight (out 0); head 1's (1.5e38) lies
  below them and takes none (out the mean of their values). A kernel that maps
  keys and sinks to base 2 differently reverses head 1's order. With a zero
  cotangent (the kernel's own backward runs: no row needs the exact one) every
  gradient is finite, and 0."""
  q, k, v, bias, ct = _call(1, 32, 48, 2, 16, whole_rows=0)
  bias = jnp.broadcast_to(jnp.where(jnp.arange(48) < 3, 2e38, 0.0), bias.shape)
  sinks = jnp.array([2.5e38, 1.5e38], jnp.float32)
  if cotangent == "zero":
    ct = jnp.zeros_like(ct)

  want = _grads("xla", q, k, v, bias, ct, sinks)
  got = _grads(implementation, q, k, v, bias, ct, sinks)
  np.testing.assert_array_equal(want[0][:, :, 0], 0.0)
  np.testing.assert_allclose(want[0][:, :, 1], jnp.broadcast_to(
      jnp.mean(v[:, :3, 1], axis=1, keepdims=True), want[0][:, :, 1].shape), rtol=1e-6)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
    assert np.all(np.isfinite(g)), name
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


@pytest.mark.parametrize("big", [1e9, 2e38])
@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_a_sink_tied_with_huge_logits(implementation, big):
  """Three keys and the sink at the same huge logit: each takes a quarter of the
  weight (out 3/4 of the keys' mean value), though the keys' lse alone rounds
  their log-sum away there; and the gradients, the sink's included, are the
  reference's (the guard's exact backward reads the lse's rounding error)."""
  q, k, v, bias, ct = _call(1, 8, 16, 1, 16, whole_rows=0)
  bias = jnp.broadcast_to(jnp.where(jnp.arange(16) < 3, big, 0.0), bias.shape)
  sinks = jnp.array([big], jnp.float32)

  want = _grads("xla", q, k, v, bias, ct, sinks)
  got = _grads(implementation, q, k, v, bias, ct, sinks)
  np.testing.assert_allclose(want[0], jnp.broadcast_to(
      0.75 * jnp.mean(v[:, :3], axis=1, keepdims=True), want[0].shape), rtol=1e-5)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
    assert np.all(np.isfinite(g)), name
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


@pytest.mark.parametrize("implementation", _implementations(cudnn=False))
def test_an_infinite_sink_takes_every_weight(implementation):
  """A sink of +inf (head 0) with a bias: that head's rows output 0 and pass no
  gradient, finite everywhere (inf - inf made NaN of them in Triton); head 1's
  ordinary sink is unaffected. (The dense reference's own dsinks is NaN for the
  infinite sink, so only head 1's is compared.)"""
  q, k, v, bias, ct = _call(1, 16, 24, 2, 16, whole_rows=0)
  sinks = jnp.array([jnp.inf, 0.5], jnp.float32)

  want = _grads("xla", q, k, v, bias, ct, sinks)
  got = _grads(implementation, q, k, v, bias, ct, sinks)
  np.testing.assert_array_equal(got[0][:, :, 0], 0.0)
  for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    assert np.all(np.isfinite(g)), name
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))
  assert np.isfinite(got[5][0])
  assert _relative(got[5][1], want[5][1]) < 1e-5


def test_an_lse_finite_on_rows_without_a_visible_key():
  """cuDNN's lse is finite on rows a mask hides whole (-2.2e12 on an H200),
  where ours is +inf; such a row has no gradient, so it must not look like one
  of huge logits: `lse_with_empty_rows` sets it to +inf, and the guard then
  stays off, though not for a row with a key."""
  q, k, v, _, ct = _call(1, 8, 8, 1, 16, whole_rows=0)
  mask = jnp.ones((1, 1, 8, 8), bool).at[..., :2, :].set(False)
  args = attention_api.canonical_args(q, k, v, jnp.zeros((1, 1, 8, 8)), mask)[0]
  stats = jnp.zeros((1, 1, 8)).at[..., :2].set(-2.2e12)
  lse = large_logits.lse_with_empty_rows(args, stats)
  np.testing.assert_array_equal(lse[..., :2], np.inf)
  np.testing.assert_array_equal(lse[..., 2:], 0.0)
  assert bool(large_logits.has_large_logit_rows(args, ct, stats))
  assert not bool(large_logits.has_large_logit_rows(args, ct, lse))
  big_row = large_logits.lse_with_empty_rows(args, stats.at[..., 2].set(-1e9))
  assert bool(large_logits.has_large_logit_rows(args, ct, big_row))


def test_the_cudnn_statistics_are_the_one_float32_bnt_residual():
  """`_cudnn_lse` takes the single float32 ``[B, N, T]`` leaf of the vjp's
  residuals (rows without a key set to +inf), and None (so the bias is read)
  where there is none or more than one: a future JAX keeping its residuals
  otherwise must fall back, not pick a wrong array."""
  q, k, v, bias, _ = _call(2, 8, 8, 3, 16, whole_rows=0)
  args = _canonical(q, k, v, bias)
  stats = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
  others = (q.astype(jnp.bfloat16), bias.astype(jnp.bfloat16), jnp.zeros((0,)),
            jnp.zeros((2, 8, 3), jnp.float32), jnp.zeros((2,), jnp.int32))
  vjp = jax.tree_util.Partial(lambda *a: None, *others, stats)
  np.testing.assert_array_equal(attention_xla._cudnn_lse(vjp, args), stats)
  assert attention_xla._cudnn_lse(jax.tree_util.Partial(lambda *a: None, *others),
                                  args) is None
  assert attention_xla._cudnn_lse(
      jax.tree_util.Partial(lambda *a: None, stats, stats + 1), args) is None


@pytest.mark.skipif(not _ON_GPU, reason="cuDNN runs on NVIDIA GPUs only")
def test_the_cudnn_forward_leaves_its_statistics():
  """On a GPU, with the JAX installed: the cuDNN forward's residuals hold the
  statistics `_cudnn_lse` looks for, and they are the reference's lse (were
  they not found, the backward would read the bias: right, but slower)."""
  q, k, v, bias, _ = _call(2, 256, 256, 2, 64, whole_rows=8, dtype=jnp.bfloat16)
  args = _canonical(q, k, v, bias)
  with op_base.allow_opaque_residuals():
    _, residuals = attention_xla.CudnnAttention().forward(args, None)
  assert attention_xla._CUDNN_VJP in residuals, "no cuDNN vjp among the residuals"
  lse = attention_xla._cudnn_lse(residuals[attention_xla._CUDNN_VJP], args)
  assert lse is not None, "cuDNN's statistics not found among the vjp's residuals"
  _, want = xla_ref.attention(*(x.astype(jnp.float32) for x in (q, k, v, bias)),
                              scale=args.scale)
  np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-3)


def test_the_chunked_weights_never_exceed_one():
  """An lse 128 below a masked row's logits (what a base-2 forward's lse can
  come to after conversion, next to -1.55e9) with that row's cotangent zero:
  finite gradients, the reference's."""
  q, k, v, bias, ct = _call(1, 16, 24, 1, 16, whole_rows=3)
  bias = jnp.where(bias < 0, -1.55e9, 0.0).astype(jnp.float32)
  ct = ct.at[:, :3].set(0)
  args = _canonical(q, k, v, bias)
  out, lse = xla_ref.attention(q, k, v, bias, scale=args.scale)
  lse = lse.at[:, :, :3].add(-128.0)
  dq, dk, dv, _ = xla_ref.attention_chunked_backward(
      q, k, v, bias, None, out, lse, ct, scale=args.scale)
  _, want_dq, want_dk, want_dv, _ = _grads("xla", q, k, v, bias, ct)
  for name, g, w in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dv", dv, want_dv)):
    assert np.all(np.isfinite(g)), name
    assert _relative(g, w) < 1e-5, (name, _relative(g, w))


def test_the_guard_stays_a_branch_under_vmap():
  """Under jax.vmap the guard's condition covers the whole batch, so the
  program keeps a conditional (a batched condition would run both backwards)."""
  q, k, v, bias, ct = _call(3, 8, 8, 1, 16, whole_rows=1)

  def grads(q, k, v, bias, ct):
    canonical = _canonical(q, k, v, bias)
    return large_logits.guard(canonical, ct, lambda: {"query": q * 0})

  jaxpr = jax.make_jaxpr(jax.vmap(grads))(q[:, None], k[:, None], v[:, None],
                                          bias[:, None], ct[:, None])
  # A batched condition turns the cond into both branches and a select.
  assert "cond[" in str(jaxpr)


def _canonical(q, k, v, bias, is_causal=False, soft_cap=None):
  return attention_api.canonical_args(q, k, v, bias, is_causal=is_causal,
                                      logits_soft_cap=soft_cap)[0]


@pytest.mark.parametrize("keys, loops", [(16 * 512, False), (16 * 512 + 1, True)])
def test_the_exact_branch_unrolls_its_chunk_loops_up_to_a_bound(keys, loops):
  """Up to `UNROLLED_CHUNKS` key chunks the exact branch holds no loop (so XLA
  can keep the conditional on the GPU); beyond, its loops stay loops (the
  unrolled program would grow with the keys)."""
  q, k, v, bias, ct = _call(1, 8, keys, 1, 16, whole_rows=0)
  args = _canonical(q, k, v, bias)
  lowered = jax.jit(lambda ct: large_logits.guard(args, ct, lambda: {"query": q})).lower(ct)
  text = lowered.as_text()
  assert "stablehlo.case" in text
  assert ("stablehlo.while" in text) == loops
