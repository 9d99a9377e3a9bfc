"""Every op on several devices: GSPMD layouts (no all-gather of the large
operands in the compiled HLO), shard_map, ring attention, and results (gradients
included) equal to the single-device ones.

8 virtual CPU devices in CI; the same tests run on 2 or 4 GPUs (the meshes follow
the device count, and GPU float32 kernels may use TF32, hence a wider tolerance).
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import tokamax
from tokamax._src.ops.attention import xla as attention_xla
from tokamax._src.ops.layer_norm import xla as layer_norm_xla

NUM_DEVICES = jax.device_count()
HALF = max(NUM_DEVICES // 2, 1)
MESHES = [(1, NUM_DEVICES), (2, HALF), (HALF, 2)]
MESHES = list(dict.fromkeys(MESHES))  # 2 devices: (1, 2) and (2, 1) once each
ON_GPU = jax.default_backend() == "gpu"
# Sharded and single-device runs may pick different tiles; on a GPU float32
# matmuls then round differently (TF32).
TOL_SCALE = 100.0 if ON_GPU else 1.0
# The query sequence splits only for implementations that take q_offset; cuDNN
# (chosen on GPUs by default) does not, so on a GPU the sequence layouts ask for
# the Triton kernel.
SEQUENCE_IMPLEMENTATION = "triton" if ON_GPU else None


# Fixed seed: a failure reproduces (and CI does not flake on a rare input).
_RNG = np.random.default_rng(0)

def _mesh(shape, explicit=False):
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, ("a", "b"), axis_types=(kind, kind))


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(_RNG.standard_normal(shape), dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _strip(spec, mesh):
  def keep(e):  # size-1 mesh axes split nothing: XLA drops them
    axes = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if mesh.shape[a] > 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes
  spec = [keep(e) for e in spec]
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


def _check(mesh, fn, args, specs, *, out_spec=None, tol=1e-5, no_gather=True):
  """fn on sharded args under jit == fn on one device, forward and gradients;
  no all-gather in the compiled forward or backward."""
  tol *= TOL_SCALE
  sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

  def loss(*a):
    return jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))

  f = jax.jit(fn)
  g = jax.jit(jax.grad(loss, argnums=argnums))
  out = f(*sharded)
  assert _rel(out, fn(*args)) < tol
  if out_spec is not None:
    assert _strip(out.sharding.spec, mesh) == _strip(out_spec, mesh), out.sharding.spec
  grads = g(*sharded)
  want = jax.grad(loss, argnums=argnums)(*args)
  for got, w in zip(grads, want):
    assert _rel(got, w) < tol * 10
  if no_gather:
    for compiled in (f.lower(*sharded).compile(), g.lower(*sharded).compile()):
      assert "all-gather" not in compiled.as_text()
  return out


# ------------------------------------------------------------------ attention

ATTENTION_LAYOUTS = {
    # name: (q spec, k/v spec, out spec); q [4, 16, 8, 8], k/v [4, 16, 2, 8] (GQA)
    "batch": (P("a"), P("a"), P("a")),
    "heads": (P(None, None, "b"), P(None, None, "b"), P(None, None, "b")),
    "batch_and_heads": (P("a", None, "b"), P("a", None, "b"), P("a", None, "b")),
    "sequence": (P(None, ("a", "b")), P(), P(None, ("a", "b"))),
}


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_attention_layouts(shape, layout):
  mesh = _mesh(shape)
  q_spec, kv_spec, out_spec = ATTENTION_LAYOUTS[layout]
  if layout != "sequence" and shape[1] > 2:
    kv_spec = P(kv_spec[0])  # 2 kv heads over 4 or 8 shards: kv stay whole
  impl = SEQUENCE_IMPLEMENTATION if layout == "sequence" else None
  fn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation=impl)
  args = (_rand(4, 16, 8, 8), _rand(4, 16, 2, 8), _rand(4, 16, 2, 8))
  _check(mesh, fn, args, (q_spec, kv_spec, kv_spec),
         out_spec=P(*out_spec, *(None,) * (4 - len(out_spec))))


def test_attention_sequence_sharded_with_every_feature():
  """Query shards get their offset (causal, window) and local query lengths;
  bias, segments and kv lengths follow."""
  mesh = _mesh((2, HALF))
  b, t, s = 2, 16, 12
  qlen = jnp.asarray([11, 16], jnp.int32)
  kvlen = jnp.asarray([12, 7], jnp.int32)
  qseg = jnp.asarray(np.repeat([[0, 1]], b, 0).repeat(8, 1), jnp.int32)
  kvseg = jnp.asarray(np.repeat([[0, 1]], b, 0).repeat(6, 1), jnp.int32)

  def fn(q, k, v, bias):
    return tokamax.dot_product_attention(
        q, k, v, bias, is_causal=True, local_window_size=(5, None),
        query_seq_lengths=qlen, key_value_seq_lengths=kvlen, q_segment_ids=qseg,
        kv_segment_ids=kvseg, logits_soft_cap=5.0,
        implementation=SEQUENCE_IMPLEMENTATION)

  args = (_rand(b, t, 4, 8), _rand(b, s, 2, 8), _rand(b, s, 2, 8), _rand(1, 4, t, s))
  _check(mesh, fn, args, (P("a", "b"), P("a"), P("a"), P(None, None, "b")),
         out_spec=P("a", "b", None, None))


@pytest.mark.parametrize("layout", ["batch_and_heads", "sequence"])
def test_attention_sinks_sharded(layout):
  """Sinks split with the query heads; their gradient sums over the batch and
  query-sequence shards."""
  mesh = _mesh((2, HALF))
  q_spec, kv_spec, out_spec = ATTENTION_LAYOUTS[layout]
  if layout != "sequence" and HALF > 2:
    kv_spec = P(kv_spec[0])
  sinks_spec = P("b") if layout == "batch_and_heads" else P()
  impl = SEQUENCE_IMPLEMENTATION if layout == "sequence" else None
  fn = lambda q, k, v, sinks: tokamax.dot_product_attention(
      q, k, v, is_causal=True, sinks=sinks, implementation=impl)
  args = (_rand(4, 16, 8, 8), _rand(4, 16, 2, 8), _rand(4, 16, 2, 8), _rand(8) * 2)
  _check(mesh, fn, args, (q_spec, kv_spec, kv_spec, sinks_spec),
         out_spec=P(*out_spec, *(None,) * (4 - len(out_spec))))


def test_attention_bfloat16():
  mesh = _mesh((2, HALF))
  fn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True)
  args = tuple(_rand(*s, dtype=jnp.bfloat16)
               for s in ((4, 16, 8, 8), (4, 16, 4, 8), (4, 16, 4, 8)))
  _check(mesh, fn, args, (P("a", None, "b"),) * 3, tol=2e-2)


@dataclasses.dataclass(frozen=True)
class NoOffset(tokamax.Op):
  """XLA attention that does not declare q_offset (as cuDNN does not)."""

  op_name = "dot_product_attention"
  name = "no_offset"

  def forward(self, args, config):
    return attention_xla.XlaAttention().forward(args, config)


def test_sequence_split_needs_q_offset_support():
  """An implementation without q_offset keeps the query sequence whole."""

  mesh = _mesh((1, NUM_DEVICES))
  fn = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation=NoOffset())
  args = (_rand(2, 16, 2, 8), _rand(2, 16, 2, 8), _rand(2, 16, 2, 8))
  with pytest.warns(UserWarning, match="queries are gathered"):
    _check(mesh, fn, args, (P(None, "b"), P(), P()), no_gather=False)
  with pytest.raises(NotImplementedError, match="q_offset"):
    from tokamax._src import dispatch
    dispatch.check_opt_in(NoOffset(), tokamax.AttentionArgs(
        *args, q_offset=jnp.int32(0)))


def test_explicit_sequence_split_prefers_an_implementation_with_q_offset():
  """Under an explicit-axes mesh the sharding is known when dispatch chooses: of
  several implementations it takes one that keeps the query split (q_offset)
  over an earlier one that would gather the queries."""

  mesh = _mesh((1, NUM_DEVICES), explicit=True)
  args = (_rand(2, 16, 2, 8), _rand(2, 16, 2, 8), _rand(2, 16, 2, 8))

  def fn(implementation):
    return lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation)

  specs = (P(None, "b"), P(), P())
  sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  with jax.set_mesh(mesh), warnings.catch_warnings():
    # No "queries are gathered" warning (others, e.g. JAX's deprecation notice
    # for its Pallas Triton backend on GPUs, are not this test's business).
    warnings.filterwarnings("error", message=".*queries are gathered")
    _check(mesh, fn([NoOffset(), "xla"]), args, specs, out_spec=P(None, "b"))
    with tokamax.record_dispatch() as records:
      jax.jit(fn([NoOffset(), "xla"]))(*sharded)
  assert [r.implementation for r in records] == ["xla"]
  # A single named implementation is used as named (and gathers, with a warning).
  with jax.set_mesh(mesh), pytest.warns(UserWarning, match="queries are gathered"):
    with tokamax.record_dispatch() as records:
      jax.jit(fn(NoOffset()))(*sharded)
  assert [r.implementation for r in records] == ["no_offset"]


def test_a_partitioned_forward_may_not_leave_opaque_residuals():
  """Partitioning lays out residuals by their documented names, so dispatch lets
  a forward keep opaque ones (the cuDNN forward's jax.vjp) only where it does not
  partition: one device, or inside shard_map."""
  from tokamax._src import op as op_lib
  allowed = []

  @dataclasses.dataclass(frozen=True)
  class Probe(tokamax.Op):
    op_name = "layer_norm"
    name = "probe"

    def forward(self, args, config):
      allowed.append(op_lib.opaque_residuals_allowed())
      return layer_norm_xla.XlaLayerNorm().forward(args, config)

  mesh = _mesh((2, HALF))
  x = jax.device_put(_rand(16, 32), NamedSharding(mesh, P("a")))
  grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(
      tokamax.layer_norm(x, None, None, implementation=Probe())))))
  grad(x)
  assert allowed and not any(allowed)
  # Inside shard_map nothing is partitioned: the per-shard call may keep them.
  allowed.clear()
  local = jax.shard_map(lambda x: tokamax.layer_norm(x, None, None,
                                                     implementation=Probe()),
                        mesh=mesh, in_specs=P("a"), out_specs=P("a"))
  jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(local(x)))))(x)
  assert allowed == [True]


# ----------------------------------------------------------------- layer_norm

NORM_LAYOUTS = {
    "rows": P(("a", "b"), None),
    "rows_and_features": P("a", "b"),
    "features": P(None, ("a", "b")),
}


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("layout", NORM_LAYOUTS)
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_norm_layouts(shape, layout, rms):
  mesh = _mesh(shape)
  spec = NORM_LAYOUTS[layout]
  if rms:
    fn = lambda x, s: tokamax.rms_norm(x, s)
    args, specs = (_rand(16, 32), _rand(32)), (spec, P(spec[1]))
  else:
    fn = lambda x, s, o: tokamax.layer_norm(x, s, o)
    args, specs = (_rand(16, 32), _rand(32), _rand(32)), (spec, P(spec[1]), P(spec[1]))
  _check(mesh, fn, args, specs, out_spec=spec, tol=1e-5)


# ---------------------------------------------------------- gated_linear_unit


# `None` on a CPU runs the composed plain program; the reference too.
@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gated_linear_unit_rows_and_tensor_parallel(shape, implementation):
  mesh = _mesh(shape)
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                              implementation=implementation)
  _check(mesh, fn, (_rand(16, 32), _rand(32, 2, 16)), (P("a"), P(None, None, "b")),
         out_spec=P("a", "b"))


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_gated_linear_unit_with_a_learned_activation_parameter(implementation):
  """An activation closing over a traced per-channel beta: its rows compute
  apart, so the rows stay split (N whole: beta spans it); beta's gradient is
  the single-device one, not a sum over replicas. (`_check`'s unsharded call
  closes over a concrete beta instead: a function with constants, which
  `custom_partitioning` refused with an AssertionError before such calls ran
  unpartitioned.)"""
  mesh = _mesh((2, HALF))
  fn = lambda x, w, beta: tokamax.gated_linear_unit(
      x, w, activation=lambda g: g * jax.nn.sigmoid(beta * g),
      implementation=implementation)
  args = (_rand(16, 32), _rand(32, 2, 16), _rand(16))
  _check(mesh, fn, args, (P(("a", "b")), P(), P()), out_spec=P(("a", "b")))
  _check(mesh, fn, args, (P("a"), P(None, None, "b"), P()), no_gather=False)


def test_gated_linear_unit_with_a_parameter_and_rows_that_mix():
  """An activation with a traced parameter that mixes rows (a column mean) runs
  whole: each device computes every row, and the result is the one-device one."""
  mesh = _mesh((2, HALF))
  fn = lambda x, w, s: tokamax.gated_linear_unit(
      x, w, activation=lambda g: s * (g - jnp.mean(g, axis=0)))
  _check(mesh, fn, (_rand(16, 32), _rand(32, 2, 16), _rand(16)),
         (P(("a", "b")), P(), P()), no_gather=False)


def _learned_swish_glu(x, w, beta):
  return tokamax.gated_linear_unit(x, w, activation=lambda g: g * jax.nn.sigmoid(beta * g))


def _plain_learned_swish_glu(x, w, beta):
  h = jnp.einsum("mk,kpn->mpn", x, w, precision=jax.lax.Precision.HIGHEST)
  return h[:, 0] * jax.nn.sigmoid(beta * h[:, 0]) * h[:, 1]


def test_gated_linear_unit_with_a_learned_activation_parameter_inside_shard_map():
  """Rows split by shard_map (check_vma on, its default): the activation is
  traced with a gate that varies over the manual axes as x does (traced without
  them, its recorded multiply refused the varying gate)."""
  mesh = _mesh((2, HALF))
  x, w, beta = _rand(16, 32), _rand(32, 2, 16), _rand(16)
  local = jax.shard_map(_learned_swish_glu, mesh=mesh, in_specs=(P(("a", "b")), P(), P()),
                        out_specs=P(("a", "b")))
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  got = jax.jit(jax.value_and_grad(loss(local), (0, 1, 2)))(x, w, beta)
  want = jax.value_and_grad(loss(_plain_learned_swish_glu), (0, 1, 2))(x, w, beta)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(g, r) < 1e-5 * TOL_SCALE


def test_explicit_axes_mesh_with_a_learned_activation_parameter():
  """A call whose plan splits nothing runs whole in the mesh's own context (its
  activation was traced there), and each cotangent comes back in its primal's
  sharding."""
  mesh = _mesh((2, HALF), explicit=True)
  with jax.set_mesh(mesh):
    _check(mesh, _learned_swish_glu, (_rand(16, 32), _rand(32, 2, 16), _rand(16)),
           (P("a"), P(None, None, "b"), P()), no_gather=False)


def test_explicit_axes_mesh_grouped_gated_linear_unit_gradients():
  """The grouped plan replicates x; x's cotangent must still come back split as
  x is (custom_vjp requires the primal's type)."""
  mesh = _mesh((2, HALF), explicit=True)
  sizes = jnp.asarray([5, 3, 6], jnp.int32)
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                              group_sizes=sizes)
  with jax.set_mesh(mesh):
    _check(mesh, fn, (_rand(16, 32), _rand(3, 32, 2, 16)), (P("a"), P()), no_gather=False)


