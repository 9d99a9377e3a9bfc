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


def test_an_op_without_residuals_keeps_its_first_forward_in_training(
    fresh_registry, highest_matmul_precision):
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


# A backward that only declines: under `None` the step keeps its forward when
# another backward takes that forward's residuals (the Mosaic GPU norm forward
# with Triton's backward where its own is slower), and moves it otherwise.


@dataclasses.dataclass(frozen=True)
class _DecliningNormVjp(layer_norm_xla.XlaLayerNormVjp):
  name = "declining_norm"

  def declines(self, args):
    return "measured slower than another backward here"


@dataclasses.dataclass(frozen=True)
class _DecliningNorm(layer_norm_xla.XlaLayerNorm):
  name = "declining_norm"


@dataclasses.dataclass(frozen=True)
class _TokenNormVjp(layer_norm_xla.XlaLayerNormVjp):
  """Takes only residuals that carry its own forward's "token"."""
  name = "token_norm"

  def check_supported(self, args, device, residuals=None):
    if residuals is not None and "token" not in residuals:
      raise NotImplementedError("needs the token residual")

  def declines(self, args):
    return None  # not the reference's, which one test makes decline


@dataclasses.dataclass(frozen=True)
class _TokenNorm(layer_norm_xla.XlaLayerNorm):
  name = "token_norm"

  def forward(self, args, config):
    y, residuals = super().forward(args, config)
    return y, {**residuals, "token": residuals["rstd"]}


_norm_module = types.ModuleType("fake_norm_plugin")
_norm_module.__dict__.update(DecliningNorm=_DecliningNorm,
                             DecliningNormVjp=_DecliningNormVjp,
                             TokenNorm=_TokenNorm, TokenNormVjp=_TokenNormVjp)
sys.modules[_norm_module.__name__] = _norm_module


def _register_norms(*names_and_priorities):
  impls = tuple(tokamax.plugin.Implementation(
      op="layer_norm", name=name, forward=f"fake_norm_plugin:{cls}",
      backward=f"fake_norm_plugin:{cls}Vjp", platforms=("cpu", "gpu", "tpu"),
      priority=priority) for name, cls, priority in names_and_priorities)
  registry.get().add_backend(tokamax.plugin.Backend(
      name="fake_norms", api_version=tokamax.plugin.PLUGIN_API_VERSION,
      implementations=impls), None, None, False)
  # Only these and the reference: on a GPU the installed kernels' backwards would
  # take the residuals too.
  entries = registry.get().entries
  entries["layer_norm"] = sorted(
      (e for e in entries["layer_norm"] if e.name in {"xla", *(n for n, _, _ in
                                                                names_and_priorities)}),
      key=lambda e: -e.spec.priority)


def _training_step(x, scale):
  dy = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), jnp.float32)
  with tokamax.record_dispatch() as records:
    dx = jax.grad(lambda x: jnp.sum(_norm(x, scale, None) * dy))(x)
  want = jax.grad(lambda x: jnp.sum(_norm(x, scale, "xla") * dy))(x)
  np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)
  return [(r.direction, r.implementation) for r in records], records


def test_a_declining_backward_keeps_its_forward_when_another_takes_the_residuals(
    fresh_registry):
  _register_norms(("declining_norm", "DecliningNorm", 500))
  ran, _ = _training_step(*_inputs())
  assert ran == [("forward", "declining_norm"), ("backward", "xla")]


def test_a_declining_backward_moves_the_forward_when_no_other_takes_the_residuals(
    fresh_registry):
  # The reference's backward declines too; the token backward refuses residuals
  # without its token: nothing takes the declining forward's residuals.
  fresh_registry.setattr(layer_norm_xla.XlaLayerNormVjp, "declines",
                         lambda self, args: "declines everything")
  _register_norms(("declining_norm", "DecliningNorm", 500),
                  ("token_norm", "TokenNorm", 400))
  ran, records = _training_step(*_inputs())
  assert ran == [("forward", "token_norm"), ("backward", "token_norm")]
  reason = dict(records[0].rejected)["declining_norm"]
  assert "declines this call" in reason and "no other backward" in reason


@dataclasses.dataclass(frozen=True)
class _DecliningForward(layer_norm_xla.XlaLayerNorm):
  name = "declining_forward"

  def declines(self, args):
    return "measured slower than another forward here"


def test_a_declining_forward_is_passed_over_only_under_automatic_choice(
    fresh_registry):
  _norm_module.DecliningForward = _DecliningForward
  _norm_module.DecliningForwardVjp = layer_norm_xla.XlaLayerNormVjp
  _register_norms(("declining_forward", "DecliningForward", 500))
  x, scale = _inputs()
  with tokamax.record_dispatch() as records:
    _norm(x, scale, None)
  assert [r.implementation for r in records] == ["xla"]
  assert "declines: measured slower" in dict(records[0].rejected)["declining_forward"]
  with tokamax.record_dispatch() as records:  # named: it runs
    _norm(x, scale, "declining_forward")
  assert [r.implementation for r in records] == ["declining_forward"]
