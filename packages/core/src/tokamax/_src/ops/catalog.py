"""Every op, for code that goes over all of them (the bench suite, introspection).

Adding an op is adding its folder and one line here.
"""

from __future__ import annotations

import types

from tokamax._src.ops import attention, gated_linear_unit, layer_norm, ragged_dot
from tokamax._src.ops.attention import problems as attention_problems
from tokamax._src.ops.gated_linear_unit import problems as gated_linear_unit_problems
from tokamax._src.ops.layer_norm import problems as layer_norm_problems
from tokamax._src.ops.ragged_dot import problems as ragged_dot_problems

# {op name: its problems module (reference_problems, quick_problems, probe_args)},
# in the order the bench suite runs them.
PROBLEMS: dict[str, types.ModuleType] = {
    attention.OP_NAME: attention_problems,
    ragged_dot.OP_NAME: ragged_dot_problems,
    layer_norm.OP_NAME: layer_norm_problems,
    gated_linear_unit.OP_NAME: gated_linear_unit_problems,
}
