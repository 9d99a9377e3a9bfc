"""Dispatch: implementation=None/name/sequence/Op, separate backward, errors."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import op as op_module
from tokamax._src.ops.attention import xla as attention_xla
from tokamax._src.ops.layer_norm import xla as layer_norm_xla


# Fixed seed: a failure reproduces (and CI does not flake on a rare input).
_RNG = np.random.default_rng(0)

_CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="checks what dispatch picks with the CPU's implementations")


def _rand(*shape, dtype=jnp.float32):
  return jnp.asarray(_RNG.standard_normal(shape), dtype)


@dataclasses.dataclass(frozen=True)
class RmsOnly(tokamax.Op):
  """A user kernel: refuses LayerNorm, runs RMSNorm through the reference."""

  op_name = "layer_norm"
  name = "rms_only"

  def check_supported(self, args, device):
    if args.subtract_mean:
      raise NotImplementedError("only RMS normalization (subtract_mean=False)")

  def forward(self, args, config):
    return layer_norm_xla.XlaLayerNorm().forward(args, config)


@_CPU_ONLY
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
  # RmsOnly has no backward of its own: the backward is chosen separately, as
  # implementation=None would choose it (xla on a CPU, a kernel on a GPU).
  with tokamax.record_dispatch() as automatic:
    jax.grad(lambda x: jnp.sum(tokamax.rms_norm(x, s)))(x)
  assert records[-1].direction == automatic[-1].direction == "backward"
  assert records[-1].implementation == automatic[-1].implementation
  ref = jax.grad(lambda x: jnp.sum(tokamax.rms_norm(x, s, implementation="xla")))(x)
  np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)


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


@_CPU_ONLY
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


@pytest.mark.parametrize("implementation,index", [(["xla", None], 1), ((None,), 0),
                                                  (["xla", 3], 1)])
def test_a_bad_entry_of_a_sequence_is_named_by_its_index(implementation, index):
  # It said "implementation must be None, a name, ...; got None": None looked
  # allowed, and the message did not say that the value was an entry.
  with pytest.raises(TypeError, match=rf"implementation\[{index}\] must be a name "
                     r"or a tokamax.Op instance \(None only as the whole argument"):
    tokamax.layer_norm(_rand(4, 8), None, None, implementation=implementation)


def test_explicit_config_is_used():
  q, k = _rand(1, 40, 2, 8), _rand(1, 40, 2, 8)
  op = attention_xla.XlaChunkedAttention(attention_xla.ChunkConfig(chunk_size=16))
  # float32 matmuls in full precision on every platform (a GPU's default is
  # TF32-class), so that the two orders of summation are compared, not roundings.
  with jax.default_matmul_precision("highest"), tokamax.record_dispatch() as records:
    out = tokamax.dot_product_attention(q, k, k, implementation=op)
    ref = tokamax.dot_product_attention(q, k, k, implementation="xla")
  assert records[0].config == attention_xla.ChunkConfig(16)
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
  assert "gpu" in statuses[("dot_product_attention", "cudnn")].platforms
  assert "gpu" not in statuses[("ragged_dot", "mosaic_tpu")].platforms
  if jax.default_backend() == "cpu":
    assert not statuses[("dot_product_attention", "cudnn")].usable
    assert "gpu" in statuses[("dot_product_attention", "cudnn")].reason
  with pytest.raises(ValueError, match="op must be one of"):
    tokamax.implementations("softmax")


def test_an_unpartitioned_forward_may_leave_opaque_residuals_for_its_backward():
  # The cuDNN forward keeps jax.vjp's residuals this way, so that its backward
  # does not run the forward a second time (not testable without a GPU).
  from tokamax._src import op as op_lib
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
  # Unpartitioned also where several devices exist (a partitioned call refuses
  # opaque residuals): pytest may run this file next to the multidevice tests.
  with tokamax.spmd_partitioning(False):
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


def test_a_forward_nested_in_another_ops_forward_may_not_leave_opaque_residuals():
  # The composed grouped GLU runs ragged_dot's dispatch inside its forward: the
  # inner call's residuals reach no backward of its own, so the outer training
  # forward's permission must not carry into it.
  from tokamax._src import op as op_lib
  seen = {}

  @dataclasses.dataclass(frozen=True)
  class Inner(layer_norm_xla.XlaLayerNorm):
    name = "inner"

    def forward(self, args, config):
      seen["inner"] = op_lib.opaque_residuals_allowed()
      return super().forward(args, config)

  @dataclasses.dataclass(frozen=True)
  class Outer(layer_norm_xla.XlaLayerNorm):
    name = "outer"
    vjp = layer_norm_xla.XlaLayerNormVjp

    def forward(self, args, config):
      seen["outer"] = op_lib.opaque_residuals_allowed()
      return tokamax.layer_norm(args.x, args.scale, None, implementation=Inner()), {}

  x = jax.random.normal(jax.random.key(0), (6, 16))
  scale = jnp.ones((16,))
  with tokamax.spmd_partitioning(False):
    jax.grad(lambda x: jnp.sum(tokamax.layer_norm(x, scale, None,
                                                  implementation=Outer())))(x)
  assert seen == {"outer": True, "inner": False}


def test_cudnn_forward_keeps_its_vjp_only_where_the_training_path_traces(monkeypatch):
  # cuDNN's training path (jax.vjp) refuses some calls its inference path takes;
  # the forward must then run without the residual (another backward runs).
  from tokamax._src import op as op_lib

  @jax.custom_jvp
  def inference_only(q):
    return q * 2.0

  @inference_only.defjvp
  def _(primals, tangents):
    raise NotImplementedError("Unsupported sequence length (training path)")

  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
  args = tokamax.AttentionArgs(q, q, q)
  op = attention_xla.CudnnAttention()
  for fn, kept in ((lambda a: a.query * 2.0, True), (lambda a: inference_only(a.query),
                                                     False)):
    monkeypatch.setattr(attention_xla, "_cudnn_forward", fn)
    with op_lib.allow_opaque_residuals():
      out, residuals = op.forward(args, None)
    np.testing.assert_allclose(out, q * 2.0)
    assert (attention_xla._CUDNN_VJP in residuals) == kept
    _, residuals = op.forward(args, None)  # not allowed: never kept
    assert not residuals


# --------------------------------------------------- argument checks (op signatures)

_Q, _K = _rand(2, 5, 4, 8), _rand(2, 6, 2, 8)
_X = _rand(3, 4)


def _attention(**kw):
  return tokamax.dot_product_attention(_Q, _K, _K, **kw)


def _ragged(**kw):
  return tokamax.ragged_dot(_X, _rand(2, 4, 5), jnp.asarray([1, 2], jnp.int32), **kw)


def _glu(activation):
  return tokamax.gated_linear_unit(_X, _rand(4, 2, 5), activation=activation)


# Each was accepted before, giving NaN, a silently different op or a wrong result.
@pytest.mark.parametrize("call, error, match", [
    (lambda: _attention(scale=float("nan")), ValueError, "scale must be a finite float"),
    (lambda: _attention(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (lambda: _attention(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (lambda: _attention(logits_soft_cap=True), ValueError, "logits_soft_cap"),
    (lambda: _attention(local_window_size=(True, 1)), ValueError,
     r"local_window_size must be .*got \(True, 1\)"),
    (lambda: tokamax.layer_norm(_X, None, None, epsilon=float("nan")), ValueError,
     "epsilon must be a finite float >= 0; got nan"),
    (lambda: tokamax.layer_norm(_X, None, None, subtract_mean="no"), TypeError,
     "subtract_mean must be a bool"),
    (lambda: tokamax.layer_norm(_X, None, None, axis=True), TypeError,
     r"axis must be an int in \[-2, 2\)"),
    (lambda: _glu(jnp.sum), ValueError,
     r"must map .* shape \(3, 5\) to a real array of the same shape; got shape "
     r"\(\) and dtype float32"),
    (lambda: _glu(lambda a, b: a), TypeError, r"activation .* must take one float32"),
    (lambda: _ragged(preferred_element_type=jnp.int32), TypeError,
     "preferred_element_type must be None or a float dtype.*got int32"),
    (lambda: _ragged(preferred_element_type="bogus"), TypeError,
     "preferred_element_type must be None or a float dtype.*got 'bogus'"),
    # Not silent before, but the messages named no shapes.
    (lambda: tokamax.dot_product_attention(_Q[None], _K, _K), ValueError,
     r"same rank; got query shape \(1, 2, 5, 4, 8\).*key shape \(2, 6, 2, 8\)"),
    (lambda: tokamax.dot_product_attention(_Q[:, :, :3], _K, _K), ValueError,
     r"N=3 must be a multiple of .* K=2.*query shape \(2, 5, 3, 8\).*"
     r"key shape \(2, 6, 2, 8\)"),
])
def test_invalid_static_arguments_raise_clear_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_numpy_scalars_are_accepted_as_static_arguments():
  np.testing.assert_array_equal(
      _attention(scale=np.float32(0.5), is_causal=np.bool_(True), logits_soft_cap=
                 np.float32(2.0), local_window_size=(np.int32(1), None)),
      _attention(scale=0.5, is_causal=True, logits_soft_cap=2.0,
                 local_window_size=(1, None)))
  np.testing.assert_array_equal(_attention(local_window_size=np.int64(2)),
                                _attention(local_window_size=2))
  # A concrete 0-d array is taken by value; a traced one is refused (static).
  np.testing.assert_array_equal(_attention(scale=1 / jnp.sqrt(4.0)),
                                _attention(scale=0.5))
  with pytest.raises(TypeError, match="scale must be a finite float.*traced"):
    jax.jit(lambda s: _attention(scale=s))(0.5)
  # The same for the integer statics: a window, an axis.
  np.testing.assert_array_equal(_attention(local_window_size=(jnp.int32(1), None)),
                                _attention(local_window_size=(1, None)))
  with pytest.raises(ValueError, match="local_window_size must be .*not a traced "
                     "array.*got .*Tracer"):
    jax.jit(lambda w: _attention(local_window_size=w))(2)
  with pytest.raises(ValueError, match="local_window_size must be .*got Array"):
    _attention(local_window_size=jnp.float32(2.0))
  np.testing.assert_array_equal(tokamax.layer_norm(_Q, None, None, axis=jnp.int32(1)),
                                tokamax.layer_norm(_Q, None, None, axis=1))
  np.testing.assert_array_equal(
      tokamax.layer_norm(_Q, None, None, axis=np.int64(1), epsilon=np.float32(0.5),
                         subtract_mean=np.bool_(False)),
      tokamax.layer_norm(_Q, None, None, axis=1, epsilon=0.5, subtract_mean=False))


class _FakeGpu:
  platform, device_kind, compute_capability = "gpu", "NVIDIA H200", "9.0"


@pytest.fixture
def gpu_machine(monkeypatch):
  """A GPU machine as dispatch sees it: its first device a GPU (the host CPU
  stays reachable by name), and no warning given yet."""
  real_devices = jax.devices
  monkeypatch.setattr(jax, "devices", lambda backend=None: (
      [_FakeGpu()] if backend is None else real_devices(backend)))
  monkeypatch.setattr(op_module, "_WARNED_PLATFORMS", set(), raising=False)


@pytest.mark.parametrize("named", ["cpu", "device"])
def test_device_info_under_jit_is_the_default_device_named(gpu_machine, named):
  # Under `jit` there is no concrete operand, and `jax.default_device` names
  # the host CPU.
  cpu = jax.devices("cpu")[0]
  # An uncommitted array (a constant the function closes over) follows the
  # computation, as in JAX; a committed one says where it runs.
  constant, placed = jnp.ones(2), jax.device_put(jnp.ones(2), cpu)
  assert tokamax.DeviceInfo.of([constant]).platform == "gpu"
  assert tokamax.DeviceInfo.of([placed]).platform == "cpu"
  with jax.default_device(cpu if named == "device" else "cpu"):
    with pytest.warns(UserWarning, match="dispatched for 'cpu'.*first device is 'gpu'"):
      info = tokamax.DeviceInfo.of([jax.ShapeDtypeStruct((2,), jnp.float32), constant])
  assert (info.platform, info.device_kind, info.compute_capability) == ("cpu", cpu.device_kind, None)


def test_tuned_data_is_read_for_the_device_the_call_decided(gpu_machine):
  # An eager call on operands committed to the host CPU decides for the CPU.
  # Its tuned-data lookups, which see no operand, read the first device's (the
  # GPU's) data, and a result measured on the CPU was ignored with a warning.
  cpu = jax.devices("cpu")[0]
  x, s = jax.device_put((_rand(8, 128), _rand(128)), cpu)
  measured_here = tokamax.AutotuningResult(device_kind=cpu.device_kind)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with measured_here, tokamax.record_dispatch() as records:
      jax.grad(lambda x: jnp.sum(tokamax.rms_norm(x, s)))(x)
  assert [r.implementation for r in records] == ["xla", "xla"]
  assert not [w for w in caught if "ignored on" in str(w.message)], caught


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU beside the host CPU")
def test_jit_meant_for_the_host_cpu_runs_the_host_implementations():
  # Under `jit` the operands are tracers, which do not say where the program
  # will run: dispatch took the first device, the GPU, and picked a kernel whose
  # lowering then failed on the CPU ("Only interpret mode is supported on CPU
  # backend"). `jax.default_device` names the device. The scale is a constant
  # the function closes over, uncommitted on the GPU: it follows the computation.
  cpu = jax.devices("cpu")[0]
  x, s = jax.device_put(_rand(64, 256), cpu), _rand(256)
  loss = lambda x: jnp.sum(jnp.sin(tokamax.rms_norm(x, s)))
  with jax.default_device(cpu), tokamax.record_dispatch() as records:
    value, grad = jax.jit(jax.value_and_grad(loss))(x)
  assert {(r.direction, r.implementation) for r in records} == {
      ("forward", "xla"), ("backward", "xla")}, records
  assert grad.devices() == {cpu}
  with jax.default_device(cpu):
    want_value, want_grad = jax.value_and_grad(
        lambda x: jnp.sum(jnp.sin(x * jax.lax.rsqrt(
            jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * s)))(x)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
