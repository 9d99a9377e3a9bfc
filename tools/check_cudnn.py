"""Conformance of the "cudnn" attention implementation and of implementation=None
attention on a GPU (cases the implementation refuses are listed, not failed)."""

import tokamax
from tokamax import testing

for name in ("cudnn", None):
  passed, refused = 0, []
  for case in testing.all_cases("dot_product_attention"):
    for dtype in ("bfloat16", "float16"):
      try:
        testing.check_case(case, name, dtype)
        passed += 1
      except NotImplementedError as e:
        refused.append(f"{case} {dtype}: {str(e)[:90]}")
      except Exception as e:  # report every failure, keep going
        print(f"FAILED {case} {dtype}: {type(e).__name__}: {str(e)[:200]}")
  print(f"implementation={name!r}: {passed} passed, {len(refused)} refused")
  for line in refused[:8]:
    print("  refused:", line)
with tokamax.record_dispatch() as records:
  import jax
  import jax.numpy as jnp
  q = jnp.ones((1, 128, 4, 64), jnp.bfloat16)
  jax.grad(lambda q: tokamax.dot_product_attention(q, q, q, is_causal=True).sum())(q)
print([(r.direction, r.implementation) for r in records])
