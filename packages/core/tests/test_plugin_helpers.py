"""The helpers tokamax.plugin offers backends (beyond the Backend contract)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax import plugin


def test_implementations_share_name_platforms_priority():
  impls = plugin.implementations(
      name="k", platforms=("gpu",), priority=7,
      ops={"layer_norm": ("m.ln:F", "m.ln:B"), "ragged_dot": ("m.rd:F", None)})
  assert impls == (
      plugin.Implementation("layer_norm", "k", "m.ln:F", "m.ln:B", ("gpu",), 7),
      plugin.Implementation("ragged_dot", "k", "m.rd:F", None, ("gpu",), 7))


def _check(args, device):
  if device == "bad":
    raise NotImplementedError("bad device")


class _Functions(plugin.OpFunctions):
  op_name = "layer_norm"
  name = "helper_test"
  check_args = staticmethod(_check)
  heuristic = staticmethod(lambda args, backward: ("heuristic", backward))
  configs = staticmethod(lambda args, backward: [("space", backward)])


@dataclasses.dataclass(frozen=True)
class _Fwd(_Functions, tokamax.Op):
  def forward(self, args, config):
    raise AssertionError


@dataclasses.dataclass(frozen=True)
class _Bwd(_Functions, tokamax.VjpOp):
  needed_residuals = {"lse": "log-sum-exp"}

  def backward(self, args, residuals, out, dout, config):
    raise AssertionError


def test_op_functions_tell_the_pass_and_check_residuals():
  assert _Fwd().heuristic_config(None) == ("heuristic", False)
  assert _Bwd().heuristic_config(None) == ("heuristic", True)
  assert _Bwd().search_space(None) == [("space", True)]
  _Fwd().check_supported(None, "ok")
  _Bwd().check_supported(None, "ok", residuals={"lse": 0})
  _Bwd().check_supported(None, "ok")  # residuals unknown yet
  with pytest.raises(NotImplementedError, match="bad device"):
    _Fwd().check_supported(None, "bad")
  with pytest.raises(NotImplementedError, match=r"log-sum-exp residual \('lse'\)"):
    _Bwd().check_supported(None, "ok", residuals={})


def test_attention_layout_and_checks():
  q = jnp.zeros((2, 8, 4, 16), jnp.float32)
  kv = jnp.zeros((2, 12, 2, 16), jnp.float32)
  args = tokamax.AttentionArgs(q, kv, kv, is_causal=True, q_offset=jnp.int32(3))
  lay = plugin.AttentionLayout.from_args(args, None)
  assert (lay.t, lay.s, lay.group, lay.left, lay.right) == (8, 12, 2, None, 0)
  assert lay.has_q_offset and lay.precision == jax.lax.Precision.HIGHEST
  bf16 = tokamax.AttentionArgs(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16),
                               kv.astype(jnp.bfloat16), q_offset=jnp.int32(3))
  lay = plugin.AttentionLayout.from_args(bf16, None)
  assert lay.precision is None and not lay.has_q_offset  # no window: no offset
  plugin.check_attention_shapes(args, 16)
  with pytest.raises(NotImplementedError, match="head dims up to 8"):
    plugin.check_attention_shapes(args, 8)
  empty = tokamax.AttentionArgs(q, kv[:, :0], kv[:, :0])
  with pytest.raises(NotImplementedError, match="empty"):
    plugin.check_attention_shapes(empty, 16)
  out = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
  assert plugin.attention_delta(out, out).shape == (2, 4, 8)


def test_vmap_fallback_batches_the_stand_in_only_under_vmap():
  """Unbatched, `call` runs; under vmap (nested too), `batched_call` runs over
  the batched arguments, the others broadcast, every output batched. (Here the
  two differ by a marker, 100 added, to tell which one ran; a real stand-in
  computes the same.)"""

  def call(x, y):
    return {"sum": x + y, "x": x * 2}

  def batched_call(x, y):
    return {"sum": x + y + 100, "x": x * 2 + 100}

  run = plugin.vmap_fallback(call, batched_call)
  x = jnp.arange(6.0).reshape(2, 3)
  y = jnp.ones(3)

  out = run(x[0], y)
  assert jnp.array_equal(out["sum"], x[0] + y)
  assert jnp.array_equal(jax.jit(run)(x[0], y)["x"], 2 * x[0])

  out = jax.vmap(run, in_axes=(0, None))(x, y)
  assert jnp.array_equal(out["sum"], x + y + 100)
  assert jnp.array_equal(out["x"], 2 * x + 100)

  xx = jnp.stack([x, x + 10])
  out = jax.jit(jax.vmap(jax.vmap(run, in_axes=(0, None)), in_axes=(0, None)))(xx, y)
  assert jnp.array_equal(out["sum"], xx + y + 100)
  assert jnp.array_equal(out["x"], 2 * xx + 100)


def test_sequential_under_vmap_runs_each_element_unbatched():
  """Under vmap (nested too, with an unbatched argument) the call only ever sees
  one element's shapes, and the outputs are the batched call's."""
  seen = []

  def call(x, y):
    seen.append((x.shape, y.shape))
    return x * 2 + y, x.sum()

  run = plugin.sequential_under_vmap(call)
  x = jnp.arange(24.0).reshape(2, 4, 3)
  y = jnp.arange(3.0)
  assert all(jnp.array_equal(a, b) for a, b in zip(run(x[0, 0], y), call(x[0, 0], y)))
  out = jax.jit(jax.vmap(jax.vmap(run, in_axes=(0, None)), in_axes=(0, None)))(x, y)
  assert jnp.array_equal(out[0], x * 2 + y) and jnp.array_equal(out[1], x.sum(-1))
  assert set(seen) == {((3,), (3,))}
  # A pytree argument with one batched and one unbatched leaf.
  run = plugin.sequential_under_vmap(lambda p: p["w"] * p["v"])
  out = jax.vmap(run, in_axes=({"w": 0, "v": None},))({"w": x[0], "v": y})
  assert jnp.array_equal(out, x[0] * y)


def test_vmap_fallback_batches_pytree_arguments_leaf_by_leaf():
  """A pytree argument with one batched and one unbatched leaf: each leaf gets
  its own axis (a flag per leaf, not one per argument)."""
  run = plugin.vmap_fallback(lambda p: p["w"] * p["v"],
                             lambda p: p["w"] * p["v"] + 100)
  w = jnp.arange(6.0).reshape(2, 3)
  v = jnp.arange(3.0)
  out = jax.vmap(run, in_axes=({"w": 0, "v": None},))({"w": w, "v": v})
  assert jnp.array_equal(out, w * v + 100)
