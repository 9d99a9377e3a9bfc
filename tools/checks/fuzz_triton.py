"""Random fuzzing of the tokamax gpu-triton kernels (interpret mode) vs XLA.

Each case draws a random feature mix and awkward shapes from its seed, runs
`implementation="triton"` inside `tokamax.interpret()` and compares the forward and
the gradient of every float input with the XLA reference on float32 upcasts
(`tokamax.testing.assert_close`). Run on a CPU, e.g.:

  python3 tools/checks/fuzz_triton.py --start 0 --count 20 --minutes 40
"""
import argparse
import contextlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax import testing
from tokamax._src.tuning import context as tuning_context
from tokamax.testing import _conformance as conformance
from tokamax_gpu_triton import attention as tri_att
from tokamax_gpu_triton import gated_linear_unit as tri_glu
from tokamax_gpu_triton import layer_norm as tri_ln
from tokamax_gpu_triton import ragged_dot as tri_rd

HIGHEST = conformance.HIGHEST
DTYPES = conformance.DTYPES
# The conformance suite's own (private) upcast: the fuzzer builds its references alike.
_upcast = conformance._upcast


def normal(rng, shape, dtype, s=1.0, mu=0.0):
  return jnp.asarray(rng.standard_normal(shape) * s + mu, dtype)


# ------------------------------------------------------------------ attention
def gen_attention(rng, dtype):
  b = int(rng.integers(1, 3))
  k = int(rng.choice([1, 1, 2]))
  n = k * int(rng.choice([1, 2, 3]))
  h = int(rng.choice([32, 40, 64, 80, 96, 128, 256]))
  hv = h if rng.random() < 0.8 else int(rng.choice([16, 32, 48, 80]))
  big = 300 if h <= 96 else 140
  t = int(rng.integers(1, big))
  s = t if rng.random() < 0.3 else int(rng.integers(1, big))
  opts = {}
  desc = dict(b=b, t=t, s=s, n=n, k=k, h=h, hv=hv)
  if rng.random() < 0.4:
    opts["is_causal"] = True
  if rng.random() < 0.3:
    l = None if rng.random() < 0.2 else int(rng.integers(0, 40))
    r = None if rng.random() < 0.2 else int(rng.integers(0, 40))
    opts["local_window_size"] = int(rng.integers(0, 30)) if rng.random() < 0.2 else (l, r)
  if rng.random() < 0.25:
    opts["logits_soft_cap"] = float(rng.choice([2.0, 5.0, 20.0]))
  if rng.random() < 0.2:
    opts["scale"] = float(rng.choice([0.05, 0.3, 1.0, -0.2]))
  if rng.random() < 0.25:
    opts["query_seq_lengths"] = rng.integers(0, t + 1, (b,))
  if rng.random() < 0.25:
    opts["key_value_seq_lengths"] = rng.integers(0, s + 1, (b,))
  if rng.random() < 0.25:
    opts["q_segment_ids"] = np.sort(rng.integers(0, 4, (b, t)), -1)
    opts["kv_segment_ids"] = np.sort(rng.integers(0, 4, (b, s)), -1)
  bias_shape = mask_shape = None
  if rng.random() < 0.3:
    full = (b, n, t, s)
    bias_shape = tuple(d if rng.random() < 0.6 else 1 for d in full)
    if rng.random() < 0.2:
      bias_shape = bias_shape[2:]
  if rng.random() < 0.25:
    full = (b, n, t, s)
    mask_shape = tuple(d if rng.random() < 0.6 else 1 for d in full)
  q_offset = None
  if rng.random() < 0.15 and ("is_causal" in opts or "local_window_size" in opts):
    q_offset = int(rng.integers(-20, 60))
  desc.update(bias=bias_shape, mask=mask_shape, q_offset=q_offset,
              **{kk: (vv.tolist() if isinstance(vv, np.ndarray) and vv.ndim == 1 else
                      ("arr" if isinstance(vv, np.ndarray) else vv))
                 for kk, vv in opts.items()})
  floats = dict(query=normal(rng, (b, t, n, h), dtype),
                key=normal(rng, (b, s, k, h), dtype),
                value=normal(rng, (b, s, k, hv), dtype))
  if bias_shape is not None:
    bdt = dtype if rng.random() < 0.8 else jnp.dtype(str(rng.choice(DTYPES)))
    desc["bias_dtype"] = bdt.name
    floats["bias"] = normal(rng, bias_shape, bdt)
  mask = None
  if mask_shape is not None:
    mask = jnp.asarray(rng.random(mask_shape) < 0.7)
  for kk in list(opts):
    if isinstance(opts[kk], np.ndarray):
      opts[kk] = jnp.asarray(opts[kk], jnp.int32)

  def fn(f, implementation, precision):
    return conformance.call_attention(f, mask, opts, q_offset, implementation,
                                      precision)
  return desc, fn, floats


