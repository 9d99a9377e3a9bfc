"""`python -m tokamax demo`: a transformer block with an MoE layer through tokamax.

norm -> attention -> norm -> SwiGLU, then an MoE layer (top-1 routing, tokens
sorted by expert, two ragged_dots), forward and backward with
``implementation=None``. Prints which implementation ran each op forward and
backward, each op's max error against the XLA reference (float32 inputs,
HIGHEST precision), and each usable implementation's time side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import tokamax
from tokamax._src import bench
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


def run() -> None:
  platform = jax.default_backend()
  cfg = _shapes(platform)
  print(f"tokamax {tokamax.__version__} demo on {jax.devices()[0].device_kind} "
        f"({platform}), JAX {jax.__version__}, dtype {jnp.dtype(cfg['dtype']).name}")
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
  print()
  header = f"{'op':<22} {'forward':<12} {'backward':<12} {'max |err| vs XLA f32':>21}   time per implementation (forward, ms)"
  print(header)
  print("-" * len(header))
  for op, (fn, args) in calls.items():
    ref = fn(upcast(args), "xla", HIGHEST)
    out = jax.jit(lambda a: fn(a, None, None))(args)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
    times = []
    for status in introspection.implementations(op):
      if not status.usable:
        continue
      try:
        ms, _ = bench.kernel_time_ms(
            jax.jit(lambda a, i=status.name: fn(a, i, None)), args, iterations=5)
        times.append(f"{status.name} {ms:.2f}")
      except NotImplementedError:
        times.append(f"{status.name} n/a")
    fwd = ",".join(sorted(chosen.get((op, "forward"), {"-"})))
    bwd = ",".join(sorted(chosen.get((op, "backward"), {"-"})))
    print(f"{op:<22} {fwd:<12} {bwd:<12} {err:>21.3g}   {' | '.join(times)}")
  print(f"\n(times: median of 5, {'CUPTI kernel time' if platform == 'gpu' else 'wall clock'}"
        "; `python -m tokamax bench` runs the reference shapes)")