def test_cotangents_of_absent_operands_stay_none_under_an_explicit_mesh():
  """`_like` (each cotangent in its primal's sharding) passes an absent
  operand's None through."""
  from tokamax._src import sharding as sharding_lib
  mesh = _mesh((2, HALF), explicit=True)
  with jax.set_mesh(mesh):
    x = jax.device_put(_rand(16, 32), NamedSharding(mesh, P("a")))
    assert sharding_lib._like(None, None) is None
    assert sharding_lib._like(None, x) is None
    g = sharding_lib._like(jnp.ones((16, 32)), x)
    assert _strip(jax.typeof(g).sharding.spec, mesh) == _strip(P("a"), mesh)


def test_gated_linear_unit_closing_over_a_concrete_array():
  mesh = _mesh((2, HALF))
  scale = np.linspace(0.5, 1.5, 16, dtype=np.float32)
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=lambda g: jnp.tanh(g) * scale)
  _check(mesh, fn, (_rand(16, 32), _rand(32, 2, 16)), (P("a"), P(None, None, "b")),
         no_gather=False)


# ----------------------------------------------------------------- ragged_dot

SIZES = jnp.asarray([3, 0, 5, 4, 6, 2, 7, 3], jnp.int32)  # 30 of 32 rows, one empty


@pytest.mark.parametrize("layout", ["rows", "experts", "experts_and_n"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ragged_dot_layouts(shape, layout):
  mesh = _mesh(shape)
  specs = {"rows": (P(("a", "b")), P()),
           "experts": (P("a"), P("b")),            # tokens on a, experts on b
           "experts_and_n": (P(), P("b", None, "a"))}[layout]
  out = {"rows": P(("a", "b"), None), "experts": P("a", None),
         "experts_and_n": P(None, "a")}[layout]
  fn = lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, SIZES)
  _check(mesh, fn, (_rand(32, 16), _rand(8, 16, 8)), specs, out_spec=out)


def test_ragged_dot_expert_parallel_with_group_offset():
  """rhs holding a slice of the groups (group_offset), itself split further."""
  mesh = _mesh((2, HALF))
  fn = lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, SIZES, group_offset=2)
  _check(mesh, fn, (_rand(32, 16), _rand(4, 16, 8)), (P("a"), P("b")),
         out_spec=P("a", None))


