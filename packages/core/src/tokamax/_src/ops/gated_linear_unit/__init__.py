"""`tokamax.gated_linear_unit` in one place: the signature and canonical
arguments (`api`), the sharding rule (`sharding`), the XLA implementation
(`xla`) and the benchmark shapes (`problems`)."""

from tokamax._src.ops.gated_linear_unit.api import DEFINITION as DEFINITION
from tokamax._src.ops.gated_linear_unit.api import DIFF_FIELDS as DIFF_FIELDS
from tokamax._src.ops.gated_linear_unit.api import OP_NAME as OP_NAME
from tokamax._src.ops.gated_linear_unit.api import GatedLinearUnitArgs as GatedLinearUnitArgs
from tokamax._src.ops.gated_linear_unit.api import gated_linear_unit as gated_linear_unit
