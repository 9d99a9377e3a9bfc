"""`tokamax.ragged_dot` in one place: the signature and canonical arguments
(`api`), the sharding rule (`sharding`), the XLA implementation (`xla`), the
expert-parallel MoE layer built on it (`moe`) and the benchmark shapes
(`problems`)."""

from tokamax._src.ops.ragged_dot.api import DEFINITION as DEFINITION
from tokamax._src.ops.ragged_dot.api import DIFF_FIELDS as DIFF_FIELDS
from tokamax._src.ops.ragged_dot.api import OP_NAME as OP_NAME
from tokamax._src.ops.ragged_dot.api import RaggedDotArgs as RaggedDotArgs
from tokamax._src.ops.ragged_dot.api import ragged_dot as ragged_dot
from tokamax._src.ops.ragged_dot.moe import moe_all_to_all as moe_all_to_all