@pytest.mark.parametrize("layout", ["rows", "experts", "experts_and_n"])
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantized_ragged_dot_layouts(shape, layout):
  """Quantized operands (quantized inside the function, as in training) split
  with their block scales: the result and the straight-through gradients of
  one device, and no all-gather (rows: 1x128 scales; experts: one scale per
  128x4 block, N split in 4-column tiles)."""
  mesh = _mesh(shape)
  specs = {"rows": (P(("a", "b")), P()),
           "experts": (P("a"), P("b")),
           "experts_and_n": (P(), P("b", None, "a"))}[layout]
  out = {"rows": P(("a", "b"), None), "experts": P("a", None),
         "experts_and_n": P(None, "a")}[layout]
  fn = lambda x, w: tokamax.ragged_dot(
      tokamax.quantize(x, (1, 128)), tokamax.quantize(w, (1, 128, 4)), SIZES,
      preferred_element_type=jnp.float32)
  _check(mesh, fn, (_rand(32, 128), _rand(8, 128, 4 * NUM_DEVICES)), specs,
         out_spec=out)


def test_quantized_ragged_dot_keeps_scales_whole_where_they_cannot_split():
  """Weights' values split on N over more shards than they have scale columns:
  a shard could not hold whole tiles, so the call gathers N, with the one-device
  result."""
  if NUM_DEVICES < 2:
    pytest.skip("needs 2 devices")
  mesh = _mesh((1, NUM_DEVICES))
  x = _rand(32, 128)
  q = tokamax.quantize(_rand(8, 128, 4 * NUM_DEVICES), (1, 128, 8)).without_source()
  assert q.scales.shape[2] < NUM_DEVICES
  sharded = dataclasses.replace(
      q, values=jax.device_put(q.values, NamedSharding(mesh, P(None, None, "b"))),
      scales=jax.device_put(q.scales, NamedSharding(mesh, P())))
  fn = lambda x, w: tokamax.ragged_dot(x, w, SIZES, preferred_element_type=jnp.float32)
  got = jax.jit(fn)(x, sharded)
  np.testing.assert_allclose(got, fn(x, q), rtol=1e-6, atol=1e-6)


