"""Independent checker of tokamax's public API (core + XLA reference), CPU only.

Run: python3 tools/checks/check_api.py [filter]
"""

import math
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import tokamax
from tokamax._src import dispatch
from tokamax._src.ops import attention as attn_mod

FILTER = sys.argv[1] if len(sys.argv) > 1 else ""
RESULTS = []
IMPLS = (None, "xla", "xla_chunked")  # xla_chunked only for attention
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 2e-2), jnp.float16: (3e-3, 3e-3)}
GTOL = {jnp.float32: (1e-4, 1e-4), jnp.bfloat16: (6e-2, 6e-2), jnp.float16: (1e-2, 1e-2)}


def check(name):
  def deco(fn):
    if FILTER and FILTER not in name:
      return fn
    try:
      fn()
      RESULTS.append((name, "ok", ""))
    except Exception as e:
      tb = traceback.format_exc(limit=-3)
      RESULTS.append((name, "FAIL", f"{type(e).__name__}: {str(e)[:600]}\n{tb[-1500:]}"))
    return fn
  return deco


def rng(seed=0):
  return np.random.default_rng(seed)


def rand(r, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(r.standard_normal(shape) * scale, dtype)


def f64(x):
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def close(got, want, dtype, tol=TOL, what=""):
  rtol, atol = tol[dtype]
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  assert np.all(np.isfinite(got)), f"{what}: non-finite values in result"
  scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
  err = np.abs(got - want)
  bound = atol * scale + rtol * np.abs(want)
  if not np.all(err <= bound):
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    raise AssertionError(f"{what}: max excess at {i}: got {got[i]}, want {want[i]} "
                         f"(max abs err {err.max():.3g})")


# --------------------------------------------------------------------------------
# Independent references, written from the documented contracts. `xp` is numpy
# (forward) or jax.numpy in float64 (gradients, by autodiff of this same code).

def attention_ref(xp, q, k, v, bias=None, mask=None, *, scale=None, is_causal=False,
                  window=None, soft_cap=None, qlen=None, kvlen=None, qseg=None,
                  kvseg=None, q_offset=0):
  *batch, t, n, h = q.shape
  s, kh = k.shape[-3], k.shape[-2]
  rep = n // kh
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  kk = xp.repeat(k, rep, axis=-2)
  vv = xp.repeat(v, rep, axis=-2)
  logits = xp.einsum("...tnh,...snh->...nts", q, kk) * scale
  if bias is not None:
    logits = logits + bias
  if soft_cap is not None:
    logits = soft_cap * xp.tanh(logits / soft_cap)
  tpos = np.arange(t)[:, None] + q_offset
  spos = np.arange(s)[None, :]
  vis = np.ones((t, s), bool)
  if is_causal:
    vis &= spos <= tpos
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    if left is not None:
      vis &= spos >= tpos - left
    if right is not None:
      vis &= spos <= tpos + right
  vis = np.broadcast_to(vis, (*batch, n, t, s))
  if mask is not None:
    vis = vis & np.broadcast_to(np.asarray(mask), vis.shape)
  if qlen is not None:
    ql = np.asarray(qlen)[..., None, None, None]
    vis = vis & (np.arange(t)[:, None] < ql)
  if kvlen is not None:
    kl = np.asarray(kvlen)[..., None, None, None]
    vis = vis & (np.arange(s)[None, :] < kl)
  if qseg is not None:
    qs, ks = np.asarray(qseg), np.asarray(kvseg)
    vis = vis & (qs[..., None, :, None] == ks[..., None, None, :])
  vis = np.asarray(vis)
  masked = xp.where(vis, logits, -1e300)
  m = xp.max(masked, axis=-1, keepdims=True)
  m = xp.where(m < -1e299, 0.0, m)
  e = xp.where(vis, xp.exp(xp.where(vis, logits - m, 0.0)), 0.0)
  tot = xp.sum(e, axis=-1, keepdims=True)
  p = e / xp.where(tot > 0, tot, 1.0)
  out = xp.einsum("...nts,...snh->...tnh", p, vv)
  return out


def norm_ref(xp, x, scale, offset, *, axis=-1, eps=1e-6, subtract_mean=True):
  if subtract_mean:
    mean = xp.mean(x, axis=axis, keepdims=True)
    c = x - mean
  else:
    c = x
  var = xp.mean(c * c, axis=axis, keepdims=True)
  y = c / xp.sqrt(var + eps)
  shape = [1] * x.ndim
  shape[axis] = x.shape[axis]
  if scale is not None:
    y = y * xp.reshape(scale, shape)
  if offset is not None:
    y = y + xp.reshape(offset, shape)
  return y


def act_ref(xp, name, g):
  if name is None:
    return g
  if name == "silu":
    return g / (1 + xp.exp(-g))
  if name == "gelu":  # jax.nn.gelu default: tanh approximation
    return 0.5 * g * (1 + xp.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
  if name == "relu":
    return xp.maximum(g, 0.0)
  if name == "custom":
    return g * (1 / (1 + xp.exp(-1.5 * g))) + 0.25 * g * g
  raise ValueError(name)


ACTS = {None: None, "silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu,
        "custom": lambda g: g * jax.nn.sigmoid(1.5 * g) + 0.25 * g * g}


def glu_ref(xp, x, wg, wu, act):
  gate = xp.einsum("...k,kn->...n", x, wg)
  up = xp.einsum("...k,kn->...n", x, wu)
  return act_ref(xp, act, gate) * up


def ragged_ref(xp, lhs, rhs, sizes, offset=None):
  sizes = np.asarray(sizes)
  m = lhs.shape[0]
  ends = np.cumsum(sizes)
  gid = np.searchsorted(ends, np.arange(m), side="right")  # G for rows past the end
  off = 0 if offset is None else int(offset)
  rows = []
  for i in range(m):
    g = gid[i] - off
    if gid[i] < len(sizes) and 0 <= g < rhs.shape[0]:
      rows.append(lhs[i] @ rhs[g])
    else:
      rows.append(xp.zeros((rhs.shape[2],), lhs.dtype) * lhs[i, :1])
  return xp.stack(rows) if m else xp.zeros((0, rhs.shape[2]))


def ref_grad(ref_fn, args, argnums, cot):
  """Gradients of sum(ref_fn(*args) * cot) in float64 (JAX autodiff of our ref)."""
  with jax.enable_x64(True):
    a64 = [None if a is None else (jnp.asarray(a, jnp.float64)
                                   if i in argnums else a) for i, a in enumerate(args)]
    c64 = jnp.asarray(cot, jnp.float64)

    def loss(*diff):
      full = list(a64)
      for i, d in zip(argnums, diff):
        full[i] = d
      return jnp.sum(ref_fn(*full) * c64)
    gs = jax.grad(loss, argnums=tuple(range(len(argnums))))(*[a64[i] for i in argnums])
    return [np.asarray(g, np.float64) for g in gs]


def tk_grad(fn, args, argnums, cot):
  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) * cot)
  return jax.grad(loss, argnums=argnums)(*args)


