"""The conformance suite: checks any implementation against the XLA reference.

Any backend, ours or a third party's, runs the same checks. In a pytest module::

    from tokamax import testing

    testing.define_conformance_tests("my_impl", namespace=globals())

defines parametrized ``test_conformance_<op>`` functions (forward and gradients,
float32/bfloat16/float16, every feature flag, awkward shapes) plus
``test_conformance_errors``. A case an implementation does not support must raise
`NotImplementedError` (reported as a skip with its reason); anything else it
returns must match the reference within the dtype's tolerance.

The functions below can also be called directly: ``check_case(case,
implementation)``.
"""

from tokamax.testing._conformance import Case
from tokamax.testing._conformance import TOLERANCES
from tokamax.testing._conformance import all_cases
from tokamax.testing._conformance import assert_close
from tokamax.testing._conformance import check_case
from tokamax.testing._conformance import check_errors
from tokamax.testing._conformance import define_conformance_tests
from tokamax.testing._conformance import error_cases
from tokamax.testing._conformance import relative_l2_error
from tokamax.testing._conformance import tolerance

__all__ = [
    "Case",
    "TOLERANCES",
    "all_cases",
    "assert_close",
    "check_case",
    "check_errors",
    "define_conformance_tests",
    "error_cases",
    "relative_l2_error",
    "tolerance",
]
