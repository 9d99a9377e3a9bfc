"""The CI test a third-party backend runs: tokamax's conformance suite on its kernels.

Every case compares forward and gradients with the XLA reference (float32, HIGHEST
precision) at the tolerance of its dtype; a case the kernel refuses with
NotImplementedError is skipped, any other error or a wrong number fails.
`TOKAMAX_CONFORMANCE_QUICK=1` runs the quick subset.
"""

import pytest

pytest.importorskip("tokamax_example_plugin")

from tokamax import testing

testing.define_conformance_tests("example_rms", namespace=globals(), ops=["layer_norm"])
