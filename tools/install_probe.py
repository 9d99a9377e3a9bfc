"""Run by tools/install_test.py inside each clean venv: reports what is installed there.

Prints one JSON object: the installed distributions, what `tokamax.backends()` and
`tokamax.backend_errors()` say, the warnings discovery gave, and which
implementation ran each of the four ops (forward and backward) with
`implementation=None`. Uses only the venv's own site-packages (checked).
"""

import importlib.metadata
import json
import sys
import warnings

import jax
import jax.numpy as jnp

import tokamax


def _ops_run():
  """Each op forward and backward on small CPU inputs; which implementation ran."""
  key = jax.random.key(0)
  q = jax.random.normal(key, (1, 16, 2, 8), jnp.float32)
  x = jax.random.normal(key, (6, 16), jnp.float32)
  w = jax.random.normal(key, (16, 2, 8), jnp.float32)
  rhs = jax.random.normal(key, (3, 16, 4), jnp.float32)
  sizes = jnp.array([2, 0, 4], jnp.int32)
  calls = {
      "dot_product_attention": lambda q: tokamax.dot_product_attention(q, q, q).sum(),
      "layer_norm": lambda x: tokamax.rms_norm(x, jnp.ones(16)).sum(),
      "gated_linear_unit": lambda x: tokamax.gated_linear_unit(x, w, activation=jax.nn.silu).sum(),
      "ragged_dot": lambda x: tokamax.ragged_dot(x, rhs, sizes).sum(),
  }
  ran = {}
  for op, f in calls.items():
    with tokamax.record_dispatch() as records:
      jax.grad(f)(q if op == "dot_product_attention" else x)
    ran[op] = sorted({f"{r.direction}:{r.implementation}" for r in records})
  return ran


def main():
  if sys.prefix not in tokamax.__file__:
    raise SystemExit(f"tokamax imported from {tokamax.__file__}, not this venv {sys.prefix}")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backends = [(b.name, b.distribution, b.version, b.status) for b in tokamax.backends()]
  report = {
      "distributions": sorted(f"{d.metadata['Name']}=={d.version}"
                              for d in importlib.metadata.distributions()),
      "backends": backends,
      "errors": [e.message for e in tokamax.backend_errors()],
      "warnings": [str(w.message) for w in caught],
      "ops": _ops_run(),
  }
  print(json.dumps(report))


if __name__ == "__main__":
  main()
