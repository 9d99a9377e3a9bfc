"""`tokamax.dot_product_attention` in one place: the signature and canonical
arguments (`api`), the sharding rule (`sharding`), the XLA implementations
(`xla`), the ring variant over a sequence-sharded mesh (`ring`) and the
benchmark shapes (`problems`)."""

from tokamax._src.ops.attention.api import DEFINITION as DEFINITION
from tokamax._src.ops.attention.api import DIFF_FIELDS as DIFF_FIELDS
from tokamax._src.ops.attention.api import OP_NAME as OP_NAME
from tokamax._src.ops.attention.api import AttentionArgs as AttentionArgs
from tokamax._src.ops.attention.api import apply_sinks as apply_sinks
from tokamax._src.ops.attention.api import canonical_args as canonical_args
from tokamax._src.ops.attention.api import dot_product_attention as dot_product_attention
from tokamax._src.ops.attention.api import sinks_cotangent as sinks_cotangent
from tokamax._src.ops.attention.ring import ring_attention as ring_attention
from tokamax._src.ops.attention.ring import zigzag_permutation as zigzag_permutation
