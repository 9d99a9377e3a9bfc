"""examples/llama_nnx.py: the Llama-style decoder trained with tokamax's Flax
modules gives the plain Flax model's losses, step by step, from the same
parameters (dense and MoE FFNs, float32 and bfloat16 computation)."""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import pytest

import tokamax
from tokamax import testing
from tokamax.__main__ import main as tokamax_main
from tokamax._src import bench_models

pytest.importorskip("flax")
pytest.importorskip("optax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "llama_nnx.py"


def _load_example():
  spec = importlib.util.spec_from_file_location("llama_nnx_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while building
  spec.loader.exec_module(module)
  return module


llama_nnx = _load_example()


@pytest.mark.parametrize("num_experts, dtype", [(0, "float32"), (0, "bfloat16"),
                                                (4, "float32"), (4, "bfloat16")])
def test_tokamax_model_trains_as_the_plain_flax_model(num_experts, dtype):
  # Capacity 1.0 drops some assignments: both programs must drop the same ones.
  config = llama_nnx.Config(num_experts=num_experts, capacity_factor=1.0, dtype=dtype,
                            dim=32, ffn_dim=64, head_dim=8)
  # One batch four times: its loss must fall, so the steps are not no-ops.
  tokens = llama_nnx.batches(config, steps=1, batch=4, length=16).repeat(4, axis=0)
  plain, ours = llama_nnx.build_pair(config)
  want = llama_nnx.train(plain, tokens)
  with tokamax.record_dispatch() as records:
    got = llama_nnx.train(ours, tokens)
  # MoE experts: a grouped GLU, then the down projection's ragged_dot.
  ffn_ops = {"gated_linear_unit", "ragged_dot"} if num_experts else {"gated_linear_unit"}
  assert {r.op for r in records} == {"dot_product_attention", "layer_norm", *ffn_ops}
  assert want[-1] < want[0] - 0.1, want
  # The loss is a mean of positive terms: its relative error is meaningful. On a
  # GPU both programs run float32 matmuls in TF32 (the default precision there).
  rel_tol = testing.tolerance(dtype, gpu=jax.default_backend() == "gpu")[0]
  for step, (g, w) in enumerate(zip(got, want)):
    assert abs(g - w) <= rel_tol * abs(w), (
        f"step {step}: tokamax loss {g:.6g}, plain Flax {w:.6g} "
        f"(relative {abs(g - w) / abs(w):.3g} > {rel_tol:g}, {dtype}); all: {got} vs {want}")


# ------------------------------------------- python -m tokamax bench --model flax-dense

TINY = ["--size", "dim=32", "--size", "heads=4", "--size", "kv_heads=2", "--size",
        "head_dim=8", "--size", "ffn=64", "--size", "batch=1", "--size", "seq=16"]


def test_bench_times_the_example_layer_against_plain_flax():
  size = bench_models.make_size("flax-dense", True, dict(a.split("=") for a in TINY[1::2]))
  rows, text = bench_models.run_model("flax-dense", size, iterations=1)
  by_impl = {r["implementation"]: r for r in rows}
  assert set(by_impl) == {"plain Flax", "tokamax auto"}
  ours = by_impl["tokamax auto"]
  assert ours["vs_peer"] == pytest.approx(by_impl["plain Flax"]["ms"] / ours["ms"])
  assert 0 <= ours["rel_err"] <= ours["tol"], ours["errors"]
  assert {"loss", "dx", "d['ffn']['gate_up']"} <= set(ours["errors"])
  assert set(ours["dispatch"]) == {"dot_product_attention", "layer_norm",
                                   "gated_linear_unit"}
  assert "flax-dense" in text and "ok" in text


def test_bench_command_line_runs_flax_dense(capsys):
  assert tokamax_main(["bench", "--model", "flax-dense", "--iterations", "1", *TINY]) == 0
  out = capsys.readouterr().out
  assert "| model flax-dense |" in out and "| plain Flax |" in out


def test_bench_flax_dense_without_the_example_says_where_to_run(monkeypatch):
  monkeypatch.setattr(bench_models, "FLAX_EXAMPLE", pathlib.Path("examples/absent.py"))
  bench_models.flax_example.cache_clear()
  try:
    with pytest.raises(FileNotFoundError, match="run from the repository's root"):
      bench_models.flax_example()
  finally:
    bench_models.flax_example.cache_clear()


def test_core_does_not_import_flax():
  code = ("import sys, tokamax, tokamax.__main__; from tokamax._src import bench_suite, "
          "bench_models; assert 'flax' not in sys.modules, 'flax imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
