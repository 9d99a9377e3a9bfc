"""`tokamax.flax`: `attention_fn` in Flax's own attention modules and the norm
modules, against Flax's own on the same parameters (checkpoints load unchanged)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing

flax = pytest.importorskip("flax")
import tokamax.flax  # noqa: E402
from flax import linen  # noqa: E402
from flax import nnx  # noqa: E402

# On a GPU float32 matmuls run at the default precision (TF32), in Flax's modules
# and in the kernels alike: the checks then take the GPU's float32 tolerance.
ON_GPU = jax.default_backend() == "gpu"


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _padding_mask(batch, length, lengths):
  keep = jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]
  return linen.make_attention_mask(keep, keep)  # [B, 1, T, T]


def _nnx_pair(**kw):
  make = lambda fn: nnx.MultiHeadAttention(
      num_heads=4, in_features=32, qkv_features=32, decode=False, attention_fn=fn,
      rngs=nnx.Rngs(0), **kw)
  return make(nnx.dot_product_attention), make(tokamax.flax.attention_fn)


@pytest.mark.parametrize("masking", ["none", "causal", "padding", "is_causal"])
def test_nnx_multi_head_attention(masking):
  flax_module, ours = _nnx_pair()
  x = _x((2, 11, 32))
  causal = nnx.make_causal_mask(jnp.ones((2, 11)))
  masks = {"none": None, "causal": causal, "padding": _padding_mask(2, 11, [11, 6]),
           "is_causal": causal}
  want = flax_module(x, mask=masks[masking])
  if masking == "is_causal":
    got = ours(x, is_causal=True)  # nnx hands is_causal to the attention_fn
  else:
    got = ours(x, mask=masks[masking])
  if masking == "padding":
    # Padded query rows see no key: Flax gives the mean of the values there,
    # tokamax 0 (see tokamax.flax). Compare the rows that see keys.
    np.testing.assert_array_equal(got[1, 6:], ours.out(jnp.zeros((5, 4, 8))))
    got, want = got[1, :6], want[1, :6]
  testing.assert_close(got, want, "float32", what=f"nnx {masking}", gpu=ON_GPU)


def test_linen_multi_head_attention_forward_and_gradients():
  x = _x((3, 9, 16), seed=1)
  mask = linen.make_causal_mask(jnp.ones((3, 9)))
  ref = linen.MultiHeadDotProductAttention(num_heads=2)
  ours = linen.MultiHeadDotProductAttention(num_heads=2,
                                            attention_fn=tokamax.flax.attention_fn)
  params = ref.init(jax.random.key(0), x, mask=mask)
  dy = _x((3, 9, 16), seed=2)

  def loss(module):
    return lambda p, x: jnp.sum(module.apply(p, x, mask=mask) * dy)
  want, want_grads = jax.value_and_grad(loss(ref), argnums=(0, 1))(params, x)
  got, got_grads = jax.value_and_grad(loss(ours), argnums=(0, 1))(params, x)
  testing.assert_close(got, want, "float32", what="loss", gpu=ON_GPU)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    testing.assert_close(g, w, "float32", what="gradient", gpu=ON_GPU)


def test_implementation_is_selectable():
  x = _x((2, 5, 16), seed=3)
  module = linen.MultiHeadDotProductAttention(
      num_heads=2, attention_fn=tokamax.flax.attention_fn_for("xla_chunked"))
  params = module.init(jax.random.key(0), x)
  with tokamax.record_dispatch() as records:
    module.apply(params, x)
  assert [r.implementation for r in records] == ["xla_chunked"]


def test_dropout_and_sown_weights_are_refused_with_what_to_do():
  x = _x((2, 5, 32), seed=4)
  module = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                                  dropout_rate=0.1, rngs=nnx.Rngs(0, dropout=1),
                                  attention_fn=tokamax.flax.attention_fn)
  with pytest.raises(NotImplementedError, match="dropout_rate=0.1 with deterministic"):
    module(x, deterministic=False)
  module(x, deterministic=True)  # no dropout: runs
  plain = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                                 rngs=nnx.Rngs(0), attention_fn=tokamax.flax.attention_fn)
  with pytest.raises(NotImplementedError, match="sow_weights"):
    plain(x, sow_weights=True)


def test_dtype_is_the_computation_dtype():
  q = _x((1, 4, 2, 8))
  out = tokamax.flax.attention_fn(q, q, q, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norm_modules_load_flax_state_and_match_flax(kind, dtype):
  kw = dict(epsilon=1e-5, dtype=jnp.dtype(dtype))
  flax_module = getattr(nnx, kind)(48, rngs=nnx.Rngs(0), **kw)
  # Non-trivial parameters, as a trained checkpoint has.
  for name, param in nnx.state(flax_module, nnx.Param).flat_state():
    param[...] = _x(param[...].shape, seed=len(name)).astype(param[...].dtype)
  ours = getattr(tokamax.flax, kind)(48, rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(flax_module))  # the checkpoint, loaded unchanged
  x = _x((3, 5, 48), seed=7).astype(dtype)
  got, want = ours(x), flax_module(x)
  assert got.dtype == want.dtype
  testing.assert_close(got, want, dtype, what=kind)
  grad = lambda m: nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2))(m, x)
  for g, w in zip(jax.tree.leaves(grad(ours)), jax.tree.leaves(grad(flax_module))):
    testing.assert_close(g, w, dtype, what=f"{kind} gradient", scale=2)


def test_norm_modules_refuse_what_the_op_does_not_do():
  norm = tokamax.flax.RMSNorm(8, reduction_axes=(-2, -1), feature_axes=-1,
                              rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="last axis only"):
    norm(_x((2, 3, 8)))
  with pytest.raises(NotImplementedError, match="mask"):
    tokamax.flax.LayerNorm(8, rngs=nnx.Rngs(0))(_x((2, 8)), mask=jnp.ones((2, 8), bool))


# What ``implementation=("triton", "xla")`` runs: the first of them usable here
# (triton takes the norms on a GPU with tokamax-gpu-triton installed).
_FIRST_OF_TRITON_XLA = next(
    name for name in ("triton", "xla")
    if any(i.op == "layer_norm" and i.name == name and i.usable
           for i in tokamax.implementations()))


def test_norm_module_implementation_is_selectable():
  norm = tokamax.flax.RMSNorm(8, rngs=nnx.Rngs(0), implementation=["triton", "xla"])
  with tokamax.record_dispatch() as records:
    norm(_x((2, 8)))
  assert [r.implementation for r in records] == [_FIRST_OF_TRITON_XLA]


# -------------------------------------------------------------------- gated MLP


def _randomize(module, seed=0):
  """Non-trivial parameters, as a trained checkpoint has (not the initializers')."""
  for i, (_, param) in enumerate(nnx.to_flat_state(nnx.state(module, nnx.Param))):
    param[...] = (0.3 * _x(param[...].shape, seed=seed + i)).astype(param[...].dtype)


def _flax_mlp(activation, k, n, seed=0):
  """A Flax MLP as Llama writes it: three bias-free nnx.Linear layers."""
  gate, up, down = (nnx.Linear(i, o, use_bias=False, rngs=nnx.Rngs(seed + j))
                    for j, (i, o) in enumerate(((k, n), (k, n), (n, k))))
  forward = lambda x: down(activation(gate(x)) * up(x))
  return (gate, up, down), forward


@pytest.mark.parametrize("kind, activation", [("SwiGLU", jax.nn.silu),
                                              ("GeGLU", jax.nn.gelu)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_mlp_loads_flax_linears_and_matches_them(kind, activation, dtype):
  (gate, up, down), flax_mlp = _flax_mlp(activation, 32, 48)
  for layer in (gate, up, down):
    layer.dtype = jnp.dtype(dtype)  # the computation dtype, as the module's
  ours = getattr(tokamax.flax, kind)(32, 48, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(5))
  ours.load_linears(gate=gate, up=up, down=down)
  x = _x((3, 7, 32), seed=1).astype(dtype)
  got, want = ours(x), flax_mlp(x)
  assert got.dtype == want.dtype == jnp.dtype(dtype)
  testing.assert_close(got, want, dtype, what=kind)
  dy = _x(want.shape, seed=2)
  loss = lambda f, x: jnp.sum(f(x).astype(jnp.float32) * dy)
  testing.assert_close(jax.grad(lambda x: loss(ours, x))(x),
                       jax.grad(lambda x: loss(flax_mlp, x))(x), dtype, what="dx", scale=2)
  ours_grads = nnx.grad(lambda m: loss(m, x))(ours)
  flax_grads = nnx.grad(lambda layers: loss(
      lambda x: layers[2](activation(layers[0](x)) * layers[1](x)), x))((gate, up, down))
  for i, name in enumerate(("gate", "up")):
    testing.assert_close(ours_grads["gate_up"][...][:, i], flax_grads[i]["kernel"][...],
                         dtype, what=f"d{name}", scale=2)
  testing.assert_close(ours_grads["down"]["kernel"][...], flax_grads[2]["kernel"][...],
                       dtype, what="ddown", scale=2)


def test_gated_mlp_initializes_each_kernel_as_nnx_linear():
  k, n = 256, 192
  mlp = tokamax.flax.GatedMLP(k, n, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert mlp.gate_up[...].shape == (k, 2, n) and mlp.gate_up[...].dtype == jnp.bfloat16
  assert mlp.down.kernel[...].shape == (n, k) and mlp.down.bias is None
  # Lecun normal per [in, out] kernel: std 1/sqrt(fan_in), fan_in the kernel's own.
  kernels = {"gate": (mlp.gate_up[...][:, 0], k), "up": (mlp.gate_up[...][:, 1], k),
             "down": (mlp.down.kernel[...], n)}
  for name, (w, fan_in) in kernels.items():
    std = float(jnp.std(w.astype(jnp.float32)))
    assert abs(std * fan_in**0.5 - 1) < 0.03, (name, std, fan_in**-0.5)
  assert not np.allclose(kernels["gate"][0], kernels["up"][0])  # separate draws
  custom = tokamax.flax.GatedMLP(4, 6, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(custom.gate_up[...], np.ones((4, 2, 6)))


def test_gated_mlp_refuses_linears_it_cannot_hold():
  (gate, up, down), _ = _flax_mlp(jax.nn.silu, 8, 12)
  mlp = tokamax.flax.SwiGLU(8, 12, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="up has a bias"):
    mlp.load_linears(gate, nnx.Linear(8, 12, rngs=nnx.Rngs(0)), down)
  with pytest.raises(ValueError, match=r"down.kernel must be \(12, 8\)"):
    mlp.load_linears(gate, up, nnx.Linear(12, 9, use_bias=False, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="hidden_features must be >= 1; got 0"):
    tokamax.flax.SwiGLU(8, 0, rngs=nnx.Rngs(0))


def test_gated_mlp_implementation_is_selectable():
  mlp = tokamax.flax.SwiGLU(8, 12, implementation="xla", rngs=nnx.Rngs(0))
  with tokamax.record_dispatch() as records:
    mlp(_x((2, 8)))
  assert [(r.op, r.implementation) for r in records] == [("gated_linear_unit", "xla")]


# -------------------------------------------------------------------------- MoE

HIGHEST = jax.lax.Precision.HIGHEST


def _kept(expert_ids, num_experts, capacity):
  """Which assignments an expert keeps, straight from the documented rule: token
  by token, a token's choices in order, the first `capacity` of each expert."""
  kept = np.zeros(expert_ids.shape, bool)
  received = np.zeros(num_experts, int)
  for t, j in np.ndindex(*expert_ids.shape):
    e = expert_ids[t, j]
    kept[t, j] = capacity is None or received[e] < capacity
    received[e] += 1
  return kept


def _moe_reference(params, x, top_k, softmax_over, kept):
  """Every token through every expert, in float32 at HIGHEST precision, weighted
  by a dense [tokens, E] gate matrix (0 where not chosen or dropped)."""
  tokens = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  w_router = params["router"]["kernel"].astype(jnp.float32)
  gate_up, down = (params[n].astype(jnp.float32) for n in ("gate_up", "down"))
  logits = jnp.dot(tokens, w_router, precision=HIGHEST)
  top_logits, ids = jax.lax.top_k(logits, top_k)
  if softmax_over == "top_k":
    gates = jax.nn.softmax(top_logits)
  else:
    gates = jnp.take_along_axis(jax.nn.softmax(logits), ids, axis=-1)
  rows = jnp.arange(tokens.shape[0])[:, None]
  dense = jnp.zeros(logits.shape).at[rows, ids].add(gates * kept)
  f = down.shape[1]
  h = jnp.einsum("md,edf->emf", tokens, gate_up, precision=HIGHEST)
  y = jnp.einsum("emf,efd->emd", jax.nn.silu(h[..., :f]) * h[..., f:], down,
                 precision=HIGHEST)
  return jnp.einsum("me,emd->md", dense, y, precision=HIGHEST).reshape(x.shape)


def _moe_case(dtype="float32", **kw):
  moe = tokamax.flax.MoE(16, 24, 4, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0), **kw)
  _randomize(moe)
  x = _x((2, 8, 16), seed=9).astype(dtype)
  params = nnx.to_pure_dict(nnx.state(moe, nnx.Param))
  logits = jnp.dot(x.reshape(-1, 16).astype(jnp.float32), params["router"]["kernel"],
                   precision=HIGHEST)
  ids = np.asarray(jax.lax.top_k(logits, moe.top_k)[1])
  capacity = (None if moe.capacity_factor is None else
              int(np.ceil(moe.capacity_factor * ids.size / moe.num_experts)))
  return moe, x, params, _kept(ids, moe.num_experts, capacity)


@pytest.mark.parametrize("top_k, softmax_over, capacity_factor", [
    (2, "top_k", None), (1, "all", 1.0), (3, "top_k", 0.5)])
def test_moe_matches_every_token_through_every_expert(top_k, softmax_over,
                                                      capacity_factor):
  moe, x, params, kept = _moe_case(top_k=top_k, softmax_over=softmax_over,
                                   capacity_factor=capacity_factor)
  if capacity_factor is not None:
    assert 0 < (~kept).sum() < kept.size  # the capacity drops some, not all
  reference = lambda p, x: _moe_reference(p, x, top_k, softmax_over, kept)
  testing.assert_close(moe(x), reference(params, x), "float32", what="MoE", gpu=ON_GPU)
  dy = _x(x.shape, seed=10)
  loss = lambda out: jnp.sum(out * dy)
  got_dp, got_dx = nnx.grad(lambda m, x: loss(m(x)), argnums=(0, 1))(moe, x)
  want_dp, want_dx = jax.grad(lambda p, x: loss(reference(p, x)), argnums=(0, 1))(params, x)
  testing.assert_close(got_dx, want_dx, "float32", what="dx", gpu=ON_GPU)
  got_dp = nnx.to_pure_dict(got_dp)
  for path, want in jax.tree_util.tree_flatten_with_path(want_dp)[0]:
    got = functools.reduce(lambda t, k: t[k.key], path, got_dp)
    testing.assert_close(got, want, "float32", what=f"d{jax.tree_util.keystr(path)}",
                         gpu=ON_GPU)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_on_no_tokens(capacity_factor):
  # An empty batch or a shard without tokens: empty outputs and gradients, as the
  # ops give (the routing's reshape raised ZeroDivisionError before).
  moe = tokamax.flax.MoE(16, 24, 4, capacity_factor=capacity_factor, rngs=nnx.Rngs(0))
  for shape in [(0, 16), (3, 0, 16)]:
    x = jnp.zeros(shape)
    assert moe(x).shape == shape
    grads, dx = nnx.grad(lambda m, x: jnp.sum(m(x)), argnums=(0, 1))(moe, x)
    assert dx.shape == shape
    for g in jax.tree_util.tree_leaves(nnx.to_pure_dict(grads)):
      assert not np.any(np.asarray(g)), "no tokens: no parameter gradient"


def test_moe_in_bfloat16():
  moe, x, params, kept = _moe_case("bfloat16", param_dtype=jnp.bfloat16)
  out = moe(x)
  assert out.dtype == jnp.bfloat16 and moe.gate_up[...].dtype == jnp.bfloat16
  testing.assert_close(out, _moe_reference(params, x, 2, "top_k", kept), "bfloat16",
                       what="MoE bf16")


@pytest.mark.parametrize("scheme", ["tokamax", "qwix"])
def test_moe_takes_quantized_expert_weights(monkeypatch, scheme):
  """Expert kernels quantized with fp8 block scales (128 x 128, DeepSeek-V3's
  weights) reach both expert matmuls as quantized operands, and the output is
  the MoE's with the weights they stand for."""
  moe = tokamax.flax.MoE(128, 128, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  _randomize(moe)
  x = _x((2, 8, 128), seed=9).astype(jnp.bfloat16)
  if scheme == "qwix":
    qwix = pytest.importorskip("qwix")
    quantize = lambda w: qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=[0],
                                       tiled_axes={1: 128, 2: 128})
    dequantize = qwix.dequantize
  else:
    quantize = lambda w: tokamax.quantize(w, (1, 128, 128), keep_source=False)
    dequantize = lambda q: q.dequantize()
  quantized = [quantize(p.get_value()) for p in (moe.gate_up, moe.down)]
  for param, q in zip((moe.gate_up, moe.down), quantized):
    param.set_value(q)
  seen = []
  real = tokamax.flax._moe.ragged_dot
  def spy(lhs, rhs, *args, **kw):
    seen.append(rhs)
    return real(lhs, rhs, *args, **kw)
  monkeypatch.setattr(tokamax.flax._moe, "ragged_dot", spy)
  out = moe(x)
  assert len(seen) == 2
  for s, q in zip(seen, quantized):  # as given: quantized values and scales
    assert type(s) is type(q)
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(q), strict=True):
      np.testing.assert_array_equal(a, b)
  params = nnx.to_pure_dict(nnx.state(moe, nnx.Param))
  params.update(gate_up=dequantize(quantized[0]), down=dequantize(quantized[1]))
  ids = np.asarray(jax.lax.top_k(
      jnp.dot(x.reshape(-1, 128).astype(jnp.float32), params["router"]["kernel"],
              precision=HIGHEST), 2)[1])
  assert out.dtype == jnp.bfloat16
  testing.assert_close(out, _moe_reference(params, x, 2, "top_k", _kept(ids, 4, None)),
                       "bfloat16", what=f"MoE, {scheme} fp8 experts")
  # Under jit, and the gradient with respect to the input.
  dx = jax.jit(jax.grad(lambda x: jnp.sum(moe(x).astype(jnp.float32))))(x)
  assert dx.shape == x.shape and bool(jnp.all(jnp.isfinite(dx)))


class _MoEBlock(nnx.Module):
  """A model holding a `tokamax.flax.MoE` at path ``moe``."""

  def __init__(self):
    self.moe = tokamax.flax.MoE(256, 384, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.moe(x)


@pytest.mark.parametrize("op_names", [("ragged_dot",), ()])  # (): every op
def test_moe_quantized_by_qwix_ptq(monkeypatch, op_names):
  """`qwix.quantize_model` with a PTQ rule for ``ragged_dot`` (fp8 weights and
  activations, 128-deep tiles): both expert kernels become Qwix's quantized
  params, both expert matmuls take quantized operands (scales kept, for a
  kernel to apply), and each matmul's output equals the float64 product of the
  quantized operands it took, with a rule for ragged_dot or for every op
  (whether a second quantization inside the op shows: test_quantized_glu.py,
  int8); later calls (eager and under jit) reuse the quantized params."""
  qwix = pytest.importorskip("qwix")
  from tokamax._src import qwix_ptq

  model = _MoEBlock()
  x = _x((2, 16, 256), seed=3).astype(jnp.bfloat16)
  stages = []
  quantize_operands = qwix_ptq.quantize_operands
  def operands_spy(*args, **kw):
    stages.append(list(quantize_operands(*args, **kw)))
    return stages[-1]
  monkeypatch.setattr(qwix_ptq, "quantize_operands", operands_spy)
  matmul = tokamax.flax._moe.ragged_dot
  def matmul_spy(lhs, rhs, group_sizes, **kw):
    out = matmul(lhs, rhs, group_sizes, **kw)
    stages[-1] += [group_sizes, out]
    return out
  monkeypatch.setattr(tokamax.flax._moe, "ragged_dot", matmul_spy)
  rule = qwix.QuantizationRule(module_path="moe", op_names=op_names,
                               weight_qtype=jnp.float8_e4m3fn,
                               act_qtype=jnp.float8_e4m3fn, tile_size=128)
  quantized = qwix.quantize_model(model, qwix.PtqProvider([rule]), x)
  state = jax.tree.map(lambda a: (a.shape, a.dtype.name),
                       nnx.to_pure_dict(nnx.state(quantized.moe, nnx.Param)))
  assert state["gate_up"] == {"array": {"qvalue": ((4, 256, 768), "float8_e4m3fn"),
                                        "scale": ((4, 2, 768), "bfloat16")}}
  assert state["down"] == {"array": {"qvalue": ((4, 384, 256), "float8_e4m3fn"),
                                     "scale": ((4, 3, 256), "bfloat16")}}
  if op_names:
    assert state["router"]["kernel"] == ((256, 4), "bfloat16")  # no rule for it
  first = quantized(x)
  testing.assert_close(jax.jit(quantized)(x), first, "bfloat16", what="under jit")
  stages.clear()
  out = quantized(x)
  np.testing.assert_array_equal(out, first)
  assert len(stages) == 2  # the gate/up and the down matmul
  for (lhs, rhs, group_sizes, got), k in zip(stages, (256, 384)):
    # Rows: one scale per row and 128 of K; weights: per expert, 128 of K and
    # column (Qwix's PTQ tiling of a matmul's operands).
    for name, operand, tiles in (("lhs", lhs, (1, 128)), ("rhs", rhs, (1, 128, 1))):
      values, scales, _, _ = tokamax._src.quantization.split(name, operand)
      assert values.dtype == jnp.float8_e4m3fn and scales is not None, name
      assert tuple(v // s for v, s in zip(values.shape, scales.shape)) == tiles, name
      assert values.shape[-2 if name == "rhs" else -1] == k, name
    lhs64, rhs64 = (np.asarray(_stands_for(a), np.float64) for a in (lhs, rhs))
    want, start = np.zeros((lhs64.shape[0], rhs64.shape[2])), 0
    for g, size in enumerate(np.asarray(group_sizes)):
      want[start:start + size] = lhs64[start:start + size] @ rhs64[g]
      start += size
    testing.assert_close(got, want, "bfloat16", what=f"expert matmul K{k}")
  if not op_names:
    return  # (the rule quantizes the router too: the gradient follows it)
  # The gradient with respect to the input goes straight through the quantized
  # rows (it was 0): near that of the weights-only model (same quantized
  # weights, rows unquantized).
  weights_only = qwix.quantize_model(
      _MoEBlock(), qwix.PtqProvider([dataclasses.replace(rule, act_qtype=None)]), x)
  cotangent = _x(out.shape, seed=4)
  def dx(model):
    loss = lambda x: jnp.sum(model(x).astype(jnp.float32) * cotangent)
    return np.asarray(jax.grad(loss)(x), np.float64)
  got, want = dx(quantized), dx(weights_only)
  error = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert np.linalg.norm(want) > 0 and error < 0.1, error


def _stands_for(operand):
  """The array a quantized operand (ours, or Qwix's, or its PTQ ``WithAux``)
  stands for."""
  operand = tokamax._src.quantization._unwrap(operand)
  if isinstance(operand, tokamax.QuantizedArray):
    return operand.dequantize()
  return pytest.importorskip("qwix").dequantize(operand)


def test_moe_refuses_qwix_rules_it_cannot_apply():
  """Qwix rules the experts cannot follow raise, naming the rule, rather than
  leave the experts unquantized or without adapters: quantized training
  (`qwix.QtRule`), LoRA (`qwix.LoraRule`) and static activation scales."""
  qwix = pytest.importorskip("qwix")
  x = _x((2, 16, 256), seed=3).astype(jnp.bfloat16)
  fp8 = dict(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn)
  qt = qwix.QtRule(module_path="moe", **fp8)
  with pytest.raises(NotImplementedError, match=r"post-training quantization "
                     r"\(qwix.PtqProvider\) rules only; a QtRule matched it"):
    qwix.quantize_model(_MoEBlock(), qwix.QtProvider([qt]), x)
  lora = qwix.LoraRule(module_path="moe", rank=4, alpha=1.0)  # no weight_qtype
  with pytest.raises(NotImplementedError, match="a LoraRule matched it"):
    qwix.apply_lora_to_model(_MoEBlock(), qwix.LoraProvider([lora]), x)
  static = qwix.QuantizationRule(module_path="moe", act_static_scale=True, **fp8)
  with pytest.raises(NotImplementedError, match=r"dynamic scales only.*act_static_"
                     r"scale=True"):
    qwix.quantize_model(_MoEBlock(), qwix.PtqProvider([static]), x)
  glu = qwix.QuantizationRule(module_path="moe", op_names=("gated_linear_unit",), **fp8)
  with pytest.raises(NotImplementedError, match="follow rules for 'ragged_dot'"):
    qwix.quantize_model(_MoEBlock(), qwix.PtqProvider([glu]), x)
  # Qwix's own errors name the op, the operand and the rule.
  odd = qwix.QuantizationRule(module_path="moe", op_names=("ragged_dot",),
                              tile_size=100, **fp8)
  with pytest.raises(ValueError, match=r"cannot quantize tokamax's ragged_dot rhs: .*"
                     r"cannot be tiled"):
    qwix.quantize_model(_MoEBlock(), qwix.PtqProvider([odd]), x)
  # A rule for other ops (or modules) leaves the experts as they are.
  dense_only = qwix.QuantizationRule(module_path="moe", op_names=("dot_general",), **fp8)
  kept = qwix.quantize_model(_MoEBlock(), qwix.PtqProvider([dense_only]), x)
  assert kept.moe.gate_up[...].dtype == jnp.bfloat16


def test_moe_parameters_and_initializers():
  moe = tokamax.flax.MoE(64, 96, 8, rngs=nnx.Rngs(0))
  shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(moe, nnx.Param)))
  assert shapes == {"router": {"kernel": (64, 8)}, "gate_up": (8, 64, 192),
                    "down": (8, 96, 64)}
  gate_up, down = moe.gate_up[...], moe.down[...]
  # Lecun normal per expert kernel ([in, out], fan_in = in), each its own draw.
  for name, w, fan_in in (("gate", gate_up[..., :96], 64), ("up", gate_up[..., 96:], 64),
                          ("down", down, 96)):
    assert abs(float(jnp.std(w)) * fan_in**0.5 - 1) < 0.03, name
  assert not np.allclose(gate_up[0], gate_up[1])


def test_moe_refuses_bad_arguments():
  make = lambda **kw: tokamax.flax.MoE(8, 8, **{"num_experts": 4, **kw},
                                       rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\]; got 5"):
    make(top_k=5)
  # Floats were taken (top_k=1.5) or failed in a JAX shape error (in_features).
  with pytest.raises(TypeError, match="top_k must be an int >= 1; got 1.5"):
    make(top_k=1.5)
  with pytest.raises(TypeError, match="in_features must be an int >= 1; got 8.0"):
    tokamax.flax.MoE(8.0, 8, num_experts=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="capacity_factor must be None or > 0; got 0"):
    make(capacity_factor=0)
  # Concrete 0-d integer arrays are taken by value (stored raw, they failed
  # under nnx.jit).
  moe = make(num_experts=jnp.int32(4), top_k=jnp.int32(2), implementation="xla")
  assert (moe.num_experts, moe.top_k) == (4, 2) and type(moe.top_k) is int
  nnx.jit(lambda m, x: m(x))(moe, _x((2, 8)))
  with pytest.raises(ValueError, match="softmax_over must be one of"):
    make(softmax_over="experts")
  with pytest.raises(ValueError, match=r"x must be \[..., 8\]; got shape \(2, 3\)"):
    make()(_x((2, 3)))
  with pytest.raises(ValueError, match="inside jax.shard_map over mesh axis 'ep'"):
    make(expert_axis="ep")(_x((2, 8)))


def test_moe_implementation_is_selectable():
  moe = tokamax.flax.MoE(8, 8, 4, implementation="xla", rngs=nnx.Rngs(0))
  with tokamax.record_dispatch() as records:
    moe(_x((6, 8)))
  assert {(r.op, r.implementation) for r in records} == {("ragged_dot", "xla")}


def test_moe_experts_run_a_grouped_glu_by_default():
  moe = tokamax.flax.MoE(8, 8, 4, rngs=nnx.Rngs(0))
  with tokamax.record_dispatch() as records:
    moe(_x((6, 8)))
  assert {r.op for r in records} == {"gated_linear_unit", "ragged_dot"}


# ------------------------------------------------------------------------ linen


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("x_dtype, dtype", [("float32", None), ("bfloat16", None),
                                            ("bfloat16", "bfloat16")])
def test_linen_norms_load_flax_variables_and_match_flax(kind, x_dtype, dtype):
  kw = dict(epsilon=1e-5, dtype=dtype and jnp.dtype(dtype))
  flax_module = getattr(linen, kind)(**kw)
  ours = getattr(tokamax.flax.linen, kind)(**kw)
  x = _x((3, 5, 48), seed=7).astype(x_dtype)
  variables = flax_module.init(jax.random.key(0), x)
  assert (jax.tree.map(jnp.shape, ours.init(jax.random.key(1), x))
          == jax.tree.map(jnp.shape, variables))  # same names and shapes
  variables = jax.tree_util.tree_map_with_path(
      lambda path, v: _x(v.shape, seed=len(jax.tree_util.keystr(path))), variables)
  got, want = ours.apply(variables, x), flax_module.apply(variables, x)
  assert got.dtype == want.dtype  # float32 params promote a bf16 x, as in Flax
  testing.assert_close(got, want, want.dtype, what=kind)
  loss = lambda m: lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32) ** 2)
  got_grads = jax.grad(loss(ours), argnums=(0, 1))(variables, x)
  want_grads = jax.grad(loss(flax_module), argnums=(0, 1))(variables, x)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    # A float32 gradient of a bf16 computation (or the reverse) has bf16's error.
    tol = jnp.bfloat16 if jnp.bfloat16 in (w.dtype, want.dtype) else jnp.float32
    testing.assert_close(g, w, tol, what=f"{kind} gradient", scale=2)


def test_linen_norms_refuse_what_the_op_does_not_do_and_select_implementations():
  x = _x((2, 3, 8))
  with pytest.raises(NotImplementedError, match="last axis only"):
    tokamax.flax.linen.LayerNorm(reduction_axes=(-2, -1)).init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="axis_name='batch'"):
    tokamax.flax.linen.RMSNorm(axis_name="batch").init(jax.random.key(0), x)
  norm = tokamax.flax.linen.RMSNorm(implementation=("triton", "xla"))
  variables = norm.init(jax.random.key(0), x)
  with tokamax.record_dispatch() as records:
    norm.apply(variables, x)
  assert [r.implementation for r in records] == [_FIRST_OF_TRITON_XLA]
