"""tokamax.moe_all_to_all: expert parallelism by all-to-all inside shard_map.

Checked against a dense per-token reference (every token times its expert's
matrix) on random routings, with and without dropped tokens, top-1 and top-k,
overlapped in pieces or not, by all-to-all or by the ring exchange; gradients too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax

NUM_DEVICES = jax.device_count()
ON_GPU = jax.default_backend() == "gpu"
TOL = 2e-3 if ON_GPU else 2e-5  # GPU float32 matmuls may use TF32


def _mesh():
  return jax.make_mesh((NUM_DEVICES,), ("ep",), axis_types=(AxisType.Auto,))


def _rand(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _layer(mesh, **kw):
  return jax.jit(jax.shard_map(
      functools.partial(tokamax.moe_all_to_all, axis_name="ep", **kw), mesh=mesh,
      in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep")))


def _dense(x, ids, w):
  return jnp.einsum("mk,m...kn->m...n", x, w[ids], precision=jax.lax.Precision.HIGHEST)


def _kept(ids, num_devices, e_local, capacity):
  """Which assignments survive a capacity, computed independently: on each
  source device, the assignments for one destination ordered by (expert, token,
  k) keep the first `capacity`."""
  ids = np.asarray(ids)
  per_device = ids.shape[0] // num_devices
  kept = np.zeros(ids.shape, bool)
  for src in range(num_devices):
    block = ids[src * per_device:(src + 1) * per_device].reshape(per_device, -1)
    for dest in range(num_devices):
      cells = [(e, t, j) for t in range(per_device) for j, e in enumerate(block[t])
               if e // e_local == dest]
      for _, t, j in sorted(cells)[:capacity]:
        kept[(src * per_device + t,) + ((j,) if ids.ndim == 2 else ())] = True
  return kept


@pytest.mark.parametrize("top_k", [None, 2])
@pytest.mark.parametrize("chunks,exchange", [(1, "all_to_all"), (3, "all_to_all"),
                                             (1, "ring")])
def test_matches_dense_reference(top_k, chunks, exchange):
  rng = np.random.default_rng(68)
  mesh = _mesh()
  e = 2 * NUM_DEVICES
  m = 8 * NUM_DEVICES + 3 * NUM_DEVICES  # tokens: 11 per device
  x, w = _rand(rng, m, 16), _rand(rng, e, 16, 8)
  ids = jnp.asarray(rng.integers(0, e, (m,) if top_k is None else (m, top_k)),
                    jnp.int32)
  f = _layer(mesh, chunks=chunks, exchange=exchange)
  args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w)]
  assert _rel(f(*args), _dense(x, ids, w)) < TOL
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, ids, w)))
  got = jax.grad(loss(f), argnums=(0, 1))(args[0], args[2])
  want = jax.grad(loss(_dense), argnums=(0, 1))(x, w)
  for g, wnt in zip(got, want):
    assert _rel(g, wnt) < 3 * TOL


@pytest.mark.parametrize("top_k,capacity,chunks,exchange", [
    (None, 1, 1, "all_to_all"), (None, 3, 2, "all_to_all"), (2, 4, 1, "all_to_all"),
    (2, 5, 3, "all_to_all"), (None, 3, 1, "ring"), (2, 4, 1, "ring")])
def test_capacity_drops_the_overflow_and_nothing_else(top_k, capacity, chunks,
                                                      exchange):
  rng = np.random.default_rng(90)
  mesh = _mesh()
  e = 2 * NUM_DEVICES
  m = 12 * NUM_DEVICES
  x, w = _rand(rng, m, 16), _rand(rng, e, 16, 8)
  # Skewed routing: half the assignments go to expert 0's device.
  ids = rng.integers(0, e, (m,) if top_k is None else (m, top_k))
  ids = np.where(rng.random(ids.shape) < 0.5, rng.integers(0, 2, ids.shape), ids)
  if top_k:
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, e - 1, m)) % e  # distinct experts
  ids = jnp.asarray(ids, jnp.int32)
  f = _layer(mesh, capacity=capacity, chunks=chunks, exchange=exchange)
  got = np.asarray(f(*[jax.device_put(a, NamedSharding(mesh, P("ep")))
                       for a in (x, ids, w)]))
  rounded = -(-capacity // chunks) * chunks  # capacity is rounded up to the pieces
  kept = _kept(ids, NUM_DEVICES, 2, rounded)
  assert 0 < kept.sum() < kept.size
  want = np.asarray(_dense(x, ids, w))
  np.testing.assert_array_equal(got[~kept], 0)
  assert _rel(got[kept], want[kept]) < TOL


@pytest.mark.parametrize("chunks,exchange", [(2, "all_to_all"), (1, "ring")])
def test_an_expert_function_runs_a_whole_ffn(chunks, exchange):
  rng = np.random.default_rng(114)
  mesh = _mesh()
  e, m, d, f_dim = NUM_DEVICES, 6 * NUM_DEVICES, 16, 24
  x, ids = _rand(rng, m, d), jnp.asarray(rng.integers(0, e, m), jnp.int32)
  w_up, w_down = _rand(rng, e, d, f_dim), _rand(rng, e, f_dim, d)

  def local(x, ids, w_up, w_down):
    def ffn(rows, sizes):
      h = jax.nn.gelu(tokamax.ragged_dot(rows, w_up, sizes))
      return tokamax.ragged_dot(h, w_down, sizes)
    return tokamax.moe_all_to_all(x, ids, ffn, axis_name="ep",
                                  num_local_experts=w_up.shape[0], chunks=chunks,
                                  exchange=exchange)

  layer = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("ep"),) * 4,
                                out_specs=P("ep")))
  want = jnp.einsum("mf,mfd->md", jax.nn.gelu(_dense(x, ids, w_up)), w_down[ids],
                    precision=jax.lax.Precision.HIGHEST)
  args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w_up,
                                                                     w_down)]
  assert _rel(layer(*args), want) < TOL


def test_combine_weights_sum_each_tokens_expert_outputs():
  rng = np.random.default_rng(138)
  mesh = _mesh()
  e, m = 2 * NUM_DEVICES, 5 * NUM_DEVICES
  x, w = _rand(rng, m, 16), _rand(rng, e, 16, 8)
  ids = jnp.asarray(rng.integers(0, e, (m, 2)), jnp.int32)
  gates = jax.nn.softmax(_rand(rng, m, 2), axis=-1)
  layer = jax.jit(jax.shard_map(
      lambda x, i, w, g: tokamax.moe_all_to_all(x, i, w, axis_name="ep",
                                                combine_weights=g),
      mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))
  want = lambda x, w, g: jnp.einsum("mk,mkn->mn", g, _dense(x, ids, w))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  assert _rel(layer(put(x), put(ids), put(w), put(gates)), want(x, w, gates)) < TOL
  loss = lambda f: lambda x, w, g: jnp.sum(jnp.sin(f(x, w, g)))
  got = jax.grad(loss(lambda x, w, g: layer(x, put(ids), w, g)), argnums=(0, 1, 2))(
      put(x), put(w), put(gates))
  for g, wnt in zip(got, jax.grad(loss(want), argnums=(0, 1, 2))(x, w, gates)):
    assert _rel(g, wnt) < 3 * TOL


@pytest.mark.parametrize("exchange", ["all_to_all", "ring"])
def test_expert_ids_out_of_range_are_dropped(exchange):
  rng = np.random.default_rng(160)
  mesh = _mesh()
  e, m = 2 * NUM_DEVICES, 6 * NUM_DEVICES
  x, w = _rand(rng, m, 16), _rand(rng, e, 16, 8)
  ids = rng.integers(0, e, m)
  bad = rng.random(m) < 0.3
  ids[bad] = rng.choice([-1, e, e + 5], bad.sum())
  ids = jnp.asarray(ids, jnp.int32)
  got = np.asarray(_layer(mesh, exchange=exchange)(
      *[jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w)]))
  np.testing.assert_array_equal(got[bad], 0)
  want = np.asarray(_dense(x, jnp.clip(ids, 0, e - 1), w))
  assert _rel(got[~bad], want[~bad]) < TOL


def test_bad_arguments_name_themselves():
  mesh = _mesh()
  x, w = jnp.ones((NUM_DEVICES * 2, 4)), jnp.ones((NUM_DEVICES, 4, 4))
  ids = jnp.zeros((NUM_DEVICES * 2,), jnp.int32)
  bad = [(dict(), jnp.ones((NUM_DEVICES * 2,)), TypeError, "expert_ids must be integers"),
         (dict(chunks=0), ids, ValueError, "chunks"),
         (dict(capacity=0), ids, ValueError, "capacity"),
         # Floats gave an indexing error from deep inside the routing.
         (dict(chunks=1.5), ids, TypeError, "chunks must be an int >= 1; got 1.5"),
         (dict(capacity=1.5), ids, TypeError, "capacity must be None or an int >= 1"),
         (dict(exchange="tree"), ids, ValueError,
          "exchange must be 'all_to_all' or 'ring'; got 'tree'"),
         (dict(exchange="ring", chunks=2), ids, ValueError, "chunks must be 1"),
         (dict(), jnp.zeros((NUM_DEVICES * 3,), jnp.int32), ValueError,
          "expert_ids must be")]
  for kw, ids, error, message in bad:
    with pytest.raises(error, match=message):
      jax.shard_map(functools.partial(tokamax.moe_all_to_all, axis_name="ep", **kw),
                    mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")),
                    out_specs=P("ep"))(x, ids, w)
  # Concrete 0-d integer arrays are taken by value (they crashed in the routing).
  args = [jax.device_put(a, NamedSharding(mesh, P("ep")))
          for a in (x, jnp.zeros((NUM_DEVICES * 2,), jnp.int32), w)]
  np.testing.assert_array_equal(
      _layer(mesh, chunks=jnp.int32(2), capacity=jnp.int32(3))(*args),
      _layer(mesh, chunks=2, capacity=3)(*args))
  # A weight of another K named ragged_dot's lhs and rhs before.
  with pytest.raises(ValueError, match=r"must have K = x's 4 features; got weights "
                     r"of shape \(1, 5, 4\)"):
    jax.shard_map(functools.partial(tokamax.moe_all_to_all, axis_name="ep"),
                  mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))(
                      x, jnp.zeros((NUM_DEVICES * 2,), jnp.int32),
                      jnp.ones((NUM_DEVICES, 5, 4)))
  with pytest.raises(ValueError, match="inside jax.shard_map over that axis"):
    tokamax.moe_all_to_all(x, jnp.zeros((NUM_DEVICES * 2,), jnp.int32), w,
                           axis_name="ep")
  with pytest.raises(ValueError, match="combine_weights must be shaped like"):
    jax.shard_map(functools.partial(tokamax.moe_all_to_all, axis_name="ep",
                                    combine_weights=jnp.ones((2, 2))),
                  mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))(
                      x, jnp.zeros((NUM_DEVICES * 2,), jnp.int32), w)
  with pytest.raises(ValueError, match="num_local_experts is required"):
    jax.shard_map(lambda x, i: tokamax.moe_all_to_all(x, i, lambda r, s: r,
                                                      axis_name="ep"),
                  mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))(
                      x, jnp.zeros((NUM_DEVICES * 2,), jnp.int32))
