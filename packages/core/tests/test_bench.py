"""The benchmark suite runner on a tiny problem (the reference shapes need a GPU)."""

import dataclasses
import re
import subprocess
import types

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src import bench_suite
from tokamax._src.ops.attention import problems as attention_problems
from tokamax._src import bench_models
from tokamax._src import benchmarking
from tokamax._src import gpu_state


def _tiny_norm():
  return bench_suite.Problem(
      "layer_norm", "tiny 64x128",
      lambda: (jax.random.normal(jax.random.key(0), (64, 128), jnp.float32),),
      lambda a, i: tokamax.rms_norm(a[0], None, implementation=i),
      {"XLA (jnp)": lambda a: a[0] * jax.lax.rsqrt(jnp.mean(a[0] ** 2, -1, keepdims=True))},
      bytes=2 * 64 * 128 * 4, backward_factor=2.0)


def test_run_problem_times_every_candidate_against_the_peer(tmp_path):
  rows = bench_suite.run_problem(_tiny_norm(), [None, "xla"], iterations=2)
  labels = {(r["direction"], r["implementation"]) for r in rows}
  for direction in ("forward", "forward+backward"):
    assert {(direction, "tokamax auto"), (direction, "tokamax xla"),
            (direction, "XLA (jnp)")} <= labels
  for r in rows:
    assert r["ms"] > 0 and r["rate"] > 0
    assert r["method"] == benchmarking.default_method()
    assert r["vs_peer"] > 0
  # `None`'s rows say what it ran (on a CPU: the XLA reference, both ways).
  ran = {r["direction"]: r["dispatch"] for r in rows if r["implementation"] == "tokamax auto"}
  assert ran == {"forward": {"forward": ["xla"]},
                 "forward+backward": {"forward": ["xla"], "backward": ["xla"]}}
  assert all("dispatch" not in r for r in rows if r["implementation"] != "tokamax auto")
  table = bench_suite.markdown_table(rows)
  assert table.count("\n") == len(rows) + 1
  pytest.importorskip("matplotlib")
  assert [p.rsplit("/", 1)[1] for p in bench_suite.plot(rows, str(tmp_path))] == ["throughput.png"]


def test_a_run_that_fails_when_its_output_is_read_is_a_failed_cell(monkeypatch):
  """Device runs are asynchronous: an out-of-memory failure surfaces when the
  output is first read (the comparison). That candidate's cell fails; the
  others are still timed."""
  base = _tiny_norm()
  call = lambda a, i: base.call(a, i).astype(jnp.float16 if i == "xla" else jnp.float32)
  problem = bench_suite.Problem(base.op, base.name, base.make_inputs, call, base.peers,
                                bytes=base.bytes, backward_factor=2.0,
                                reference=("XLA (jnp)",))
  compare = bench_models.relative_errors

  def failing_on_float16(actual, expected):
    if any(x.dtype == jnp.float16 for x in jax.tree_util.tree_leaves(actual)):
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (as a device reports it)")
    return compare(actual, expected)
  monkeypatch.setattr(bench_models, "relative_errors", failing_on_float16)
  rows = bench_suite.run_problem(problem, [None, "xla"], iterations=2,
                                 directions=("forward",))
  by_label = {r["implementation"]: r for r in rows}
  assert "RESOURCE_EXHAUSTED" in by_label["tokamax xla"]["error"]
  assert "ms" not in by_label["tokamax xla"]
  assert by_label["tokamax auto"]["ms"] > 0 and by_label["XLA (jnp)"]["ms"] > 0


def test_a_problem_whose_inputs_cannot_be_made_is_failed_cells(monkeypatch, capsys):
  """Making the inputs can fail (out of device memory on a smaller card): every
  cell of that problem fails with the reason, and the run goes on."""
  def out_of_memory():
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 14.02GiB")
  failing = dataclasses.replace(_tiny_norm(), make_inputs=out_of_memory)
  rows = bench_suite.run_problem(failing, [None, "xla"], iterations=2)
  assert {(r["direction"], r["implementation"]) for r in rows} == {
      (d, label) for d in ("forward", "forward+backward")
      for label in ("tokamax auto", "tokamax xla", "XLA (jnp)")}
  for r in rows:
    assert r["error"].startswith("RuntimeError making the inputs: RESOURCE_EXHAUSTED")
    assert "ms" not in r
  assert "failed: RuntimeError making the inputs" in bench_suite.markdown_table(rows)

  after = dataclasses.replace(_tiny_norm(), name="after 64x128")
  for p in (failing, after):
    p.reference, p.dtype = ("XLA (jnp)",), "float32"
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [failing, after])
  assert bench_suite.main(["layer_norm"], None, 1, [None], quick=True) == 0
  out = capsys.readouterr().out
  assert "| tiny 64x128 | forward | tokamax auto | failed: RuntimeError making" in out
  assert re.search(r"\| after 64x128 \| forward \| tokamax auto \| \d+\.\d+ \|", out)