# --------------------------------------------------------------------------------
# Attention numerics.

ATTN_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal_T>S": dict(is_causal=True, T=7, S=4),
    "causal_T<S": dict(is_causal=True, T=3, S=8),
    "window_int": dict(window=1),
    "window_pair": dict(window=(2, 0)),
    "window_left_none": dict(window=(None, 1)),
    "window_right_none": dict(window=(1, None)),
    "window+causal": dict(window=(2, 3), is_causal=True),
    "soft_cap": dict(soft_cap=2.0),
    "bias_full": dict(bias="full"),
    "bias_bcast": dict(bias="bcast"),
    "mask_full": dict(mask="full"),
    "mask_bcast": dict(mask="bcast"),
    "segments": dict(seg=True),
    "gqa": dict(N=4, K=2),
    "mqa": dict(N=4, K=1),
    "qlen": dict(qlen=True),
    "kvlen": dict(kvlen=True),
    "scale": dict(scale=0.3),
    "Hv!=H": dict(Hv=3),
    "T=1": dict(T=1),
    "1head": dict(N=1, K=1),
    "width1": dict(H=1, Hv=1),
    "all": dict(is_causal=True, window=(3, None), soft_cap=3.0, bias="bcast",
                mask="bcast", seg=True, N=4, K=2, qlen=True, kvlen=True, scale=0.5),
    "bias+softcap": dict(bias="full", soft_cap=1.5),
}


def make_attention(case, dtype=jnp.float32, seed=0, batch=(2,)):
  c = dict(T=5, S=6, N=2, K=2, H=4, Hv=None)
  c.update(case)
  r = rng(seed)
  t, s, n, kh, h = c["T"], c["S"], c["N"], c["K"], c["H"]
  hv = c["Hv"] or h
  q = rand(r, (*batch, t, n, h), dtype)
  k = rand(r, (*batch, s, kh, h), dtype)
  v = rand(r, (*batch, s, kh, hv), dtype)
  kw = {}
  ref_kw = {}
  bias = mask = None
  if c.get("bias") == "full":
    bias = rand(r, (*batch, n, t, s), dtype)
  elif c.get("bias") == "bcast":
    bias = rand(r, (1, t, s), dtype)  # rank 3: broadcast over batch and head
  if c.get("mask") == "full":
    mask = jnp.asarray(r.random((*batch, n, t, s)) > 0.3)
  elif c.get("mask") == "bcast":
    mask = jnp.asarray(r.random((t, s)) > 0.3)
  if c.get("is_causal"):
    kw["is_causal"] = ref_kw["is_causal"] = True
  if c.get("window") is not None:
    kw["local_window_size"] = ref_kw["window"] = c["window"]
  if c.get("soft_cap") is not None:
    kw["logits_soft_cap"] = ref_kw["soft_cap"] = c["soft_cap"]
  if c.get("scale") is not None:
    kw["scale"] = ref_kw["scale"] = c["scale"]
  if c.get("qlen"):
    ql = jnp.asarray(r.integers(0, t + 1, batch), jnp.int32)
    kw["query_seq_lengths"] = ref_kw["qlen"] = ql
  if c.get("kvlen"):
    kl = jnp.asarray(r.integers(0, s + 1, batch), jnp.int32)
    kw["key_value_seq_lengths"] = ref_kw["kvlen"] = kl
  if c.get("seg"):
    qs = jnp.asarray(np.sort(r.integers(0, 3, (*batch, t)), axis=-1), jnp.int32)
    ks = jnp.asarray(np.sort(r.integers(0, 3, (*batch, s)), axis=-1), jnp.int32)
    kw["q_segment_ids"] = ref_kw["qseg"] = qs
    kw["kv_segment_ids"] = ref_kw["kvseg"] = ks
  return q, k, v, bias, mask, kw, ref_kw


def attention_forward_and_grad(case_name, case, impl, dtype):
  q, k, v, bias, mask, kw, ref_kw = make_attention(case, dtype)

  def fn(q, k, v, bias):
    return tokamax.dot_product_attention(q, k, v, bias, mask, implementation=impl, **kw)
  out = fn(q, k, v, bias)
  assert out.dtype == dtype, f"out dtype {out.dtype}"
  want = attention_ref(np, f64(q), f64(k), f64(v), f64(bias), mask, **ref_kw)
  close(out, want, dtype, what=f"fwd {case_name}")
  cot = rand(rng(9), out.shape)
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  got = tk_grad(fn, (q, k, v, bias), argnums, cot)
  want = ref_grad(lambda q, k, v, b: attention_ref(jnp, q, k, v, b, mask, **ref_kw),
                  [q, k, v, bias], argnums, cot)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == (q, k, v, bias)[i].dtype, f"grad {i} dtype {g.dtype}"
    close(g, w, dtype, GTOL, what=f"grad arg{i} {case_name}")


for _impl in IMPLS:
  for _name, _case in ATTN_CASES.items():
    for _dt in ((jnp.float32, jnp.bfloat16, jnp.float16) if _name in ("all", "causal")
                else (jnp.float32,)):
      check(f"attention[{_impl}] {_name} {jnp.dtype(_dt).name}")(
          lambda n=_name, c=_case, i=_impl, d=_dt: attention_forward_and_grad(n, c, i, d))