# ------------------------------------------------------------------ layer norm
def gen_layer_norm(rng, dtype):
  nd = int(rng.integers(1, 4))
  r = rng.random()
  d = int(rng.choice([1, 3, 17, 37, 100, 129, 255, 513, 1000])) if r < 0.7 else \
      int(rng.integers(8193, 20000))
  shape = [int(rng.integers(1, 12)) for _ in range(nd)]
  if d > 8192:
    shape = [int(rng.integers(1, 4)) for _ in range(nd)]
  axis = int(rng.integers(-nd - 1, nd + 1))
  shape.insert(axis % (nd + 1), d)
  subtract_mean = bool(rng.random() < 0.6)
  has_scale, has_offset = bool(rng.random() < 0.7), bool(rng.random() < 0.6)
  eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
  use_rms_fn = not subtract_mean and not has_offset and rng.random() < 0.5
  desc = dict(shape=tuple(shape), axis=axis, subtract_mean=subtract_mean,
              scale=has_scale, offset=has_offset, eps=eps, rms_fn=use_rms_fn)
  floats = dict(x=normal(rng, shape, dtype, 2.0, 0.5))
  pdt = dtype if rng.random() < 0.8 else jnp.dtype(str(rng.choice(DTYPES)))
  desc["param_dtype"] = pdt.name
  if has_scale:
    floats["scale"] = normal(rng, (d,), pdt)
  if has_offset:
    floats["offset"] = normal(rng, (d,), pdt)

  def fn(f, implementation, precision):
    del precision
    if use_rms_fn:
      return tokamax.rms_norm(f["x"], f.get("scale"), axis=axis, epsilon=eps,
                              implementation=implementation)
    return tokamax.layer_norm(f["x"], f.get("scale"), f.get("offset"), axis=axis,
                              epsilon=eps, subtract_mean=subtract_mean,
                              implementation=implementation)
  return desc, fn, floats


# ------------------------------------------------------------------ GLU
def _custom1(x):
  return x * jnp.tanh(x)


def _custom2(x):
  return jnp.where(x > 0, x * x, 0.1 * x)


def _custom3(x):
  return jax.nn.gelu(x, approximate=False)


def _custom4(x):
  return jnp.clip(x, -1.0, 2.0) + jnp.sin(x)


def _custom5(x):
  return jax.nn.softplus(x) * 0.5


ACTS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "sigmoid": jax.nn.sigmoid,
        "relu": jax.nn.relu, "none": None, "x*tanh": _custom1, "piecewise": _custom2,
        "gelu_exact": _custom3, "clip+sin": _custom4, "softplus": _custom5,
        "elu": jax.nn.elu, "mish": jax.nn.mish, "leaky": jax.nn.leaky_relu}


def gen_glu(rng, dtype):
  lead = [int(rng.integers(1, 40))]
  if rng.random() < 0.3:
    lead = [int(rng.integers(1, 5)), int(rng.integers(1, 12))]
  k = int(rng.integers(1, 200))
  n = int(rng.integers(1, 200))
  act = str(rng.choice(list(ACTS)))
  pair = bool(rng.random() < 0.3)
  desc = dict(lead=lead, k=k, n=n, act=act, pair=pair)
  floats = dict(x=normal(rng, (*lead, k), dtype),
                weights=normal(rng, (k, 2, n), dtype, 1 / np.sqrt(k)))

  def fn(f, implementation, precision):
    w = f["weights"]
    if pair:
      w = (w[:, 0], w[:, 1])
    return tokamax.gated_linear_unit(f["x"], w, activation=ACTS[act],
                                     precision=precision,
                                     implementation=implementation)
  return desc, fn, floats