def test_quantized_ragged_dot_gradients_on_sharded_operands():
  """Activations quantized inside the differentiated function, rows sharded:
  the straight-through gradients reach x and w as on one device."""
  mesh = _mesh((2, HALF))
  fn = lambda x, w: tokamax.ragged_dot(
      tokamax.quantize(x, (1, 128)), tokamax.quantize(w, (1, 128, 8), minor_axis=1),
      SIZES, preferred_element_type=jnp.float32)
  x, w = _rand(32, 128), _rand(8, 128, 8)
  _check(mesh, fn, (x, w), (P("a"), P()), no_gather=False)
  dx, dw = jax.grad(lambda x, w: jnp.sum(fn(x, w)), argnums=(0, 1))(x, w)
  assert float(jnp.abs(dx).max()) > 0 and float(jnp.abs(dw).max()) > 0


# ------------------------------------------- leading dims sharded individually

# x [B, T, D] with T sharded (sequence parallelism) or B and T over two axes: a
# merge of B and T would keep only a sharding of B, so each is split on its own.
LEADING_LAYOUTS = {"sequence": P(None, "b"), "batch_and_sequence": P("a", "b")}


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("layout", LEADING_LAYOUTS)
def test_norm_with_a_sharded_non_leading_row_dim(layout, rms):
  mesh = _mesh((2, HALF))
  spec = LEADING_LAYOUTS[layout]
  x, scale, offset = _rand(2, 4 * HALF, 32), _rand(32), _rand(32)
  if rms:
    _check(mesh, lambda x, s: tokamax.rms_norm(x, s), (x, scale), (spec, P()),
           out_spec=spec)
  else:
    _check(mesh, lambda x, s, o: tokamax.layer_norm(x, s, o), (x, scale, offset),
           (spec, P(), P()), out_spec=spec)


def test_norm_over_a_middle_axis_with_sharded_rows():
  """axis=1 of [B, D, T]: the rows are B and T, each split on its own."""
  mesh = _mesh((2, HALF))
  fn = lambda x, s: tokamax.layer_norm(x, s, None, axis=1)
  _check(mesh, fn, (_rand(2, 16, 4 * HALF), _rand(16)), (P("a", None, "b"), P()),
         out_spec=P("a", None, "b"))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("layout", LEADING_LAYOUTS)
