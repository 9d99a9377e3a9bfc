"""A GLU activation that closes over traced values (a learned parameter inside
it, a value of an enclosing jit): the values are hoisted into the op's
`activation_params` and differentiated with x and the weights, by the
implementations whose activation runs in XLA; the kernels refuse such calls.

Before, `jax.grad` with respect to such a parameter failed with
UnexpectedTracerError on every implementation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax import testing
from tokamax._src.dispatch import candidates
from tokamax._src.op import Op
from tokamax._src.ops.gated_linear_unit import api as glu_api
from tokamax._src.ops.gated_linear_unit import closure as glu_closure

HIGHEST = jax.lax.Precision.HIGHEST
K, N = 16, 12

# float32 checks against a definition: a GPU's default float32 matmul is TF32.
pytestmark = pytest.mark.usefixtures("highest_matmul_precision")


def _inputs(dtype, lead=(2, 5), groups=False, seed=0):
  rng = np.random.default_rng(seed)
  w_shape = (3, K, 2, N) if groups else (K, 2, N)
  x = jnp.asarray(rng.standard_normal((*lead, K)), dtype)
  w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(K), dtype)
  dy = jnp.asarray(rng.standard_normal((*lead, N)), dtype)
  beta = jnp.asarray(1 + 0.5 * rng.standard_normal(N), jnp.float32)  # per channel
  return x, w, dy, beta, jnp.float32(0.8)


def _swish(beta, scale):
  """Swish with a learned per-channel beta, times a learned scalar."""
  return lambda gate: scale * gate * jax.nn.sigmoid(beta * gate)


def _reference(x, w, beta, scale, group_sizes=None):
  """The plain program in float32 at HIGHEST (grouped: each row's own weights)."""
  x, w = x.astype(jnp.float32), w.astype(jnp.float32)
  if group_sizes is None:
    h = jnp.einsum("...k,kpn->...pn", x, w, precision=HIGHEST)
  else:
    rows = jnp.repeat(jnp.arange(len(group_sizes)), group_sizes,
                      total_repeat_length=x.shape[0])
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    h = jnp.einsum("mk,mkpn->mpn", x, w[rows], precision=HIGHEST)
    h = jnp.where(valid[:, None, None], h, 0)
  return _swish(beta, scale)(h[..., 0, :]) * h[..., 1, :]


def _loss_and_grads(fn, x, w, dy, beta, scale):
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dy.astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w, beta, scale)