@check("attention multi-batch dims [2,3]")
def _():
  q, k, v, bias, mask, kw, ref_kw = make_attention(
      dict(bias="full", mask="full", qlen=True, kvlen=True, seg=True), batch=(2, 3))
  out = tokamax.dot_product_attention(q, k, v, bias, mask, **kw)
  want = attention_ref(np, f64(q), f64(k), f64(v), f64(bias), mask, **ref_kw)
  close(out, want, jnp.float32)


@check("attention fully masked rows are 0 and grads finite")
def _():
  q, k, v, _, _, _, _ = make_attention({})
  mask = np.ones((2, 2, 5, 6), bool)
  mask[:, :, 1] = False
  mask[1, 0, 3] = False
  mask = jnp.asarray(mask)
  for impl in IMPLS:
    out = tokamax.dot_product_attention(q, k, v, mask=mask, implementation=impl)
    assert np.all(np.asarray(out)[:, 1] == 0), impl
    assert np.all(np.asarray(out)[1, 3, 0] == 0), impl
    g = jax.grad(lambda q, k, v: jnp.sum(tokamax.dot_product_attention(
        q, k, v, mask=mask, implementation=impl) ** 2), argnums=(0, 1, 2))(q, k, v)
    for x in g:
      assert np.all(np.isfinite(np.asarray(x))), impl
    assert np.all(np.asarray(g[0])[:, 1] == 0)


@check("attention kvlen=0 and qlen=0 rows are 0 and grads finite")
def _():
  q, k, v, _, _, _, _ = make_attention({})
  for impl in IMPLS:
    for kw in (dict(key_value_seq_lengths=jnp.asarray([0, 3])),
               dict(query_seq_lengths=jnp.asarray([0, 2]))):
      out = tokamax.dot_product_attention(q, k, v, implementation=impl, **kw)
      assert np.all(np.isfinite(np.asarray(out)))
      g = jax.grad(lambda q, k, v: jnp.sum(tokamax.dot_product_attention(
          q, k, v, implementation=impl, **kw) ** 2), argnums=(0, 1, 2))(q, k, v)
      for x in g:
        assert np.all(np.isfinite(np.asarray(x))), (impl, kw)
    out = tokamax.dot_product_attention(q, k, v, implementation=impl,
                                        key_value_seq_lengths=jnp.asarray([0, 3]))
    assert np.all(np.asarray(out)[0] == 0)


@check("attention bias -inf entries (masking via bias)")
def _():
  q, k, v, _, _, _, _ = make_attention({})
  bias = np.array(rand(rng(3), (2, 2, 5, 6)))
  bias[:, :, :, 0] = -np.inf
  bias = jnp.asarray(bias, jnp.float32)
  for impl in IMPLS:
    out = tokamax.dot_product_attention(q, k, v, bias, implementation=impl)
    fin = np.asarray(bias) > -np.inf
    want = attention_ref(np, f64(q), f64(k), f64(v), np.where(fin, f64(bias), 0), fin)
    # with the contract logits = q.k*scale + bias; -inf bias excludes the key
    close(out, want + 0 * want, jnp.float32, what=f"{impl}")


@check("attention q_offset via AttentionArgs (xla, xla_chunked)")
def _():
  q, k, v, _, _, _, _ = make_attention({})
  for off in (-2, 0, 3):
    for case in (dict(is_causal=True), dict(local_window_size=(1, 2)),
                 dict(is_causal=True, local_window_size=(2, None))):
      args, _ = attn_mod.canonical_args(q, k, v, **case)
      import dataclasses
      args = dataclasses.replace(args, q_offset=jnp.asarray(off, jnp.int32))
      ref_kw = dict(is_causal=case.get("is_causal", False),
                    window=case.get("local_window_size"), q_offset=off)
      want = attention_ref(np, f64(q), f64(k), f64(v), None, None, **ref_kw)
      for impl in ("xla", "xla_chunked", None):
        out = dispatch.call(attn_mod.DEFINITION, args, impl)
        close(out, want, jnp.float32, what=f"{impl} off={off} {case}")
        cot = rand(rng(9), out.shape)

        def fn(q, k, v, args=args, impl=impl):
          a = dataclasses.replace(args, query=q, key=k, value=v)
          return dispatch.call(attn_mod.DEFINITION, a, impl)
        got = tk_grad(fn, (q, k, v), (0, 1, 2), cot)
        wg = ref_grad(lambda q, k, v: attention_ref(jnp, q, k, v, **ref_kw),
                      [q, k, v], (0, 1, 2), cot)
        for g, w in zip(got, wg):
          close(g, w, jnp.float32, GTOL, what=f"grad {impl} off={off} {case}")


@check("attention chunked with small chunk (S not multiple)")
def _():
  import importlib
  ra = importlib.import_module('tokamax_xla_reference.attention')
  q, k, v, bias, mask, kw, ref_kw = make_attention(
      dict(bias="bcast", mask="full", is_causal=True, S=7, soft_cap=2.0, N=4, K=2))
  args, _ = attn_mod.canonical_args(q, k, v, bias, mask, **kw)
  for cs in (1, 2, 3, 16):
    out, lse = ra.attention_chunked(args.query, args.key, args.value, args.bias,
                                    args.mask, scale=args.scale, is_causal=True,
                                    logits_soft_cap=2.0, chunk_size=cs)
    want = attention_ref(np, f64(q), f64(k), f64(v), f64(bias), mask, **ref_kw)
    close(out, want, jnp.float32, what=f"cs={cs}")
    dout = rand(rng(4), out.shape)
    dq, dk, dv, db = ra.attention_chunked_backward(
        args.query, args.key, args.value, args.bias, args.mask, out, lse, dout,
        scale=args.scale, is_causal=True, logits_soft_cap=2.0, chunk_size=cs)
    wg = ref_grad(lambda q, k, v, b: attention_ref(jnp, q, k, v, b, mask, **ref_kw),
                  [q, k, v, bias], (0, 1, 2, 3), dout)
    close(dq, wg[0], jnp.float32, GTOL, what=f"dq cs={cs}")
    close(dk, wg[1], jnp.float32, GTOL, what=f"dk cs={cs}")
    close(dv, wg[2], jnp.float32, GTOL, what=f"dv cs={cs}")
    close(db.reshape(wg[3].shape), wg[3], jnp.float32, GTOL, what=f"db cs={cs}")


