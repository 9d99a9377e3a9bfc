"""Regressions found by an outside check of the SPMD rules (8 virtual CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _rand(rng, *shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _value_and_grads(f, args, argnums, ct):
  def loss(*a):
    return jnp.sum(f(*a).astype(jnp.float32) * ct)
  return jax.jit(f)(*args), jax.jit(jax.grad(loss, argnums=argnums))(*args)


def _compare(f, args, specs, mesh, argnums, tol):
  rng = np.random.default_rng(5)
  local = [jax.device_put(a, jax.devices()[0]) for a in args]
  with tokamax.spmd_partitioning(False):
    out_ref = jax.jit(f)(*local)
    ct = jnp.asarray(rng.standard_normal(out_ref.shape), jnp.float32)
    ref, gref = _value_and_grads(f, local, argnums, ct)
  sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  hlo = jax.jit(f).lower(*sharded).compile().as_text()
  out, grads = _value_and_grads(f, sharded, argnums, ct)
  assert _rel(out, ref) < tol
  for g, gr in zip(grads, gref):
    assert _rel(g, gr) < tol
  return hlo


def test_ragged_dot_with_preferred_element_type_partitions():
  # A numpy dtype has a `shape`: the Shardy rule counted preferred_element_type
  # as an operand ("Sharding rule has 4 operands, but the operation has 3").
  rng = np.random.default_rng(11)
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  lhs = _rand(rng, 64, 16, dtype=jnp.bfloat16)
  rhs = _rand(rng, 8, 16, 32, dtype=jnp.bfloat16)
  sizes = jnp.asarray([5, 0, 13, 7, 9, 0, 11, 15], jnp.int32)

  def f(lhs, rhs, sizes):
    return tokamax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)

  hlo = _compare(f, [lhs, rhs, sizes], [P("data"), P("expert"), P()], mesh, (0, 1),
                 tol=2e-2)
  assert "all-gather" not in hlo


def test_gqa_kv_heads_stay_split_over_a_prefix_of_the_head_axes():
  # 8 query heads over ("y", "z") (4 shards), 2 kv heads: each shard's query heads
  # share one kv head. The kv heads split over "y" are kept split (each shard
  # slices its head from its local one) instead of being gathered.
  rng = np.random.default_rng(12)
  mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Auto,) * 3)
  q = _rand(rng, 4, 16, 8, 8)
  k, v = _rand(rng, 4, 16, 2, 8), _rand(rng, 4, 16, 2, 8)

  def f(q, k, v):
    return tokamax.dot_product_attention(q, k, v, is_causal=True)

  hlo = _compare(f, [q, k, v], [P("x", None, ("y", "z")), P("x", None, "y"),
                                P("x", None, "y")], mesh, (0, 1, 2), tol=1e-5)
  assert "all-gather" not in hlo


def test_partitioned_step_pays_the_forward_a_backward_reruns(
    monkeypatch, attention_step_dispatch):
  """On several devices a forward leaves no opaque residuals (sharding.active),
  so a backward that reruns its forward without them (cuDNN's:
  `VjpOp.reruns_forward_without_own_residuals`) costs its own forward twice:
  dispatch adds it to that implementation's step. Here xla_chunked's step
  (1 + 3 ms) beats xla's (1.5 + 3.1) until its backward reruns its forward."""
  from tokamax._src.ops.attention import xla as attention_xla
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 48, 2, 8)), jnp.float32)
  times = {("forward", "xla_chunked"): 1.0, ("forward", "xla"): 1.5,
           ("backward", "xla_chunked"): 3.0, ("backward", "xla"): 3.1}
  assert jax.device_count() > 1
  assert attention_step_dispatch(q, times) == [("forward", "xla_chunked"),
                                               ("backward", "xla_chunked")]
  monkeypatch.setattr(attention_xla.XlaChunkedAttentionVjp,
                      "reruns_forward_without_own_residuals", True)
  assert attention_step_dispatch(q, times) == [("forward", "xla"), ("backward", "xla")]


@pytest.mark.parametrize("op", ["layer_norm", "attention"])
@pytest.mark.parametrize("second_order", ["hessian", "grad_of_grad"])
def test_second_derivatives_on_several_devices(op, second_order):
  # With more than one device every call was wrapped for partitioning in
  # `custom_partitioning`, which has no rule to differentiate it: `jax.hessian`
  # failed even with implementation="xla". A call differentiated twice runs the
  # XLA implementations unwrapped (XLA partitions them as any JAX code).
  rng = np.random.default_rng(0)
  if op == "layer_norm":
    x = _rand(rng, 2, 3, 13)  # leading dims merged before dispatch
    fn = lambda s: tokamax.layer_norm(x, s, None)
    s = _rand(rng, 13)
  else:
    k, v = _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 6, 2, 8)
    fn = lambda q: tokamax.dot_product_attention(q, k, v, is_causal=True)
    s = _rand(rng, 1, 5, 2, 8)
  loss = lambda s: jnp.sum(jnp.sin(fn(s)))
  d = rng.standard_normal(s.shape)
  d = jnp.asarray(d / np.linalg.norm(d), s.dtype)
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    if second_order == "hessian":
      got = jax.hessian(loss)(s).reshape(s.size, s.size) @ d.reshape(-1)
    else:  # the gradient of <grad, d> is the Hessian times d
      got = jax.grad(lambda s: jnp.vdot(jax.grad(loss)(s), d))(s)
  assert {r.implementation for r in records} <= {"xla", "xla_chunked"}, records
  grad, eps = jax.jit(jax.grad(loss)), 1e-2
  want = (grad(s + eps * d) - grad(s - eps * d)) / (2 * eps)
  np.testing.assert_allclose(np.reshape(got, -1), np.reshape(want, -1), rtol=2e-2,
                             atol=2e-3)


