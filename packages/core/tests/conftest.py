import jax
import pytest

from tokamax._src import registry


@pytest.fixture
def fresh_registry(monkeypatch):
  """Rediscovers plugins in the test and again afterwards (env changes apply)."""
  registry.reset()
  yield monkeypatch
  monkeypatch.undo()
  registry.reset()


@pytest.fixture
def highest_matmul_precision():
  """float32 checks against a definition: a GPU's default float32 matmul is TF32."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture
def tuned_step_dispatch():
  """`run(op_name, key, times, loss, x)`: the (direction, implementation)
  dispatch records of ``jax.grad(loss)(x)`` with tuned data measuring `times`
  (``{(direction, implementation): ms}``) at the `op_name` call of args key
  `key`."""
  # Imported here: the multi-device folder's conftest sets XLA_FLAGS first.
  import tokamax
  from tokamax._src.tuning import results

  def run(op_name, key, times, loss, x):
    result = results.AutotuningResult(
        [results.Measurement(op_name, d, key, impl, None, t)
         for (d, impl), t in times.items()], device_kind="cpu")
    with result, tokamax.record_dispatch() as records:
      jax.grad(loss)(x)
    return [(r.direction, r.implementation) for r in records]
  return run


@pytest.fixture
def attention_step_dispatch(tuned_step_dispatch):
  """`run(q, times)`: `tuned_step_dispatch` of a training step of
  ``dot_product_attention(q, q, q, implementation=None)``."""
  import jax.numpy as jnp
  import tokamax
  from tokamax._src.ops.attention import api
  from tokamax._src.tuning import results

  def run(q, times):
    key = results.args_key(api.canonical_args(q, q, q, None, None)[0])
    loss = lambda q: jnp.sum(tokamax.dot_product_attention(q, q, q,
                                                           implementation=None))
    return tuned_step_dispatch("dot_product_attention", key, times, loss, q)
  return run
