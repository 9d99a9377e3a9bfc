"""A small Llama-style decoder in Flax NNX, built with tokamax's modules or Flax's own.

    python examples/llama_nnx.py          # trains both versions, prints their losses
    python examples/llama_nnx.py --moe    # the MoE variant

One model class; ``Config.use_tokamax`` picks, module by module, between the plain
Flax program and tokamax's drop-ins with the same parameters:

==============  ==========================================  ==============================
piece           plain Flax                                  tokamax
==============  ==========================================  ==============================
RMSNorm         `nnx.RMSNorm`                               `tokamax.flax.RMSNorm`
attention       `nnx.dot_product_attention` (K/V heads      `tokamax.flax.attention_fn`
                repeated for GQA, a causal mask)            (GQA and ``is_causal`` native)
SwiGLU FFN      `PlainSwiGLU`: one matmul with the fused    `tokamax.flax.SwiGLU`
                ``[D, 2, F]`` gate/up kernel, then
                ``silu(gate) * up``
MoE FFN         `PlainMoE`: every token through every       `tokamax.flax.MoE`
                expert, weighted by a dense gate matrix     (sorted tokens, grouped GLU)
==============  ==========================================  ==============================

The parameter trees are identical (names, shapes, initializers), so the tokamax
version starts from the plain version's parameters with `nnx.update`, and a
checkpoint of one loads into the other. A model whose MLP has separate gate and up
`nnx.Linear` layers loads into `tokamax.flax.SwiGLU` with its ``load_linears``.

RoPE is plain JAX in both (tokamax has no RoPE op). Written for Flax >= 0.12 (`nnx.List`,
`nnx.Optimizer(..., wrt=)`) and optax.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import tokamax.flax


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 256
  dim: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2         # GQA: num_heads / num_kv_heads query heads per K/V head
  head_dim: int = 16
  ffn_dim: int = 128            # per expert in the MoE variant
  num_experts: int = 0          # 0: a SwiGLU FFN in every layer; > 0: an MoE FFN
  top_k: int = 2
  capacity_factor: float | None = None
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"        # the computation dtype
  param_dtype: str = "float32"
  use_tokamax: bool = True

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")

  def dtypes(self) -> dict:
    """The dtype keywords every Flax module here takes."""
    return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


# ------------------------------------------------------------------------ pieces


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x [B, T, heads, H]`` (Llama's: the two halves
  of each head rotate together), computed in float32."""
  half = x.shape[-1] // 2
  frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[..., None].astype(jnp.float32) * frequencies  # [B, T, H/2]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def plain_attention(q, k, v, dtype):
  """Causal GQA attention as plain Flax computes it: each K/V head repeated for
  its query heads, then `nnx.dot_product_attention` with a causal mask."""
  repeats = q.shape[-2] // k.shape[-2]
  k, v = (jnp.repeat(a, repeats, axis=-2) for a in (k, v))
  mask = nnx.make_causal_mask(jnp.ones(q.shape[:2]))
  return nnx.dot_product_attention(q, k, v, mask=mask, dtype=dtype)


