"""tokamax.flax.MoE with expert_axis: experts sharded over a mesh axis, tokens
moved by moe_all_to_all inside jax.shard_map.

Checked against every token through every expert in plain JAX, the capacity
applied to each device's own tokens as documented; forward and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tokamax import testing

pytest.importorskip("flax")
import tokamax.flax  # noqa: E402
from flax import nnx  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
NUM_DEVICES = jax.device_count()
ON_GPU = jax.default_backend() == "gpu"


def _sharded_call(module):
  """``f(state, x)``: the module inside shard_map, its experts split over "ep"."""
  mesh = jax.make_mesh((NUM_DEVICES,), ("ep",), axis_types=(AxisType.Auto,))
  graphdef, state = nnx.split(module)
  # gate_up and down ([E, ...]) split by expert; the router replicated.
  specs = jax.tree.map(lambda a: P("ep") if a.ndim == 3 else P(), state)
  local = lambda state, x: nnx.merge(graphdef, state)(x)
  return state, jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("ep")),
                                      out_specs=P("ep")))


def _kept(expert_ids, num_experts, capacity):
  """Per device block of tokens: token by token, each expert's first `capacity`."""
  kept = np.zeros(expert_ids.shape, bool)
  for block in np.split(np.arange(expert_ids.shape[0]), NUM_DEVICES):
    received = np.zeros(num_experts, int)
    for t in block:
      for j, e in enumerate(expert_ids[t]):
        kept[t, j] = received[e] < capacity
        received[e] += 1
  return kept


def _reference(state, x, kept, top_k):
  w_router = state["router"]["kernel"][...]
  gate_up, down = state["gate_up"][...], state["down"][...]
  logits = jnp.dot(x, w_router, precision=HIGHEST)
  top_logits, ids = jax.lax.top_k(logits, top_k)
  rows = jnp.arange(x.shape[0])[:, None]
  dense = jnp.zeros(logits.shape).at[rows, ids].add(jax.nn.softmax(top_logits) * kept)
  f = down.shape[1]
  h = jnp.einsum("md,edf->emf", x, gate_up, precision=HIGHEST)
  y = jnp.einsum("emf,efd->emd", jax.nn.silu(h[..., :f]) * h[..., f:], down,
                 precision=HIGHEST)
  return jnp.einsum("me,emd->md", dense, y, precision=HIGHEST)


def test_sharded_moe_matches_every_token_through_every_expert():
  experts, top_k, capacity_factor, per_device = 2 * NUM_DEVICES, 2, 1.0, 12
  moe = tokamax.flax.MoE(16, 24, experts, top_k=top_k, capacity_factor=capacity_factor,
                         expert_axis="ep", rngs=nnx.Rngs(0))
  state, call = _sharded_call(moe)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((NUM_DEVICES * per_device, 16)),
                  jnp.float32)
  ids = np.asarray(jax.lax.top_k(x @ state["router"]["kernel"][...], top_k)[1])
  capacity = int(np.ceil(capacity_factor * per_device * top_k / experts))
  kept = _kept(ids, experts, capacity)
  assert 0 < (~kept).sum()  # the capacity drops some
  reference = functools.partial(_reference, kept=kept, top_k=top_k)
  dtype = "float32"
  testing.assert_close(call(state, x), reference(state, x), dtype, gpu=ON_GPU)
  dy = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
  grads = lambda f: jax.grad(lambda s, x: jnp.sum(f(s, x) * dy), argnums=(0, 1))(state, x)
  got, want = grads(call), grads(reference)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(want)):
    testing.assert_close(g, w, dtype, what=jax.tree_util.keystr(path), gpu=ON_GPU)


def test_experts_not_split_over_the_axis_are_refused():
  moe = tokamax.flax.MoE(8, 8, NUM_DEVICES, top_k=1, expert_axis="ep", rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((NUM_DEVICES,), ("ep",), axis_types=(AxisType.Auto,))
  graphdef, state = nnx.split(moe)
  replicated = jax.tree.map(lambda a: P(), state)
  call = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh,
                       in_specs=(replicated, P("ep")), out_specs=P("ep"))
  with pytest.raises(ValueError, match="split gate_up and down along their first axis"):
    call(state, jnp.zeros((NUM_DEVICES * 2, 8)))


def test_quantized_experts_split_over_the_mesh():
  """fp8 expert weights (128 x 128 block scales, sources kept) split by expert
  over the mesh: the output and the gradients (input, and the weights' sources,
  straight-through) equal the module's on one device."""
  moe = tokamax.flax.MoE(128, 128, 2 * NUM_DEVICES, expert_axis="ep",
                         param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  for param in (moe.gate_up, moe.down):
    param.set_value(tokamax.quantize(param.get_value(), (1, 128, 128)))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8 * NUM_DEVICES, 128)),
                  jnp.bfloat16)
  state, sharded = _sharded_call(moe)
  local = nnx.merge(*nnx.split(moe))
  local.expert_axis = None
  loss = lambda out: jnp.sum(out.astype(jnp.float32) ** 2)
  got, (got_state, got_dx) = jax.value_and_grad(
      lambda s, x: loss(sharded(s, x)), argnums=(0, 1))(state, x)
  want, (want_state, want_dx) = jax.value_and_grad(
      lambda s, x: loss(nnx.merge(nnx.graphdef(local), s)(x)), argnums=(0, 1))(
          nnx.state(local), x)
  testing.assert_close(got, want, "bfloat16", what="loss")
  testing.assert_close(got_dx, want_dx, "bfloat16", what="dx")
  got_state, want_state = nnx.to_pure_dict(got_state), nnx.to_pure_dict(want_state)
  for name in ("gate_up", "down"):
    testing.assert_close(got_state[name].source, want_state[name].source,
                         "bfloat16", what=f"d{name} (its source)")
