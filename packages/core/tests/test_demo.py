"""`python -m tokamax demo`: its errors come with the conformance tolerance."""

import jax.numpy as jnp
import numpy as np

from tokamax import testing
from tokamax._src import demo


def test_accuracy_is_judged_by_the_conformance_tolerance():
  ref = jnp.asarray(np.linspace(-1.0, 1.0, 64), jnp.float32)
  rel_tol, abs_tol = testing.TOLERANCES["bfloat16"]
  close = demo.accuracy(ref.astype(jnp.bfloat16), ref, jnp.bfloat16)
  assert close.ok and close.tolerance == (rel_tol, abs_tol)
  assert 0 < close.rel_l2 <= rel_tol and 0 < close.max_abs <= abs_tol
  assert demo.format_accuracy(close).endswith(" ok")
  far = demo.accuracy(ref + 0.1, ref, jnp.bfloat16)
  assert not far.ok and far.max_abs > abs_tol
  assert demo.format_accuracy(far).endswith(" FAIL")
  # Gradients get twice the tolerance, as in testing.check_case.
  assert demo.accuracy(ref, ref, jnp.float32, scale=2.0).tolerance == tuple(
      2 * t for t in testing.TOLERANCES["float32"])


def test_demo_shows_tolerance_verdict_and_forward_backward_times(monkeypatch, capsys):
  monkeypatch.setattr(demo, "_shapes", lambda platform: dict(
      batch=1, seq=16, heads=2, kv_heads=1, head_dim=8, hidden=16, ffn=32, experts=2,
      dtype=jnp.bfloat16))
  demo.run()
  out = capsys.readouterr().out
  assert "tokamax.testing.TOLERANCES['bfloat16']" in out
  ops = ["dot_product_attention", "layer_norm", "gated_linear_unit", "ragged_dot"]
  rel_tol, abs_tol = testing.TOLERANCES["bfloat16"]
  accuracy_rows = [r for r in out.splitlines() if "<=" in r and r.split()[0] in ops]
  assert [r.split()[0] for r in accuracy_rows] == ops
  for row in accuracy_rows:
    # Output then gradients, each beside its tolerance and verdict.
    assert row.count(f"<= {rel_tol:<5.2g} {abs_tol:<5.2g} ok") == 1, row
    assert row.count(f"<= {2 * rel_tol:<5.2g} {2 * abs_tol:<5.2g} ok") == 1, row
  assert "FAIL" not in out
  assert "fwd+bwd ms" in out
  timing = [line for line in out.splitlines()
            if line.split()[:2] == ["dot_product_attention", "xla"] and "<=" not in line]
  assert len(timing) == 1 and len(timing[0].split()) == 4, timing  # op, impl, fwd, fwd+bwd
  assert all(float(ms) > 0 for ms in timing[0].split()[2:]), timing