def test_auto_is_compared_with_the_fastest_named_implementation(capsys):
  row = lambda shape, impl, ms: dict(op="op", shape=shape, direction="forward",
                                     implementation=impl, ms=ms)
  rows = [dict(row("a", "tokamax auto", 1.10),
               dispatch={"forward": ["k2"], "backward": ["k1"]}),
          row("a", "tokamax k1", 1.00),
          row("a", "tokamax k2", 1.20), row("a", "peer", 0.50),
          row("b", "tokamax auto", 2.00), row("b", "tokamax k1", 2.02),
          row("c", "tokamax k1", 3.0),  # no auto row: nothing to compare
          dict(op="op", shape="d", direction="forward", implementation="tokamax auto",
               error="failed")]
  found = {f["shape"]: f for f in bench_suite.auto_against_fastest(rows)}
  assert set(found) == {"a", "b"}
  assert found["a"]["fastest"] == "tokamax k1"
  assert found["a"]["ratio"] == pytest.approx(1.10)
  assert found["b"]["ratio"] == pytest.approx(2.00 / 2.02)
  bench_suite._print_auto_against_fastest(rows)
  out = capsys.readouterr().out
  assert "within 3% on 1 of 2 rows" in out and "op / a / forward" in out
  assert "(None ran forward k2, backward k1)" in out
  assert "op / b /" not in out


def test_grid_runs_the_tuning_grid(monkeypatch, capsys):
  tiny, quick = _tiny_norm(), _tiny_norm()
  quick.name = "quick 8x8"
  for p in (tiny, quick):
    p.reference, p.dtype = ("XLA (jnp)",), "float32"
  monkeypatch.setattr(bench_suite, "grid_suite", lambda: [tiny])
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [quick])
  status = bench_suite.main(["layer_norm"], None, 1, [None, "xla"], grid=True)
  out = capsys.readouterr().out
  assert status == 0 and "the tuning grid" in out
  assert "tiny 64x128" in out and "quick 8x8" not in out
  assert "implementation=None against the fastest named implementation" in out
  for other in (dict(quick=True), dict(sweep=True), dict(models=["dense"])):
    with pytest.raises(ValueError, match="grid takes neither"):
      bench_suite.main(["layer_norm"], None, 1, [None], grid=True, **other)


def test_peer_runs_only_the_named_peers(monkeypatch, capsys):
  tiny = _tiny_norm()
  tiny.reference, tiny.dtype = ("XLA (jnp)",), "float32"
  tiny.peers = dict(tiny.peers, **{"slow peer": tiny.peers["XLA (jnp)"]})
  assert bench_suite.select_peers(tiny, None) is tiny
  kept = bench_suite.select_peers(tiny, ["SLOW"])
  assert list(kept.peers) == ["slow peer"] and kept.reference == ()
  assert bench_suite.select_peers(tiny, ["none"]).peers == {}
  assert bench_suite.select_peers(tiny, ["jnp"]).reference == ("XLA (jnp)",)
  # A reference that is an implementation's row, not a peer, stays.
  tiny_xla = dataclasses.replace(tiny, reference=("XLA (jnp)", "tokamax xla"))
  assert bench_suite.select_peers(tiny_xla, ["none"]).reference == ("tokamax xla",)
  # From the command line: the rows of the peers left out are not run, and
  # without the reference peer no row has an error.
  monkeypatch.setattr(bench_suite, "grid_suite", lambda: [tiny])
  from tokamax import __main__ as cli
  assert cli.main(["bench", "--grid", "--op", "layer_norm", "--implementation", "auto",
                   "--implementation", "xla", "--peer", "slow", "--iterations", "1"]) == 0
  table = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("| layer_norm")]
  assert {line.split(" | ")[3] for line in table} == {"tokamax auto", "tokamax xla",
                                                       "slow peer"}
  assert all(line.split("|")[-2].strip() == "" for line in table), table  # rel. error


def test_grid_suite_holds_every_op_s_grid():
  names = {(p.op, p.name) for p in bench_suite.grid_suite()}
  assert ("layer_norm", "rms_norm 4096x16384") in names
  assert ("ragged_dot", "M16384 K4096 N4096 G64 random") in names
  # Attention at 8192 tokens too, the dense model's block among them.
  assert ("dot_product_attention", "B2 T4096 N32 K8 H128 causal") in names
  assert ("dot_product_attention", "B8 T1024 N16 H256") in names
  assert {op for op, _ in names} == {p.op for p in bench_suite.reference_suite()}


def test_reference_suite_covers_the_benchmark_shapes():
  names = {(p.op, p.name) for p in bench_suite.reference_suite()}
  assert ("dot_product_attention", "B4 T4096 N16 H128 causal") in names
  assert ("ragged_dot", "M65536 K7168 N2048 G256 random") in names
  assert ("gated_linear_unit", "silu x16384x4096 w4096x2x14336") in names
  assert len(bench_suite.sequence_sweep()) == 5


