"""`python -m tokamax demo`: a transformer block with an MoE layer through tokamax.

norm -> attention -> norm -> SwiGLU, then an MoE layer (top-1 routing, tokens
sorted by expert, two ragged_dots), forward and backward with
``implementation=None``. Prints which implementation ran each op forward and
backward; each op's output and gradient error against the XLA reference (float32
inputs, HIGHEST precision) beside the dtype's tolerance from the conformance suite
(`tokamax.testing.TOLERANCES`) and whether it is within it; and each usable
implementation's forward and forward+backward time side by side.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import tokamax
from tokamax import testing
from tokamax._src import benchmarking
from tokamax._src import introspection

HIGHEST = jax.lax.Precision.HIGHEST


def _shapes(platform: str) -> dict:
  if platform == "cpu":
    return dict(batch=2, seq=128, heads=4, kv_heads=2, head_dim=32, hidden=128,
                ffn=256, experts=4, dtype=jnp.bfloat16)
  return dict(batch=4, seq=2048, heads=16, kv_heads=4, head_dim=128, hidden=2048,
              ffn=8192, experts=8, dtype=jnp.bfloat16)


def _params(cfg, key):
  keys = jax.random.split(key, 8)
  d, f, e = cfg["hidden"], cfg["ffn"], cfg["experts"]
  h, n, k = cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
  init = lambda kk, shape, fan_in: (jax.random.normal(kk, shape, jnp.float32) /
                                    fan_in**0.5).astype(cfg["dtype"])
  return dict(
      norm1=jnp.ones((d,), cfg["dtype"]),
      norm2=jnp.ones((d,), cfg["dtype"]),
      norm2_offset=jnp.zeros((d,), cfg["dtype"]),
      wq=init(keys[0], (d, n * h), d), wkv=init(keys[1], (d, 2 * k * h), d),
      wo=init(keys[2], (n * h, d), n * h),
      w_glu=init(keys[3], (d, 2, f), d), w_down=init(keys[4], (f, d), f),
      router=init(keys[5], (d, e), d),
      expert_up=init(keys[6], (e, d, f), d), expert_down=init(keys[7], (e, f, d), f),
  )


def block(params, x, cfg, implementation=None):
  """One transformer block plus an MoE layer; every heavy op through tokamax."""
  b, t, d = x.shape
  n, k, h = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
  y = tokamax.rms_norm(x, params["norm1"], implementation=implementation)
  q = (y @ params["wq"]).reshape(b, t, n, h)
  kv = (y @ params["wkv"]).reshape(b, t, 2, k, h)
  attn = tokamax.dot_product_attention(q, kv[:, :, 0], kv[:, :, 1], is_causal=True,
                                       implementation=implementation)
  x = x + attn.reshape(b, t, n * h) @ params["wo"]
  y = tokamax.layer_norm(x, params["norm2"], params["norm2_offset"],
                         implementation=implementation)
  x = x + tokamax.gated_linear_unit(y, params["w_glu"], activation=jax.nn.silu,
                                    implementation=implementation) @ params["w_down"]
  # MoE: top-1 routing, tokens sorted by expert so each expert's rows are contiguous.
  tokens = x.reshape(b * t, d)
  expert = jnp.argmax(tokens @ params["router"], axis=-1)
  order = jnp.argsort(expert)
  group_sizes = jnp.bincount(expert, length=cfg["experts"]).astype(jnp.int32)
  hidden = tokamax.ragged_dot(tokens[order], params["expert_up"], group_sizes,
                              implementation=implementation)
  out = tokamax.ragged_dot(jax.nn.silu(hidden), params["expert_down"], group_sizes,
                           implementation=implementation)
  moe = jnp.zeros_like(tokens).at[order].set(out)
  return x + moe.reshape(b, t, d)



def _op_calls(cfg, key):
  """One representative call per op (at the block's shapes): fn(implementation, precision)."""
  b, t, d = cfg["batch"], cfg["seq"], cfg["hidden"]
  n, k, h, f, e = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["ffn"], cfg["experts"]
  dt = cfg["dtype"]
  ks = jax.random.split(key, 8)
  rnd = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(dt)
  q, kk_, v = rnd(ks[0], (b, t, n, h)), rnd(ks[1], (b, t, k, h)), rnd(ks[2], (b, t, k, h))
  x, scale, offset = rnd(ks[3], (b * t, d)), rnd(ks[4], (d,)), rnd(ks[5], (d,))
  w = rnd(ks[6], (d, 2, f)) * (d**-0.5)
  rhs = rnd(ks[7], (e, d, f)) * (d**-0.5)
  sizes = jnp.full((e,), (b * t) // e, jnp.int32)
  up = lambda a: jax.tree_util.tree_map(lambda z: z.astype(jnp.float32), a)
  return {
      "dot_product_attention": (lambda args, i, p: tokamax.dot_product_attention(
          *args, is_causal=True, implementation=i, precision=p), (q, kk_, v)),
      "layer_norm": (lambda args, i, p: tokamax.layer_norm(
          *args, implementation=i), (x, scale, offset)),
      "gated_linear_unit": (lambda args, i, p: tokamax.gated_linear_unit(
          *args, activation=jax.nn.silu, implementation=i, precision=p), (x, w)),
      "ragged_dot": (lambda args, i, p: tokamax.ragged_dot(
          args[0], args[1], sizes, implementation=i, precision=p), (x, rhs)),
  }, up


@dataclasses.dataclass(frozen=True)
class Accuracy:
  """One result against its reference, measured as `testing.assert_close` does."""

  rel_l2: float  # relative L2 error
  max_abs: float  # max |result - reference| / max(1, max |reference|)
  tolerance: tuple[float, float]  # (rel_l2, max_abs) allowed for the dtype
  ok: bool  # what `testing.assert_close` says (it alone decides)


def accuracy(actual, expected, dtype, *, scale: float = 1.0) -> Accuracy:
  """How far `actual` is from `expected`, against the tolerance for `dtype`.

  `scale` widens the tolerance as the conformance suite does (2 for gradients).
  """
  name = jnp.dtype(dtype).name
  gpu = jax.default_backend() == "gpu"
  try:
    testing.assert_close(actual, expected, dtype, scale=scale, gpu=gpu)
    ok = True
  except AssertionError:
    ok = False
  rel_tol, abs_tol = testing.tolerance(name, gpu=gpu)
  a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  peak = float(np.max(np.abs(e))) if e.size else 0.0
  max_abs = float(np.max(np.abs(a - e))) / max(peak, 1.0) if e.size else 0.0
  return Accuracy(testing.relative_l2_error(a, e), max_abs,
                  (rel_tol * scale, abs_tol * scale), ok)


def worst(accuracies: list[Accuracy]) -> Accuracy:
  """The failing one if any, else the one closest to its tolerance."""
  return max(accuracies, key=lambda a: (not a.ok, max(a.rel_l2 / a.tolerance[0],
                                                      a.max_abs / a.tolerance[1])))


_ACCURACY_HEADER = f"{'rel L2':>8} {'max abs*':>8}  <= tolerance"


def format_accuracy(acc: Accuracy) -> str:
  return (f"{acc.rel_l2:8.2g} {acc.max_abs:8.2g}  <= {acc.tolerance[0]:<5.2g} "
          f"{acc.tolerance[1]:<5.2g} {'ok' if acc.ok else 'FAIL'}")


def _time_ms(fn, args) -> str:
  try:
    ms, _ = benchmarking.kernel_time_ms(fn, args, iterations=5)
  except NotImplementedError:
    return "n/a"
  return f"{ms:.2f}"


def run() -> None:
  platform = jax.default_backend()
  cfg = _shapes(platform)
  dtype = jnp.dtype(cfg["dtype"])
  print(f"tokamax {tokamax.__version__} demo on {jax.devices()[0].device_kind} "
        f"({platform}), JAX {jax.__version__}, dtype {dtype.name}")
  params = _params(cfg, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (cfg["batch"], cfg["seq"], cfg["hidden"]),
                        jnp.float32).astype(cfg["dtype"])
  dy = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(cfg["dtype"])

  def loss(params, x):
    return jnp.sum(block(params, x, cfg).astype(jnp.float32) * dy)

  with tokamax.record_dispatch() as records:
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x)
  jax.block_until_ready(grads)
  chosen: dict[tuple[str, str], set[str]] = {}
  for r in records:
    chosen.setdefault((r.op, r.direction), set()).add(r.implementation)
  print(f"block forward+backward with implementation=None: loss {float(value):.4g}, "
        f"|grad| finite: {all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))}")

  calls, upcast = _op_calls(cfg, jax.random.key(3))
  print(f"\nEach op alone, implementation=None against the XLA reference in float32 "
        f"at HIGHEST precision; tolerance: tokamax.testing.TOLERANCES[{dtype.name!r}] "
        "(x2 for gradients, as the conformance suite allows)")
  width = len(format_accuracy(Accuracy(0.0, 0.0, (0.0, 0.0), False)))
  print(f"{'':<48} {'output':<{width}}   gradients (worst of the inputs)")
  header = (f"{'op':<22} {'forward':<12} {'backward':<12} "
            f"{_ACCURACY_HEADER:<{width}}   {_ACCURACY_HEADER}")
  print(header)
  print("-" * len(header))
  timings = []
  failed = False
  for op, (fn, args) in calls.items():
    ref = fn(upcast(args), "xla", HIGHEST)
    out = jax.jit(lambda a: fn(a, None, None))(args)
    out_acc = accuracy(out, ref, dtype)
    # Exact in the input dtype, so the float32 reference sees the same cotangent.
    cotangent = jax.random.normal(jax.random.key(4), out.shape, jnp.float32).astype(
        dtype).astype(jnp.float32)

    def loss_of(i, p, fn=fn, cotangent=cotangent):
      return lambda a: jnp.sum(fn(a, i, p).astype(jnp.float32) * cotangent)

    got = jax.jit(jax.grad(loss_of(None, None)))(args)
    want = jax.grad(loss_of("xla", HIGHEST))(upcast(args))
    grad_acc = worst([accuracy(g, w, dtype, scale=2.0) for g, w in zip(got, want)])
    failed |= not (out_acc.ok and grad_acc.ok)
    fwd = ",".join(sorted(chosen.get((op, "forward"), {"-"})))
    bwd = ",".join(sorted(chosen.get((op, "backward"), {"-"})))
    print(f"{op:<22} {fwd:<12} {bwd:<12} {format_accuracy(out_acc):<{width}}   "
          f"{format_accuracy(grad_acc)}")
    for status in introspection.implementations(op):
      if status.usable:
        timings.append((op, status.name,
                        _time_ms(jax.jit(lambda a, i=status.name: fn(a, i, None)), args),
                        _time_ms(jax.jit(jax.grad(loss_of(status.name, None))), args)))
  print("* max |result - reference| / max(1, max |reference|), as "
        "tokamax.testing.assert_close measures it")
  if failed:
    print("FAIL: an op is outside the tolerance the conformance suite allows")

  method = "CUPTI kernel time" if platform == "gpu" else "wall clock"
  header = f"\n{'op':<22} {'implementation':<16} {'forward ms':>11} {'fwd+bwd ms':>11}"
  print(header)
  print("-" * (len(header) - 1))
  previous = None
  for op, name, forward_ms, both_ms in timings:
    print(f"{op if op != previous else '':<22} {name:<16} {forward_ms:>11} {both_ms:>11}")
    previous = op
  print(f"\n(times: median of 5, {method}; fwd+bwd: the gradient of a sum, with the "
        "backward dispatched as for a training step; `python -m tokamax bench` runs "
        "the reference shapes)")
