"""The conformance suite run on the built-in XLA implementations."""

from tokamax import testing
from tokamax._src.ops.attention import xla as attention_xla

testing.define_conformance_tests("xla", namespace=globals())


# xla_chunked only implements attention; small chunks so every case spans chunks.
def test_xla_chunked_attention_cases():
  op = attention_xla.XlaChunkedAttention(attention_xla.ChunkConfig(chunk_size=16))
  for case in testing.all_cases("dot_product_attention"):
    for dtype in ("float32", "bfloat16"):
      testing.check_case(case, op, dtype)