# --------------------------------------------------------------- formatting, shapes


@pytest.mark.parametrize("rate, text", [
    (678.26, "678"), (1234.4, "1234"), (4.2718, "4.27"), (0.012345, "0.0123"),
    (12.345, "12.3"), (0.0, "0"), (0.00046, "0.000460")])
def test_rates_have_three_significant_figures(rate, text):
  assert bench_suite.format_rate(rate) == text


def test_small_shapes_off_a_gpu():
  assert bench_suite.use_quick_shapes() == (jax.default_backend() != "gpu")
  assert bench_suite.use_quick_shapes(True) and not bench_suite.use_quick_shapes(False)
  quick = bench_suite.quick_suite()
  assert {p.op for p in quick} == {p.op for p in bench_suite.reference_suite()}
  for p in quick:  # every input under a million elements
    assert all(x.size <= 2**20 for x in jax.eval_shape(p.make_inputs))


def test_one_table_per_run_and_numerics_per_row(monkeypatch, capsys):
  tiny = _tiny_norm()
  tiny.reference = ("XLA (jnp)",)
  tiny.dtype = "float32"
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [tiny, tiny])
  rows, _ = bench_suite._run(["layer_norm"], 2, [None], False, None, True, None)
  out = capsys.readouterr().out
  assert out.count("| op | shape |") == 1 and out.count(bench_suite.HEADER[1]) == 1
  assert len(rows) == 2 * 2 * 2
  for r in rows:
    assert r["rel_err"] <= r["tol"] and r["reference"] == "XLA (jnp)"
  assert "| reference |" in out


def test_missing_matplotlib_is_said_clearly(monkeypatch, tmp_path, capsys):
  monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
  rows = [dict(op="layer_norm", shape="s", direction="forward", implementation="x",
               ms=1.0, rate=1.0, unit="TB/s")]
  assert bench_suite.plot(rows, str(tmp_path)) == []
  err = capsys.readouterr().err
  assert "NOT written" in err and "tokamax-core[plot]" in err


# ----------------------------------------------------------------------- models


TINY_DENSE = bench_models.DenseSize(dim=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                                   batch=1, seq=32)
TINY_MOE = bench_models.MoeSize(tokens=64, dim=64, ffn=128, experts=4, top_k=2)


@pytest.mark.parametrize("model, size", [("dense", TINY_DENSE), ("moe", TINY_MOE)])
def test_model_training_step_tokamax_against_plain(model, size):
  rows, text = bench_models.run_model(model, size, iterations=1)
  by_impl = {r["implementation"]: r for r in rows}
  assert set(by_impl) == {"plain JAX", "tokamax auto"}
  for r in rows:
    assert r["ms"] > 0 and r["rate"] > 0 and r["direction"] == "training step"
  ours = by_impl["tokamax auto"]
  assert ours["vs_peer"] == pytest.approx(by_impl["plain JAX"]["ms"] / ours["ms"])
  assert 0 <= ours["rel_err"] <= ours["tol"], ours["errors"]
  assert {"loss", "dx"} <= set(ours["errors"])  # gradients over the input too
  expected_ops = ({"dot_product_attention", "layer_norm", "gated_linear_unit"}
                  if model == "dense" else {"gated_linear_unit", "ragged_dot"})
  assert set(ours["dispatch"]) == expected_ops
  for directions in ours["dispatch"].values():
    assert directions["forward"] and directions["backward"]
  assert "ok" in text and "BEYOND" not in text


def test_model_steps_timed_as_a_training_loop_from_the_command_line(tmp_path):
  from tokamax import __main__ as cli
  path = tmp_path / "rows.json"
  sizes = [f"--size={kv}" for kv in ("dim=64", "heads=4", "kv_heads=2", "head_dim=16",
                                      "ffn=128", "batch=1", "seq=32")]
  assert cli.main(["bench", "--model", "dense", *sizes, "--iterations", "1",
                   "--method", "loop", "--json", str(path)]) == 0
  rows = bench_suite.load_rows(str(path))[1]
  assert {r["implementation"] for r in rows} == {"plain JAX", "tokamax auto"}
  assert all(r["method"] == "loop" and r["ms"] > 0 for r in rows), rows


@pytest.mark.skipif(jax.default_backend() == "gpu", reason=(
    "float32 steps: the plain step's cuDNN attention takes only 16-bit inputs on GPUs"))
def test_model_steps_compute_the_same_function():
  for model, size in (("dense", TINY_DENSE), ("moe", TINY_MOE)):
    params, x, dy = bench_models.inputs(model, size)
    up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    ref = bench_models.training_step(model, size, "plain")(up(params), up(x), dy)
    got = bench_models.training_step(model, size, "tokamax")(up(params), up(x), dy)
    errors = bench_models.relative_errors(got, ref)
    assert max(errors.values()) < 1e-4, errors


