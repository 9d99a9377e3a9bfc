"""`tokamax.layer_norm` and `tokamax.rms_norm` in one place: the signature and
canonical arguments (`api`), the sharding rule (`sharding`), the XLA
implementation (`xla`) and the benchmark shapes (`problems`)."""

from tokamax._src.ops.layer_norm.api import DEFINITION as DEFINITION
from tokamax._src.ops.layer_norm.api import DIFF_FIELDS as DIFF_FIELDS
from tokamax._src.ops.layer_norm.api import OP_NAME as OP_NAME
from tokamax._src.ops.layer_norm.api import LayerNormArgs as LayerNormArgs
from tokamax._src.ops.layer_norm.api import layer_norm as layer_norm
from tokamax._src.ops.layer_norm.api import rms_norm as rms_norm
