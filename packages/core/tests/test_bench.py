"""The benchmark suite runner on a tiny problem (the reference shapes need a GPU)."""

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src import bench


def _tiny_norm():
  return bench.Problem(
      "layer_norm", "tiny 64x128",
      lambda: (jax.random.normal(jax.random.key(0), (64, 128), jnp.float32),),
      lambda a, i: tokamax.rms_norm(a[0], None, implementation=i),
      {"XLA (jnp)": lambda a: a[0] * jax.lax.rsqrt(jnp.mean(a[0] ** 2, -1, keepdims=True))},
      bytes=2 * 64 * 128 * 4, backward_factor=2.0)


def test_run_problem_times_every_candidate_against_the_peer(tmp_path):
  rows = bench.run_problem(_tiny_norm(), [None, "xla"], iterations=2)
  labels = {(r["direction"], r["implementation"]) for r in rows}
  for direction in ("forward", "forward+backward"):
    assert {(direction, "tokamax auto"), (direction, "tokamax xla"),
            (direction, "XLA (jnp)")} <= labels
  for r in rows:
    assert r["ms"] > 0 and r["rate"] > 0 and r["method"] == "wallclock"
    assert r["vs_peer"] > 0
  table = bench.markdown_table(rows)
  assert table.count("\n") == len(rows) + 1
  pytest.importorskip("matplotlib")
  assert [p.rsplit("/", 1)[1] for p in bench.plot(rows, str(tmp_path))] == ["throughput.png"]


def test_reference_suite_covers_the_benchmark_shapes():
  names = {(p.op, p.name) for p in bench.reference_suite()}
  assert ("dot_product_attention", "B4 T4096 N16 H128 causal") in names
  assert ("ragged_dot", "M65536 K7168 N2048 G256 random") in names
  assert ("gated_linear_unit", "silu x16384x4096 w4096x2x14336") in names
  assert len(bench.sequence_sweep()) == 5
