"""Dispatch: implementation=None/name/sequence/Op, separate backward, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import xla_backend


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng().standard_normal(shape), dtype)


@dataclasses.dataclass(frozen=True)
class RmsOnly(tokamax.Op):
  """A user kernel: refuses LayerNorm, runs RMSNorm through the reference."""

  op_name = "layer_norm"
  name = "rms_only"

  def check_supported(self, args, device):
    if args.subtract_mean:
      raise NotImplementedError("only RMS normalization (subtract_mean=False)")

  def forward(self, args, config):
    return xla_backend.XlaLayerNorm().forward(args, config)


def test_none_picks_reference_on_cpu_for_both_directions():
  x, s = _rand(4, 16), _rand(16)
  with tokamax.record_dispatch() as records:
    jax.grad(lambda x: jnp.sum(tokamax.layer_norm(x, s, None) * x))(x)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "xla"), ("backward", "xla")]


def test_op_instance_and_automatic_backward():
  x, s = _rand(4, 16), _rand(16)
  with tokamax.record_dispatch() as records:
    g = jax.grad(lambda x: jnp.sum(tokamax.rms_norm(x, s, implementation=RmsOnly())))(x)
  assert records[0].implementation == "rms_only"
  # RmsOnly has no backward of its own: the backward is chosen separately.
  assert records[-1].direction == "backward" and records[-1].implementation == "xla"
  ref = jax.grad(lambda x: jnp.sum(tokamax.rms_norm(x, s, implementation="xla")))(x)
  np.testing.assert_allclose(g, ref, rtol=1e-6)


def test_refusal_names_the_implementation_and_reason():
  x = _rand(4, 16)
  with pytest.raises(NotImplementedError, match="'rms_only' cannot run this call: only RMS"):
    tokamax.layer_norm(x, None, None, implementation=RmsOnly())


def test_sequence_falls_back_in_order():
  x = _rand(4, 16)
  with tokamax.record_dispatch() as records:
    tokamax.layer_norm(x, None, None, implementation=[RmsOnly(), "xla"])
  assert records[0].implementation == "xla"
  assert records[0].rejected[0][0] == "rms_only"


def test_cudnn_on_cpu_says_why():
  q = _rand(1, 8, 2, 16, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="cudnn.*NVIDIA GPU"):
    tokamax.dot_product_attention(q, q, q, implementation="cudnn")


def test_wrong_op_instance_is_rejected():
  with pytest.raises(ValueError, match="implements 'layer_norm'"):
    tokamax.ragged_dot(_rand(4, 8), _rand(1, 8, 2), jnp.asarray([4], jnp.int32),
                       implementation=RmsOnly())
  with pytest.raises(TypeError, match="implementation must be"):
    tokamax.layer_norm(_rand(4, 8), None, None, implementation=3)


def test_explicit_config_is_used():
  q, k = _rand(1, 40, 2, 8), _rand(1, 40, 2, 8)
  op = xla_backend.XlaChunkedAttention(xla_backend.ChunkConfig(chunk_size=16))
  with tokamax.record_dispatch() as records:
    out = tokamax.dot_product_attention(q, k, k, implementation=op)
  assert records[0].config == xla_backend.ChunkConfig(16)
  ref = tokamax.dot_product_attention(q, k, k, implementation="xla")
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class BadBackward(tokamax.VjpOp):
  op_name = "layer_norm"
  name = "bad_backward"

  def backward(self, args, residuals, out, dout, config):
    return {"x": dout[:1]}


@dataclasses.dataclass(frozen=True)
class WithBadBackward(RmsOnly):
  name = "with_bad_backward"
  vjp = BadBackward

  def check_supported(self, args, device):
    pass


def test_backend_cotangent_shape_is_checked():
  x = _rand(4, 16)
  with pytest.raises(ValueError, match="cotangent of shape"):
    jax.grad(lambda x: jnp.sum(tokamax.layer_norm(
        x, None, None, implementation=WithBadBackward())))(x)


def test_interpret_context():
  assert not tokamax.interpret_mode()
  with tokamax.interpret():
    assert tokamax.interpret_mode()
  assert not tokamax.interpret_mode()


def test_implementations_introspection():
  statuses = {(s.op, s.name): s for s in tokamax.implementations()}
  assert statuses[("layer_norm", "xla")].usable
  if jax.default_backend() == "cpu":
    assert not statuses[("dot_product_attention", "cudnn")].usable
    assert "gpu" in statuses[("dot_product_attention", "cudnn")].reason
  with pytest.raises(ValueError, match="op must be one of"):
    tokamax.implementations("softmax")


def test_an_unpartitioned_forward_may_leave_opaque_residuals_for_its_backward():
  # The cuDNN forward keeps jax.vjp's residuals this way, so that its backward
  # does not run the forward a second time (not testable without a GPU).
  from tokamax._src import op as op_lib  # pylint: disable=import-outside-toplevel
  seen = {}

  @dataclasses.dataclass(frozen=True)
  class KeepsVjpBackward(tokamax.VjpOp):
    op_name = "layer_norm"
    name = "keeps_vjp"

    def backward(self, args, residuals, out, dout, config):
      seen["residuals"] = sorted(residuals)
      (grads,) = residuals["own_vjp"](dout)
      return grads

  @dataclasses.dataclass(frozen=True)
  class KeepsVjp(tokamax.Op):
    op_name = "layer_norm"
    name = "keeps_vjp"
    vjp = KeepsVjpBackward

    def forward(self, args, config):
      seen["allowed"] = op_lib.opaque_residuals_allowed()
      fn = lambda p: tokamax.layer_norm(p["x"], p["scale"], None, implementation="xla")
      out, vjp = jax.vjp(fn, {"x": args.x, "scale": args.scale})
      return out, {"own_vjp": vjp}

  x = jax.random.normal(jax.random.key(0), (6, 16))
  scale = jax.random.normal(jax.random.key(1), (16,))
  loss = lambda f: lambda x, s: jnp.sum(jnp.sin(f(x, s)))
  got = jax.grad(loss(lambda x, s: tokamax.layer_norm(x, s, None,
                                                       implementation=KeepsVjp())),
                 argnums=(0, 1))(x, scale)
  want = jax.grad(loss(lambda x, s: tokamax.layer_norm(x, s, None,
                                                        implementation="xla")),
                  argnums=(0, 1))(x, scale)
  assert seen == {"allowed": True, "residuals": ["own_vjp"]}
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert not op_lib.opaque_residuals_allowed()  # only while dispatch runs a forward


def test_cudnn_forward_keeps_its_vjp_only_where_the_training_path_traces(monkeypatch):
  # cuDNN's training path (jax.vjp) refuses some calls its inference path takes;
  # the forward must then run without the residual (another backward runs).
  from tokamax._src import op as op_lib  # pylint: disable=import-outside-toplevel

  @jax.custom_jvp
  def inference_only(q):
    return q * 2.0

  @inference_only.defjvp
  def _(primals, tangents):
    raise NotImplementedError("Unsupported sequence length (training path)")

  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
  args = tokamax.AttentionArgs(q, q, q)
  op = xla_backend.CudnnAttention()
  for fn, kept in ((lambda a: a.query * 2.0, True), (lambda a: inference_only(a.query),
                                                     False)):
    monkeypatch.setattr(xla_backend, "_cudnn_forward", fn)
    with op_lib.allow_opaque_residuals():
      out, residuals = op.forward(args, None)
    np.testing.assert_allclose(out, q * 2.0)
    assert (xla_backend._CUDNN_VJP in residuals) == kept  # pylint: disable=protected-access
    _, residuals = op.forward(args, None)  # not allowed: never kept
    assert not residuals
