"""Independent checker of tokamax's multi-device support (8 virtual CPU devices).

python3 tools/checks/check_sharding.py [substring filter...]
"""
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
import functools
import re
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import tokamax

assert jax.device_count() == 8, jax.device_count()
jax.config.update("jax_default_matmul_precision", "highest")

FILTERS = sys.argv[1:]
RESULTS = []
REF_CACHE = {}
RNG = np.random.default_rng(1234)


def rnd(*shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(RNG.standard_normal(shape) * scale, dtype)


MESHES = {
    "1x8": ((1, 8), ("rows", "cols")),
    "2x4": ((2, 4), ("dp", "mp")),
    "4x2": ((4, 2), ("fsdp", "tensor")),
    "8": ((8,), ("all",)),
    "2x2x2": ((2, 2, 2), ("p", "q", "r")),
}


def mesh_of(name, explicit=False):
  shape, axes = MESHES[name]
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, axes, axis_types=(kind,) * len(shape))


_COLL = re.compile(r"=\s*(\(?[a-z0-9\[\],{}: ]*?\)?)\s*(all-gather|all-reduce|all-to-all|"
                   r"collective-permute|reduce-scatter)(-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collectives(hlo):
  """[(kind, elements)] of the collectives in compiled HLO text."""
  out = []
  for line in hlo.splitlines():
    m = _COLL.search(line)
    if not m:
      continue
    elems = 0
    for _, dims in _SHAPE.findall(m.group(1)):
      elems += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    out.append((m.group(2), elems))
  return out


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def record(name, ok, msg=""):
  RESULTS.append((name, ok, msg))
  print(("PASS " if ok else "FAIL ") + name + ("  " + msg if msg else ""), flush=True)


def selected(name):
  return not FILTERS or any(f in name for f in FILTERS)


def check(name, fn, args, specs, mesh, *, tol=2e-5, grad_argnums=(), gather_limit=64,
          allow_forward_allreduce=False, expect_out_spec=None, ref_fn=None, ref_key=None):
  """fn(*args) sharded by specs on mesh vs unsharded on one device."""
  if not selected(name):
    return
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _check(name, fn, args, specs, mesh, tol, grad_argnums, gather_limit,
             allow_forward_allreduce, expect_out_spec, ref_fn, ref_key)
    for w in caught:
      if "tokamax" in str(w.filename) or "sharding" in str(w.message):
        print(f"   warning: {str(w.message)[:200]}")
  except Exception as e:
    record(name, False, f"EXCEPTION {type(e).__name__}: {str(e)[:400]}")
    if os.environ.get("TB"):
      traceback.print_exc()


def _loss_fn(fn, cts):
  def loss(*a):
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * cts)
  return loss


def _check(name, fn, args, specs, mesh, tol, grad_argnums, gather_limit,
           allow_forward_allreduce, expect_out_spec, ref_fn, ref_key):
  dev0 = jax.devices()[0]
  local = [jax.device_put(a, dev0) for a in args]
  key = (ref_key, "fwd") if ref_key else None
  if key in REF_CACHE:
    ref = REF_CACHE[key]
  else:
    with tokamax.spmd_partitioning(False):
      ref = jax.jit(ref_fn or fn)(*local)
    if key:
      REF_CACHE[key] = ref
  sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  jf = jax.jit(fn)
  compiled = jf.lower(*sharded).compile()
  colls = collectives(compiled.as_text())
  out = compiled(*sharded)
  problems, info = [], []
  e = rel_err(out, ref)
  if not e <= tol:
    problems.append(f"fwd rel err {e:.2e} > {tol:.0e}")
  big = [(k, n) for k, n in colls if n > gather_limit and k != "all-reduce"]
  if big:
    problems.append(f"fwd big collectives {big}")
  ar = [(k, n) for k, n in colls if n > gather_limit and k == "all-reduce"]
  if ar and not allow_forward_allreduce:
    problems.append(f"fwd all-reduce {ar}")
  if expect_out_spec is not None:
    got = out.sharding.spec
    want = P(*expect_out_spec)
    def norm(s):
      s = tuple(s) + (None,) * (out.ndim - len(s))
      res = []
      for e in s:
        ax = tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if mesh.shape[a] > 1)
        res.append(ax or None)
      return tuple(res)
    if norm(got) != norm(want):
      problems.append(f"out spec {got} != {want}")
  if grad_argnums:
    cts = jnp.asarray(np.random.default_rng(7).standard_normal(ref.shape), jnp.float32)
    gfn = jax.grad(_loss_fn(fn, cts), argnums=grad_argnums)
    key = (ref_key, "grad", grad_argnums) if ref_key else None
    if key in REF_CACHE:
      gref = REF_CACHE[key]
    else:
      with tokamax.spmd_partitioning(False):
        gref = jax.jit(jax.grad(_loss_fn(ref_fn or fn, cts), argnums=grad_argnums))(*local)
      if key:
        REF_CACHE[key] = gref
    gc = jax.jit(gfn).lower(*sharded).compile()
    gcolls = collectives(gc.as_text())
    gs = gc(*sharded)
    for i, g, gr in zip(grad_argnums, gs, gref):
      e = rel_err(g, gr)
      if not e <= tol:
        problems.append(f"grad[{i}] rel err {e:.2e}")
    bigg = [(k, n) for k, n in gcolls if n > gather_limit and k == "all-gather"]
    if bigg:
      info.append(f"bwd all-gathers {bigg}")
  summary = ",".join(sorted({k for k, n in colls if n > gather_limit})) or "-"
  record(name, not problems, "; ".join(problems + info) or f"collectives fwd: {summary}")