# ------------------------------------------------------------------ ragged dot
def gen_ragged(rng, dtype):
  g = int(rng.integers(1, 7))
  sizes = [int(rng.integers(0, 50)) if rng.random() < 0.7 else 0 for _ in range(g)]
  m = sum(sizes) + (int(rng.integers(0, 30)) if rng.random() < 0.5 else 0)
  if m == 0:
    m = int(rng.integers(1, 10))
  k = int(rng.integers(1, 150))
  n = int(rng.integers(1, 150))
  opts = {}
  g_rhs = g
  if rng.random() < 0.35:
    g_rhs = int(rng.integers(1, g + 1))
    opts["group_offset"] = int(rng.integers(0, g - g_rhs + 1))
  pet = None
  if rng.random() < 0.3:
    pet = str(rng.choice(DTYPES))
    opts["preferred_element_type"] = jnp.dtype(pet)
  desc = dict(sizes=sizes, m=m, k=k, n=n, g_rhs=g_rhs,
              group_offset=opts.get("group_offset"), pet=pet)
  floats = dict(lhs=normal(rng, (m, k), dtype),
                rhs=normal(rng, (g_rhs, k, n), dtype, 1 / np.sqrt(k)))
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def fn(f, implementation, precision):
    o = dict(opts)
    if implementation == "xla" and "preferred_element_type" in o:
      # reference on f32 upcasts: keep f32 output
      o["preferred_element_type"] = jnp.float32
    return tokamax.ragged_dot(f["lhs"], f["rhs"], group_sizes, precision=precision,
                              implementation=implementation, **o)
  return desc, fn, floats


GENS = {"attention": gen_attention, "layer_norm": gen_layer_norm, "glu": gen_glu,
        "ragged_dot": gen_ragged}


class RandomConfigs:
  """Small random tilings (many blocks, partial edges) for every triton op."""

  def __init__(self, rng):
    c = lambda *xs: int(rng.choice(xs))
    self.att = tri_att.AttentionConfig(c(16, 32, 64), c(16, 32, 64), 4, 2,
                                       prefetch_qk=bool(rng.random() < 0.5))
    self.att_vjp = tri_att.AttentionVjpConfig(c(16, 32, 64), c(16, 32, 64),
                                              c(16, 32, 64), c(16, 32, 64), 4, 4, 2)
    self.ln = tri_ln.LayerNormConfig(c(1, 2, 4, 8), c(16, 32, 64, 128, 2048), 1)
    self.ln_vjp = tri_ln.LayerNormVjpConfig(c(1, 2, 4, 8), c(16, 32, 64, 128, 2048),
                                            1, c(1, 2, 3, 5, 264), 1,
                                            bool(rng.random() < 0.5))
    self.glu = tri_glu.GatedLinearUnitConfig(c(16, 32, 64), c(16, 32, 64),
                                             c(16, 32, 64), c(1, 2, 3, 8), 4, 2,
                                             bool(rng.random() < 0.5))
    self.glu_vjp = tri_glu.GatedLinearUnitConfig(c(16, 32, 64), c(16, 32, 64),
                                                 c(16, 32, 64), c(1, 2, 3, 8), 4, 2,
                                                 bool(rng.random() < 0.5))
    self.rd = tri_rd.RaggedDotConfig(c(16, 32, 64), c(16, 32, 64), c(16, 32, 64),
                                     c(1, 2, 3, 8), 4, 2)
    self.rd_vjp = tri_rd.RaggedDotConfig(c(16, 32, 64), c(16, 32, 64), c(16, 32, 64),
                                         c(1, 2, 3, 8), 4, 2)

  def lookup(self, op, args):
    del args
    table = [(tri_att.TritonAttentionVjp, self.att_vjp),
             (tri_att.TritonAttention, self.att),
             (tri_ln.TritonLayerNormVjp, self.ln_vjp), (tri_ln.TritonLayerNorm, self.ln),
             (tri_glu.TritonGatedLinearUnitVjp, self.glu_vjp),
             (tri_glu.TritonGatedLinearUnit, self.glu),
             (tri_rd.TritonRaggedDotVjp, self.rd_vjp), (tri_rd.TritonRaggedDot, self.rd)]
    for cls, cfg in table:
      if isinstance(op, cls):
        return cfg
    return None

  def __repr__(self):
    return repr({k: v for k, v in vars(self).items()})