# --------------------------------------------------------------------------------
# Norms.

def norm_case(impl, dtype, shape, axis, with_scale, with_offset, eps, rms):
  r = rng(1)
  x = rand(r, shape, dtype, scale=2.0) + jnp.asarray(0.5, dtype)
  d = shape[axis]
  scale = rand(r, (d,), dtype) if with_scale else None
  offset = rand(r, (d,), dtype) if with_offset else None
  if rms:
    fn = lambda x, s, o: tokamax.rms_norm(x, s, axis=axis, epsilon=eps,
                                          implementation=impl)
  else:
    fn = lambda x, s, o: tokamax.layer_norm(x, s, o, axis=axis,
                                            epsilon=eps, implementation=impl)
  out = fn(x, scale, offset)
  assert out.dtype == dtype and out.shape == x.shape
  o_ref = None if rms else offset
  want = norm_ref(np, f64(x), f64(scale), f64(o_ref), axis=axis, eps=eps,
                  subtract_mean=not rms)
  close(out, want, dtype, what="fwd")
  cot = rand(rng(5), shape)
  argnums = tuple(i for i, a in enumerate((x, scale, None if rms else offset))
                  if a is not None)
  got = tk_grad(fn, (x, scale, offset), argnums, cot)
  wg = ref_grad(lambda x, s, o: norm_ref(jnp, x, s, o, axis=axis, eps=eps,
                                         subtract_mean=not rms),
                [x, scale, o_ref], argnums, cot)
  for g, w in zip(got, wg):
    close(g, w, dtype, GTOL, what="grad")


for _impl in (None, "xla"):
  for _rms in (False, True):
    for _shape, _axis in (((3, 8), -1), ((4, 5, 6), 1), ((5, 4, 3), 0), ((1, 8), -1),
                          ((3, 1), -1), ((7,), 0), ((2, 3, 4), -3)):
      for _sc, _of in ((True, True), (False, False), (True, False), (False, True)):
        if _rms and _of:
          continue
        check(f"{'rms' if _rms else 'layer'}_norm[{_impl}] {_shape} ax={_axis} "
              f"s={_sc} o={_of}")(
            lambda i=_impl, s=_shape, a=_axis, sc=_sc, of=_of, rm=_rms: norm_case(
                i, jnp.float32, s, a, sc, of, 1e-5, rm))
  for _dt in (jnp.bfloat16, jnp.float16):
    check(f"layer_norm[{_impl}] {jnp.dtype(_dt).name}")(
        lambda i=_impl, d=_dt: norm_case(i, d, (4, 16), -1, True, True, 1e-6, False))
  check(f"layer_norm[{_impl}] eps=0.5")(
      lambda i=_impl: norm_case(i, jnp.float32, (4, 16), -1, True, True, 0.5, False))
  check(f"layer_norm[{_impl}] eps=0 int eps")(
      lambda i=_impl: norm_case(i, jnp.float32, (4, 16), -1, True, True, 0, False))


@check("layer_norm constant row (var 0) eps>0 finite")
def _():
  x = jnp.ones((2, 8), jnp.float32) * 3.0
  y = tokamax.layer_norm(x, None, None)
  assert np.all(np.isfinite(np.asarray(y)))
  g = jax.grad(lambda x: jnp.sum(tokamax.layer_norm(x, None, None) * jnp.arange(8.)))(x)
  assert np.all(np.isfinite(np.asarray(g)))


# --------------------------------------------------------------------------------
# GLU.

def glu_case(impl, dtype, act, x_shape, n, pair):
  r = rng(2)
  kdim = x_shape[-1]
  x = rand(r, x_shape, dtype)
  w = rand(r, (kdim, 2, n), dtype, scale=0.5)
  weights = (w[:, 0], w[:, 1]) if pair else w

  def fn(x, w):
    ww = (w[:, 0], w[:, 1]) if pair else w
    return tokamax.gated_linear_unit(x, ww, activation=ACTS[act], implementation=impl)
  out = fn(x, w)
  del weights
  assert out.dtype == dtype and out.shape == (*x_shape[:-1], n), (out.shape, out.dtype)
  want = glu_ref(np, f64(x), f64(w[:, 0]), f64(w[:, 1]), act)
  close(out, want, dtype, what="fwd")
  cot = rand(rng(6), out.shape)
  got = tk_grad(fn, (x, w), (0, 1), cot)
  wg = ref_grad(lambda x, w: glu_ref(jnp, x, w[:, 0], w[:, 1], act), [x, w], (0, 1), cot)
  for g, w_ in zip(got, wg):
    close(g, w_, dtype, GTOL, what="grad")


for _impl in (None, "xla"):
  for _act in ACTS:
    check(f"glu[{_impl}] act={_act}")(
        lambda i=_impl, a=_act: glu_case(i, jnp.float32, a, (3, 8), 4, False))
  check(f"glu[{_impl}] pair weights rank3 x")(
      lambda i=_impl: glu_case(i, jnp.float32, "silu", (2, 3, 8), 4, True))
  check(f"glu[{_impl}] 1 row, K=1, N=1")(
      lambda i=_impl: glu_case(i, jnp.float32, "gelu", (1, 1), 1, False))
  check(f"glu[{_impl}] rank1 x")(
      lambda i=_impl: glu_case(i, jnp.float32, "silu", (8,), 3, False))
  for _dt in (jnp.bfloat16, jnp.float16):
    check(f"glu[{_impl}] {jnp.dtype(_dt).name}")(
        lambda i=_impl, d=_dt: glu_case(i, d, "silu", (4, 16), 8, False))


# --------------------------------------------------------------------------------
# ragged_dot.