def test_gated_linear_unit_with_a_sharded_non_leading_row_dim(layout, implementation):
  mesh = _mesh((2, HALF))
  spec = LEADING_LAYOUTS[layout]
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                              implementation=implementation)
  _check(mesh, fn, (_rand(2, 4 * HALF, 32), _rand(32, 2, 16)), (spec, P()),
         out_spec=P(*spec, None))


def test_attention_with_a_sharded_non_leading_batch_dim():
  """[B1, B2, T, N, H] split on B2 (and B1), with per-batch bias and lengths."""
  mesh = _mesh((2, HALF))
  qlen = jnp.asarray(_RNG.integers(1, 9, (2, HALF)), jnp.int32)

  def fn(q, k, v, bias):
    return tokamax.dot_product_attention(q, k, v, bias, is_causal=True,
                                         query_seq_lengths=qlen)

  args = (_rand(2, HALF, 8, 4, 8), _rand(2, HALF, 8, 2, 8), _rand(2, HALF, 8, 2, 8),
          _rand(2, HALF, 4, 8, 8))
  for spec in (P(None, "b"), P("a", "b")):
    _check(mesh, fn, args, (spec,) * 4, out_spec=P(*spec, None, None, None))


def test_explicit_axes_mesh_with_a_sharded_non_leading_row_dim():
  mesh = _mesh((2, HALF), explicit=True)
  fn = lambda x, s: tokamax.rms_norm(x, s)
  with jax.set_mesh(mesh):
    out = _check(mesh, fn, (_rand(2, 4 * HALF, 32), _rand(32)), (P(None, "b"), P()),
                 out_spec=P(None, "b"), no_gather=False)
  assert out.shape == (2, 4 * HALF, 32)


def test_leading_dims_keep_the_merged_shapes_for_implementations():
  """Implementations (and tuned data's keys) see the row dims merged, sharded
  or not: on one device the 2-D x, in a partitioned call the local 2-D shard."""
  from tokamax._src import autotuning
  seen, keys = [], []

  @dataclasses.dataclass(frozen=True)
  class Probe(tokamax.Op):
    op_name = "layer_norm"
    name = "probe_shapes"

    def forward(self, args, config):
      seen.append(tuple(args.x.shape))
      return layer_norm_xla.XlaLayerNorm().forward(args, config)

  x = _rand(2, 4 * HALF, 32)
  fn = lambda x: tokamax.rms_norm(x, None, implementation=Probe())
  with tokamax.spmd_partitioning(False):
    fn(x)
  mesh = _mesh((2, HALF))
  jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P(None, "b"))))
  # Traced for the global shapes too (the call's result shapes), then per shard.
  assert seen[0] == (8 * HALF, 32) and (8, 32) in seen[1:]
  assert set(seen) == {(8 * HALF, 32), (8, 32)}
  from tokamax._src import dispatch
  with dispatch.observe(lambda op, args, impl: keys.append(autotuning.args_key(args))):
    jax.jit(lambda x: fn(x))(jax.device_put(x, NamedSharding(mesh, P(None, "b"))))
  assert keys == [f"x=float32[{8 * HALF},32] epsilon=1e-06 subtract_mean=False"]


# ------------------------------------------------------- explicit, vmap, etc.


def test_explicit_axes_mesh():
  mesh = _mesh((2, HALF), explicit=True)
  fn = lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.gelu)
  with jax.set_mesh(mesh):
    _check(mesh, fn, (_rand(16, 32), _rand(32, 2, 16)), (P("a"), P(None, None, "b")),
           out_spec=P("a", "b"), no_gather=False)


def test_activation_check_works_inside_shard_map_under_an_explicit_mesh():
  # Kernels check the GLU activation on concrete arrays (check_supported, run
  # inside the per-shard body); under jax.set_mesh that evaluation failed, so the
  # GPU kernels refused gelu there after dispatch had chosen them.
  mesh = _mesh((2, HALF), explicit=True)
  seen = []

  def body(x):
    tokamax.plugin.check_elementwise_activation(jax.nn.gelu)
    with pytest.raises(NotImplementedError, match="not elementwise"):
      tokamax.plugin.check_elementwise_activation(lambda z: jax.nn.softmax(z, axis=-1))
    seen.append(True)
    return x

  with jax.set_mesh(mesh):
    x = jax.device_put(_rand(8, 8), NamedSharding(mesh, P("a", "b")))
    jax.jit(jax.shard_map(body, in_specs=P("a", "b"), out_specs=P("a", "b")))(x)
  assert seen


def test_every_op_under_vmap_on_an_explicit_axes_mesh():
  # Under jax.vmap the call was not partitioned, so with explicit axes an
  # implementation got operands typed as split and failed (the GLU's fused
  # weight reshape of [K, 2, N@b]). shard_map has a batching rule: it runs there.
  mesh = _mesh((2, HALF), explicit=True)
  q, k = _rand(3, 2, 8, 4, 8), _rand(2, 8, 4, 8)
  x, w = _rand(3, 16, 32), _rand(32, 2, 16)
  lhs, rhs = _rand(3, 16, 16), _rand(4, 16, 8)
  sizes = jnp.asarray([5, 0, 7, 4], jnp.int32)
  cases = [  # (fn of the vmapped operand and the shared one, their specs)
      (lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu), x, w,
       P(None, "a"), P(None, None, "b")),
      (lambda x, s: tokamax.rms_norm(x, s), x, _rand(32), P(None, "a"), P()),
      (lambda q, k: tokamax.dot_product_attention(q, k, k, is_causal=True), q, k,
       P(None, "a", None, "b"), P("a", None, "b")),
      (lambda a, b: tokamax.ragged_dot(a, b, sizes), lhs, rhs, P(), P(None, None, "b")),
  ]
  for fn, batched, shared, batched_spec, shared_spec in cases:
    loss = lambda a, b: jnp.sum(jnp.sin(fn(a, b).astype(jnp.float32)))
    run = jax.jit(jax.vmap(jax.value_and_grad(loss, (0, 1)), in_axes=(0, None)))
    with tokamax.spmd_partitioning(False):
      want = run(batched, shared)
    with jax.set_mesh(mesh):
      got = run(jax.device_put(batched, NamedSharding(mesh, batched_spec)),
                jax.device_put(shared, NamedSharding(mesh, shared_spec)))
    # (float32 sums over shards, in another order: the weights' gradient.)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert _rel(g, r) < 5e-5 * TOL_SCALE
  # And it runs split: the GLU's rows on a, N on b, nothing gathered.
  glu = jax.jit(jax.vmap(cases[0][0], in_axes=(0, None)))
  with jax.set_mesh(mesh):
    xs, ws = (jax.device_put(x, NamedSharding(mesh, P(None, "a"))),
              jax.device_put(w, NamedSharding(mesh, P(None, None, "b"))))
    assert _strip(glu(xs, ws).sharding.spec, mesh) == _strip(P(None, "a", "b"), mesh)
    assert "all-gather" not in glu.lower(xs, ws).compile().as_text()