# ------------------------------------------------------------------ attention

def attn(q, k, v, *, impl=None, **kw):
  return tokamax.dot_product_attention(q, k, v, implementation=impl, **kw)


def attention_cases():
  B, T, N, H = 8, 32, 8, 16
  feats_cycle = ("causal", "window_softcap", "segments")
  seg = jnp.asarray(np.sort(RNG.integers(0, 3, (B, T)), axis=1), jnp.int32)
  for kv_heads in (8, 2):
    q = rnd(B, T, N, H)
    k = rnd(B, T, kv_heads, H)
    v = rnd(B, T, kv_heads, H)
    i = 0
    for mname, (_mshape, axes) in MESHES.items():
      mesh = mesh_of(mname)
      a0 = axes[0]
      a_last = axes[-1]
      kv_h = a_last if kv_heads % mesh.shape[a_last] == 0 else None
      layouts = {
          "batch": (P(axes), P(axes)),
          "heads": (P(None, None, a_last), P(None, None, kv_h)),
          "batch_heads": (P(axes[:-1], None, a_last), P(axes[:-1], None, kv_h)),
          "seq_q": (P(None, axes), P()),
          "batch_seq_q": (P(a0, a_last), P(a0)),
          "q_heads_kv_repl": (P(None, None, a_last), P()),
      }
      if len(axes) == 1:
        layouts.pop("batch_heads")
        layouts.pop("batch_seq_q")
      for lname, (qs, ks) in layouts.items():
        feats = feats_cycle[i % 3]
        impl = (None, "xla")[(i // 3) % 2]
        i += 1
        kw = {}
        if feats == "causal":
          kw = dict(is_causal=True)
        elif feats == "window_softcap":
          kw = dict(local_window_size=(5, 3), logits_soft_cap=3.0)
        name = f"attn/{mname}/{lname}/K{kv_heads}/{feats}/impl={impl}"
        rk = f"attn/K{kv_heads}/{feats}"
        if feats == "segments":
          seg_spec = P(*qs[:2])
          kseg_spec = P(ks[0] if len(ks) > 0 else None)
          fn = lambda q, k, v, s1, s2, impl=impl: attn(
              q, k, v, impl=impl, q_segment_ids=s1, kv_segment_ids=s2, is_causal=True)
          check(name, fn, [q, k, v, seg, seg], [qs, ks, ks, seg_spec, kseg_spec], mesh,
                grad_argnums=(0, 1, 2), ref_key=rk)
        else:
          fn = functools.partial(attn, impl=impl, **kw)
          check(name, fn, [q, k, v], [qs, ks, ks], mesh, grad_argnums=(0, 1, 2),
                ref_key=rk)


def attention_extra_cases():
  B, T, N, H = 8, 32, 8, 16
  mesh = mesh_of("2x4")
  q, k, v = rnd(B, T, N, H), rnd(B, T, 4, H), rnd(B, T, 4, H)
  # kv heads sharded over a different axis than q heads.
  check("attn_x/2x4/q_heads_mp_kv_heads_dp", functools.partial(attn, is_causal=True),
        [q, k, v], [P(None, None, "mp"), P(None, None, "dp"), P(None, None, "dp")], mesh,
        grad_argnums=(0, 1, 2))
  # uneven: B=6 over 4
  q6, k6, v6 = rnd(6, T, N, H), rnd(6, T, 4, H), rnd(6, T, 4, H)
  check("attn_x/2x4/uneven_batch6_over_mp", functools.partial(attn, is_causal=True),
        [q6, k6, v6], [P("mp"), P("mp"), P("mp")], mesh, grad_argnums=(0, 1, 2))
  # uneven heads: N=6 over mp=4
  q7, k7, v7 = rnd(B, T, 6, H), rnd(B, T, 2, H), rnd(B, T, 2, H)
  check("attn_x/2x4/uneven_heads6_over_mp", functools.partial(attn, is_causal=True),
        [q7, k7, v7], [P(None, None, "mp"), P(), P()], mesh, grad_argnums=(0, 1, 2))
  # MQA, heads sharded.
  q8, k8, v8 = rnd(B, T, N, H), rnd(B, T, 1, H), rnd(B, T, 1, H)
  check("attn_x/2x4/mqa_heads_mp", functools.partial(attn, is_causal=True),
        [q8, k8, v8], [P(None, None, "mp"), P(), P()], mesh, grad_argnums=(0, 1, 2))
  # GQA K=2 heads over 2x2x2 with heads over ("q","r") (4-way): slice kv.
  m3 = mesh_of("2x2x2")
  qg, kg, vg = rnd(B, T, N, H), rnd(B, T, 2, H), rnd(B, T, 2, H)
  check("attn_x/2x2x2/gqa_K2_heads_qr", functools.partial(attn, is_causal=True),
        [qg, kg, vg], [P("p", None, ("q", "r")), P("p"), P("p")], m3,
        grad_argnums=(0, 1, 2))
  check("attn_x/2x2x2/gqa_K2_heads_qr_kvsharded", functools.partial(attn, is_causal=True),
        [qg, kg, vg], [P("p", None, ("q", "r")), P("p", None, "q"), P("p", None, "q")], m3,
        grad_argnums=(0, 1, 2))
  # sequence-sharded q over 2 axes with window and causal, T != S (cross attention
  # with kv longer than q), q_offset semantics.
  qs, ks, vs = rnd(2, 16, 4, H), rnd(2, 24, 4, H), rnd(2, 24, 4, H)
  check("attn_x/2x4/seq_q_T16_S24_causal", functools.partial(attn, is_causal=True),
        [qs, ks, vs], [P(None, ("dp", "mp")), P(), P()], mesh, grad_argnums=(0, 1, 2))
  check("attn_x/2x4/seq_q_T16_S24_window", functools.partial(attn, local_window_size=(3, 2)),
        [qs, ks, vs], [P(None, ("dp", "mp")), P(), P()], mesh, grad_argnums=(0, 1, 2))
  # seq-sharded keys (no ring): allowed to gather, must be correct.
  check("attn_x/2x4/seq_kv_sharded_causal", functools.partial(attn, is_causal=True),
        [q, k, v], [P(), P(None, "mp"), P(None, "mp")], mesh, grad_argnums=(0, 1, 2),
        gather_limit=10**9)
  # bias and mask, batch+heads
  bias = rnd(B, N, T, T)
  mask = jnp.asarray(RNG.random((B, 1, T, T)) > 0.2)
  fn = lambda q, k, v, b, m: attn(q, k, v, bias=b, mask=m, is_causal=True)
  check("attn_x/2x4/bias_mask_batch_heads", fn, [q, k, v, bias, mask],
        [P("dp", None, "mp"), P("dp", None, "mp"), P("dp", None, "mp"), P("dp", "mp"),
         P("dp")], mesh, grad_argnums=(0, 1, 2, 3))
  check("attn_x/2x4/bias_mask_seq_q", fn, [q, k, v, bias, mask],
        [P(None, "mp"), P(), P(), P(None, None, "mp"), P(None, None, "mp")], mesh,
        grad_argnums=(0, 1, 2, 3))
  # seq lengths with sequence-sharded queries
  ql = jnp.asarray(RNG.integers(1, T + 1, (B,)), jnp.int32)
  kl = jnp.asarray(RNG.integers(1, T + 1, (B,)), jnp.int32)
  fn = lambda q, k, v, a, b: attn(q, k, v, query_seq_lengths=a,
                                  key_value_seq_lengths=b, is_causal=True)
  check("attn_x/2x4/seq_lengths_seq_q", fn, [q, k, v, ql, kl],
        [P("dp", "mp"), P("dp"), P("dp"), P(), P()], mesh, grad_argnums=(0, 1, 2))
  # 5-D batch [2, 4, T, N, H] sharded over both batch dims
  q5, k5, v5 = rnd(2, 4, T, N, H), rnd(2, 4, T, 2, H), rnd(2, 4, T, 2, H)
  check("attn_x/2x4/5d_batch", functools.partial(attn, is_causal=True), [q5, k5, v5],
        [P("dp", "mp"), P("dp", "mp"), P("dp", "mp")], mesh, grad_argnums=(0, 1, 2))
  check("attn_x/2x4/5d_inner_batch", functools.partial(attn, is_causal=True), [q5, k5, v5],
        [P(None, "mp"), P(None, "mp"), P(None, "mp")], mesh, grad_argnums=(0, 1, 2))
  # bf16
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  check("attn_x/2x4/bf16_batch_heads", functools.partial(attn, is_causal=True),
        [qb, kb, vb], [P("dp", None, "mp")] * 3, mesh, tol=2e-2, grad_argnums=(0, 1, 2))
  check("attn_x/2x4/bf16_seq_q", functools.partial(attn, is_causal=True),
        [qb, kb, vb], [P(None, ("dp", "mp")), P(), P()], mesh, tol=2e-2,
        grad_argnums=(0, 1, 2))


# ------------------------------------------------------------------ norms

def norm_cases():
  R, D = 16, 64
  x3 = rnd(8, R, D)
  scale, offset = rnd(D, scale=0.5) + 1.0, rnd(D)
  for mname, (_mshape, axes) in MESHES.items():
    mesh = mesh_of(mname)
    a0, al = axes[0], axes[-1]
    layouts = {
        "rows": (P(axes), P(), P()),
        "features": (P(None, None, axes), P(axes), P(axes)),
        "rows_features": (P(a0, None, al), P(al), P(al)) if len(axes) > 1 else None,
        "features_params_repl": (P(None, None, al), P(), P()),
        "rows_params_sharded_diff": (P(None, a0), P(al), P(al)) if len(axes) > 1 else None,
    }
    for lname, sp in layouts.items():
      if sp is None:
        continue
      for rms in (False, True):
        for impl in (None, "xla"):
          opname = "rms" if rms else "ln"
          if rms:
            fn = lambda x, s, o, impl=impl: tokamax.rms_norm(x, s, implementation=impl)
          else:
            fn = lambda x, s, o, impl=impl: tokamax.layer_norm(x, s, o, implementation=impl)
          check(f"norm/{mname}/{lname}/{opname}/impl={impl}", fn, [x3, scale, offset],
                list(sp), mesh, grad_argnums=(0, 1) if rms else (0, 1, 2),
                allow_forward_allreduce="feat" in lname)
  # other axis, bf16, uneven
  mesh = mesh_of("2x4")
  fn = lambda x, s, o: tokamax.layer_norm(x, s, o, axis=1)
  xa = rnd(8, D, 12)
  check("norm_x/2x4/axis1_features_sharded", fn, [xa, scale, offset],
        [P("dp", "mp"), P("mp"), P("mp")], mesh, grad_argnums=(0, 1, 2),
        allow_forward_allreduce=True)
  xb, sb, ob = (x.astype(jnp.bfloat16) for x in (x3, scale, offset))
  fn = lambda x, s, o: tokamax.layer_norm(x, s, o)
  check("norm_x/2x4/bf16_rows_features", fn, [xb, sb, ob],
        [P("dp", None, "mp"), P("mp"), P("mp")], mesh, tol=2e-2, grad_argnums=(0, 1, 2),
        allow_forward_allreduce=True)
  xu = rnd(6, 5, 36)
  su, ou = rnd(36), rnd(36)
  check("norm_x/2x4/uneven_rows6x5_feat36", fn, [xu, su, ou],
        [P("mp", "dp"), P(), P()], mesh, grad_argnums=(0, 1, 2),
        gather_limit=10**9, allow_forward_allreduce=True)
  check("norm_x/2x4/uneven_feat36_over_mp", fn, [xu, su, ou],
        [P(None, None, "mp"), P("mp"), P("mp")], mesh, grad_argnums=(0, 1, 2),
        gather_limit=10**9, allow_forward_allreduce=True)
  # no scale/offset
  fn = lambda x: tokamax.layer_norm(x, None, None)
  check("norm_x/2x4/no_params_features", fn, [x3], [P("dp", None, "mp")], mesh,
        grad_argnums=(0,), allow_forward_allreduce=True)


# ------------------------------------------------------------------ GLU

def glu_cases():
  M, K, N = 32, 32, 64
  x = rnd(M, K)
  w = rnd(K, 2, N, scale=0.2)
  for mname, (_mshape, axes) in MESHES.items():
    mesh = mesh_of(mname)
    a0, al = axes[0], axes[-1]
    layouts = {
        "rows": (P(axes), P(), P(axes)),
        "tp_n": (P(), P(None, None, axes), P(None, axes)),
        "rows_tp": (P(a0), P(None, None, al), P(a0, al)) if len(axes) > 1 else None,
        "k_sharded": (P(None, al), P(al), None),
        "rows_w_fsdp_on_k": (P(a0), P(al), None) if len(axes) > 1 else None,
    }
    for lname, sp in layouts.items():
      if sp is None:
        continue
      for impl in (None, "xla"):
        fn = lambda x, w, impl=impl: tokamax.gated_linear_unit(
            x, w, activation=jax.nn.silu, implementation=impl)
        check(f"glu/{mname}/{lname}/impl={impl}", fn, [x, w], list(sp[:2]), mesh,
              grad_argnums=(0, 1), expect_out_spec=sp[2],
              gather_limit=10**9 if "k_sharded" in lname or "fsdp" in lname else 64)
  mesh = mesh_of("2x4")
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.gelu)
  x3 = rnd(4, 8, K)
  check("glu_x/2x4/3d_x_batch_and_tp", fn, [x3, w], [P("dp"), P(None, None, "mp")], mesh,
        grad_argnums=(0, 1), expect_out_spec=("dp", None, "mp"))
  check("glu_x/2x4/3d_x_second_dim_rows", fn, [x3, w], [P(None, "mp"), P()], mesh,
        grad_argnums=(0, 1), expect_out_spec=(None, "mp"))
  fnp = lambda x, wg, wu: tokamax.gated_linear_unit(x, (wg, wu), activation=jax.nn.silu)
  wg, wu = rnd(K, N, scale=0.2), rnd(K, N, scale=0.2)
  check("glu_x/2x4/pair_weights_tp", fnp, [x, wg, wu], [P("dp"), P(None, "mp"), P(None, "mp")],
        mesh, grad_argnums=(0, 1, 2), expect_out_spec=("dp", "mp"))
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  check("glu_x/2x4/bf16_rows_tp", fn, [xb, wb], [P("dp"), P(None, None, "mp")], mesh,
        tol=2e-2, grad_argnums=(0, 1), expect_out_spec=("dp", "mp"))
  xu = rnd(30, K)
  check("glu_x/2x4/uneven_rows30", fn, [xu, w], [P("mp"), P()], mesh, grad_argnums=(0, 1),
        gather_limit=10**9)
  wu3 = rnd(K, 2, 36, scale=0.2)
  check("glu_x/2x4/uneven_n36_over_8", fn, [x, wu3], [P(), P(None, None, ("dp", "mp"))],
        mesh, grad_argnums=(0, 1), gather_limit=10**9)


# ------------------------------------------------------------------ ragged_dot

def ragged_cases():
  M, K, N, G = 64, 16, 32, 8
  lhs = rnd(M, K)
  rhs = rnd(G, K, N, scale=0.3)
  sizes = np.array([5, 0, 13, 7, 9, 0, 11, 15])  # sums to 60 < M
  gs = jnp.asarray(sizes, jnp.int32)
  for mname, (_mshape, axes) in MESHES.items():
    mesh = mesh_of(mname)
    a0, al = axes[0], axes[-1]
    layouts = {
        "rows": (P(axes), P(), True, False),
        "experts": (P(), P(axes), False, True),
        "rows_experts": (P(a0), P(al), False, True) if len(axes) > 1 else None,
        "experts_n": (P(), P(a0, None, al), False, True) if len(axes) > 1 else None,
        "n": (P(), P(None, None, axes), False, False),
    }
    for lname, sp in layouts.items():
      if sp is None:
        continue
      for impl in (None, "xla"):
        fn = lambda l, r, g, impl=impl: tokamax.ragged_dot(l, r, g, implementation=impl)
        check(f"ragged/{mname}/{lname}/impl={impl}", fn, [lhs, rhs, gs],
              [sp[0], sp[1], P()], mesh, grad_argnums=(0, 1),
              allow_forward_allreduce=sp[3])
  mesh = mesh_of("2x4")
  # group_offset given by the user with rhs over experts
  rhs4 = rhs[2:6]
  fn = lambda l, r, g: tokamax.ragged_dot(l, r, g, group_offset=2)
  check("ragged_x/2x4/user_group_offset_experts", fn, [lhs, rhs4, gs], [P(), P("mp"), P()],
        mesh, grad_argnums=(0, 1), allow_forward_allreduce=True)
  check("ragged_x/2x4/user_group_offset_rows", fn, [lhs, rhs4, gs], [P("mp"), P(), P()],
        mesh, grad_argnums=(0, 1))
  # group_sizes sharded (odd but legal)
  fn = lambda l, r, g: tokamax.ragged_dot(l, r, g)
  check("ragged_x/2x4/group_sizes_sharded_rows", fn, [lhs, rhs, gs], [P("dp"), P(), P("mp")],
        mesh, grad_argnums=(0, 1))
  # preferred_element_type, bf16
  lb, rb = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
  fn = lambda l, r, g: tokamax.ragged_dot(l, r, g, preferred_element_type=jnp.float32)
  check("ragged_x/2x4/bf16_pet_f32_experts", fn, [lb, rb, gs], [P("dp"), P("mp"), P()],
        mesh, tol=2e-2, grad_argnums=(0, 1), allow_forward_allreduce=True)
  fn = lambda l, r, g: tokamax.ragged_dot(l, r, g)
  check("ragged_x/2x4/bf16_experts", fn, [lb, rb, gs], [P(), P(("dp", "mp"))],
        mesh, tol=2e-2, grad_argnums=(0, 1), allow_forward_allreduce=True) if False else None
  check("ragged_x/2x4/bf16_experts_8way", fn, [lb, rb, gs], [P(), P(("dp", "mp")), P()],
        mesh, tol=2e-2, grad_argnums=(0, 1), allow_forward_allreduce=True)
  # uneven: G=6 over 4, M=60 over 8
  rhs6 = rnd(6, K, N)
  gs6 = jnp.asarray([10, 3, 0, 20, 12, 9], jnp.int32)
  check("ragged_x/2x4/uneven_G6_experts_over4", fn, [lhs, rhs6, gs6], [P(), P("mp"), P()],
        mesh, grad_argnums=(0, 1), gather_limit=10**9, allow_forward_allreduce=True)
  l60 = rnd(60, K)
  check("ragged_x/2x4/uneven_M60_rows_over8", fn, [l60, rhs, gs], [P(("dp", "mp")), P(), P()],
        mesh, grad_argnums=(0, 1), gather_limit=10**9)
  # group_sizes traced through the router (inside a model: below)


# ------------------------------------------------------------------ models

def block(params, x, seg, *, impl=None, n_heads=8, kv_heads=2, act_spec=None):
  b, t, d = x.shape
  h = tokamax.rms_norm(x, params["rms"], implementation=impl)
  hd = d // n_heads
  q = (h @ params["wq"]).reshape(b, t, n_heads, hd)
  k = (h @ params["wk"]).reshape(b, t, kv_heads, hd)
  v = (h @ params["wv"]).reshape(b, t, kv_heads, hd)
  if act_spec is not None:
    q = jax.lax.with_sharding_constraint(q, act_spec)
    k = jax.lax.with_sharding_constraint(k, act_spec)
    v = jax.lax.with_sharding_constraint(v, act_spec)
  a = tokamax.dot_product_attention(
      q, k, v, is_causal=True, local_window_size=(12, 0), logits_soft_cap=20.0,
      q_segment_ids=seg, kv_segment_ids=seg, implementation=impl)
  x = x + a.reshape(b, t, d) @ params["wo"]
  h = tokamax.layer_norm(x, params["ln_s"], params["ln_o"], implementation=impl)
  g = tokamax.gated_linear_unit(h, params["glu"], activation=jax.nn.silu,
                                implementation=impl)
  return x + g @ params["wd"]


def model_cases():
  B, T, D, F = 8, 32, 64, 96
  params = dict(rms=rnd(D, scale=0.1) + 1, wq=rnd(D, D, scale=D ** -0.5),
                wk=rnd(D, 16, scale=D ** -0.5), wv=rnd(D, 16, scale=D ** -0.5),
                wo=rnd(D, D, scale=D ** -0.5), ln_s=rnd(D, scale=0.1) + 1,
                ln_o=rnd(D, scale=0.1), glu=rnd(D, 2, F, scale=D ** -0.5),
                wd=rnd(F, D, scale=F ** -0.5))
  x = rnd(B, T, D)
  seg = jnp.asarray(np.sort(RNG.integers(0, 2, (B, T)), axis=1), jnp.int32)
  keys = sorted(params)

  def fn_of(impl, act_spec=None):
    def fn(x, seg, *ps):
      return block(dict(zip(keys, ps)), x, seg, impl=impl, act_spec=act_spec)
    return fn

  pl = [params[k] for k in keys]
  for mname in MESHES:
    mesh = mesh_of(mname)
    axes = MESHES[mname][1]
    dp, tp = (axes[0], axes[-1]) if len(axes) > 1 else (axes[0], None)
    # data parallel: x batch-sharded, params replicated
    specs = [P(axes), P(axes)] + [P()] * len(pl)
    for impl in (None, "xla"):
      check(f"model/{mname}/dp/impl={impl}", fn_of(impl), [x, seg, *pl], specs, mesh,
            tol=5e-5, grad_argnums=tuple(range(2, 2 + len(pl))) + (0,))
    if tp is None:
      continue
    # megatron-ish: batch over dp, attention heads over tp, GLU N over tp.
    pspec = dict(rms=P(), wq=P(None, tp), wk=P(), wv=P(), wo=P(tp), ln_s=P(), ln_o=P(),
                 glu=P(None, None, tp), wd=P(tp))
    specs = [P(dp), P(dp)] + [pspec[k] for k in keys]
    check(f"model/{mname}/dp_tp", fn_of(None, NamedSharding(mesh, P(dp, None, tp))), [x, seg, *pl], specs,
          mesh, tol=5e-5, grad_argnums=tuple(range(2, 2 + len(pl))) + (0,),
          allow_forward_allreduce=True, ref_fn=fn_of(None))
    # sequence parallel queries via activation constraints
    specs = [P(None, tp), P(None, tp)] + [P()] * len(pl)
    check(f"model/{mname}/seq", fn_of(None), [x, seg, *pl], specs, mesh, tol=5e-5,
          grad_argnums=tuple(range(2, 2 + len(pl))) + (0,), gather_limit=10**9)


def moe_layer(x, w_router, w_up, w_down, *, top_k=2):
  """Dense-routing MoE with sort + ragged_dot, tokens [M, D]."""
  m, _ = x.shape
  e = w_up.shape[0]
  logits = x @ w_router
  gates, ids = jax.lax.top_k(jax.nn.softmax(logits, -1), top_k)
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  tok = order // top_k
  xs = x[tok]
  group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  h = tokamax.ragged_dot(xs, w_up, group_sizes)
  h = jax.nn.gelu(h)
  y = tokamax.ragged_dot(h, w_down, group_sizes)
  out = jnp.zeros((m * top_k, y.shape[1]), y.dtype).at[order].set(y)
  out = out.reshape(m, top_k, -1)
  return jnp.sum(out * gates[..., None], axis=1)


def moe_cases():
  M, D, F, E = 64, 16, 32, 8
  x = rnd(M, D)
  wr = rnd(D, E)
  wu = rnd(E, D, F, scale=D ** -0.5)
  wd = rnd(E, F, D, scale=F ** -0.5)
  for mname in ("2x4", "8", "2x2x2"):
    mesh = mesh_of(mname)
    axes = MESHES[mname][1]
    ep = axes[-1]
    # GSPMD expert parallel: weights split over experts
    check(f"moe/{mname}/gspmd_ep", moe_layer, [x, wr, wu, wd],
          [P(), P(), P(ep), P(ep)], mesh, grad_argnums=(0, 1, 2, 3),
          allow_forward_allreduce=True, gather_limit=10**9)
  # the documented all-to-all recipe under shard_map
  for mname in ("8", "2x4"):
    mesh = mesh_of(mname)
    axes = MESHES[mname][1]
    ep = axes[-1]
    n = mesh.shape[ep]
    e_local = E // n

    def layer(x, wr, wu, wd):
      logits = x @ wr
      gates, ids = jax.lax.top_k(jax.nn.softmax(logits, -1), 2)

      def ffn(rows, group_sizes):
        h = jax.nn.gelu(tokamax.ragged_dot(rows, wu, group_sizes))
        return tokamax.ragged_dot(h, wd, group_sizes)
      return tokamax.moe_all_to_all(x, ids, ffn, axis_name=ep, combine_weights=gates,
                                    num_local_experts=e_local)

    tok_spec = P(axes) if len(axes) == 1 else P(axes)
    f = jax.shard_map(layer, mesh=mesh, in_specs=(tok_spec, P(), P(ep), P(ep)),
                      out_specs=tok_spec)
    check(f"moe/{mname}/all_to_all_shard_map", f, [x, wr, wu, wd],
          [tok_spec, P(), P(ep), P(ep)], mesh, grad_argnums=(0, 1, 2, 3),
          ref_fn=moe_layer, gather_limit=10**9, allow_forward_allreduce=True)


# ------------------------------------------------------------------ shard_map

def shard_map_cases():
  mesh = mesh_of("2x4")
  B, T, N, H = 8, 32, 8, 16
  q, k, v = rnd(B, T, N, H), rnd(B, T, 2, H), rnd(B, T, 2, H)
  for impl in (None, "xla"):
    f = jax.shard_map(lambda q, k, v, impl=impl: attn(q, k, v, impl=impl, is_causal=True),
                      mesh=mesh, in_specs=(P("dp", None, "mp"), P("dp"), P("dp")),
                      out_specs=P("dp", None, "mp"), check_vma=True)
    # heads split while kv is whole: local q has 2 heads, kv 2 heads -> GQA locally
    # differs! so give kv the matching slice instead: kv heads over mp is not
    # divisible (2 over 4) -> use batch only.
    f = jax.shard_map(lambda q, k, v, impl=impl: attn(q, k, v, impl=impl, is_causal=True),
                      mesh=mesh, in_specs=(P(("dp", "mp")),) * 3,
                      out_specs=P(("dp", "mp")))
    check(f"smap/2x4/attn_batch/impl={impl}", f, [q, k, v], [P(("dp", "mp"))] * 3, mesh,
          grad_argnums=(0, 1, 2),
          ref_fn=functools.partial(attn, is_causal=True))
  qm, km, vm = rnd(B, T, N, H), rnd(B, T, 4, H), rnd(B, T, 4, H)
  f = jax.shard_map(lambda q, k, v: attn(q, k, v, is_causal=True, logits_soft_cap=5.0),
                    mesh=mesh, in_specs=(P("dp", None, "mp"),) * 3,
                    out_specs=P("dp", None, "mp"))
  check("smap/2x4/attn_batch_heads_gqa", f, [qm, km, vm], [P("dp", None, "mp")] * 3,
        mesh, grad_argnums=(0, 1, 2),
        ref_fn=lambda q, k, v: attn(q, k, v, is_causal=True, logits_soft_cap=5.0))
  # norms: rows over all
  x = rnd(16, 64)
  s, o = rnd(64), rnd(64)
  f = jax.shard_map(lambda x, s, o: tokamax.layer_norm(x, s, o), mesh=mesh,
                    in_specs=(P(("dp", "mp")), P(), P()), out_specs=P(("dp", "mp")))
  check("smap/2x4/ln_rows", f, [x, s, o], [P(("dp", "mp")), P(), P()], mesh,
        grad_argnums=(0, 1, 2), ref_fn=lambda x, s, o: tokamax.layer_norm(x, s, o),
        allow_forward_allreduce=True)
  # GLU TP: x replicated across mp, weights split on N
  xg, w = rnd(16, 32), rnd(32, 2, 64, scale=0.2)
  f = jax.shard_map(lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu),
                    mesh=mesh, in_specs=(P("dp"), P(None, None, "mp")),
                    out_specs=P("dp", "mp"))
  check("smap/2x4/glu_tp", f, [xg, w], [P("dp"), P(None, None, "mp")], mesh,
        grad_argnums=(0, 1),
        ref_fn=lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu),
        allow_forward_allreduce=True)
  # ragged_dot EP with group_offset inside shard_map
  lhs, rhs = rnd(64, 16), rnd(8, 16, 32)
  gs = jnp.asarray([5, 0, 13, 7, 9, 0, 11, 15], jnp.int32)

  def ep(l, r, g):
    off = jax.lax.axis_index("mp") * r.shape[0]
    return jax.lax.psum(tokamax.ragged_dot(l, r, g, group_offset=off), "mp")
  f = jax.shard_map(ep, mesh=mesh, in_specs=(P("dp"), P("mp"), P()), out_specs=P("dp"))
  # reference needs rows-local group sizes: only valid when rows are whole -> use P()
  f = jax.shard_map(ep, mesh=mesh, in_specs=(P(), P("mp"), P()), out_specs=P())
  check("smap/2x4/ragged_ep_group_offset", f, [lhs, rhs, gs], [P(), P("mp"), P()], mesh,
        grad_argnums=(0, 1), ref_fn=lambda l, r, g: tokamax.ragged_dot(l, r, g),
        allow_forward_allreduce=True)
  # explicit mesh
  emesh = mesh_of("2x4", explicit=True)
  check("explicit/2x4/attn_batch_heads", functools.partial(attn, is_causal=True),
        [qm, km, vm], [P("dp", None, "mp")] * 3, emesh, grad_argnums=(0, 1, 2))
  check("explicit/2x4/attn_seq_q", functools.partial(attn, is_causal=True),
        [qm, km, vm], [P(None, "mp"), P(), P()], emesh, grad_argnums=(0, 1, 2))
  check("explicit/2x4/ln_features", lambda x, s, o: tokamax.layer_norm(x, s, o),
        [x, s, o], [P("dp", "mp"), P("mp"), P("mp")], emesh, grad_argnums=(0, 1, 2),
        allow_forward_allreduce=True)
  check("explicit/2x4/glu_tp", lambda x, w: tokamax.gated_linear_unit(x, w),
        [xg, w], [P("dp"), P(None, None, "mp")], emesh, grad_argnums=(0, 1))
  check("explicit/2x4/ragged_ep", lambda l, r, g: tokamax.ragged_dot(l, r, g),
        [lhs, rhs, gs], [P("dp"), P("mp"), P()], emesh, grad_argnums=(0, 1),
        allow_forward_allreduce=True)
  # partially manual shard_map: manual over "dp", "mp" left to the rules.
  def inner(q, k, v):
    return attn(q, k, v, is_causal=True)
  f = jax.shard_map(inner, mesh=mesh, in_specs=(P("dp"),) * 3, out_specs=P("dp"),
                    axis_names={"dp"})
  check("smap/2x4/partial_manual_dp_heads_auto_mp", f, [qm, km, vm],
        [P("dp", None, "mp")] * 3, mesh, grad_argnums=(0, 1, 2),
        ref_fn=functools.partial(attn, is_causal=True))
  xs = rnd(16, 64)
  f = jax.shard_map(lambda x, s, o: tokamax.layer_norm(x, s, o), mesh=mesh,
                    in_specs=(P("dp"), P(), P()), out_specs=P("dp"), axis_names={"dp"})
  check("smap/2x4/partial_manual_ln_features_auto", f, [xs, s, o],
        [P("dp", "mp"), P("mp"), P("mp")], mesh, grad_argnums=(0, 1, 2),
        ref_fn=lambda x, s, o: tokamax.layer_norm(x, s, o), allow_forward_allreduce=True)