def test_moe_routing_matches_a_dense_computation():
  size = TINY_MOE
  params, x, _ = bench_models.moe_inputs(size)
  params, x = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
  out = bench_models.moe_ffn(params, x, size, "plain")
  top, ids = jax.lax.top_k(x @ params["w_router"], size.top_k)
  gates = jax.nn.softmax(top, axis=-1)
  h = jnp.einsum("td,edf->tef", x, params["w_gate_up"])
  h = jax.nn.silu(h[..., :size.ffn]) * h[..., size.ffn:]
  y = jnp.einsum("tef,efd->ted", h, params["w_down"])
  expected = jnp.sum(jnp.take_along_axis(y, ids[..., None], axis=1) * gates[..., None], 1)
  assert jnp.allclose(out, expected, atol=1e-4, rtol=1e-4)


def test_model_sizes_from_the_command_line():
  assert bench_models.make_size("dense", False) == bench_models.DenseSize()
  size = bench_models.make_size("dense", True, {"seq": "64", "kv-heads": "1", "tokens": "8"})
  assert size.seq == 64 and size.kv_heads == 1
  assert bench_models.make_size("moe", False, {"seq": "64"}) == bench_models.MoeSize()
  with pytest.raises(ValueError, match="no model has a size 'bogus'"):
    bench_models.make_size("moe", True, {"bogus": "1"})
  with pytest.raises(ValueError, match="top_k=9.*experts=8.*at most experts"):
    bench_models.make_size("moe", True, {"top_k": "9"})
  with pytest.raises(ValueError, match="heads=32 kv_heads=3: the query heads"):
    bench_models.make_size("dense", False, {"kv_heads": "3"})
  assert bench_models.MoeSize().flops() == 3 * (2 * 16384 * 4096 * 2 * 14336
                                              + 2 * 16384 * 14336 * 4096)


# ------------------------------------------------------------- regression guard


def _row(impl, ms, rel_err=None, op="gated_linear_unit"):
  row = dict(op=op, shape="s", direction="forward", implementation=impl, ms=ms,
             rate=1.0, unit="TFLOP/s")
  if rel_err is not None:
    row.update(rel_err=rel_err, tol=0.04)
  return row


def test_compare_flags_a_slower_row_and_changed_numerics():
  baseline = [_row("tokamax auto", 10.0, 0.005), _row("tokamax triton", 10.0, 0.005),
              _row("XLA (jnp)", 10.0, 0.0), _row("tokamax xla", 10.0, 0.005),
              _row("tokamax mosaic_gpu", 10.0, 0.005), _row("only in baseline", 1.0)]
  current = [_row("tokamax auto", 10.9, 0.005),      # within the 10% noise
             _row("tokamax triton", 11.5, 0.005),    # slower: fails
             _row("XLA (jnp)", 13.0, 0.0),           # a peer: reported only
             _row("tokamax xla", 10.0, 0.012),       # error grew 2.4x: fails
             _row("tokamax mosaic_gpu", 9.0, 0.05),  # beyond tolerance: fails
             _row("new one", 1.0)]
  report, failures = bench_suite.compare(current, baseline)
  assert len(failures) == 3
  assert any("SLOWER" in f and "tokamax triton" in f for f in failures)
  assert any("NUMERICS" in f and "tokamax xla" in f for f in failures)
  assert any("NUMERICS" in f and "tokamax mosaic_gpu" in f for f in failures)
  assert any("peer; not a failure" in line for line in report)
  assert any(line.startswith("not measured") for line in report)
  assert any(line.startswith("new") for line in report)
  # A tighter threshold catches the 9% row; a looser one lets the 15% row pass.
  assert len(bench_suite.compare(current, baseline, threshold=0.05)[1]) == 4
  assert len(bench_suite.compare(current, baseline, threshold=0.2)[1]) == 2
  # A row that failed now but ran in the baseline is a regression.
  failed = [dict(_row("tokamax auto", 0), error="boom")]
  failed[0].pop("ms")
  assert bench_suite.compare(failed, baseline[:1])[1]


def test_compare_leaves_rows_timed_another_way_out_of_the_speed_check():
  # A step's wall time per call ("loop") is longer than its kernel time
  # ("cupti") by the gaps between kernels: that is no regression; the numerics
  # of such a row are still checked.
  base = [dict(_row("tokamax auto", 10.0, 0.005), method="cupti")]
  loop = [dict(_row("tokamax auto", 12.0, 0.005), method="loop")]
  report, failures = bench_suite.compare(loop, base)
  assert not failures and "12.000 ms by loop, the baseline 10.000 ms by cupti" in report[0]
  wrong = [dict(_row("tokamax auto", 12.0, 0.5), method="loop")]
  assert any("NUMERICS" in f for f in bench_suite.compare(wrong, base)[1])
  # The same method on both sides, both device times, or rows that do not say
  # are compared.
  assert bench_suite.compare([dict(loop[0], method="cupti")], base)[1]
  assert bench_suite.compare([dict(loop[0], method="cuda_events")], base)[1]
  # Wall time waiting after each call ("wallclock") is not the loop's either.
  wallclock = [dict(_row("tokamax auto", 10.0, 0.005), method="wallclock")]
  assert not bench_suite.compare(loop, wallclock)[1]
  assert bench_suite.compare([_row("tokamax auto", 12.0, 0.005)], base)[1]


