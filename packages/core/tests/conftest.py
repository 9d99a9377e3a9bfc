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
