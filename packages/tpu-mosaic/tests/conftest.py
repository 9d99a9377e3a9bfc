"""With env TOKAMAX_TPU_DETECT_RACES=1, every test here runs under the race detector.

`_common.interpret_params()` then turns the detector on for every kernel; this
fixture records what it saw and fails the test on a race. Off by default (slow).
"""

import os

import pytest

from tokamax_tpu_mosaic import _common


@pytest.fixture(autouse=True)
def _fail_on_races(request):
  # test_races.py checks the detector itself (including a deliberately racy kernel).
  if (os.environ.get(_common.RACES_ENV, "") in ("", "0")
      or request.module.__name__.endswith("test_races")):
    yield
    return
  with _common.detect_races() as log:
    yield
  assert not log.found, "TPU interpret mode's race detector reported a race"
