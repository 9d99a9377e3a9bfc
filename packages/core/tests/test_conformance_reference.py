"""The conformance suite run on the built-in XLA implementations."""

from tokamax import testing

testing.define_conformance_tests("xla", namespace=globals())


# xla_chunked only implements attention; small chunks so every case spans chunks.
def test_xla_chunked_attention_cases():
  from tokamax._src import xla_backend  # pylint: disable=g-import-not-at-top
  op = xla_backend.XlaChunkedAttention(xla_backend.ChunkConfig(chunk_size=16))
  for case in testing.all_cases("dot_product_attention"):
    for dtype in ("float32", "bfloat16"):
      testing.check_case(case, op, dtype)
