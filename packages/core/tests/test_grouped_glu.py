"""`tokamax.gated_linear_unit(..., group_sizes=...)`: the grouped GLU (an MoE
layer's experts) against a per-group composition of plain JAX, its gradients,
its errors, and which implementations are given such calls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.ops.gated_linear_unit import composed

HIGHEST = jax.lax.Precision.HIGHEST
# On a GPU the op's float32 matmuls run at the default precision (TF32).
ON_GPU = jax.default_backend() == "gpu"
_seed = iter(range(1_000_000))


def _inputs(m, k, n, sizes, dtype=jnp.float32):
  rng = np.random.default_rng(next(_seed))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, 2, n)) / np.sqrt(k), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32)


def _per_group(x, w, sizes, activation):
  """Each group's dense GLU on its rows (jnp, float32, HIGHEST), zeros past them."""
  rows, start = [], 0
  for g, size in enumerate(np.asarray(sizes)):
    h = jnp.einsum("mk,kpn->mpn", x[start:start + size].astype(jnp.float32),
                   w[g].astype(jnp.float32), precision=HIGHEST)
    rows.append((activation or (lambda v: v))(h[:, 0]) * h[:, 1])
    start += size
  rows.append(jnp.zeros((x.shape[0] - start, w.shape[-1]), jnp.float32))
  return jnp.concatenate(rows)


@pytest.mark.parametrize("activation,sizes", [
    (jax.nn.silu, (10, 0, 25)),  # an empty group, rows past the groups
    (jax.nn.gelu, (0, 40, 0)),  # one group holds every row
    (None, (13, 14, 13))])
def test_matches_each_group_dense_glu(activation, sizes):
  x, w, gs = _inputs(40, 24, 20, sizes)
  out = jax.jit(lambda x, w, gs: tokamax.gated_linear_unit(
      x, w, activation=activation, group_sizes=gs))(x, w, gs)
  testing.assert_close(out, _per_group(x, w, gs, activation), jnp.float32, what="forward",
                       gpu=ON_GPU)


# sigmoid(0) != 0: rows past the groups (projections 0) have a nonzero dh,
# which no gradient may read.
@pytest.mark.parametrize("activation", [jax.nn.silu, jax.nn.sigmoid])
def test_gradients_match_autodiff_of_each_group_and_skip_rows_past_the_groups(activation):
  x, w, gs = _inputs(48, 16, 12, (20, 0, 21))
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((48, 12)), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) * dy)
  grads = jax.grad(loss(lambda x, w: tokamax.gated_linear_unit(
      x, w, activation=activation, group_sizes=gs)), argnums=(0, 1))(x, w)
  want = jax.grad(loss(lambda x, w: _per_group(x, w, gs, activation)), argnums=(0, 1))(x, w)
  for got, ref, what in zip(grads, want, ("dx", "dw")):
    testing.assert_close(got, ref, jnp.float32, what=what, scale=2.0, gpu=ON_GPU)
  assert not np.any(np.asarray(grads[0][41:])), "rows past the groups get no gradient"
  assert not np.any(np.asarray(grads[1][1])), "an empty group's weights get none"


def test_a_pair_of_weights_is_stacked_per_group():
  x, w, gs = _inputs(30, 8, 16, (10, 20))
  pair = tokamax.gated_linear_unit(x, (w[:, :, 0], w[:, :, 1]), activation=jax.nn.silu,
                                   group_sizes=gs)
  np.testing.assert_array_equal(
      pair, tokamax.gated_linear_unit(x, w, activation=jax.nn.silu, group_sizes=gs))


@pytest.mark.parametrize("x_shape,w_shape,sizes,match", [
    ((2, 30, 8), (2, 8, 2, 16), (10, 20), r"x must be \[M, K\] with group_sizes"),
    ((30, 8), (8, 2, 16), (10, 20), r"\[G, K, 2, N\]"),
    ((30, 8), (2, 8, 2, 16), (10, 5, 15), "group_sizes must have 2 entries"),
    ((30, 8), (2, 8, 2, 16), (-1, 20), "non-negative"),
    ((30, 8), (2, 8, 2, 16), (20, 20), "sum to at most M=30"),
])
def test_bad_grouped_arguments_name_what_is_wrong(x_shape, w_shape, sizes, match):
  with pytest.raises(ValueError, match=match):
    tokamax.gated_linear_unit(jnp.ones(x_shape), jnp.ones(w_shape),
                              group_sizes=jnp.asarray(sizes, jnp.int32))


def test_int64_numpy_sizes_past_int32_are_refused_not_wrapped():
  """Without x64, JAX converts NumPy int64 to int32 by wrapping: 2**32 + 10 would
  be 10, a silently different call (ragged_dot's group sizes, attention's
  lengths: every integer argument taken through the shared check)."""
  sizes = np.array([2**32 + 10, 20], np.int64)
  with pytest.raises(ValueError, match="group_sizes holds values from 20 to "
                     "4294967306, outside int32"):
    tokamax.gated_linear_unit(jnp.ones((30, 8)), jnp.ones((2, 8, 2, 16)),
                              group_sizes=sizes)
  with pytest.raises(ValueError, match="key_value_seq_lengths holds values"):
    q = jnp.ones((1, 4, 2, 8))
    tokamax.dot_product_attention(q, q, q, key_value_seq_lengths=np.array([2**32 + 1]))
  # In range, int64 NumPy sizes are taken as they are.
  got = tokamax.gated_linear_unit(jnp.ones((30, 8)), jnp.ones((2, 8, 2, 16)),
                                  group_sizes=np.array([10, 20], np.int64))
  assert got.shape == (30, 16)