def test_json_and_compare_from_the_command_line(tmp_path, capsys):
  from tokamax import __main__ as cli
  rows = [_row("tokamax auto", 10.0, 0.005), _row("plain JAX", 12.0, op="model dense")]
  src = tmp_path / "rows.json"
  src.write_text(__import__("json").dumps(rows))
  base = tmp_path / "baseline.json"
  assert cli.main(["bench", "--from-json", str(src), "--json", str(base)]) == 0
  doc, loaded = bench_suite.load_rows(str(base))
  # Rows of unknown origin (a bare list) are not stamped with this machine.
  assert loaded == rows and "device_kind" not in doc and "jax" not in doc
  # The rows are printed as a table.
  assert "| gated_linear_unit | s | forward | tokamax auto | 10.000 |" in (
      capsys.readouterr().out)
  assert cli.main(["bench", "--from-json", str(base), "--compare", str(base)]) == 0
  slow = tmp_path / "slow.json"
  slow.write_text(__import__("json").dumps([_row("tokamax auto", 12.0, 0.005)] + rows[1:]))
  assert cli.main(["bench", "--from-json", str(slow), "--compare", str(base)]) == 1
  assert cli.main(["bench", "--from-json", str(slow), "--compare", str(base),
                   "--threshold", "0.25"]) == 0
  assert "no regression" in capsys.readouterr().out


def test_compare_fails_on_an_implementation_gone_from_a_case_that_ran(tmp_path, capsys):
  """A tokamax row of the baseline missing from a case the run measured (its
  backend no longer imports, registers or takes the call) is a regression,
  unless the run was limited to some implementations (`--implementation`,
  recorded in its --json document); a missing peer row or case is reported."""
  from tokamax import __main__ as cli
  baseline = [_row("tokamax auto", 10.0, 0.005), _row("tokamax triton", 10.0, 0.005),
              _row("XLA (jnp)", 10.0, 0.0), _row("tokamax xla", 1.0, op="layer_norm")]
  current = baseline[:1]
  report, failures = bench_suite.compare(current, baseline)
  assert len(failures) == 1 and "MISSING now" in failures[0]
  assert "tokamax triton" in failures[0]
  assert "not measured: gated_linear_unit / s / forward / XLA (jnp)" in report
  assert "not measured: layer_norm / s / forward / tokamax xla" in report
  assert bench_suite.compare(current, baseline, every_implementation=False)[1] == []
  # A row that only failed in the baseline is not missed.
  failed = dict(_row("tokamax triton", 0), error="boom")
  failed.pop("ms")
  assert bench_suite.compare(current, [baseline[0], failed])[1] == []
  # From the command line, documents of one known device kind: a run (or
  # baseline) limited to some implementations says so, and missing rows are then
  # not failures; nor where a document names no device kind (a bare list).
  json = __import__("json")
  kind = {"device_kind": "NVIDIA H200"}
  base, cur = tmp_path / "base.json", tmp_path / "cur.json"
  base.write_text(json.dumps(dict(kind, rows=baseline)))
  cur.write_text(json.dumps(dict(kind, rows=current)))
  assert cli.main(["bench", "--from-json", str(cur), "--compare", str(base)]) == 1
  assert "MISSING now" in capsys.readouterr().out
  limited = tmp_path / "limited.json"
  limited.write_text(json.dumps(dict(kind, implementations=["auto"], rows=current)))
  assert cli.main(["bench", "--from-json", str(limited), "--compare", str(base)]) == 0
  assert cli.main(["bench", "--from-json", str(cur), "--compare", str(limited)]) == 0
  other = tmp_path / "other.json"
  other.write_text(json.dumps(dict(device_kind="cpu", rows=current)))
  assert cli.main(["bench", "--from-json", str(other), "--compare", str(base)]) == 0
  bare = tmp_path / "bare.json"
  bare.write_text(json.dumps(current))
  assert cli.main(["bench", "--from-json", str(bare), "--compare", str(base)]) == 0
  written = tmp_path / "written.json"
  bench_suite.write_json(str(written), current, implementations=[None, "triton"])
  assert bench_suite.load_rows(str(written))[0]["implementations"] == ["auto", "triton"]