def ring_cases():
  for mname in ("8", "2x4", "2x2x2"):
    mesh = mesh_of(mname)
    axes = MESHES[mname][1]
    sp = axes if len(axes) > 1 else axes[0]
    n = 8
    B, T, N, H = 2, 64, 4, 16
    q, k, v = rnd(B, T, N, H), rnd(B, T, 2, H), rnd(B, T, 2, H)
    for causal, balanced in ((False, False), (True, False), (True, True)):
      perm = tokamax.zigzag_permutation(T, n) if balanced else np.arange(T)
      inv = np.argsort(perm)

      def f(q, k, v, causal=causal, balanced=balanced, perm=perm, inv=inv):
        ring = jax.shard_map(
            lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name=sp,
                                                   is_causal=causal,
                                                   load_balanced=balanced),
            mesh=mesh, in_specs=P(None, sp), out_specs=P(None, sp))
        return ring(q[:, perm], k[:, perm], v[:, perm])[:, inv]
      check(f"ring/{mname}/causal={causal}/balanced={balanced}", f, [q, k, v],
            [P(None, sp)] * 3, mesh, grad_argnums=(0, 1, 2),
            ref_fn=lambda q, k, v, c=causal: attn(q, k, v, is_causal=c),
            gather_limit=10**9)


GROUPS = dict(attn=attention_cases, attn_x=attention_extra_cases, norm=norm_cases,
              glu=glu_cases, ragged=ragged_cases, model=model_cases, moe=moe_cases,
              smap=shard_map_cases, ring=ring_cases)

if __name__ == "__main__":
  groups = os.environ.get("CHECK_GROUPS", ",".join(GROUPS)).split(",")
  for g in groups:
    GROUPS[g]()
  fails = [r for r in RESULTS if not r[1]]
  print(f"\n{len(RESULTS) - len(fails)} passed, {len(fails)} failed")
  for name, _, msg in fails:
    print("FAIL", name, msg)