def ragged_case(impl, dtype, sizes, m, g_rhs=None, offset=None, pet=None):
  r = rng(3)
  g = len(sizes)
  g_rhs = g if g_rhs is None else g_rhs
  lhs = rand(r, (m, 8), dtype)
  rhs = rand(r, (g_rhs, 8, 5), dtype)
  gs = jnp.asarray(sizes, jnp.int32)

  def fn(lhs, rhs):
    return tokamax.ragged_dot(lhs, rhs, gs, group_offset=offset,
                              preferred_element_type=pet, implementation=impl)
  out = fn(lhs, rhs)
  want_dtype = jnp.dtype(pet) if pet is not None else jnp.dtype(dtype)
  assert out.dtype == want_dtype, out.dtype
  want = ragged_ref(np, f64(lhs), f64(rhs), sizes, offset)
  close(out, want, (jnp.bfloat16 if jnp.bfloat16 in (dtype, pet) else
                    jnp.float16 if jnp.float16 in (dtype, pet) else jnp.float32), what="fwd")
  cot = rand(rng(7), out.shape)
  got = tk_grad(fn, (lhs, rhs), (0, 1), cot)
  wg = ref_grad(lambda a, b: ragged_ref(jnp, a, b, sizes, offset), [lhs, rhs], (0, 1), cot)
  for x, w in zip(got, wg):
    assert x.dtype == jnp.dtype(dtype), x.dtype
    close(x, w, jnp.bfloat16 if jnp.bfloat16 in (dtype, pet) else
          jnp.float16 if jnp.float16 in (dtype, pet) else jnp.float32, GTOL, what="grad")


for _impl in (None, "xla"):
  check(f"ragged[{_impl}] basic")(lambda i=_impl: ragged_case(i, jnp.float32, [3, 2, 4], 9))
  check(f"ragged[{_impl}] empty groups")(
      lambda i=_impl: ragged_case(i, jnp.float32, [0, 5, 0, 4, 0], 9))
  check(f"ragged[{_impl}] rows beyond sum")(
      lambda i=_impl: ragged_case(i, jnp.float32, [2, 1, 3], 10))
  check(f"ragged[{_impl}] all zero sizes")(
      lambda i=_impl: ragged_case(i, jnp.float32, [0, 0], 4))
  check(f"ragged[{_impl}] group_offset=1 g_rhs=2")(
      lambda i=_impl: ragged_case(i, jnp.float32, [2, 3, 1, 2], 9, g_rhs=2, offset=1))
  check(f"ragged[{_impl}] group_offset=0 g_rhs=1")(
      lambda i=_impl: ragged_case(i, jnp.float32, [2, 3, 1], 7, g_rhs=1, offset=0))
  check(f"ragged[{_impl}] group_offset=2 g_rhs=2 (last)")(
      lambda i=_impl: ragged_case(i, jnp.float32, [2, 3, 1, 2], 9, g_rhs=2, offset=2))
  check(f"ragged[{_impl}] pet=f32 from bf16")(
      lambda i=_impl: ragged_case(i, jnp.bfloat16, [3, 2, 4], 9, pet=jnp.float32))
  check(f"ragged[{_impl}] pet=bf16 from f32")(
      lambda i=_impl: ragged_case(i, jnp.float32, [3, 2, 4], 9, pet=jnp.bfloat16))
  for _dt in (jnp.bfloat16, jnp.float16):
    check(f"ragged[{_impl}] {jnp.dtype(_dt).name}")(
        lambda i=_impl, d=_dt: ragged_case(i, d, [3, 2, 4], 9))
  check(f"ragged[{_impl}] 1 row 1 group")(
      lambda i=_impl: ragged_case(i, jnp.float32, [1], 1))


# --------------------------------------------------------------------------------
# Transforms: jit, vmap (incl. vmap of grad), export round trip, eval_shape.

def _ops():
  r = rng(11)
  q, k, v, bias, mask, kw, _ = make_attention(
      dict(is_causal=True, bias="full", mask="full", seg=True, qlen=True, kvlen=True,
           N=4, K=2, soft_cap=2.0, window=(3, 1)), batch=(2,))
  sizes = jnp.asarray([3, 0, 4], jnp.int32)
  sizes_off = jnp.asarray([2, 3, 1, 2], jnp.int32)
  return {
      "attention": (lambda q, k, v, b: tokamax.dot_product_attention(
          q, k, v, b, mask, **kw), (q, k, v, bias)),
      "attention_chunked": (lambda q, k, v, b: tokamax.dot_product_attention(
          q, k, v, b, mask, implementation="xla_chunked", **kw), (q, k, v, bias)),
      "attention_plain": (lambda q, k, v: tokamax.dot_product_attention(q, k, v),
                          (q, k, v)),
      "layer_norm": (lambda x, s, o: tokamax.layer_norm(x, s, o, axis=0),
                     (rand(r, (6, 3, 4)), rand(r, (6,)), rand(r, (6,)))),
      "rms_norm": (lambda x, s: tokamax.rms_norm(x, s), (rand(r, (3, 16)), rand(r, (16,)))),
      "glu": (lambda x, w: tokamax.gated_linear_unit(x, w, activation=ACTS["custom"]),
              (rand(r, (5, 16)), rand(r, (16, 2, 8)))),
      "ragged_dot": (lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, sizes),
                     (rand(r, (9, 16)), rand(r, (3, 16, 8)))),
      "ragged_dot_offset": (lambda lhs, rhs: tokamax.ragged_dot(
          lhs, rhs, sizes_off, group_offset=jnp.asarray(1)),
          (rand(r, (9, 16)), rand(r, (2, 16, 8)))),
  }


def _loss(f):
  return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)


