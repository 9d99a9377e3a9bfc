import pytest

from tokamax._src import registry


@pytest.fixture
def fresh_registry(monkeypatch):
  """Rediscovers plugins in the test and again afterwards (env changes apply)."""
  registry.reset()
  yield monkeypatch
  monkeypatch.undo()
  registry.reset()
