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
def attention_step_dispatch():
  """`run(q, times)`: the (direction, implementation) dispatch records of a
  training step of ``dot_product_attention(q, q, q, implementation=None)``,
  with tuned data measuring `times` (``{(direction, implementation): ms}``) at
  that call."""
  # Imported here: the multi-device folder's conftest sets XLA_FLAGS first.
  import jax.numpy as jnp
  import tokamax
  from tokamax._src.ops.attention import api
  from tokamax._src.tuning import results

  def run(q, times):
    key = results.args_key(api.canonical_args(q, q, q, None, None)[0])
    result = results.AutotuningResult(
        [results.Measurement("dot_product_attention", d, key, impl, None, t)
         for (d, impl), t in times.items()], device_kind="cpu")
    loss = lambda q: jnp.sum(tokamax.dot_product_attention(q, q, q,
                                                           implementation=None))
    with result, tokamax.record_dispatch() as records:
      jax.grad(loss)(q)
    return [(r.direction, r.implementation) for r in records]
  return run