def test_vmap_over_a_split_dim_on_an_explicit_axes_mesh():
  # The vmapped dim itself split (data parallel over examples), nothing else:
  # the call stays unpartitioned (its implementation sees operands split on
  # nothing). Through shard_map, JAX 0.10's batching gathered the operand and
  # JAX 0.12 failed under jax.grad of the vmap.
  mesh = _mesh((2, HALF), explicit=True)
  x, w, scale = _rand(4, 16, 32), _rand(32, 2, 16), _rand(32)
  for fn, shared in ((lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu), w),
                     (lambda x, s: tokamax.rms_norm(x, s), scale)):
    loss = lambda a, b: jnp.sum(jnp.sin(fn(a, b)))
    run = jax.jit(jax.vmap(fn, in_axes=(0, None)))
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jax.vmap(loss, in_axes=(0, None))(a, b)),
                            (0, 1)))
    with tokamax.spmd_partitioning(False):
      want, want_grads = run(x, shared), grad(x, shared)
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P("a")))
      assert _rel(run(xs, shared), want) < 1e-5 * TOL_SCALE
      assert "all-gather" not in run.lower(xs, shared).compile().as_text()
      for g, r in zip(grad(xs, shared), want_grads):
        assert _rel(g, r) < 5e-5 * TOL_SCALE
  # With the weights split on N too the call is partitioned (on JAX 0.10 with
  # that gather): unpartitioned, the GLU's weight reshape failed.
  glu = jax.jit(jax.vmap(lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu),
                         in_axes=(0, None)))
  with tokamax.spmd_partitioning(False):
    want = glu(x, w)
  with jax.set_mesh(mesh):
    got = glu(jax.device_put(x, NamedSharding(mesh, P("a"))),
              jax.device_put(w, NamedSharding(mesh, P(None, None, "b"))))
  assert _rel(got, want) < 1e-5 * TOL_SCALE


def test_vmap_on_many_devices_is_not_partitioned():
  x = _rand(3, 16, 32)
  fn = jax.jit(jax.vmap(lambda x: tokamax.rms_norm(x, None)))
  np.testing.assert_allclose(fn(x), tokamax.rms_norm(x, None), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ shard_map


def test_every_op_inside_shard_map_runs_on_local_shards():
  mesh = _mesh((2, HALF))
  hs = 4 // HALF  # heads per shard
  q, k, v = _rand(4, 8, 4, 8), _rand(4, 8, 4, 8), _rand(4, 8, 4, 8)
  x, w = _rand(16, 32), _rand(32, 2, 8)
  lhs, rhs = _rand(16, 16), _rand(8, 16, 8)
  sizes = jnp.asarray([1, 2, 0, 1, 3, 0, 1, 0], jnp.int32)  # per shard of 8 rows

  def local(q, k, v, x, w, lhs):
    return (tokamax.dot_product_attention(q, k, v, is_causal=True,
                                          implementation="xla_chunked"),
            tokamax.layer_norm(x, None, None), tokamax.gated_linear_unit(x, w),
            tokamax.ragged_dot(lhs, rhs, sizes))

  specs = (P("a", None, "b"),) * 3 + (P("a"), P(), P("a"))
  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs,
                            out_specs=(P("a", None, "b"), P("a"), P("a"), P("a"))))
  got = f(q, k, v, x, w, lhs)
  heads = lambda a, j: a[:, :, j * hs:(j + 1) * hs]
  blocks = [local(heads(q[i * 2:(i + 1) * 2], j), heads(k[i * 2:(i + 1) * 2], j),
                  heads(v[i * 2:(i + 1) * 2], j), x[i * 8:(i + 1) * 8], w,
                  lhs[i * 8:(i + 1) * 8]) for i in range(2) for j in range(HALF)]
  tol = dict(rtol=1e-5 * TOL_SCALE, atol=1e-5 * TOL_SCALE)
  last = HALF - 1  # the shard (1, last) of the mesh
  np.testing.assert_allclose(heads(got[0][2:4], last), blocks[HALF + last][0], **tol)
  for n in (1, 2, 3):
    np.testing.assert_allclose(got[n][8:], blocks[HALF][n], **tol)
  # Gradients inside shard_map too.
  g = jax.jit(jax.grad(lambda *a: sum(jnp.sum(o) for o in jax.shard_map(
      local, mesh=mesh, in_specs=specs,
      out_specs=(P("a", None, "b"), P("a"), P("a"), P("a")))(*a)), argnums=(0, 3, 4)))
  dq, dx, dw = g(q, k, v, x, w, lhs)
  assert all(jnp.all(jnp.isfinite(a)) for a in (dq, dx))
  # w is replicated (invariant): its cotangent sums every shard's part, as the
  # unsharded gradient does (a kernel's per-shard part must be psum'd).
  want_dw = jax.grad(lambda w: jnp.sum(tokamax.gated_linear_unit(x, w)))(w)
  assert _rel(dw, want_dw) < 1e-5 * TOL_SCALE