@pytest.mark.parametrize("op", ["ragged_dot", "gated_linear_unit"])
def test_traced_unsigned_group_sizes_past_int32_do_not_wrap(op):
  # A traced uint32 size past int32's range (unchecked, like any traced size)
  # takes the rest of the rows, as a size past M does (and as
  # `jax.lax.ragged_dot` treats an int64 one); cast as it was, it became -1
  # and the rows went to the other groups.
  m, k, n = 16, 8, 6
  x = jnp.ones((m, k))
  scale = jnp.arange(1.0, 5.0)[:, None, None]
  sizes = jnp.array([2**32 - 1, 5, 4, 4], jnp.uint32)
  if op == "ragged_dot":
    got = jax.jit(tokamax.ragged_dot)(x, scale * jnp.ones((4, k, n)), sizes)
    want = jnp.full((m, n), float(k))  # every row in group 0: 8 * 1
  else:
    w = scale[..., None] * jnp.ones((4, k, 2, n))
    got = jax.jit(lambda x, w, s: tokamax.gated_linear_unit(
        x, w, activation=None, group_sizes=s))(x, w, sizes)
    want = jnp.full((m, n), float(k * k))  # every row in group 0: (8 * 1) * (8 * 1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_float_group_sizes_are_refused():
  with pytest.raises(TypeError, match="group_sizes"):
    tokamax.gated_linear_unit(jnp.ones((30, 8)), jnp.ones((2, 8, 2, 16)),
                              group_sizes=jnp.asarray([10.0, 20.0]))


@dataclasses.dataclass(frozen=True)
class _DenseOnly(tokamax.Op):
  """A GLU that knows nothing of groups: given a grouped call it would apply
  weights[0] to every row."""

  op_name = "gated_linear_unit"
  name = "dense_only"

  def forward(self, args, config):
    w = args.weights.reshape(-1, *args.weights.shape[-3:])[0]
    h = jnp.einsum("mk,kpn->mpn", args.x, w)
    return h[:, 0] * h[:, 1], {}


def test_only_implementations_that_declare_groups_are_given_them():
  x, w, gs = _inputs(30, 8, 16, (10, 20))
  args = tokamax.GatedLinearUnitArgs(x=x, weights=w, group_sizes=gs)
  assert args.opt_in_features() == ("group_sizes",)
  assert tokamax.GatedLinearUnitArgs(x=x, weights=w[0]).opt_in_features() == ()
  with pytest.raises(NotImplementedError, match="does not support group_sizes"):
    tokamax.gated_linear_unit(x, w, group_sizes=gs, implementation=_DenseOnly())
  # Dense calls still reach it.
  tokamax.gated_linear_unit(x, w[0], implementation=_DenseOnly())
  # Float32 takes no grouped GLU kernel: the composed implementation runs, its
  # projections by ragged_dot's own dispatch (xla on the CPU).
  with tokamax.record_dispatch() as records:
    jax.grad(lambda x: tokamax.gated_linear_unit(x, w, group_sizes=gs).sum())(x)
  glu = {(r.direction, r.implementation) for r in records if r.op == "gated_linear_unit"}
  assert glu == {("forward", "composed"), ("backward", "composed")}
  ragged = {(r.direction, r.implementation) for r in records if r.op == "ragged_dot"}
  assert {d for d, _ in ragged} == {"forward", "backward"}
  if jax.default_backend() == "cpu":
    assert ragged == {("forward", "xla"), ("backward", "xla")}


@pytest.mark.parametrize("grouped", [True, False])
def test_the_composed_implementation_recomputes_missing_projections(grouped):
  # Without residuals (a backward chosen apart from the forward) it recomputes
  # the projections; a dense call (one group of every row here) by one matmul.
  x, w, gs = _inputs(30, 8, 16, (10, 20) if grouped else (30,))
  dy = jnp.asarray(np.random.default_rng(next(_seed)).standard_normal((30, 16)), jnp.float32)
  args = (tokamax.GatedLinearUnitArgs(x=x, weights=w, activation=jax.nn.silu, group_sizes=gs)
          if grouped else
          tokamax.GatedLinearUnitArgs(x=x, weights=w[0], activation=jax.nn.silu))
  grads = composed.ComposedGatedLinearUnitVjp().backward(args, {}, None, dy, None)
  if not grouped:
    grads["weights"] = grads["weights"][None]
  want = jax.grad(lambda x, w: jnp.sum(_per_group(x, w, gs, jax.nn.silu) * dy),
                  argnums=(0, 1))(x, w)
  testing.assert_close(grads["x"], want[0], jnp.float32, what="dx", scale=2.0, gpu=ON_GPU)
  testing.assert_close(grads["weights"], want[1], jnp.float32, what="dw", scale=2.0,
                       gpu=ON_GPU)


def test_dense_only_helpers_refuse_grouped_args():
  x, w, gs = _inputs(30, 8, 16, (10, 20))
  args = tokamax.GatedLinearUnitArgs(x=x, weights=w, group_sizes=gs)
  with pytest.raises(ValueError, match="forward_with_projections takes dense weights"):
    args.forward_with_projections()
  with pytest.raises(ValueError, match="dense_projections takes dense weights"):
    args.dense_projections()
  with pytest.raises(ValueError, match="backward_from_dh takes dense weights"):
    args.backward_from_dh(jnp.zeros((30, 32)))


def test_autotune_takes_a_grouped_call():
  # Autotuning fills group_sizes with an equal split of x's rows (or the given
  # ones) when it makes its trial inputs.
  x, w, gs = _inputs(32, 8, 16, (10, 22))
  result = tokamax.autotune(
      lambda x, w, gs: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu,
                                                 group_sizes=gs), x, w, gs, iterations=1)
  assert any(m.op == "gated_linear_unit" for m in result.measurements), result
