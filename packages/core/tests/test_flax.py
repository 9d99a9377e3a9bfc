"""`tokamax.flax`: `attention_fn` in Flax's own attention modules and the norm
modules, against Flax's own on the same parameters (checkpoints load unchanged)."""

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
  testing.assert_close(got, want, "float32", what=f"nnx {masking}")


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
  np.testing.assert_allclose(got, want, rtol=1e-4)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    testing.assert_close(g, w, "float32", what="gradient")


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


def test_norm_module_implementation_is_selectable():
  norm = tokamax.flax.RMSNorm(8, rngs=nnx.Rngs(0), implementation=["triton", "xla"])
  with tokamax.record_dispatch() as records:
    norm(_x((2, 8)))
  assert [r.implementation for r in records] == ["xla"]