@pytest.mark.parametrize("placed", ["uncommitted", "sharded"])
def test_interpreted_tpu_kernels_under_jit_on_several_devices(placed):
  # Pallas' TPU interpreter runs a kernel through ordered host callbacks (side
  # effects), which `custom_partitioning` failed to lower: every jitted mosaic_tpu
  # call in interpret mode on a host with several devices raised a bare KeyError.
  # Such a call now runs unpartitioned.
  pytest.importorskip("tokamax_tpu_mosaic")
  rng = np.random.default_rng(3)
  x, scale = _rand(rng, 16, 40), _rand(rng, 40)
  if placed == "sharded":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
  ct = _rand(rng, 16, 40)

  def value_and_grad(implementation):
    def loss(x, scale):
      return jnp.sum(tokamax.rms_norm(x, scale, implementation=implementation) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, scale)

  with tokamax.interpret(), tokamax.record_dispatch() as records:
    value, grads = value_and_grad("mosaic_tpu")
  assert {r.implementation for r in records} == {"mosaic_tpu"}, records
  want_value, want_grads = value_and_grad("xla")
  assert _rel(value, want_value) < 1e-5
  for got, want in zip(grads, want_grads):
    assert _rel(got, want) < 1e-5


def _value_and_grad_in_shard_map(fn, ct):
  """Jitted value and gradient of ``sum(fn(x) * ct)``, `fn` run inside shard_map
  on 8 devices (check_vma=True) with x split along its first dim."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  per_device = jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  return jax.jit(jax.value_and_grad(lambda x: jnp.sum(per_device(x) * ct)))


def test_interpreted_triton_refuses_shard_map_with_check_vma():
  # JAX's Triton interpreter mis-types the varying mesh axes inside shard_map with
  # check_vma=True: `None` picked triton there and died with JAX's "Primitive pad
  # requires varying manual axes to match". Triton now refuses with the way out,
  # and `None` runs another implementation.
  pytest.importorskip("tokamax_gpu_triton")
  if jax.default_backend() != "cpu":
    pytest.skip("interpret mode is the CPU's")
  rng = np.random.default_rng(4)
  x, ct = _rand(rng, 8 * 4, 40), _rand(rng, 8 * 4, 40)
  loss = lambda implementation: _value_and_grad_in_shard_map(
      lambda x: tokamax.rms_norm(x, None, implementation=implementation), ct)

  with tokamax.interpret():
    with pytest.raises(NotImplementedError, match="check_vma=False"):
      loss("triton")(x)
    with tokamax.record_dispatch() as records:
      value, grad = loss(None)(x)
  assert "triton" not in {r.implementation for r in records}, records
  want_value, want_grad = loss("xla")(x)
  assert _rel(value, want_value) < 1e-5
  assert _rel(grad, want_grad) < 1e-5


def test_interpreted_attention_inside_shard_map_runs_what_the_interpreters_can():
  # Inside shard_map (check_vma=True) in interpret mode, `None` picked triton, whose
  # interpreter failed JAX's varying-axes check; next came mosaic_tpu, whose
  # interpreter hangs on the attention kernels there. Both refuse now.
  pytest.importorskip("tokamax_tpu_mosaic")
  if jax.default_backend() != "cpu":
    pytest.skip("interpret mode is the CPU's")
  rng = np.random.default_rng(6)
  q, ct = _rand(rng, 8, 24, 2, 16), _rand(rng, 8, 24, 2, 16)
  loss = lambda implementation: _value_and_grad_in_shard_map(
      lambda q: tokamax.dot_product_attention(q, q, q, is_causal=True,
                                              implementation=implementation), ct)

  with tokamax.interpret():
    with pytest.raises(NotImplementedError, match="hangs"):
      loss("mosaic_tpu")(q)
    with tokamax.record_dispatch() as records:
      value, grad = loss(None)(q)
  assert not {r.implementation for r in records} & {"triton", "mosaic_tpu"}, records
  want_value, want_grad = loss("xla")(q)
  assert _rel(value, want_value) < 1e-5
  assert _rel(grad, want_grad) < 1e-5
