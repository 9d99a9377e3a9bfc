"""The conformance suite run on the built-in XLA implementations."""

import jax
import pytest

from tokamax import testing
from tokamax._src.ops.attention import xla as attention_xla

# XLA on a CPU ignores matmul precision: there the xla implementation's float32
# outputs and gradients are the float32 reference's own, bit for bit (every case
# of every op), a check that cannot fail. On a GPU (TF32 by default) they differ.
# The xla implementations compute in float32 whatever the input dtype, so on a
# CPU one 16-bit dtype checks their math and casts: float16, whose tolerance is
# the tighter (3e-3 against bfloat16's 2e-2). bfloat16 would check the same
# casts again (118 CPU-seconds of CI's oldest-JAX run, session 22); GPUs run
# every dtype.
_DTYPES = ["float16"] if jax.default_backend() == "cpu" else list(testing.TOLERANCES)
testing.define_conformance_tests("xla", namespace=globals(), dtypes=_DTYPES)


# xla_chunked only implements attention; small chunks so every case spans chunks.
# On a CPU in float32 only: what the chunk loop adds (per-chunk masks and offsets,
# the online softmax) is what can go wrong, and float32's tight tolerance is what
# catches it. It computes in float32 whatever the input dtype, so a bfloat16 run
# checks little more than its casts and cost as much again (about 70 CPU-seconds
# of CI's oldest-JAX run, session 22). GPUs run both.
@pytest.mark.parametrize("dtype", ["float32"] if jax.default_backend() == "cpu"
                         else ["float32", "bfloat16"])
@pytest.mark.parametrize("case", testing.all_cases("dot_product_attention"), ids=str)
def test_xla_chunked_attention_cases(case, dtype):
  op = attention_xla.XlaChunkedAttention(attention_xla.ChunkConfig(chunk_size=16))
  testing.check_case(case, op, dtype)


# The composed GLU (the plain program; ragged_dot's dispatch inside for grouped
# calls): every GLU case. In float16 on a CPU (its projections come in the input
# dtype: 16-bit roundings the float32 reference lacks).
@pytest.mark.parametrize("dtype", ["float16"] if jax.default_backend() == "cpu"
                         else list(testing.TOLERANCES))
@pytest.mark.parametrize("case", testing.all_cases("gated_linear_unit"), ids=str)
def test_composed_glu_cases(case, dtype):
  testing.check_case(case, "composed", dtype)