# ------------------------------------------------------------- ring attention


@pytest.mark.parametrize("causal,balanced", [(False, False), (True, False),
                                             (True, True)])
@pytest.mark.parametrize("shape", [m for m in MESHES if m[1] > 1][:2],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_ring_attention(shape, causal, balanced):
  mesh = _mesh(shape)
  n = shape[1]
  q, k, v = _rand(2, 32, 4, 8), _rand(2, 32, 2, 8), _rand(2, 32, 2, 8)
  ring = jax.shard_map(
      lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name="b", is_causal=causal,
                                             load_balanced=balanced),
      mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))
  if balanced:
    perm = tokamax.zigzag_permutation(32, n)
    inv = np.argsort(perm)
    fn = lambda q, k, v: ring(q[:, perm], k[:, perm], v[:, perm])[:, inv]
  else:
    fn = ring
  ref = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal)
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  assert _rel(jax.jit(fn)(q, k, v), ref(q, k, v)) < 1e-5 * TOL_SCALE
  grad = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))
  for got, want in zip(grad(q, k, v), jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
    assert _rel(got, want) < 1e-5 * TOL_SCALE
  text = jax.jit(ring).lower(q, k, v).compile().as_text()
  assert "collective-permute" in text and "all-gather" not in text


@pytest.mark.parametrize("causal,balanced", [(False, False), (True, True)])
def test_ring_attention_with_sinks(causal, balanced):
  """Sinks join once, after the ring's blocks merge; their gradient is summed over
  the ring: equal to dot_product_attention(sinks=) on the whole sequence."""
  shape = [m for m in MESHES if m[1] > 1][0]
  mesh, n = _mesh(shape), shape[1]
  q, k, v = _rand(2, 32, 4, 8), _rand(2, 32, 2, 8), _rand(2, 32, 2, 8)
  sinks = _rand(4) * 2
  ring = jax.shard_map(
      lambda q, k, v, s: tokamax.ring_attention(
          q, k, v, axis_name="b", is_causal=causal, load_balanced=balanced, sinks=s),
      mesh=mesh, in_specs=(P("a", "b"), P("a", "b"), P("a", "b"), P()),
      out_specs=P("a", "b"))
  if balanced:
    perm = tokamax.zigzag_permutation(32, n)
    inv = np.argsort(perm)
    fn = lambda q, k, v, s: ring(q[:, perm], k[:, perm], v[:, perm], s)[:, inv]
  else:
    fn = ring
  ref = lambda q, k, v, s: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                         sinks=s)
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  assert _rel(jax.jit(fn)(q, k, v, sinks), ref(q, k, v, sinks)) < 1e-5 * TOL_SCALE
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for g, w in zip(got, want):
    assert _rel(g, w) < 1e-5 * TOL_SCALE


def test_ring_attention_checks_its_arguments_as_dot_product_attention():
  """Arguments dot_product_attention refuses are refused here too (they ran:
  is_causal="no" as causal, a NaN scale to zeros, int32 blocks to int32
  garbage), and outside shard_map the error says where to call it."""
  mesh = _mesh((1, NUM_DEVICES))
  q, k, v = _rand(1, 2 * NUM_DEVICES, 2, 8), _rand(1, 2 * NUM_DEVICES, 1, 8), _rand(
      1, 2 * NUM_DEVICES, 1, 8)

  def ring(*a, **kw):
    return jax.shard_map(lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name="b", **kw),
                         mesh=mesh, in_specs=P(None, "b"), out_specs=P(None, "b"))(*a)
  for kw, arrays, error, says in [
      (dict(is_causal="no"), (q, k, v), TypeError, "is_causal must be a bool"),
      (dict(scale=float("nan")), (q, k, v), ValueError, "scale must be a finite float"),
      ({}, (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)),
       (TypeError, ValueError), "query"),
      ({}, (q.astype(jnp.bfloat16), k, v), (TypeError, ValueError), "same dtype"),
      ({}, (q, k[..., :4], v), ValueError, "key head dim must equal query head dim"),
      (dict(precision=["highest", "highest"]), (q, k, v), None, None),
  ]:
    if error is None:
      assert jnp.all(jnp.isfinite(ring(*arrays, **kw)))
      continue
    with pytest.raises(error, match=says):
      ring(*arrays, **kw)
  with pytest.raises(ValueError, match="call it inside jax.shard_map over that axis"):
    tokamax.ring_attention(q, k, v, axis_name="b")
  with pytest.raises(TypeError, match="num_shards must be an int >= 1"):
    tokamax.zigzag_permutation(8, 2.0)
  with pytest.raises(ValueError, match="num_shards >= 1"):
    tokamax.zigzag_permutation(8, 0)


def test_zigzag_balances_causal_work():
  perm = tokamax.zigzag_permutation(16, 4)
  chunks = perm.reshape(4, 2, 2)[:, :, 0] // 2  # chunk ids per shard
  np.testing.assert_array_equal(chunks, [[0, 7], [1, 6], [2, 5], [3, 4]])
  assert sorted(perm.tolist()) == list(range(16))