def test_compare_across_devices_and_runs_that_share_no_row(tmp_path, capsys):
  """A document's own environment travels through --from-json into --json; a
  baseline of another device compares numerics, not speed; a run that shares
  no row with its baseline is a failure, not "no regression"."""
  from tokamax import __main__ as cli
  json = __import__("json")
  rows = [_row("tokamax auto", 10.0, 0.005), _row("plain JAX", 12.0, op="model dense")]
  h200 = tmp_path / "h200.json"
  h200.write_text(json.dumps(dict(device_kind="NVIDIA H200", jax="0.11.2", rows=rows)))
  copy = tmp_path / "copy.json"
  assert cli.main(["bench", "--from-json", str(h200), "--json", str(copy)]) == 0
  doc, loaded = bench_suite.load_rows(str(copy))
  assert (doc["device_kind"], doc["jax"], loaded) == ("NVIDIA H200", "0.11.2", rows)
  # The same device (the --from-json document's, not this machine's): compared.
  slow = tmp_path / "slow.json"
  slow.write_text(json.dumps(dict(device_kind="NVIDIA H200", rows=[
      _row("tokamax auto", 12.0, 0.005)] + rows[1:])))
  assert cli.main(["bench", "--from-json", str(slow), "--compare", str(h200)]) == 1
  capsys.readouterr()
  other = tmp_path / "other.json"
  other.write_text(json.dumps(dict(device_kind="NVIDIA H100", rows=[
      _row("tokamax auto", 12.0, 0.005)] + rows[1:])))
  assert cli.main(["bench", "--from-json", str(other), "--compare", str(h200)]) == 0
  assert "another device, speed not compared" in capsys.readouterr().out
  # Numerics still count across devices.
  wrong = tmp_path / "wrong.json"
  wrong.write_text(json.dumps(dict(device_kind="NVIDIA H100", rows=[
      _row("tokamax auto", 10.0, 0.5)] + rows[1:])))
  assert cli.main(["bench", "--from-json", str(wrong), "--compare", str(h200)]) == 1
  disjoint = tmp_path / "disjoint.json"
  disjoint.write_text(json.dumps([dict(_row("tokamax auto", 10.0, 0.005), shape="t")]))
  capsys.readouterr()
  assert cli.main(["bench", "--from-json", str(disjoint), "--compare", str(h200)]) == 1
  assert "nothing compared: none of this run's 1 rows" in capsys.readouterr().out


def test_a_failed_model_row_fails_the_run(tmp_path):
  """tokamax's step failing, or a NaN error, fails the run; the plain program
  failing (e.g. out of memory where tokamax's step fits) does not."""
  from tokamax import __main__ as cli
  json = __import__("json")
  base = dict(op="model dense", shape="s", direction="forward+backward")
  path = tmp_path / "rows.json"
  for row, status in ((dict(implementation="tokamax auto", error="ValueError: no"), 1),
                      (dict(implementation="plain JAX", error="XlaRuntimeError: OOM"), 0),
                      (dict(implementation="tokamax auto", ms=1.0, rate=1.0, unit="TFLOP/s",
                            rel_err=float("nan"), tol=0.01), 1)):
    path.write_text(json.dumps([dict(base, **row)]))
    assert cli.main(["bench", "--from-json", str(path)]) == status, row


def test_rows_of_an_unknown_device_compare_speed_with_the_baseline(tmp_path, capsys):
  """A bare list of rows (as --out writes) names no device: its speed is
  compared with the baseline's, whatever machine runs the compare."""
  from tokamax import __main__ as cli
  json = __import__("json")
  h200 = tmp_path / "h200.json"
  h200.write_text(json.dumps(dict(device_kind="NVIDIA H200",
                                  rows=[_row("tokamax auto", 10.0, 0.005)])))
  slow = tmp_path / "slow.json"
  slow.write_text(json.dumps([_row("tokamax auto", 30.0, 0.005)]))
  assert cli.main(["bench", "--from-json", str(slow), "--compare", str(h200)]) == 1
  assert "SLOWER" in capsys.readouterr().out