def _assert_grads_close(got, want, dtype):
  for name, g, r in zip(("loss", "dx", "dw", "dbeta", "dscale"),
                        (got[0], *got[1]), (want[0], *want[1])):
    testing.assert_close(g, r, dtype, what=name, scale=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", [None, "composed", "xla"])
def test_gradients_reach_parameters_inside_the_activation(implementation, dtype):
  x, w, dy, beta, scale = _inputs(dtype)

  def fn(x, w, beta, scale):
    return tokamax.gated_linear_unit(x, w, activation=_swish(beta, scale),
                                     implementation=implementation)
  got = _loss_and_grads(fn, x, w, dy, beta, scale)
  want = _loss_and_grads(_reference, x, w, dy, beta, scale)
  assert got[1][2].shape == beta.shape and got[1][3].shape == ()
  _assert_grads_close(got, want, dtype)


@pytest.mark.parametrize("implementation", [None, "composed", "xla"])
def test_grouped_gradients_reach_parameters_inside_the_activation(implementation):
  x, w, dy, beta, scale = _inputs("float32", lead=(11,), groups=True, seed=1)
  sizes = jnp.asarray([4, 0, 5], jnp.int32)  # an empty group; 2 rows past the groups

  def fn(x, w, beta, scale):
    return tokamax.gated_linear_unit(x, w, activation=_swish(beta, scale),
                                     group_sizes=sizes, implementation=implementation)
  got = _loss_and_grads(fn, x, w, dy, beta, scale)
  want = _loss_and_grads(lambda *a: _reference(*a, group_sizes=sizes), x, w, dy, beta,
                         scale)
  _assert_grads_close(got, want, "float32")


def test_transformations_of_a_traced_closure():
  """vmap of grad, grad of grad and jax.export, each against the plain program."""
  x, w, _, beta, _ = _inputs("float32", lead=(6,))

  def ours(s):
    act = lambda g: g * jax.nn.sigmoid(s * g)
    return jnp.sum(jnp.sin(tokamax.gated_linear_unit(x, w, activation=act)))

  def plain(s):
    h = jnp.einsum("mk,kpn->mpn", x, w, precision=HIGHEST)
    return jnp.sum(jnp.sin(h[:, 0] * jax.nn.sigmoid(s * h[:, 0]) * h[:, 1]))

  s = jnp.asarray([0.7, 1.3], jnp.float32)
  testing.assert_close(jax.vmap(jax.grad(ours))(s), jax.vmap(jax.grad(plain))(s),
                       "float32", what="vmap(grad)")
  testing.assert_close(jax.grad(jax.grad(ours))(s[0]), jax.grad(jax.grad(plain))(s[0]),
                       "float32", what="grad(grad)", scale=2)
  exported = jax.export.export(jax.jit(ours))(s[0])
  testing.assert_close(jax.grad(exported.call)(s[0]), jax.grad(plain)(s[0]), "float32",
                       what="grad of the exported call")


def test_only_traced_floating_values_are_hoisted():
  """Concrete arrays stay closed over (a kernel may inline them), and so do
  integer tracers (nothing to differentiate); a function of none is kept as
  it is. Hoisted values of several dtypes pack into one array of their common
  dtype."""
  shape = (4, N)
  assert glu_closure.hoist_traced_closure(jax.nn.silu, shape) == (None, None)
  concrete = lambda g: g * jnp.float32(1.5)
  assert glu_closure.hoist_traced_closure(concrete, shape) == (None, None)

  def params(n, v, t):
    return glu_closure.hoist_traced_closure(lambda g: g * n * v[0] * t, shape)[1]
  packed = jax.eval_shape(params, 3, jnp.ones(5, jnp.bfloat16), jnp.float32(2))
  assert (packed.shape, packed.dtype) == ((6,), jnp.float32)
  # A weak-typed Python float packs at float32 next to a bfloat16 value (packing
  # at their promotion, bfloat16, rounded 1.001 to 1.0).
  packed = jax.jit(params)(3, jnp.ones(5, jnp.bfloat16), 1.001)
  assert packed.dtype == jnp.float32 and float(packed[-1]) == np.float32(1.001)


def test_rows_independent_only_where_shown():
  """The one-row trace serves other row counts (a shard's) only where a random
  four-row check shows each row computing alone."""
  shape = (6, N)
  key = jax.random.key(0)

  def hoisted(activation_of, *values):
    return jax.jit(lambda *v: glu_closure.hoist_traced_closure(
        activation_of(*v), shape, rows_may_split=True)[0].rows_independent)(*values)
  beta = jnp.linspace(0.5, 1.5, N)
  assert hoisted(_swish, beta, jnp.float32(0.8))
  mixes_rows = lambda s: (lambda g: s * (g - jnp.mean(g, axis=0)))
  assert not hoisted(mixes_rows, jnp.float32(2))
  # Rows that mix behind values a normal draw would make NaN (rsqrt of a
  # negative variance): NaN outputs prove nothing, and positive draws show it.
  normalized = lambda gamma, var: (lambda g: (g - g.mean(0)) * gamma * jax.lax.rsqrt(var))
  assert not hoisted(normalized, jnp.float32(1.2), jnp.float32(0.7))
  # A traced value per element: no trace at another row count takes it.
  assert not hoisted(lambda m: (lambda g: g * m), jnp.ones(shape))
  # A mask drawn at the gate's shape: one row at a time would repeat one row's.
  # (With a concrete key the numeric check decides; a traced key cannot be
  # drawn at random, so no check is made.)
  dropout = lambda s, k: (lambda g: s * g * jax.random.bernoulli(k, 0.5, g.shape))
  assert not hoisted(lambda s: dropout(s, key), jnp.float32(2))
  assert not hoisted(dropout, jnp.float32(2), key)

  def rows_apart(beta):
    with_params, params = glu_closure.hoist_traced_closure(_swish(beta, 1.0), shape,
                                                           rows_may_split=True)
    gate = jnp.linspace(-3, 3, 3 * N, dtype=jnp.float32).reshape(3, N)
    return with_params(gate, params), _swish(beta, 1.0)(gate)
  got, want = jax.jit(rows_apart)(beta)
  testing.assert_close(got, want, "float32", what="three rows of a six-row trace")


def test_a_complex_closure_works_as_before():
  """A traced complex value is not hoisted (not differentiable through the
  packed params): the call computes as before the hoisting existed."""
  x, w, _, _, _ = _inputs("float32", lead=(4,))
  act = lambda c: (lambda g: jnp.real(g * c))
  out = jax.jit(lambda c: tokamax.gated_linear_unit(x, w, activation=act(c)))(1 + 2j)
  h = jnp.einsum("mk,kpn->mpn", x, w, precision=HIGHEST)
  testing.assert_close(out, h[:, 0] * h[:, 1], "float32")

  x, w, _, _, _ = _inputs("float32", lead=(4,))
  out = jax.jit(lambda n: tokamax.gated_linear_unit(x, w, activation=lambda g: g * n))(3)
  h = jnp.einsum("mk,kpn->mpn", x, w, precision=HIGHEST)
  testing.assert_close(out, 3 * h[:, 0] * h[:, 1], "float32")


def test_an_implementation_without_the_feature_refuses_with_the_reason():
  @dataclasses.dataclass(frozen=True)
  class LowersTheActivation(Op):
    op_name = "gated_linear_unit"
    name = "kernel"
    supported_features = ("group_sizes",)

    def forward(self, args, config):
      raise AssertionError("a refused call never runs")

  x, w, _, beta, scale = _inputs("float32", lead=(4,))

  def check(beta):
    activation = _swish(beta, scale)
    with_params, params = glu_closure.hoist_traced_closure(activation, (4, N))
    args = glu_api.GatedLinearUnitArgs(x=x, weights=w, activation=with_params,
                                       activation_params=params)
    candidates.check_opt_in(LowersTheActivation(), args)
    return params
  with pytest.raises(NotImplementedError,
                     match=r"activation_params \(an activation that closes over traced"
                     r".*implementation=None runs one that does"):
    jax.jit(check)(beta)
