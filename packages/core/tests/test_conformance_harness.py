"""`tokamax.testing.check_case` itself: it catches a wrong implementation, and its
cache of reference results never hands one case's reference to another."""

import dataclasses

import pytest

from tokamax import testing
from tokamax._src.ops.layer_norm import xla as layer_norm_xla


@dataclasses.dataclass(frozen=True)
class _TenPercentHigh(layer_norm_xla.XlaLayerNorm):
  def forward(self, args, config):
    y, residuals = super().forward(args, config)
    return y * 1.1, residuals


def _layer_norm_case():
  return testing.all_cases("layer_norm")[0]


def test_a_wrong_forward_fails_the_check():
  case = _layer_norm_case()
  testing.check_case(case, "xla", "bfloat16")  # the reference is now cached
  with pytest.raises(AssertionError, match="forward"):
    testing.check_case(case, _TenPercentHigh(), "bfloat16")


def test_a_case_rebuilt_with_other_shapes_gets_its_own_reference():
  # tpu-mosaic's tests scale a case's shapes under the same name: a reference
  # cached by name alone would have the old shape and fail (or, worse, pass).
  case = _layer_norm_case()
  testing.check_case(case, "xla", "bfloat16")
  shapes = dict(case.shapes, x=(3 * case.shapes["x"][0], *case.shapes["x"][1:]))
  testing.check_case(dataclasses.replace(case, shapes=shapes), "xla", "bfloat16")