@pytest.mark.parametrize("args,says", [
    (["--iterations", "0"], "--iterations must be at least 1; got 0"),
    (["--threshold", "-0.5"], "--threshold is a fraction >= 0"),
    (["--error-growth", "0.5"], "--error-growth is a factor >= 1"),
    (["--op", "layer_norm", "--implementation", "nosuch"],
     "--implementation: no installed implementation is named 'nosuch'"),
    (["--op", "layer_norm", "--peer", "nosuch"],
     "--peer: no peer's label contains ['nosuch']; the selected problems' peers are: "
     "XLA (jnp)"),
    (["--model", "dense", "--size", "dim=abc"], "--size dim=abc: dim takes a positive"),
    (["--model", "dense", "--size", "dtype=int8"], "--size dtype=int8: the models run in "
     "bfloat16, float16, float32"),
    (["--size", "dim=64"], "--size sets a model's size: it needs --model"),
    (["--model", "moe", "--shape", "G16"], "with --model alone no per-op rows run"),
    (["--sweep", "--op", "layer_norm"], "--sweep times attention against sequence"),
    (["--from-json", "MISSING"], "No such file or directory"),
    (["--from-json", "ROWS", "--quick"], "--from-json takes rows already run: not with "
     "--quick"),
    (["--compare", "NOT_ROWS"], "holds no benchmark rows"),
    (["--from-json", "ROWS", "--op", "layer_norm"],
     "--from-json takes rows already run: not with --op"),
    (["--out", "ROWS"], "not a folder"),
    (["--json", "FOLDER"], "a folder, not a file"),
])
def test_bench_usage_errors_before_anything_runs(args, says, tmp_path, capsys, monkeypatch):
  """Values that would select nothing, fail every row, or fail only after a long
  run are usage errors (exit 2) naming the flag, before any problem runs."""
  from tokamax import __main__ as cli
  monkeypatch.setattr(bench_suite, "run_problem", lambda *a, **k: pytest.fail("ran"))
  monkeypatch.setattr(bench_suite.bench_models, "run_model", lambda *a, **k: pytest.fail("ran"))
  rows = tmp_path / "rows.json"
  rows.write_text(__import__("json").dumps([_row("tokamax auto", 10.0, 0.005)]))
  (tmp_path / "not_rows.json").write_text('{"rows": 3}')
  paths = dict(MISSING=tmp_path / "missing.json", NOT_ROWS=tmp_path / "not_rows.json",
               ROWS=rows, FOLDER=tmp_path)
  args = [str(paths[a]) if a in paths else a for a in args]
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["bench"] + args)
  assert exit_info.value.code == 2
  assert says in capsys.readouterr().err


def test_visible_pairs_count_causal_windows_by_brute_force():
  import numpy as np
  for t in (1, 5, 64):
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    assert attention_problems.visible_pairs(t, False, None) == t * t
    assert attention_problems.visible_pairs(t, True, None) == int((cols <= rows).sum())
    for w in (0, 1, 3, 200):
      want = int(((cols <= rows) & (cols >= rows - w)).sum())
      assert attention_problems.visible_pairs(t, True, w) == want, (t, w)
  with pytest.raises(ValueError, match="causal"):
    attention_problems.visible_pairs(8, False, 2)


def test_shape_selects_problems_by_name(monkeypatch):
  tiny, other = _tiny_norm(), _tiny_norm()
  other.name = "other 8x8"
  for p in (tiny, other):
    p.reference, p.dtype = ("XLA (jnp)",), "float32"
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [tiny, other])
  rows, _ = bench_suite._run(["layer_norm"], 1, [None], False, None, True, None,
                             ["64x128"])
  assert rows and {r["shape"] for r in rows} == {"tiny 64x128"}
  # Several names: the problems matching any of them.
  rows, _ = bench_suite._run(["layer_norm"], 1, [None], False, None, True, None,
                             ["64x128", "other"])
  assert {r["shape"] for r in rows} == {"tiny 64x128", "other 8x8"}


def test_shape_ending_in_a_dollar_must_end_the_name():
  names = ["B8 T4096 N16 H128", "B8 T4096 N16 H128 causal", "B2 T4096 N16 H128"]
  problems = [types.SimpleNamespace(name=n) for n in names]
  chosen = lambda shapes: [p.name for p in bench_suite.select_shapes(problems, shapes)]
  assert chosen(["N16 H128"]) == names
  assert chosen(["N16 H128$"]) == [names[0], names[2]]
  assert chosen(["B8 T4096 N16 H128$", "causal"]) == names[:2]
  with pytest.raises(bench_suite.NoMatchingShape) as error:
    chosen(["T4096$"])
  assert "regular expressions" not in str(error.value)
  # A regular expression given as a substring: the error says how to write it.
  with pytest.raises(bench_suite.NoMatchingShape,
                     match=r"takes substrings, not regular expressions: give one "
                           r"--shape for each"):
    chosen(["T4096 N(16|32) H128$"])


@pytest.mark.parametrize("command", [["bench", "--quick"], ["autotune", "--out", "unused"]])
def test_unknown_op_is_a_usage_error_naming_the_ops(command, capsys, tmp_path):
  """A mistyped `--op` is a usage error naming the suites' ops, not an empty
  table (or an empty tuning run); rms_norm, a tokamax function of its own,
  gets the layer_norm op's way to its rows."""
  from tokamax import __main__ as cli
  command = [tmp_path.as_posix() if a == "unused" else a for a in command]
  for op, says in (("nosuch", "no op 'nosuch' in the benchmark suites; their ops are "
                    "dot_product_attention, gated_linear_unit, layer_norm, ragged_dot "
                    "(or 'all')"),
                   ("rms_norm", "--op layer_norm --shape rms_norm")):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(command + ["--op", "layer_norm", "--op", op])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
  assert not list(tmp_path.iterdir())  # autotune wrote nothing