def run_case(op, seed, dtype, check_det=False):
  rng = np.random.default_rng(seed)
  desc, fn, floats = GENS[op](rng, jnp.dtype(dtype))
  note = f"{op} {dtype} seed={seed} {desc}"
  # Output dtype for tolerance: ragged_dot with preferred type wider than input
  out_tol = dtype
  if op == "ragged_dot" and desc["pet"] is not None:
    # a narrower output type rounds the result: use the coarser tolerance
    order = {"float32": 2, "float16": 1, "bfloat16": 0}
    out_tol = min(dtype, desc["pet"], key=order.get)
  cot_rng = np.random.default_rng(seed + 1)

  cfg_rng = np.random.default_rng(seed + 7)
  configs = RandomConfigs(cfg_rng) if cfg_rng.random() < 0.65 else None
  if configs is not None:
    pick = {"attention": ("att", "att_vjp"), "layer_norm": ("ln", "ln_vjp"),
            "glu": ("glu", "glu_vjp"), "ragged_dot": ("rd", "rd_vjp")}[op]
    note += f" configs={[getattr(configs, a) for a in pick]}"

  def triton_run():
    with tokamax.interpret(), (tuning_context.use(configs) if configs is not None
                               else contextlib.nullcontext()):
      out, vjp = jax.vjp(lambda f: fn(f, "triton", None), floats)
      cot = jnp.asarray(cot_exact, out.dtype)
      (g,) = vjp(cot)
    return out, g

  ref_out = fn(_upcast(floats), "xla", HIGHEST)
  cot_rng_std = cot_rng.standard_normal(ref_out.shape)
  # exact in the input dtype and in the op's output dtype (the implementation
  # receives the cotangent in its output dtype; the f32 reference does not)
  out_dtype = ref_out.dtype
  if op == "ragged_dot" and desc["pet"] is not None:
    out_dtype = jnp.dtype(desc["pet"])
  cot_exact = jnp.asarray(jnp.asarray(jnp.asarray(cot_rng_std, dtype), out_dtype),
                          jnp.float32)
  try:
    out, grads = triton_run()
  except NotImplementedError as e:
    msg = str(e).splitlines()[0][:300]
    # fallback check
    try:
      with tokamax.interpret():
        o2 = fn(floats, None, None)
      testing.assert_close(o2, ref_out, out_tol, what=f"{note}: fallback forward")
      fb = "fallback ok"
    except Exception as e2:
      fb = f"FALLBACK FAIL {type(e2).__name__}: {str(e2)[:300]}"
    return "refused", f"{msg} [{fb}]"
  cot = cot_exact

  def loss(f):
    return jnp.sum(fn(f, "xla", HIGHEST).astype(jnp.float32) * cot)
  ref_grads = jax.grad(loss)(_upcast(floats))
  errs = []
  try:
    testing.assert_close(out, ref_out, out_tol, what=f"{note}: forward")
  except AssertionError as e:
    errs.append(str(e))
  for name in floats:
    if grads[name].dtype != floats[name].dtype:
      errs.append(f"d{name} dtype {grads[name].dtype}")
    try:
      order = {"float32": 2, "float16": 1, "bfloat16": 0}
      gdt = min(dtype, floats[name].dtype.name, key=order.get)
      testing.assert_close(grads[name], ref_grads[name], gdt, what=f"d{name}",
                           scale=2.0)
    except AssertionError as e:
      errs.append(str(e))
  if check_det:
    out2, grads2 = triton_run()
    if not (np.array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))
            and all(np.array_equal(np.asarray(grads[n], np.float32),
                                   np.asarray(grads2[n], np.float32)) for n in floats)):
      errs.append("NONDETERMINISTIC")
  if errs:
    return "FAIL", note + "\n    " + "\n    ".join(errs)
  return "ok", ""


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--ops", default="attention,layer_norm,glu,ragged_dot")
  p.add_argument("--start", type=int, default=0)
  p.add_argument("--count", type=int, default=10)
  p.add_argument("--dtypes", default=",".join(DTYPES))
  p.add_argument("--minutes", type=float, default=1e9)
  p.add_argument("--seeds", default="")
  a = p.parse_args()
  t_end = time.time() + a.minutes * 60
  stats = {}
  seeds = [int(s) for s in a.seeds.split(",")] if a.seeds else \
      range(a.start, a.start + a.count)
  for seed in seeds:
    for op in a.ops.split(","):
      for dtype in a.dtypes.split(","):
        if time.time() > t_end:
          break
        t0 = time.time()
        try:
          status, msg = run_case(op, seed, dtype, check_det=(seed % 5 == 0))
        except Exception as e:
          status, msg = "ERROR", f"{op} {dtype} seed={seed}: {type(e).__name__}: " \
              f"{str(e)[:500]}\n{traceback.format_exc()[-1500:]}"
        stats.setdefault((op, dtype, status), 0)
        stats[(op, dtype, status)] += 1
        print(f"[{time.time() - t0:6.1f}s] {status:8s} {op} {dtype} seed={seed} {msg}",
              flush=True)
  print("SUMMARY")
  for kk, vv in sorted(stats.items()):
    print(kk, vv)
  sys.stdout.flush()


if __name__ == "__main__":
  main()
