"""Every op under jit, grad, vmap and jax.export (with serialization)."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import tokamax
from tokamax._src.ops.attention import xla as attention_xla


# Fixed seed: a failure reproduces (and CI does not flake on a rare input).
_RNG = np.random.default_rng(0)

def _rand(*shape):
  return jnp.asarray(_RNG.standard_normal(shape), jnp.float32)


def _calls():
  sizes = jnp.asarray([3, 0, 4], jnp.int32)
  return {
      "attention": (lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=True), (_rand(2, 6, 4, 8), _rand(2, 7, 2, 8),
                                     _rand(2, 7, 2, 8))),
      "layer_norm": (lambda x, s, o: tokamax.layer_norm(x, s, o),
                     (_rand(3, 5, 16), _rand(16), _rand(16))),
      "rms_norm": (lambda x, s: tokamax.rms_norm(x, s), (_rand(3, 16), _rand(16))),
      # `None` on a CPU: the composed plain program; and the reference.
      "glu": (lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu),
              (_rand(5, 16), _rand(16, 2, 8))),
      "glu_xla": (lambda x, w: tokamax.gated_linear_unit(
          x, w, activation=jax.nn.silu, implementation="xla"),
                  (_rand(5, 16), _rand(16, 2, 8))),
      "ragged_dot": (lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, sizes),
                     (_rand(9, 16), _rand(3, 16, 8))),
      # Grouped: the composed implementation dispatches ragged_dot inside.
      "grouped_glu": (lambda x, w: tokamax.gated_linear_unit(
          x, w, activation=jax.nn.silu, group_sizes=sizes),
                      (_rand(9, 16), _rand(3, 16, 2, 8))),
      # Quantized inside: straight-through gradients to the sources.
      "quantized_ragged_dot": (lambda lhs, rhs: tokamax.ragged_dot(
          tokamax.quantize(lhs, (1, 16)),
          tokamax.quantize(rhs, (1, 16, 8), minor_axis=1), sizes),
                               (_rand(9, 16), _rand(3, 16, 8))),
  }


CALLS = _calls()


def _loss(f):
  return lambda *a: jnp.sum(f(*a) ** 2)


@pytest.mark.parametrize("name", CALLS)
def test_jit_and_grad_match_eager(name):
  f, args = CALLS[name]
  np.testing.assert_allclose(jax.jit(f)(*args), f(*args), rtol=1e-5, atol=1e-6)
  argnums = tuple(range(len(args)))
  g_eager = jax.grad(_loss(f), argnums=argnums)(*args)
  g_jit = jax.jit(jax.grad(_loss(f), argnums=argnums))(*args)
  for a, b, x in zip(g_eager, g_jit, args):
    assert a.shape == x.shape
    assert float(jnp.max(jnp.abs(a))) > 0, "every float input gets a gradient"
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", CALLS)
def test_vmap_matches_loop(name):
  f, args = CALLS[name]
  batched = [jnp.stack([a, a * 0.5 + 1]) for a in args]
  out = jax.vmap(f)(*batched)
  for i in range(2):
    np.testing.assert_allclose(out[i], f(*[b[i] for b in batched]), rtol=1e-5, atol=1e-5)
  grads = jax.vmap(jax.grad(_loss(f)))(*batched)
  np.testing.assert_allclose(grads[1], jax.grad(_loss(f))(*[b[1] for b in batched]),
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", CALLS)
def test_export_round_trip(name):
  f, args = CALLS[name]
  fwd_and_grad = jax.jit(lambda *a: (f(*a), jax.grad(_loss(f))(*a)))
  exported = export.export(fwd_and_grad)(*args)
  restored = export.deserialize(exported.serialize())
  want = fwd_and_grad(*args)
  got = restored.call(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ragged_dot_export_with_symbolic_rows_and_fixed_group_sizes():
  # group_sizes closed over (concrete) while M is symbolic: the "sum <= M" check
  # compared against a symbolic dim and failed the export.
  sizes = jnp.asarray([3, 0, 4], jnp.int32)
  f = lambda lhs, rhs: tokamax.ragged_dot(lhs, rhs, sizes)
  lhs, rhs = _rand(9, 16), _rand(3, 16, 8)
  specs = export.symbolic_args_specs((lhs, rhs), ("m, 16", "3, 16, 8"))
  restored = export.deserialize(export.export(jax.jit(f))(*specs).serialize())
  np.testing.assert_allclose(restored.call(lhs, rhs), f(lhs, rhs), rtol=1e-5, atol=1e-6)


_SYMBOLIC_SPECS = {
    "attention": ("b, 6, 4, 8", "b, 7, 2, 8", "b, 7, 2, 8"),
    "layer_norm": ("b, 5, 16", "16", "16"),
    "rms_norm": ("m, 16", "16"),
    "glu": ("m, 16", "16, 2, 8"),
    "ragged_dot": ("m, 16", "3, 16, 8"),
    "grouped_glu": ("m, 16", "3, 16, 2, 8"),
}


# Kernels usable: the interpreter's anywhere, natively on a GPU or TPU.
_KERNELS = [pytest.param(True, id="interpreted"),
            pytest.param(False, id="native", marks=[pytest.mark.gpu, pytest.mark.skipif(
                jax.default_backend() not in ("gpu", "tpu"), reason="no GPU or TPU")])]


def _full_precision(interpreted: bool):
  """Natively, float32 matmuls at full precision (a GPU's default is TF32, whose
  rounding the comparisons below would read as an error)."""
  return contextlib.nullcontext() if interpreted else jax.default_matmul_precision("highest")


def _on_host(fn, *args):
  """`fn` on the host CPU, where `implementation=None` runs the XLA
  implementations in full float32: the reference of the native variants."""
  with jax.default_device(jax.devices("cpu")[0]):
    return fn(*jax.device_put(args, jax.devices("cpu")[0]))


def _unit_direction(shape, seed: int) -> jax.Array:
  d = np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(d / np.linalg.norm(d), jnp.float32)


def _central_difference(fn, x, d, *rest, eps=1e-2):
  """The derivative of `fn` at `x` along `d`, on the host (`_on_host`)."""
  return (_on_host(fn, x + eps * d, *rest) - _on_host(fn, x - eps * d, *rest)) / (2 * eps)


@pytest.mark.parametrize("interpreted", _KERNELS)
@pytest.mark.parametrize("name", _SYMBOLIC_SPECS)
def test_export_with_symbolic_sizes_runs_the_xla_implementations(name, interpreted):
  # With kernels usable (the interpreter's, as on a GPU or TPU), a symbolic size
  # reached their shape checks and heuristics, which compare sizes: the export
  # failed with JAX's "inconclusive dimension comparison". Such calls go to the
  # implementations that declare `tokamax.SYMBOLIC_SHAPES`.
  f, args = CALLS[name]
  fwd_and_grad = jax.jit(lambda *a: (f(*a), jax.grad(_loss(f))(*a)))
  specs = export.symbolic_args_specs(args, _SYMBOLIC_SPECS[name])
  with (tokamax.interpret(interpreted), tokamax.record_dispatch() as records,
        _full_precision(interpreted)):
    exported = export.export(fwd_and_grad)(*specs)
  assert {r.implementation for r in records} <= {"xla", "xla_chunked", "composed"}, records
  assert any("symbolic_shapes" in why for r in records for _, why in r.rejected), records
  got = export.deserialize(exported.serialize()).call(*args)
  # Natively against the host's result: two devices sum in different orders.
  tol = dict(rtol=1e-5, atol=1e-6) if interpreted else dict(rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(_on_host(fwd_and_grad, *args))):
    np.testing.assert_allclose(a, b, **tol)


@pytest.mark.parametrize("interpreted", _KERNELS)
@pytest.mark.parametrize("name", ["attention", "layer_norm", "glu", "ragged_dot",
                                  "grouped_glu"])
@pytest.mark.parametrize("second_order", ["hessian", "grad_of_grad"])
def test_second_derivatives_run_where_kernels_are_usable(name, interpreted, second_order):
  # `jax.hessian` (forward over reverse) and `jax.grad` of `jax.grad`
  # differentiate the forward and backward the inner `jax.grad` runs: a kernel
  # there (the interpreter's, as on a GPU or TPU) raised a bare AssertionError
  # or NotImplementedError from Pallas, and under `jax.hessian` the grouped GLU's
  # composed forward JAX's "can't apply forward-mode autodiff" (it calls
  # ragged_dot's custom_vjp) even without kernels. Such calls go to the
  # implementations that declare `tokamax.HIGHER_ORDER_AUTODIFF`.
  f, (x, *rest) = CALLS[name]
  loss = lambda x, *rest: jnp.sum(jnp.sin(f(x, *rest)))
  if second_order == "hessian":
    # Columns of the Hessian.
    directions = [jnp.zeros(x.size).at[i].set(1.0).reshape(x.shape)
                  for i in (0, x.size // 2, x.size - 1)]
    with (tokamax.interpret(interpreted), tokamax.record_dispatch() as records,
          _full_precision(interpreted)):
      hessian = jax.hessian(loss)(x, *rest).reshape(x.size, x.size)
    got = [hessian @ d.reshape(-1) for d in directions]
  else:
    # The gradient of <grad, d> is the Hessian times d (a random unit vector).
    directions = [_unit_direction(x.shape, seed=1)]
    with (tokamax.interpret(interpreted), tokamax.record_dispatch() as records,
          _full_precision(interpreted)):
      got = [jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x, *rest), directions[0]))(x)]
  # (composed: the dense GLU's plain-JAX program.)
  assert {r.implementation for r in records} <= {"xla", "xla_chunked", "composed"}, records
  assert any("higher_order_autodiff" in why for r in records for _, why in r.rejected)
  # Against central differences of the gradient.
  grad = jax.jit(jax.grad(loss))
  for i, (d, g) in enumerate(zip(directions, got)):
    want = _central_difference(grad, x, d, *rest)
    np.testing.assert_allclose(np.reshape(g, -1), np.reshape(want, -1), rtol=2e-2,
                               atol=2e-3, err_msg=f"direction {i}")


@pytest.mark.parametrize("interpreted", _KERNELS)
@pytest.mark.parametrize("name", ["attention", "layer_norm", "ragged_dot"])
def test_gradient_penalty_runs_where_kernels_are_usable(name, interpreted):
  # The outer jax.grad traces an operand the inner one does not (the weights,
  # the inner one x): no single operand showed two differentiations, a kernel
  # ran and its forward was differentiated (a bare error from Pallas).
  f, (x, w, *rest) = CALLS[name]
  inner = lambda x, w: jnp.sum(jnp.sin(f(x, w, *rest)))
  penalty = lambda w: jnp.sum(jax.grad(inner)(x, w) ** 2)
  with (tokamax.interpret(interpreted), tokamax.record_dispatch() as records,
        _full_precision(interpreted)):
    got = jax.grad(penalty)(w)
  assert {r.implementation for r in records} <= {"xla", "xla_chunked"}, records
  assert any("higher_order_autodiff" in why for r in records for _, why in r.rejected)
  d = _unit_direction(w.shape, seed=2)
  np.testing.assert_allclose(jnp.vdot(got, d), _central_difference(penalty, w, d),
                             rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("name", ["attention", "layer_norm", "ragged_dot"])
@pytest.mark.parametrize("second_order", ["hessian", "grad_of_grad"])
def test_a_kernel_differentiated_again_after_tracing_says_what_to_do(name, second_order):
  # Traced inside `jax.jit` before the outer differentiation, the call shows
  # dispatch no sign of it and a kernel runs; differentiating the kernel raised
  # a bare AssertionError from Pallas. Now the reason and the way out.
  f, (x, *rest) = CALLS[name]
  loss = jax.jit(lambda x: jnp.sum(jnp.sin(f(x, *rest))))
  twice = {"hessian": jax.hessian(loss),
           "grad_of_grad": jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))}
  with tokamax.interpret(), tokamax.record_dispatch() as records:
    with pytest.raises(NotImplementedError, match="Put jax.jit outside"):
      twice[second_order](x)
  assert records and all(r.implementation not in ("xla", "xla_chunked")
                         for r in records), records


def test_chunked_attention_takes_a_symbolic_key_length_as_one_chunk():
  # Its chunks split the keys at trace time: with a symbolic S it raised JAX's
  # "inconclusive dimension comparison", then refused the call, although it is
  # the implementation whose backward computes from a given log-sum-exp (ring
  # attention's blocks need that). Now a symbolic S is one chunk of every key.
  q, k, v = _rand(2, 6, 4, 8), _rand(2, 7, 2, 8), _rand(2, 7, 2, 8)
  dout = _rand(2, 6, 4, 8)
  specs = export.symbolic_args_specs((q, k, v, dout), (
      "b, t, 4, 8", "b, s, 2, 8", "b, s, 2, 8", "b, t, 4, 8"))

  def value_and_grads(implementation):
    def run(q, k, v, dout):
      f = lambda *a: tokamax.dot_product_attention(*a, is_causal=True,
                                                   implementation=implementation)
      out, vjp = jax.vjp(f, q, k, v)
      return out, vjp(dout)
    return jax.jit(run)

  with tokamax.record_dispatch() as records:
    exported = export.export(value_and_grads("xla_chunked"))(*specs)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "xla_chunked"), ("backward", "xla_chunked")}, records
  got = export.deserialize(exported.serialize()).call(q, k, v, dout)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(value_and_grads("xla")(q, k, v, dout))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class _DenseThenChunked(attention_xla.XlaAttention):
  """The dense forward with the chunked backward, which then computes from
  another forward's log-sum-exp (behind the large-logit check's guard)."""

  name = "dense_then_chunked"
  vjp = attention_xla.XlaChunkedAttentionVjp


def test_chunked_backward_from_another_forward_takes_a_symbolic_key_length():
  # With a bias, that backward's guard may run the exact chunked forward and
  # backward, whose unroll rule compared the symbolic S with a chunk count.
  q, k, v, bias = _rand(2, 6, 4, 8), _rand(2, 7, 2, 8), _rand(2, 7, 2, 8), _rand(2, 4, 6, 7)

  def grad(implementation):
    return jax.jit(jax.grad(lambda q, k, v, bias: jnp.sum(jnp.sin(
        tokamax.dot_product_attention(q, k, v, bias=bias,
                                      implementation=implementation)))))

  specs = export.symbolic_args_specs((q, k, v, bias), (
      "b, t, 4, 8", "b, s, 2, 8", "b, s, 2, 8", "b, 4, t, s"))
  with tokamax.record_dispatch() as records:
    exported = export.export(grad(_DenseThenChunked()))(*specs)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "dense_then_chunked"), ("backward", "xla_chunked")], records
  np.testing.assert_allclose(export.deserialize(exported.serialize()).call(q, k, v, bias),
                             grad("xla")(q, k, v, bias), rtol=1e-5, atol=1e-6)