for _name in ("attention", "attention_chunked", "attention_plain", "layer_norm",
              "rms_norm", "glu", "ragged_dot", "ragged_dot_offset"):
  @check(f"transform jit+grad {_name}")
  def _(name=_name):
    f, args = _ops()[name]
    eager = f(*args)
    jitted = jax.jit(f)(*args)
    close(jitted, f64(eager), jnp.float32, what="jit")
    ga = jax.grad(_loss(f), argnums=tuple(range(len(args))))(*args)
    gj = jax.jit(jax.grad(_loss(f), argnums=tuple(range(len(args)))))(*args)
    for a, b in zip(ga, gj):
      close(b, f64(a), jnp.float32, GTOL, what="jit grad")

  @check(f"transform vmap {_name}")
  def _(name=_name):
    f, args = _ops()[name]
    r = rng(12)
    batched = [jnp.stack([a, a + rand(r, a.shape, a.dtype, 0.1),
                          a - rand(r, a.shape, a.dtype, 0.1)]) for a in args]
    got = jax.vmap(f)(*batched)
    for i in range(3):
      close(got[i], f64(f(*[b[i] for b in batched])), jnp.float32, what=f"vmap {i}")
    argnums = tuple(range(len(args)))
    gv = jax.vmap(jax.grad(_loss(f), argnums=argnums))(*batched)
    for i in range(3):
      gl = jax.grad(_loss(f), argnums=argnums)(*[b[i] for b in batched])
      for a, b in zip(gv, gl):
        close(a[i], f64(b), jnp.float32, GTOL, what=f"vmap grad {i}")
    # vmap over only the first argument (others broadcast)
    got = jax.vmap(f, in_axes=(0,) + (None,) * (len(args) - 1))(batched[0], *args[1:])
    for i in range(3):
      close(got[i], f64(f(batched[0][i], *args[1:])), jnp.float32, what=f"vmap0 {i}")

  @check(f"transform export {_name}")
  def _(name=_name):
    f, args = _ops()[name]
    exp = export.export(jax.jit(f))(*args)
    exp2 = export.deserialize(exp.serialize())
    close(exp2.call(*args), f64(f(*args)), jnp.float32, what="export")
    argnums = tuple(range(len(args)))
    g = jax.jit(jax.grad(_loss(f), argnums=argnums))
    expg = export.deserialize(export.export(g)(*args).serialize())
    for a, b in zip(expg.call(*args), g(*args)):
      close(a, f64(b), jnp.float32, GTOL, what="export grad")
    # export with vjp_order=1 and differentiate the deserialized function
    exp1 = export.deserialize(export.export(jax.jit(f))(*args).serialize(vjp_order=1))
    gg = jax.grad(_loss(exp1.call), argnums=argnums)(*args)
    for a, b in zip(gg, g(*args)):
      close(a, f64(b), jnp.float32, GTOL, what="export vjp_order=1")

  @check(f"transform eval_shape {_name}")
  def _(name=_name):
    f, args = _ops()[name]
    shp = jax.eval_shape(f, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
    out = f(*args)
    assert shp.shape == out.shape and shp.dtype == out.dtype, (shp, out.shape)


@check("transform vmap ragged_dot over group_sizes too")
def _():
  r = rng(13)
  lhs = rand(r, (3, 9, 8))
  rhs = rand(r, (3, 3, 8, 5))
  gs = jnp.asarray([[3, 0, 4], [1, 1, 1], [9, 0, 0]], jnp.int32)
  out = jax.vmap(lambda a, b, g: tokamax.ragged_dot(a, b, g))(lhs, rhs, gs)
  for i in range(3):
    close(out[i], ragged_ref(np, f64(lhs[i]), f64(rhs[i]), np.asarray(gs[i])),
          jnp.float32, what=f"{i}")


@check("transform vmap attention over lengths/segments/mask too")
def _():
  q, k, v, bias, mask, kw, ref_kw = make_attention(
      dict(mask="full", seg=True, qlen=True, kvlen=True, bias="full"), batch=(3, 2))
  f = lambda q, k, v, b, m, ql, kl, qs, ks: tokamax.dot_product_attention(
      q, k, v, b, m, query_seq_lengths=ql, key_value_seq_lengths=kl,
      q_segment_ids=qs, kv_segment_ids=ks)
  out = jax.vmap(f)(q, k, v, bias, mask, kw["query_seq_lengths"],
                    kw["key_value_seq_lengths"], kw["q_segment_ids"],
                    kw["kv_segment_ids"])
  want = attention_ref(np, f64(q), f64(k), f64(v), f64(bias), mask, **ref_kw)
  close(out, want, jnp.float32)


@check("transform jit with traced lengths & group sizes & group_offset")
def _():
  q, k, v, _, _, kw, ref_kw = make_attention(dict(qlen=True, kvlen=True))
  out = jax.jit(lambda q, k, v, ql, kl: tokamax.dot_product_attention(
      q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl))(
          q, k, v, kw["query_seq_lengths"], kw["key_value_seq_lengths"])
  close(out, attention_ref(np, f64(q), f64(k), f64(v), **ref_kw), jnp.float32)
  r = rng(3)
  lhs, rhs = rand(r, (9, 8)), rand(r, (2, 8, 5))
  sizes = jnp.asarray([2, 3, 1, 2], jnp.int32)
  out = jax.jit(lambda a, b, g, o: tokamax.ragged_dot(a, b, g, group_offset=o))(
      lhs, rhs, sizes, jnp.asarray(1))
  close(out, ragged_ref(np, f64(lhs), f64(rhs), [2, 3, 1, 2], 1), jnp.float32)


# --------------------------------------------------------------------------------
# Bad inputs: must raise ValueError/TypeError (or the documented error class) with
# a message that names the argument.

def expect_error(fn, types, *needles):
  try:
    out = fn()
    if hasattr(out, "block_until_ready"):
      out.block_until_ready()
  except types as e:
    msg = str(e)
    for nd in needles:
      assert nd.lower() in msg.lower(), f"message lacks {nd!r}: {msg!r}"
    return msg
  except Exception as e:
    raise AssertionError(f"wrong error type {type(e).__name__}: {str(e)[:400]}") from e
  raise AssertionError("no error raised")


VE, TE = ValueError, TypeError
VTE = (ValueError, TypeError)
_r = rng(20)
Q, K, V = rand(_r, (2, 5, 4, 8)), rand(_r, (2, 6, 2, 8)), rand(_r, (2, 6, 2, 8))
BAD = {
    "attn q rank3": (lambda: tokamax.dot_product_attention(Q[0], K[0], V[0]), VE,
                     "query", "rank"),
    "attn q int": (lambda: tokamax.dot_product_attention(Q.astype(jnp.int32), K, V), TE,
                   "query", "int32"),
    "attn f64 numpy": (lambda: tokamax.dot_product_attention(
        np.asarray(Q, np.float64), K, V), (), ),  # JAX canonicalizes f64 -> f32 (x64 off)
    "attn dtype mismatch": (lambda: tokamax.dot_product_attention(
        Q, K.astype(jnp.bfloat16), V), TE, "key", "bfloat16"),
    "attn head dim mismatch": (lambda: tokamax.dot_product_attention(
        Q, K[..., :4], V), VE, "key", "head dim"),
    "attn v seq mismatch": (lambda: tokamax.dot_product_attention(Q, K, V[:, :5]), VE,
                            "value"),
    "attn N%K": (lambda: tokamax.dot_product_attention(Q[:, :, :3], K, V), VE, "heads"),
    "attn batch mismatch": (lambda: tokamax.dot_product_attention(Q, K[:1], V[:1]), VE,
                            "batch"),
    "attn bias bad shape": (lambda: tokamax.dot_product_attention(
        Q, K, V, bias=jnp.ones((2, 4, 5, 7))), VE, "bias", "(2, 4, 5, 7)"),
    "attn bias int": (lambda: tokamax.dot_product_attention(
        Q, K, V, bias=jnp.ones((5, 6), jnp.int32)), TE, "bias"),
    "attn mask float": (lambda: tokamax.dot_product_attention(
        Q, K, V, mask=jnp.ones((5, 6))), TE, "mask", "bool"),
    "attn mask bad shape": (lambda: tokamax.dot_product_attention(
        Q, K, V, mask=jnp.ones((5, 7), bool)), VE, "mask"),
    "attn window negative": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=-1), VE, "local_window_size"),
    "attn window triple": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=(1, 2, 3)), VE, "local_window_size"),
    "attn window float": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=1.5), VE, "local_window_size"),
    "attn window bool": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=True), VE, "local_window_size"),
    "attn window (True, 1)": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=(True, 1)), VE, "local_window_size"),
    "attn window numpy int": (lambda: tokamax.dot_product_attention(
        Q, K, V, local_window_size=np.int64(2)), (), ),
    "attn soft cap negative": (lambda: tokamax.dot_product_attention(
        Q, K, V, logits_soft_cap=-1.0), VE, "logits_soft_cap"),
    "attn soft cap nan": (lambda: tokamax.dot_product_attention(
        Q, K, V, logits_soft_cap=float("nan")), VE, "logits_soft_cap"),
    "attn soft cap bool": (lambda: tokamax.dot_product_attention(
        Q, K, V, logits_soft_cap=True), VTE, "logits_soft_cap"),
    # A concrete 0-d array is taken by value (types () = must be accepted); a
    # non-scalar one is refused.
    "attn scale 0-d array": (lambda: tokamax.dot_product_attention(
        Q, K, V, scale=jnp.asarray(0.5)), ()),
    "attn scale array": (lambda: tokamax.dot_product_attention(
        Q, K, V, scale=jnp.asarray([0.5])), TE, "scale"),
    "attn scale nan": (lambda: tokamax.dot_product_attention(
        Q, K, V, scale=float("nan")), VE, "scale"),
    "attn is_causal int": (lambda: tokamax.dot_product_attention(
        Q, K, V, is_causal=1), TE, "is_causal"),
    "attn qlen too large": (lambda: tokamax.dot_product_attention(
        Q, K, V, query_seq_lengths=jnp.asarray([6, 1])), VE, "query_seq_lengths"),
    "attn kvlen negative": (lambda: tokamax.dot_product_attention(
        Q, K, V, key_value_seq_lengths=jnp.asarray([-1, 1])), VE,
        "key_value_seq_lengths"),
    "attn kvlen float": (lambda: tokamax.dot_product_attention(
        Q, K, V, key_value_seq_lengths=jnp.asarray([1.0, 1.0])), TE,
        "key_value_seq_lengths"),
    "attn kvlen wrong shape": (lambda: tokamax.dot_product_attention(
        Q, K, V, key_value_seq_lengths=jnp.asarray([1, 1, 1])), VE,
        "key_value_seq_lengths"),
    "attn kvlen python list": (lambda: tokamax.dot_product_attention(
        Q, K, V, key_value_seq_lengths=[1, 2]), TE, "key_value_seq_lengths", "list"),
    "attn seg only q": (lambda: tokamax.dot_product_attention(
        Q, K, V, q_segment_ids=jnp.zeros((2, 5), jnp.int32)), VE, "kv_segment_ids"),
    "attn seg wrong shape": (lambda: tokamax.dot_product_attention(
        Q, K, V, q_segment_ids=jnp.zeros((2, 6), jnp.int32),
        kv_segment_ids=jnp.zeros((2, 6), jnp.int32)), VE, "q_segment_ids"),
    "attn seg float": (lambda: tokamax.dot_product_attention(
        Q, K, V, q_segment_ids=jnp.zeros((2, 5)),
        kv_segment_ids=jnp.zeros((2, 6))), TE, "q_segment_ids"),
    "attn unknown impl": (lambda: tokamax.dot_product_attention(
        Q, K, V, implementation="nope"), VE, "nope"),
    "attn impl triton (cpu)": (lambda: tokamax.dot_product_attention(
        Q, K, V, implementation="triton"), (NotImplementedError,), "triton"),
    "attn impl cudnn (cpu)": (lambda: tokamax.dot_product_attention(
        Q, K, V, implementation="cudnn"), (NotImplementedError,), "cudnn"),
    "attn impl empty list": (lambda: tokamax.dot_product_attention(
        Q, K, V, implementation=[]), TE, "implementation"),
    "attn impl int": (lambda: tokamax.dot_product_attention(
        Q, K, V, implementation=3), TE, "implementation"),
    "attn precision bad": (lambda: tokamax.dot_product_attention(
        Q, K, V, precision="bogus"), VE, "precision"),
    "attn q not array (list)": (lambda: tokamax.dot_product_attention(
        Q.tolist(), K, V), TE, "query"),
    "ln x int": (lambda: tokamax.layer_norm(jnp.ones((3, 4), jnp.int32), None, None), TE,
                 "x", "int32"),
    "ln scalar x": (lambda: tokamax.layer_norm(jnp.float32(1.0), None, None), VE, "x"),
    "ln scale wrong shape": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), jnp.ones((3,)), None), VE, "scale", "(4,)"),
    "ln offset wrong rank": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, jnp.ones((1, 4))), VE, "offset"),
    "ln scale int": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), jnp.ones((4,), jnp.int32), None), TE, "scale"),
    "ln scale dtype mismatch (bf16 vs f32)": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), jnp.ones((4,), jnp.bfloat16), None), (), ),
    "ln axis out of range": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, axis=2), VE, "axis"),
    "ln axis bool": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, axis=True), VTE, "axis"),
    "ln axis numpy int": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, axis=np.int64(1)), (), ),
    "ln eps negative": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, epsilon=-1.0), VE, "epsilon"),
    "ln eps nan": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, epsilon=float("nan")), VE, "epsilon"),
    "ln eps 0-d array": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, epsilon=jnp.asarray(1e-6)), ()),
    "ln eps array": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, epsilon=jnp.asarray([1e-6])), VTE, "epsilon"),
    "ln subtract_mean str": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, subtract_mean="no"), TE, "subtract_mean"),
    "ln unknown impl": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, implementation="nope"), VE, "nope"),
    "ln impl triton (cpu)": (lambda: tokamax.layer_norm(
        jnp.ones((3, 4)), None, None, implementation="triton"), (NotImplementedError,),
        "triton"),
    "rms offset kw": (lambda: tokamax.rms_norm(jnp.ones((3, 4)), None, offset=1), TE),
    "glu x int": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4), jnp.int32), jnp.ones((4, 2, 5))), TE, "x"),
    "glu w rank2": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 10))), VE, "weights", "rank"),
    "glu w axis1 != 2": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 3, 5))), VE, "weights"),
    "glu K mismatch": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((5, 2, 5))), VE, "weights", "K=4"),
    "glu dtype mismatch": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5), jnp.bfloat16)), TE, "weights", "bfloat16"),
    "glu pair of 3": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), [jnp.ones((4, 5))] * 3), VE, "weights"),
    "glu pair shape mismatch": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), (jnp.ones((4, 5)), jnp.ones((4, 6)))), VE, "weights"),
    "glu activation str": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5)), activation="silu"), TE, "activation"),
    "glu activation wrong shape": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5)), activation=lambda g: jnp.sum(g)), VTE,
        "activation"),
    "glu activation returns int": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5)),
        activation=lambda g: (g > 0).astype(jnp.int32)), (), ),
    "glu activation 2 args": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5)), activation=lambda a, b: a), VTE,
        "activation"),
    "glu scalar x": (lambda: tokamax.gated_linear_unit(
        jnp.float32(1), jnp.ones((1, 2, 5))), VE, "x"),
    "rd lhs rank3": (lambda: tokamax.ragged_dot(
        jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1])), VE, "lhs", "rank"),
    "rd rhs rank2": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.asarray([1, 1])), VE, "rhs", "rank"),
    "rd K mismatch": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 5, 5)), jnp.asarray([1, 1])), VE, "rhs"),
    "rd dtype mismatch": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5), jnp.bfloat16), jnp.asarray([1, 1])), TE,
        "rhs", "bfloat16"),
    "rd sizes float": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1.0, 1.0])), TE,
        "group_sizes"),
    "rd sizes negative": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([-1, 2])), VE, "group_sizes"),
    "rd sizes too large": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([2, 2])), VE, "group_sizes"),
    "rd sizes wrong count": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1])), VE,
        "group_sizes"),
    "rd sizes rank2": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([[1, 1]])), VE,
        "group_sizes"),
    "rd sizes list": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), [1, 1]), TE, "group_sizes", "list"),
    "rd lhs int": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4), jnp.int32), jnp.ones((2, 4, 5), jnp.int32), jnp.asarray([1, 1])),
        TE, "lhs"),
    "rd offset too large": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1]), group_offset=2),
        VE, "group_offset"),
    "rd offset negative": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1]), group_offset=-1),
        VE, "group_offset"),
    "rd offset float": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1]),
        group_offset=1.0), TE, "group_offset"),
    "rd offset vector": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1]),
        group_offset=jnp.asarray([1])), VE, "group_offset"),
    "rd offset bool": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1, 1]),
        group_offset=True), TE, "group_offset"),
    "rd rhs more groups than sizes": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((3, 4, 5)), jnp.asarray([1, 1]), group_offset=0),
        VE, "rhs"),
    "rd pet bogus": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1]),
        preferred_element_type="bogus"), VTE, "preferred_element_type"),
    "rd pet int": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1]),
        preferred_element_type=jnp.int32), VTE, "preferred_element_type"),
    "rd sizes bool": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([True, True])), TE,
        "group_sizes"),
    "rd unknown impl": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1]),
        implementation="nope"), VE, "nope"),
    "rd impl triton (cpu)": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1]),
        implementation="triton"), (NotImplementedError,), "triton"),
    "rd impl mosaic (cpu)": (lambda: tokamax.ragged_dot(
        jnp.ones((3, 4)), jnp.ones((2, 4, 5)), jnp.asarray([1, 1]),
        implementation="mosaic"), (NotImplementedError, ValueError), "mosaic"),
    "glu impl xla_chunked (other op's name)": (lambda: tokamax.gated_linear_unit(
        jnp.ones((3, 4)), jnp.ones((4, 2, 5)), implementation="xla_chunked"), VE,
        "xla_chunked"),
}

for _name, (_fn, _types, *_needles) in BAD.items():
  @check(f"bad input: {_name}")
  def _(fn=_fn, types=_types, needles=_needles, name=_name):
    if types == ():  # must be accepted (valid input)
      fn()
      return
    msg = expect_error(fn, types, *needles)
    print(f"  [{name}] -> {msg[:200]}")


# Bad inputs under jit: concreteness checks disappear; must not silently go wrong.
@check("bad input under jit: ragged group_sizes sum > M gives no crash/NaN")
def _():
  out = jax.jit(lambda g: tokamax.ragged_dot(jnp.ones((3, 4)), jnp.ones((2, 4, 5)), g))(
      jnp.asarray([2, 2]))
  assert np.all(np.isfinite(np.asarray(out)))


if __name__ == "__main__":
  fails = [r for r in RESULTS if r[1] != "ok"]
  for name, status, msg in RESULTS:
    if status != "ok":
      print(f"FAIL {name}\n    {msg}\n")
  print(f"{len(RESULTS) - len(fails)} ok, {len(fails)} failed")
