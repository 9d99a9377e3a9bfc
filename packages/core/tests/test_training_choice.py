"""Dispatch chooses a training step's forward so that its own backward runs.

A forward whose own backward refuses the call (cuDNN's at odd T != S) leaves
residuals that only a slow backward can use; when dispatch chooses among several,
a training step then takes the next forward whose backward runs, while inference
keeps the first choice.
"""

import dataclasses
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import registry
from tokamax._src.ops.layer_norm import xla as layer_norm_xla
from tokamax._src.ops.ragged_dot import xla as ragged_dot_xla


class _Refuses:
  """A backward that refuses every call (mixed into a reference VjpOp)."""

  def check_supported(self, args, device, residuals=None):
    raise NotImplementedError("this backward refuses every call")


@dataclasses.dataclass(frozen=True)
class _RefusingVjp(_Refuses, layer_norm_xla.XlaLayerNormVjp):
  name = "refusing"


@dataclasses.dataclass(frozen=True)
class _FastForward(layer_norm_xla.XlaLayerNorm):
  name = "fast_forward"
  vjp = _RefusingVjp


@dataclasses.dataclass(frozen=True)
class _Paired(layer_norm_xla.XlaLayerNorm):
  name = "paired"
  vjp = layer_norm_xla.XlaLayerNormVjp


def _inputs():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((6, 16)), jnp.float32),
          jnp.asarray(rng.standard_normal(16), jnp.float32))


def _norm(x, scale, implementation):
  return tokamax.rms_norm(x, scale, implementation=implementation)


def test_inference_keeps_the_first_forward():
  x, scale = _inputs()
  with tokamax.record_dispatch() as records:
    _norm(x, scale, [_FastForward(), _Paired()])
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "fast_forward")]


def test_training_takes_the_forward_whose_backward_runs():
  x, scale = _inputs()
  dy = jnp.asarray(np.random.default_rng(1).standard_normal((6, 16)), jnp.float32)
  with tokamax.record_dispatch() as records:
    dx = jax.grad(lambda x: jnp.sum(_norm(x, scale, [_FastForward(), _Paired()]) * dy))(x)
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "paired"), ("backward", "xla")]
  (label, reason), = records[0].rejected
  assert label == "fast_forward" and "backward refuses" in reason
  want = jax.grad(lambda x: jnp.sum(_norm(x, scale, "xla") * dy))(x)
  np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class _AlsoFastForward(_FastForward):
  name = "also_fast_forward"


def test_training_keeps_the_first_forward_when_no_other_pair_runs():
  x, scale = _inputs()
  # No later forward has a backward that runs: the first stays, and, named
  # explicitly, its own backward's refusal is the error.
  with pytest.raises(NotImplementedError, match="'fast_forward' cannot run this call"):
    jax.grad(lambda x: jnp.sum(
        _norm(x, scale, [_FastForward(), _AlsoFastForward()])))(x)


def test_training_choice_under_grad_of_jit_records_one_forward():
  x, scale = _inputs()
  with tokamax.record_dispatch() as records:
    jax.grad(jax.jit(lambda x: jnp.sum(_norm(x, scale, [_FastForward(), _Paired()]))))(x)
  # jit traces the inference forward first; the training forward takes its place.
  assert [(r.direction, r.implementation) for r in records] == [
      ("forward", "paired"), ("backward", "xla")]


@dataclasses.dataclass(frozen=True)
class _RefusingRaggedDotVjp(_Refuses, ragged_dot_xla.XlaRaggedDotVjp):
  name = "fast_ragged_dot"


@dataclasses.dataclass(frozen=True)
class _FastRaggedDot(ragged_dot_xla.XlaRaggedDot):
  name = "fast_ragged_dot"


_module = types.ModuleType("fake_ragged_dot_plugin")
_module.Forward, _module.Backward = _FastRaggedDot, _RefusingRaggedDotVjp
sys.modules[_module.__name__] = _module


def test_an_op_without_residuals_keeps_its_first_forward_in_training(fresh_registry):
  """ragged_dot documents no residuals: any backward computes from the operands,
  so `None` keeps the first forward in a training step although its own backward
  refuses (mosaic_gpu's fp8 forward has no fp8 backward)."""
  registry.get().add_backend(tokamax.plugin.Backend(
      name="fake", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=(tokamax.plugin.Implementation(
          op="ragged_dot", name="fast_ragged_dot",
          forward="fake_ragged_dot_plugin:Forward",
          backward="fake_ragged_dot_plugin:Backward",
          platforms=("cpu", "gpu", "tpu"), priority=500),)), None, None, False)
  registry.get().entries["ragged_dot"].sort(key=lambda e: -e.spec.priority)
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.float32)
  sizes = jnp.asarray([5, 7], jnp.int32)
  dy = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
  loss = lambda lhs, impl: jnp.sum(tokamax.ragged_dot(lhs, rhs, sizes,
                                                      implementation=impl) * dy)
  with tokamax.record_dispatch() as records:
    grad = jax.grad(loss)(lhs, None)
  # The backward: the best usable one (its own refuses): the reference on a CPU.
  assert [r.direction for r in records] == ["forward", "backward"]
  assert records[0].implementation == "fast_ragged_dot"
  assert records[1].implementation != "fast_ragged_dot"
  with jax.default_matmul_precision("highest"):
    want = jax.grad(loss)(lhs, "xla")
  np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-3)  # TF32 on a GPU