def test_kernel_out_shapes_vary_like_their_inputs():
  """Inside shard_map, `pl.pallas_call` needs its outputs' varying axes (the GPU
  kernels run in the ring attention and MoE tests above; here the helper itself)."""
  mesh = _mesh((1, NUM_DEVICES))
  seen = {}

  def local(x, y):
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
    seen["x"] = tokamax.plugin.varying_out_shape(sds, (x,)).manual_axis_type.varying
    seen["y"] = tokamax.plugin.varying_out_shape([sds], {"y": y})[0].manual_axis_type
    return x

  jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, "b"), P()),
                        out_specs=P(None, "b")))(_rand(2, 2 * NUM_DEVICES), _rand(3))
  assert seen["x"] == {"b"}
  assert seen["y"].varying == frozenset()  # typed, and invariant like its input
  sds = jax.ShapeDtypeStruct((2,), jnp.float32)
  assert tokamax.plugin.varying_out_shape(sds, (jnp.ones(2),)) is sds  # outside


@pytest.mark.parametrize("implementation", [None, "triton"])
def test_ring_attention_block_backward_uses_the_global_lse(implementation):
  """Each block pair's backward must compute from the global log-sum-exp: the
  chosen implementation's own when it does (Triton), never a backward that
  recomputes the block's softmax (XLA autodiff, cuDNN)."""
  on_cpu = jax.default_backend() == "cpu"
  if implementation == "triton":
    pytest.importorskip("tokamax_gpu_triton")
  mesh = _mesh((1, NUM_DEVICES))
  q, k, v = (_rand(1, 2 * NUM_DEVICES * 4, 2, 16) for _ in range(3))
  perm = tokamax.zigzag_permutation(q.shape[1], NUM_DEVICES)
  inv = np.argsort(perm)
  # TPU/Triton interpret mode on the CPU mis-types shard_map's varying axes.
  ring = jax.shard_map(
      lambda q, k, v: tokamax.ring_attention(q, k, v, axis_name="b", is_causal=True,
                                             load_balanced=True,
                                             implementation=implementation),
      mesh=mesh, in_specs=P(None, "b"), out_specs=P(None, "b"),
      check_vma=not (on_cpu and implementation is not None))
  fn = lambda q, k, v: ring(q[:, perm], k[:, perm], v[:, perm])[:, inv]
  ref = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="xla")
  loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
  with tokamax.interpret(on_cpu and implementation is not None), \
      tokamax.record_dispatch() as records:
    grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads, jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
    assert _rel(got, want) < 1e-5 * TOL_SCALE
  backward = {r.implementation for r in records if r.direction == "backward"}
  assert backward == {implementation or ("xla_chunked" if on_cpu else "triton")}


def test_vmap_of_grad_and_of_jit_with_several_leading_dims():
  # Under vmap the call is not partitioned although several devices exist: the
  # leading dims must still be merged before an implementation sees them, and the
  # batching rule must return the outputs' structure.
  x, scale = _rand(3, 4, 8, 16), _rand(16)
  w, xg = _rand(16, 2, 8), _rand(3, 2, 4, 16)
  q = _rand(3, 2, 2, 8, 2, 16)
  cases = [
      (lambda x: jnp.sum(tokamax.layer_norm(x, scale, None) ** 2), x),
      (lambda x: jnp.sum(tokamax.gated_linear_unit(x, w) ** 2), xg),
      (lambda q: jnp.sum(tokamax.dot_product_attention(q, q, q, is_causal=True) ** 2), q),
  ]
  for loss, operand in cases:
    got = jax.vmap(jax.grad(loss))(operand)
    with tokamax.spmd_partitioning(False):
      want = jax.vmap(jax.grad(loss))(operand)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  norm = jax.vmap(jax.jit(lambda x: tokamax.layer_norm(x, scale, None)))
  got = norm(x[0])
  with tokamax.spmd_partitioning(False):
    want = norm(x[0])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_glu_with_a_row_wise_activation_keeps_rows_whole_across_n_shards():
  # Centering over N mixes a row's columns: splitting the weights on N (tensor
  # parallel) would center each shard's columns alone (a silently wrong result).
  # The weights are gathered instead, by design.
  centering = lambda g: g - jnp.mean(g, axis=-1, keepdims=True)
  _check(_mesh((2, 4)),
         lambda x, w: tokamax.gated_linear_unit(x, w, activation=centering),
         [_rand(8, 16), _rand(16, 2, 32)], [P("a"), P(None, None, "b")],
         no_gather=False)


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_glu_with_an_activation_that_mixes_rows_keeps_rows_whole(implementation):
  # Centering over the rows (a column mean) mixes rows: splitting x's rows would
  # center each shard's rows alone (a silently wrong result). No traced params
  # here, so this is the activation itself, checked when the plan splits rows.
  centering = lambda g: g - jnp.mean(g, axis=0, keepdims=True)
  _check(_mesh((2, HALF)),
         lambda x, w: tokamax.gated_linear_unit(x, w, activation=centering,
                                                implementation=implementation),
         [_rand(16, 32), _rand(32, 2, 16)], [P(("a", "b")), P()], no_gather=False)


def test_glu_with_a_row_wise_activation_keeps_its_rows_split():
  # Centering over N is not elementwise, but each row computes alone: the rows
  # stay split (data parallelism), N whole.
  centering = lambda g: g - jnp.mean(g, axis=-1, keepdims=True)
  _check(_mesh((2, HALF)),
         lambda x, w: tokamax.gated_linear_unit(x, w, activation=centering),
         [_rand(16, 32), _rand(32, 2, 16)], [P(("a", "b")), P()], out_spec=P(("a", "b")))