class Attention(nnx.Module):
  """GQA self-attention with RoPE; no biases (Llama)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    c = config
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs, **c.dtypes())
    self.q = linear(c.dim, c.num_heads * c.head_dim)
    self.k = linear(c.dim, c.num_kv_heads * c.head_dim)
    self.v = linear(c.dim, c.num_kv_heads * c.head_dim)
    self.o = linear(c.num_heads * c.head_dim, c.dim)
    self.config = config

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    c = self.config
    b, t, _ = x.shape
    q = rope(self.q(x).reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta)
    k = rope(self.k(x).reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
    v = self.v(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.use_tokamax:
      out = tokamax.flax.attention_fn(q, k, v, is_causal=True, dtype=c.dtype)
    else:
      out = plain_attention(q, k, v, jnp.dtype(c.dtype))
    return self.o(out.reshape(b, t, c.num_heads * c.head_dim))


class PlainSwiGLU(nnx.Module):
  """SwiGLU in plain Flax with `tokamax.flax.SwiGLU`'s parameters: ``gate_up [D, 2,
  F]`` (gate, up) and ``down``. One matmul ``x @ [w_gate | w_up]`` (a free
  reshape) computes both projections, the strongest plain form we measured."""

  def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    gate, up = (init(rngs.params(), (dim, hidden), param_dtype) for _ in range(2))
    self.gate_up = nnx.Param(jnp.stack([gate, up], axis=1))
    self.down = nnx.Linear(hidden, dim, use_bias=False, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.gate_up[...]
    k, _, n = w.shape
    h = x.astype(self.dtype) @ w.reshape(k, 2 * n).astype(self.dtype)
    return self.down(jax.nn.silu(h[..., :n]) * h[..., n:])


class PlainMoE(nnx.Module):
  """The MoE FFN in plain Flax with `tokamax.flax.MoE`'s parameters and rules
  (router logits in float32, softmax over the top-k logits, the same capacity).

  Every token goes through every expert and the outputs are summed with a dense
  ``[tokens, E]`` gate matrix that is 0 off the chosen (and kept) experts: the
  simplest correct program, E times the FLOPs, fine at this size.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    c = config
    init = nnx.initializers.lecun_normal()
    draw = lambda shape: jnp.stack([init(rngs.params(), shape, c.param_dtype)
                                    for _ in range(c.num_experts)])
    self.router = nnx.Linear(c.dim, c.num_experts, use_bias=False, rngs=rngs, **c.dtypes())
    self.gate_up = nnx.Param(jnp.concatenate([draw((c.dim, c.ffn_dim)),
                                              draw((c.dim, c.ffn_dim))], axis=-1))
    self.down = nnx.Param(draw((c.ffn_dim, c.dim)))
    self.config = config

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    dtype = jnp.dtype(c.dtype)
    tokens = x.reshape(-1, c.dim).astype(dtype)
    logits = jnp.dot(tokens, self.router.kernel[...].astype(dtype),
                     preferred_element_type=jnp.float32)
    top_logits, ids = jax.lax.top_k(logits, c.top_k)
    gates = jax.nn.softmax(top_logits, axis=-1) * self._kept(ids, tokens.shape[0])
    dense_gates = jnp.zeros_like(logits).at[jnp.arange(len(ids))[:, None], ids].add(gates)
    h = jnp.einsum("md,edf->emf", tokens, self.gate_up[...].astype(dtype))
    hidden = jax.nn.silu(h[..., :c.ffn_dim]) * h[..., c.ffn_dim:]
    y = jnp.einsum("emf,efd->emd", hidden, self.down[...].astype(dtype))
    out = jnp.einsum("me,emd->md", dense_gates, y.astype(jnp.float32))
    return out.astype(dtype).reshape(x.shape)

  def _kept(self, ids, num_tokens):
    """1 where the expert keeps the assignment: each expert's first ``capacity``
    assignments, token by token (GShard's cumulative-sum form)."""
    c = self.config
    if c.capacity_factor is None:
      return jnp.ones(ids.shape)
    capacity = math.ceil(c.capacity_factor * num_tokens * c.top_k / c.num_experts)
    one_hot = jax.nn.one_hot(ids.reshape(-1), c.num_experts, dtype=jnp.int32)
    earlier = jnp.cumsum(one_hot, axis=0) - one_hot  # same expert, earlier assignments
    return (jnp.sum(earlier * one_hot, axis=-1) < capacity).reshape(ids.shape)


# ------------------------------------------------------------------------- model