def test_shape_that_matches_nothing_names_the_problems(monkeypatch, capsys):
  tiny = _tiny_norm()
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [tiny])
  with pytest.raises(bench_suite.NoMatchingShape, match="tiny 64x128"):
    bench_suite._run(["layer_norm"], 1, [None], False, None, True, None, ["G128"])
  # The command line: a usage error (exit status 2) that says so, no table.
  from tokamax import __main__ as cli
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["bench", "--quick", "--op", "layer_norm", "--shape", "G128"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "--shape: no problem's name contains any of ['G128']" in err
  assert "tiny 64x128" in err


def test_json_keeps_the_rows_of_a_run_cut_short(monkeypatch, tmp_path):
  # A device call's time limit can stop a long run (ragged_dot's xla rows take
  # seconds each): the rows measured before it must already be in the file.
  done, cut = _tiny_norm(), _tiny_norm()
  cut.name = "cut 8x8"
  for p in (done, cut):
    p.reference, p.dtype = ("XLA (jnp)",), "float32"
  monkeypatch.setattr(bench_suite, "quick_suite", lambda: [done, cut])
  real_run_problem = bench_suite.run_problem

  def stopped_at_the_second(p, *args, **kwargs):
    if p is cut:
      raise KeyboardInterrupt  # what `timeout -s INT` delivers
    return real_run_problem(p, *args, **kwargs)

  monkeypatch.setattr(bench_suite, "run_problem", stopped_at_the_second)
  path = tmp_path / "run.json"
  with pytest.raises(KeyboardInterrupt):
    bench_suite.main(["layer_norm"], None, 1, [None], quick=True, json_path=str(path))
  doc, rows = bench_suite.load_rows(str(path))
  assert rows and {r["shape"] for r in rows} == {done.name}
  assert doc["device_kind"] == jax.devices()[0].device_kind


def test_norm_rates_count_the_bytes_a_training_step_moves():
  """x 4 x 8 bf16 (64 bytes an array), one param of 16 bytes (RMSNorm's scale).
  Forward: x, y, scale = 144. Backward: x again, dy, dx, scale, dscale = 224."""
  from tokamax._src.ops.layer_norm import problems as layer_norm_problems
  assert layer_norm_problems.traffic_bytes(4, 8, num_params=1) == (144, 368)
  rms = layer_norm_problems.problem(4, 8, rms=True)
  assert (rms.bytes, rms.bytes * rms.backward_factor) == (144, 368)
  # Scale and offset: forward 128 + 32; backward 192 + 16 (scale) + 32 (their grads).
  layer = layer_norm_problems.problem(4, 8, rms=False)
  assert (layer.bytes, layer.bytes * layer.backward_factor) == (160, 400)


# ------------------------------------------------------------ the GPU's state


class _FakeNvidiaSmi:
  """`subprocess.run` for nvidia-smi: answers the queries whose fields it knows."""

  def __init__(self, known):
    self.known = known  # field -> value
    self.queries = []

  def __call__(self, command, **_):
    fields = command[1].removeprefix("--query-gpu=").split(",")
    self.queries.append(fields)
    if not set(fields) <= set(self.known):
      return subprocess.CompletedProcess(command, 2, stdout="", stderr="bad field")
    line = ", ".join(self.known[f] for f in fields)
    return subprocess.CompletedProcess(command, 0, stdout=line + "\n", stderr="")


_STATE = {"clocks.sm": "1440", "clocks.max.sm": "1980", "power.draw": "698.20",
          "power.limit": "700.00", "temperature.gpu": "61"}


def test_gpu_state_names_clock_power_and_what_limits_the_clock(monkeypatch):
  fake = _FakeNvidiaSmi({**_STATE, "clocks_throttle_reasons.active": "0x04"})
  monkeypatch.setattr(gpu_state.shutil, "which", lambda name: "/usr/bin/" + name)
  monkeypatch.setattr(gpu_state.subprocess, "run", fake)
  assert gpu_state.describe() == ("SM clock 1440 MHz of 1980 MHz, power 698.20 W of "
                                  "700.00 W, 61 C, clock limit reasons 0x04")
  # The newer field name first, refused by this (older) driver.
  assert [q[-1] for q in fake.queries] == ["clocks_event_reasons.active",
                                           "clocks_throttle_reasons.active"]


def test_gpu_state_without_the_reasons_field_or_nvidia_smi(monkeypatch):
  monkeypatch.setattr(gpu_state.shutil, "which", lambda name: "/usr/bin/" + name)
  monkeypatch.setattr(gpu_state.subprocess, "run", _FakeNvidiaSmi(_STATE))
  assert gpu_state.describe() == ("SM clock 1440 MHz of 1980 MHz, power 698.20 W of 700.00 W, "
                                  "61 C")
  monkeypatch.setattr(gpu_state.subprocess, "run", _FakeNvidiaSmi({}))
  assert gpu_state.describe() is None
  monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
  assert gpu_state.describe() is None