class DecoderLayer(nnx.Module):
  """RMSNorm -> attention -> residual -> RMSNorm -> FFN -> residual."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    c = config
    norm = tokamax.flax.RMSNorm if c.use_tokamax else nnx.RMSNorm
    self.attention_norm = norm(c.dim, epsilon=c.norm_eps, rngs=rngs, **c.dtypes())
    self.attention = Attention(c, rngs=rngs)
    self.ffn_norm = norm(c.dim, epsilon=c.norm_eps, rngs=rngs, **c.dtypes())
    if c.num_experts and c.use_tokamax:
      self.ffn = tokamax.flax.MoE(c.dim, c.ffn_dim, c.num_experts, top_k=c.top_k,
                                  capacity_factor=c.capacity_factor, rngs=rngs,
                                  **c.dtypes())
    elif c.num_experts:
      self.ffn = PlainMoE(c, rngs=rngs)
    elif c.use_tokamax:
      self.ffn = tokamax.flax.SwiGLU(c.dim, c.ffn_dim, rngs=rngs, **c.dtypes())
    else:
      self.ffn = PlainSwiGLU(c.dim, c.ffn_dim, rngs=rngs, **c.dtypes())

  def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    x = x + self.attention(self.attention_norm(x), positions)
    return x + self.ffn(self.ffn_norm(x))


class Llama(nnx.Module):
  """Token embedding -> decoder layers -> RMSNorm -> logits (float32)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    c = config
    self.embed = nnx.Embed(c.vocab_size, c.dim, rngs=rngs, **c.dtypes())
    self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
    norm = tokamax.flax.RMSNorm if c.use_tokamax else nnx.RMSNorm
    self.norm = norm(c.dim, epsilon=c.norm_eps, rngs=rngs, **c.dtypes())
    self.lm_head = nnx.Linear(c.dim, c.vocab_size, use_bias=False, rngs=rngs, **c.dtypes())

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for layer in self.layers:
      x = layer(x, positions)
    return self.lm_head(self.norm(x)).astype(jnp.float32)


def build_pair(config: Config, seed: int = 0) -> tuple[Llama, Llama]:
  """(plain Flax model, tokamax model), the second with the first's parameters."""
  plain = Llama(dataclasses.replace(config, use_tokamax=False), rngs=nnx.Rngs(seed))
  ours = Llama(dataclasses.replace(config, use_tokamax=True), rngs=nnx.Rngs(seed + 1))
  nnx.update(ours, nnx.state(plain, nnx.Param))  # identical trees: loads unchanged
  return plain, ours


# ---------------------------------------------------------------------- training


def loss_fn(model: Llama, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: Llama, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  optimizer.update(model, grads)
  return loss


def batches(config: Config, steps: int, batch: int = 8, length: int = 32, seed: int = 0):
  """``[steps, batch, length]`` sequences with a learnable rule (each token the
  one before plus 7, from a random start), so the loss falls within a few steps."""
  starts = jax.random.randint(jax.random.key(seed), (steps, batch, 1), 0, config.vocab_size)
  return (starts + 7 * jnp.arange(length)) % config.vocab_size


def train(model: Llama, tokens: jax.Array, learning_rate: float = 1e-2) -> list[float]:
  """Adam on each batch of `tokens` ``[steps, B, T]`` in turn; the losses."""
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
  return [float(train_step(model, optimizer, batch)) for batch in tokens]


def decoder_layer_functions(config: Config, seed: int = 0):
  """``({"plain": f, "tokamax": f}, params)``: one decoder layer as pure functions
  ``f(params, x [B, T, D]) -> [B, T, D]`` and its parameters (a dict of arrays),
  what ``python -m tokamax bench --model flax-dense`` times."""
  functions, params = {}, None
  for program in ("plain", "tokamax"):
    layer = DecoderLayer(dataclasses.replace(config, use_tokamax=program == "tokamax"),
                         rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(layer)
    if params is None:
      params = nnx.to_pure_dict(state)
    functions[program] = lambda params, x, graphdef=graphdef: nnx.merge(graphdef, params)(x)
  return functions, params


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--moe", action="store_true", help="MoE FFNs (8 experts, top-2)")
  parser.add_argument("--dtype", default="float32", help="computation dtype")
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  config = Config(dtype=args.dtype, num_experts=8 if args.moe else 0)
  tokens = batches(config, args.steps)
  plain, ours = build_pair(config)
  print(f"{'step':>4} {'plain Flax':>12} {'tokamax':>12}")
  for step, (a, b) in enumerate(zip(train(plain, tokens), train(ours, tokens))):
    print(f"{step:>4} {a:>12.6f} {b:>12.6f}")


if __name__ == "__main__":
  main()
