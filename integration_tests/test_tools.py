"""The repository's measuring tools that need no GPU: their pure parts."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pytest  # noqa: E402
import drhs_ab  # noqa: E402
import experiment_overlay  # noqa: E402
import grid_check  # noqa: E402
import guard_cost  # noqa: E402
import kernel_breakdown  # noqa: E402
import l2_model  # noqa: E402
import l2_model_attention  # noqa: E402
import none_check  # noqa: E402
import ptxas_registers  # noqa: E402
import pytest_shard  # noqa: E402
import sass_stalls  # noqa: E402
import sm90_compile  # noqa: E402
import step_anatomy  # noqa: E402
import trace_summary  # noqa: E402
import tune  # noqa: E402
from tokamax._src.tuning import context as tuning_context  # noqa: E402


def _event(pid, name, ts, dur):
  return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}


def test_trace_summary_splits_kernel_time_and_overlap():
  # One GPU, two calls (times in microseconds): per call a 1000 us Mosaic kernel,
  # a 300 us NCCL kernel of which 100 us run under it, and a 50 us XLA fusion.
  trace = {"traceEvents": [
      {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      _event(1, "PjitFunction", 0, 5000),  # host events are ignored
  ]}
  for start in (0, 2000):
    trace["traceEvents"] += [
        _event(7, "kernel_mosaic_gpu_kernel", start, 1000),
        _event(7, "ncclDevKernel_SendRecv", start + 900, 300),
        _event(7, "loop_multiply_fusion", start + 1300, 50)]
  text = trace_summary.summarize(trace, calls=2)
  assert "/device:GPU:0" in text and "CPU" not in text
  assert "comm 0.300" in text and "custom 1.000" in text and "xla 0.050" in text
  assert "comm 0.300 of which 0.100 under compute" in text
  assert "span/call 1.675 ms" in text  # (0 .. 3350 us) / 2 calls


def test_trace_summary_without_gpu_events():
  assert "no GPU kernel events" in trace_summary.summarize({"traceEvents": []}, 1)


def test_pytest_shard_runs_every_nth_collected_test(tmp_path, capfd):
  (tmp_path / "test_five.py").write_text(
      "import pytest\n\n@pytest.mark.parametrize('i', range(5))\n"
      "def test_i(i):\n  print('RAN', i)\n")
  ids = pytest_shard.collect([str(tmp_path)])
  assert len(ids) == 5 and ids[1].endswith("test_i[1]")
  assert pytest_shard.shard(ids, 1, 2) == [ids[1], ids[3]]
  assert pytest_shard.main(["1/2", str(tmp_path), "--", "-q", "-s"]) == 0
  out = capfd.readouterr().out
  assert "shard 1/2: 2 tests" in out
  assert "RAN 1" in out and "RAN 3" in out
  assert not any(f"RAN {i}" in out for i in (0, 2, 4))


def test_pytest_shard_splits_only_the_selected_tests(tmp_path, capfd):
  # Collected in the order kept0, drop0, kept1, drop1, ...: split before the
  # selection, shard 0 would take every kept test and shard 1 none.
  names = [f"{kind}{i}" for i in range(4) for kind in ("kept", "drop")]
  (tmp_path / "test_eight.py").write_text(
      f"import pytest\n\n@pytest.mark.parametrize('name', {names})\n"
      "def test_name(name):\n  print('RAN', name)\n")
  assert pytest_shard.selection(["-q", "-k", "kept", "-n", "8", "-m", "gpu"]) == [
      "-k", "kept", "-m", "gpu"]
  assert pytest_shard.selection(["-mgpu", "-k=kept", "-q"]) == ["-m", "gpu", "-k", "kept"]
  assert pytest_shard.main(["1/2", str(tmp_path), "--", "-q", "-s", "-k", "kept"]) == 0
  out = capfd.readouterr().out
  assert "shard 1/2: 2 tests" in out
  assert "RAN kept1" in out and "RAN kept3" in out
  assert "RAN kept0" not in out and "RAN drop" not in out
  # A shard past the selection's end runs nothing (pytest given no IDs would
  # run every test under its directory).
  assert pytest_shard.main(["5/6", str(tmp_path), "--", "-q", "-s", "-k", "kept"]) == 0
  out = capfd.readouterr().out
  assert "shard 5/6: 0 tests" in out and "RAN" not in out
  with pytest.raises(SystemExit, match="no test of .* is selected by -k nothing"):
    pytest_shard.collect([str(tmp_path)], ["-k", "nothing"])


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 3), (0, 0)])
def test_pytest_shard_refuses_a_shard_outside_its_count(index, count):
  with pytest.raises(ValueError, match=f"got {index}/{count}"):
    pytest_shard.shard(["a", "b"], index, count)


@dataclasses.dataclass(frozen=True)
class _Config:
  block: int = 64
  chain_items: bool = True
  order: bool | None = None  # None: the kernel's own rule


class _Op:
  def heuristic_config(self, args):
    return _Config(block=args)


class _OtherOp:
  def heuristic_config(self, args):
    del args
    return None


class _OrderedOp(_Op):
  def heuristic_config(self, args):
    return _Config(block=args, order=True)


def test_tune_ab_replaces_fields_of_the_heuristic_config():
  source = tune._Replaced({"chain_items": tune._literal("False")})
  assert not source.applied
  assert source.lookup(_Op(), 128) == _Config(block=128, chain_items=False)
  assert source.applied
  # The A side: the heuristic itself.
  assert tune._Replaced({}).lookup(_Op(), 128) == _Config(block=128)
  # An Op whose config lacks a field keeps its own choice (None: not this
  # source's), and the source says it replaced nothing.
  misspelt = tune._Replaced({"chain_item": False})
  assert misspelt.lookup(_Op(), 128) is None and not misspelt.applied
  assert source.lookup(_OtherOp(), 128) is None
  assert tune._literal("3") == 3 and tune._literal("group") == "group"
  # A value of another type than the field's ("false" is a string) is refused.
  with pytest.raises(ValueError, match="chain_items is a bool"):
    tune._Replaced({"chain_items": tune._literal("false")}).lookup(_Op(), 128)
  # None, where the field admits it (back to the kernel's rule), and only there.
  assert tune._Replaced({"order": None}).lookup(_OrderedOp(), 128) == _Config(block=128)
  with pytest.raises(ValueError, match=r"chain_items is a bool \(True\)"):
    tune._Replaced({"chain_items": tune._literal("None")}).lookup(_Op(), 128)


class _BackwardOp(tune.VjpOp):
  def heuristic_config(self, args):
    return _Config(block=args)

  def backward(self, args, residuals, out, dout, config):
    raise AssertionError("not called")


def test_tune_ab_side_replaces_one_ops_fields():
  backward_only = tune._Replaced({"chain_items": False}, side="backward")
  assert backward_only.lookup(_Op(), 128) == _Config(block=128)
  assert not backward_only.applied
  assert backward_only.lookup(_BackwardOp(), 64) == _Config(block=64, chain_items=False)
  assert backward_only.applied
  forward_only = tune._Replaced({"chain_items": False}, side="forward")
  assert forward_only.lookup(_BackwardOp(), 64) == _Config(block=64)
  assert forward_only.lookup(_Op(), 128) == _Config(block=128, chain_items=False)


def test_tune_profile_runs_calls_each_direction_untimed(capsys):
  calls = []
  builders = {"forward": lambda: (lambda x: calls.append(("f", x)) or x, (1,)),
              "forward+backward": lambda: (lambda x: calls.append(("b", x)) or x, (2,))}
  tune.profile_runs("op shape (impl)", builders, {}, 3)
  assert calls == [("f", 1)] * 3 + [("b", 2)] * 3
  assert "op shape (impl) forward: ran 3 times" in capsys.readouterr().out
  # Fields no config took: refused, as in the A/B (a misspelt field).
  with pytest.raises(SystemExit, match="no Op's config has these fields"):
    tune.profile_runs("op", {"forward": builders["forward"]}, {"chain_item": "False"}, 1)


def test_sm90_compile_sass_counts_fresh_accumulators_and_zeroings():
  # nvdisasm's text: a wgmma chain on a fresh accumulator ptxas folded (RZ),
  # one on zeros it wrote (two CS2R pairs), a CS2R that is no zeroing.
  sass = """
        /*3050*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR28], RZ, !UPT ;
        /*30f0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], R24, gsb0 ;
        /*3100*/                   CS2R R88, SRZ ;
        /*3110*/                   CS2R R90, SRZ ;
        /*3120*/                   CS2R R4, SR_CLOCKLO ;
        /*3130*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88, gsb0 ;
  """
  assert sm90_compile.sass_counts(sass) == {"wgmma": 3, "fresh": 1, "zeroings": 2}


def _sm90_args(*argv):
  parser = sm90_compile.make_parser()
  return parser, parser.parse_args([*argv, "--out", "unused"])


def test_sm90_compile_random_draws_none_checks_calls():
  parser, args = _sm90_args("--op", "dot_product_attention", "--random", "3", "--seed", "5")
  drawn = sm90_compile.chosen_problems(parser, args)
  expected = none_check.random_problems("dot_product_attention", 3, 5)
  assert [p.name for p in drawn] == [p.name for p in expected]
  assert len({p.name for p in drawn}) > 1  # three draws, not one call thrice


@pytest.mark.parametrize("argv,message", [
    (("--op", "dot_product_attention", "--random", "2", "--call", "1,1024,2,2,64"),
     "--call and --random"),
    (("--op", "dot_product_attention", "--op", "ragged_dot", "--random", "2"),
     "--random takes one --op"),
    (("--op", "dot_product_attention", "--random", "2", "--grid"),
     "no --shape or --grid beside it"),
])
def test_sm90_compile_random_refuses_other_selections(argv, message, capsys):
  parser, args = _sm90_args(*argv)
  with pytest.raises(SystemExit):
    sm90_compile.chosen_problems(parser, args)
  assert message in capsys.readouterr().err


def test_sm90_compile_a_triton_pick_is_no_failure():
  # Pallas' Triton lowering without a GPU (dispatch picked a Triton kernel).
  triton = RuntimeError("No supported GPU devices found, please specify an "
                        "abstract GPU device using AbstractDevice.")
  assert sm90_compile.failure_line(triton) == sm90_compile.TRITON_KERNEL
  assert not sm90_compile.is_bad(sm90_compile.failure_line(triton))
  other = sm90_compile.failure_line(ValueError("bad tile"))
  assert other.startswith("  failed: ValueError: bad tile")
  assert sm90_compile.is_bad(other)


def _env_builders(variable: str):
  """`tune.ab` builders whose traced function reads `variable` (a code change
  behind a switch): doubled where it is "1"."""
  def build():
    def f(x):
      return x * 2.0 if os.environ.get(variable) == "1" else x + 1.0
    return jax.jit(f), (jax.numpy.ones((8, 8)),)
  return {"forward": build}


def test_tune_ab_env_traces_the_second_side_with_the_variable(capsys):
  os.environ.pop("TOKAMAX_TEST_SWITCH", None)
  read = tune.ab("op shape (impl)", _env_builders("TOKAMAX_TEST_SWITCH"), {}, 2,
                 env={"TOKAMAX_TEST_SWITCH": "1"})
  out = capsys.readouterr().out
  assert read
  assert "heuristic vs $TOKAMAX_TEST_SWITCH=1" in out
  assert "heuristic / other" in out
  assert "TOKAMAX_TEST_SWITCH" not in os.environ  # restored after the side
  # A switch this call does not read compiles both sides alike: skipped, not
  # timed, and the run goes on to its other calls.
  unread = tune.ab("op", _env_builders("TOKAMAX_TEST_SWITCH"), {}, 2,
                   env={"TOKAMAX_TEST_OTHER": "1"})
  out = capsys.readouterr().out
  assert not unread
  assert "skipped: both sides compiled to the same program" in out
  assert "heuristic / other" not in out
  # A run where no call read it stops with an error; one where some call did, not.
  with pytest.raises(SystemExit, match="same program at every call"):
    tune.require_env_read({"TOKAMAX_TEST_OTHER": "1"}, [unread, unread])
  tune.require_env_read({"TOKAMAX_TEST_OTHER": "1"}, [unread, read])
  tune.require_env_read({}, [unread])  # no switch: a fields-only A/B


def _config_builders():
  """`tune.ab` builders whose traced function is chosen by `_Op`'s config, looked
  up in the active config source as dispatch would."""
  def build():
    config = tuning_context.active()[-1].lookup(_Op(), 64)
    scale = 2.0 if config.chain_items else 3.0
    return jax.jit(lambda x: x * scale), (jax.numpy.ones((8, 8)),)
  return {"forward": build}


def test_tune_ab_says_when_the_fields_change_nothing(capsys):
  """Fields the heuristic already has at a call give both sides one program: the
  A/B still times them (other calls of the run may differ) but says it is an
  A/A run, so that its ratio is not read as the fields' effect."""
  tune.ab("op shape (impl)", _config_builders(), {"chain_items": "True"}, 2)
  out = capsys.readouterr().out
  assert "heuristic / other" in out and "an A/A run" in out
  tune.ab("op shape (impl)", _config_builders(), {"chain_items": "False"}, 2)
  out = capsys.readouterr().out
  assert "heuristic / other" in out and "A/A" not in out


def test_tune_same_program_ignores_debug_tables_and_metadata():
  """`tune._program_text`: one program whose debug tables come in another order
  and whose instructions point at other source lines (as an executable from JAX's
  persistent compilation cache is listed) reads as the same program; another
  instruction does not."""
  class Compiled:
    def __init__(self, text):
      self.text = text

    def as_text(self):
      return self.text

  def program(tables, line, op="multiply"):
    return "\n".join([
        "HloModule jit_f, is_scheduled=true", "", "FileNames", *tables, "",
        "ENTRY %main (x: f32[8]) -> f32[8] {",
        f"  ROOT %y = f32[8]{{0}} {op}(%x, %x), metadata={{op_name=\"jit(f)/mul\" "
        f"source_file=\"t.py\" source_line={line}}}", "}"])
  fresh = Compiled(program(['1 "t.py"', '2 "u.py"'], 3))
  cached = Compiled(program(['1 "u.py"', '2 "t.py"'], 7))
  other = Compiled(program(['1 "t.py"', '2 "u.py"'], 3, op="add"))
  assert tune._program_text(fresh) == tune._program_text(cached)
  assert tune._program_text(fresh) != tune._program_text(other)


def test_tune_ab_backward_side_leaves_the_forward_untimed(capsys):
  # The forward runs no backward, so its two sides are one program: skipped,
  # rather than stopping with "no Op's config has these fields".
  calls = []
  builders = {"forward": lambda: calls.append("built") or (jax.jit(lambda x: x), (1.0,))}
  tune.ab("op shape (impl)", builders, {"chain_items": "False"}, 2, side="backward")
  assert calls == []
  out = capsys.readouterr().out
  assert "heuristic vs chain_items=False" in out and "forward           skipped" in out


def test_tune_environment_restores_a_set_variable():
  os.environ["TOKAMAX_TEST_SWITCH"] = "a"
  try:
    with tune.environment({"TOKAMAX_TEST_SWITCH": "b"}):
      assert os.environ["TOKAMAX_TEST_SWITCH"] == "b"
    assert os.environ["TOKAMAX_TEST_SWITCH"] == "a"
  finally:
    os.environ.pop("TOKAMAX_TEST_SWITCH", None)


def test_kernel_breakdown_keys_a_launch_by_its_name_not_its_position():
  """Kernels of several streams recorded in another order in one run: each launch
  still counts once (by position, a and b would each count twice)."""
  runs = [[("a", 1.0), ("b", 2.0), ("c", 3.0), ("a", 4.0)],
          [("b", 2.2), ("a", 1.2), ("c", 3.2), ("a", 4.2)],
          [("a", 1.1), ("b", 2.1), ("c", 3.1), ("a", 4.1)]]
  assert kernel_breakdown.per_launch_medians(runs) == [
      ("a", 1.1), ("b", 2.1), ("c", 3.1), ("a", 4.1)]
  with pytest.raises(ValueError, match="different kernels"):
    kernel_breakdown.per_launch_medians([[("a", 1.0)], [("a", 1.0), ("b", 1.0)]])
  # A first run that missed a kernel is outvoted by the two after it.
  assert kernel_breakdown.per_launch_medians(
      [[("a", 9.0)], [("a", 1.0), ("b", 2.0)], [("a", 3.0), ("b", 4.0)]]) == [
          ("a", 2.0), ("b", 3.0)]


def test_kernel_breakdown_sets_fields_of_tokamax_configs(monkeypatch, capsys):
  # `--set chunk_size=64`: the tokamax implementation's config takes it (traced
  # under the breakdown's config source); the peers still run.
  from tokamax._src import bench_suite
  import tokamax
  ran = []

  def traced(label, f, args, iterations):
    with tokamax.record_dispatch() as records:
      jax.eval_shape(f, *args)
    ran.append((label, [r.config for r in records if r.direction == "forward"]))
  monkeypatch.setattr(kernel_breakdown, "report", traced)
  (problem,) = [p for p in bench_suite.quick_suite()
                if p.op == "dot_product_attention" and p.name == "B1 T256 N4 H64"]
  kernel_breakdown.problem_breakdown(problem, ["xla_chunked"], "forward", True, 1,
                                     {"chunk_size": 64})
  (label, configs), *peers = ran
  assert label == "tokamax xla_chunked" and [c.chunk_size for c in configs] == [64]
  assert [label for label, _ in peers] == list(problem.peers)
  assert "chunk_size=64" in capsys.readouterr().out
  # A field no config of it has is said, and its own config ran.
  ran.clear()
  kernel_breakdown.problem_breakdown(problem, ["xla"], "forward", False, 1,
                                     {"chunk_size": 64})
  assert "no config of it has ['chunk_size']" in capsys.readouterr().out


def test_kernel_breakdown_shape_is_a_regex_and_a_miss_is_an_error(monkeypatch, capsys):
  """`--shape` selects as tools/tune.py's does (a regular expression, so two
  shapes in one call), and one that matches nothing is a usage error naming the
  suite's problems, not a run that prints nothing."""
  chosen = []
  monkeypatch.setattr(kernel_breakdown, "problem_breakdown",
                      lambda problem, *_: chosen.append(problem.name))
  argv = ["kernel_breakdown.py", "--op", "ragged_dot", "--grid", "--shape",
          "M65536 K7168 N2048 G256|K768 N2048 G128"]
  monkeypatch.setattr(sys, "argv", argv)
  kernel_breakdown.main()
  assert sorted(chosen) == ["M65536 K7168 N2048 G256 random", "M65536 K768 N2048 G128 random"]
  monkeypatch.setattr(sys, "argv", argv[:-1] + ["G999"])
  with pytest.raises(SystemExit) as exit_info:
    kernel_breakdown.main()
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert "match no problem" in error and "M65536 K7168 N2048 G256 random" in error


def test_tune_shape_miss_is_a_usage_error(monkeypatch, capsys):
  """tune.py and kernel_breakdown.py select problems alike
  (`tune.select_problems`): a `--shape` that matches nothing, or is no regular
  expression, stops with a usage error before anything runs."""
  for shape, message in (("G999", "match no problem"),
                         ("(", "is not a regular expression")):
    monkeypatch.setattr(sys, "argv", ["tune.py", "--op", "ragged_dot", "--grid",
                                      "--shape", shape, "--ab", "block_k=32"])
    with pytest.raises(SystemExit) as exit_info:
      tune.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_call_builds_problems_off_the_suites(monkeypatch, capsys):
  """`--call` takes none_check's --shape forms for the one --op; beside --shape,
  --grid or several ops, or in a bad form, it is a usage error."""
  parser = argparse.ArgumentParser()
  problems = tune.call_problems(parser, ["dot_product_attention"],
                                ["1,32768,16,16,64", "2,1500,16,16,64,causal"], False)
  assert [p.name for p in problems] == ["B1 T32768 N16 H64", "B2 T1500 N16 H64 causal"]
  titles = []
  monkeypatch.setattr(tune, "problem_builders", lambda *a: {})
  monkeypatch.setattr(tune, "ab", lambda title, *a: titles.append(title))
  monkeypatch.setattr(sys, "argv", ["tune.py", "--op", "dot_product_attention",
                                    "--implementation", "mosaic_gpu", "--call",
                                    "1,32768,16,16,64", "--ab", "block_kv=192"])
  tune.main()
  assert titles == ["dot_product_attention B1 T32768 N16 H64 (mosaic_gpu)"]
  for argv, message in (
      (["--op", "dot_product_attention", "--call", "1,2,3"], "--shape wants B,T,N,K,H"),
      (["--op", "dot_product_attention", "--call", "1,256,2,2,64", "--grid"],
       "no --shape or --grid"),
      (["--op", "ragged_dot", "--op", "layer_norm", "--call", "1,2"], "one --op")):
    monkeypatch.setattr(sys, "argv", ["tune.py", *argv, "--ab", "block_k=32"])
    with pytest.raises(SystemExit) as exit_info:
      tune.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_equal_groups_rebuilds_only_random_ragged_dot_problems():
  from tokamax._src.ops.ragged_dot import problems
  random = problems.problem(512, 64, 128, 4, True)
  equal = tune._with_equal_groups(random)
  assert equal.name == "M512 K64 N128 G4"
  assert list(equal.make_inputs()[2]) == [128] * 4
  assert list(random.make_inputs()[2]) != [128] * 4
  already_equal = problems.problem(512, 64, 128, 4, False)
  assert tune._with_equal_groups(already_equal) is already_equal


def _l2_case(schedule, jitter, l2_bytes, sms=8):
  m, k, n, g, bm, cta_n = 4096, 512, 1024, 16, 128, 256
  sizes = l2_model.group_sizes(m, g, equal=False)
  rows = l2_model.item_rows(sizes, m, n, bm, cta_n, "group", 4)
  times = l2_model.start_times(rows, sms, schedule, jitter, 0.0)
  return sizes, l2_model.l2_traffic(rows, times, m, k, bm, cta_n, l2_bytes)


def test_l2_model_counts_each_slice_once_in_an_unbounded_cache():
  sizes, t = _l2_case("static", 0.0, float("inf"))
  k, n, bm = 512, 1024, 128
  weights = np.count_nonzero(sizes) * k * n * 2
  # lhs: each group's row tiles from its start rounded down to 8 rows.
  starts = np.cumsum(sizes) - sizes
  rows = set()
  for s, size in zip(starts, sizes):
    if size:
      first = s - s % 8
      tiles = -(-(s + size - first) // bm)
      rows |= set(range(first, min(first + tiles * bm, 4096)))  # past M: zero fill
  assert t.dram == weights + len(rows) * k * 2
  assert t.requested > t.dram


def test_l2_model_row_padding():
  m, bm = 4096, 128
  equal = l2_model.item_rows(l2_model.group_sizes(m, 16, equal=True), m, 512, bm,
                             256, "group", 4)
  assert l2_model.row_padding(equal, m, bm) == (1.0, 1.0)  # 256-row groups
  # Groups of 100 and 3996 rows: one tile [0, 128), both halves with rows;
  # then 32 tiles from row 96 (100 rounded down to 8), the last [4064, 4192)
  # holding rows in its first half only.
  split = l2_model.item_rows([100, 3996], m, 512, bm, 256, "group", 4)
  assert l2_model.row_padding(split, m, bm) == (33 * bm / m, (2 + 2 * 32 - 1) * 64 / m)


def test_l2_model_attention_moves_each_operand_once_in_an_unbounded_cache():
  call = l2_model_attention.Call(1, 2048, 8, 64)
  operand = 2048 * 8 * 64 * 2  # bytes of Q, K, V, dO, dK or dV
  for fused in (True, False):
    t = l2_model_attention.simulate(call, 8, fused, float("inf"), sms=16)
    # Q, K, V, dO read once; dK, dV written once, and the float32 dQ once
    # (its first addition stores, reading nothing).
    assert (t.read, t.written) == (4 * operand, (4 if fused else 2) * operand), t


def test_l2_model_attention_smaller_groups_fit_a_smaller_cache():
  # With dQ inside, a group of 8 heads holds 8 x (Q, dO, float32 dQ) = 4 MiB at
  # T2048 H64: it misses in a 4 MiB cache, where groups of 4 move the least.
  call = l2_model_attention.Call(1, 2048, 8, 64)
  eight, four = (l2_model_attention.simulate(call, g, True, 4 * 2**20, sms=16)
                 for g in (8, 4))
  assert eight.read > 2 * eight.least_read and eight.written > eight.least_written
  assert (four.read, four.written) == (four.least_read, four.least_written)
  # The two kernels' dK/dV kernel holds Q and dO alone: group 8 fits.
  two = l2_model_attention.simulate(call, 8, False, 4 * 2**20, sms=16)
  assert two.read == two.least_read


def test_l2_model_attention_block_order():
  call = l2_model_attention.Call(1, 512, 4, 64)  # 4 key blocks a head
  fused = l2_model_attention.block_order(call, 2, fused=True)
  assert fused[:4] == [(0, 3), (1, 3), (0, 2), (1, 2)]  # the highest key block first
  assert fused[8:10] == [(2, 3), (3, 3)]  # the next group
  assert l2_model_attention.block_order(call, 2, fused=False)[:2] == [(0, 0), (1, 0)]


def test_l2_model_drift_misses_and_meeting_sharers_recovers():
  l2 = 1e6  # a few weight slices: readers share one only close in time
  lockstep = _l2_case("static", 0.0, l2)[1]
  drifting = _l2_case("static", 0.2, l2)[1]
  met = _l2_case("sharer_sync", 0.2, l2)[1]
  assert drifting.dram > 1.2 * lockstep.dram
  assert met.dram < 1.05 * lockstep.dram


def test_kernel_breakdown_without_set_leaves_the_tuned_configs(monkeypatch):
  # No --set: no config source is entered, so tuned configs run as in dispatch
  # (an empty replacement would force every heuristic config).
  from tokamax._src import bench_suite
  entered = []
  monkeypatch.setattr(kernel_breakdown.tuning_context, "use", entered.append)
  monkeypatch.setattr(kernel_breakdown, "report", lambda *a: None)
  (problem,) = [p for p in bench_suite.quick_suite()
                if p.op == "dot_product_attention" and p.name == "B1 T256 N4 H64"]
  kernel_breakdown.problem_breakdown(problem, ["xla_chunked"], "forward", True, 1, {})
  assert entered == []


def test_kernel_breakdown_lists_launches_in_order_above_a_share(monkeypatch, capsys):
  launches = [("mosaic", 5.0), ("fusion", 0.01), ("mosaic", 4.99)]
  monkeypatch.setattr(kernel_breakdown, "breakdown", lambda f, args, iterations: launches)
  kernel_breakdown.report("step", None, (), 1, min_share=0.005)
  lines = capsys.readouterr().out.splitlines()
  assert "10.000 ms in 3 kernels" in lines[0]
  # The two launches of one name stay apart, in order; the 0.1% one is left out.
  assert [line.split()[0] for line in lines[1:]] == ["5.000", "4.990"]


def test_none_check_reads_shapes():
  assert none_check.parse_shape("65536,4096,1536,128,random") == (65536, 4096, 1536, 128, True)
  assert none_check.parse_shape("16384,2048,16384,16") == (16384, 2048, 16384, 16, False)
  for bad in ("1,2,3", "1,2,3,4,skewed"):
    with pytest.raises(Exception, match="M,K,N,G"):
      none_check.parse_shape(bad)


def test_none_check_reads_attention_shapes():
  assert none_check.parse_attention_shape("4,8192,32,8,128,causal") == (
      4, 8192, 32, 8, 128, True, None)
  assert none_check.parse_attention_shape("4,3000,16,16,128") == (
      4, 3000, 16, 16, 128, False, None)
  assert none_check.parse_attention_shape("2,8192,16,16,64,causal,1024") == (
      2, 8192, 16, 16, 64, True, 1024)
  problem = none_check.problems_from(None, "dot_product_attention",
                                     ["2,8192,16,16,64,causal,1024"])[0]
  assert problem.name.endswith("H64 causal window 1024"), problem.name
  for bad in ("4,8192,32,8", "4,8192,32,8,128,window", "4,8192,32,8,128,1024",
              "4,8192,32,8,128,causal,w1024"):
    with pytest.raises(Exception, match="B,T,N,K,H"):
      none_check.parse_attention_shape(bad)


def _timed_rows(times: dict, seen: list | None = None):
  """A stand-in for `bench_suite.run_problem`: every implementation of `times`
  (row name -> ms) at its time in each direction; each call's problem name and
  implementations go to `seen`."""
  def rows(problem, implementations, iterations):
    if seen is not None:
      seen.append((problem.name, tuple(implementations)))
    return [dict(op=problem.op, shape=problem.name, direction=d, implementation=i, ms=ms)
            for d in problem.directions for i, ms in times.items()]
  return rows


def test_none_check_attention_times_none_against_mosaic_and_cudnn(monkeypatch, capsys):
  seen = []
  monkeypatch.setattr(none_check.bench_suite, "run_problem", _timed_rows(
      {"tokamax auto": 1.05, "tokamax mosaic_gpu": 1.0, "tokamax cudnn": 1.2}, seen))
  monkeypatch.setattr(sys, "argv", ["none_check", "--op", "dot_product_attention",
                                    "--shape", "2,512,4,2,64,causal"])
  assert none_check.main() == 1  # 5% over the fastest
  assert seen == [("B2 T512 N4 K2 H64 causal", (None, "mosaic_gpu", "cudnn"))]
  assert "| B2 T512 N4 K2 H64 causal | forward | auto 1.050 |" in capsys.readouterr().out
  # Its default shapes are none of the grid's.
  grid = {p.name for p in none_check.attention_problems.grid_problems()}
  defaults = [none_check.attention_problems.problem(*s).name
              for s in none_check.OFF_GRID_ATTENTION]
  assert len(defaults) == len(set(defaults)) == 16 and not grid & set(defaults)


def test_none_check_reads_glu_and_norm_shapes():
  assert none_check.parse_glu_shape("12000,4096,11008") == (12000, 4096, 11008)
  assert none_check.parse_norm_shape("8192,5120,rms") == (8192, 5120, True)
  assert none_check.parse_norm_shape("12000,4096") == (12000, 4096, False)
  for parse, bad, usage in ((none_check.parse_glu_shape, "1,2", "M,K,N"),
                            (none_check.parse_norm_shape, "1,2,layer", "ROWS,D")):
    with pytest.raises(Exception, match=usage):
      parse(bad)


@pytest.mark.parametrize("op,grid,off_grid,named", [
    ("gated_linear_unit", "glu_problems", "OFF_GRID_GLU",
     ("mosaic_gpu", "triton", "composed", "xla")),
    ("layer_norm", "norm_problems", "OFF_GRID_NORM", ("mosaic_gpu", "triton", "xla")),
])
def test_none_check_glu_and_norms_default_off_the_grid(monkeypatch, op, grid, off_grid,
                                                       named):
  # None against every named implementation, XLA's included, at shapes no grid
  # point has; a None 4% over the XLA one fails.
  seen = []
  monkeypatch.setattr(none_check.bench_suite, "run_problem", _timed_rows(
      {"tokamax auto": 1.04, "tokamax mosaic_gpu": 1.1, "tokamax triton": 1.2,
       "tokamax xla": 1.0}, seen))
  monkeypatch.setattr(sys, "argv", ["none_check", "--op", op, "--iterations", "1"])
  assert none_check.main() == 1
  module = getattr(none_check, grid)
  defaults = [module.problem(*s).name for s in getattr(none_check, off_grid)]
  assert [name for name, _ in seen] == defaults
  assert {impls for _, impls in seen} == {(None, *named)}
  assert not {p.name for p in module.grid_problems()} & set(defaults)


@pytest.mark.parametrize("auto_ms,status", [(1.02, 0), (1.05, 1)])
def test_none_check_fails_past_the_margin(monkeypatch, capsys, auto_ms, status):
  monkeypatch.setattr(none_check.bench_suite, "run_problem", _timed_rows(
      {"tokamax auto": auto_ms, "tokamax mosaic_gpu": 1.0, "tokamax triton": 1.1}))
  monkeypatch.setattr(sys, "argv", ["none_check", "--shape", "512,256,512,4,random"])
  assert none_check.main() == status
  printed = capsys.readouterr().out
  assert f"| forward | auto {auto_ms:.3f} | mosaic_gpu 1.000 | triton 1.100 |" in printed


def _ncu_sass_csv(tmp_path, header, body) -> str:
  """An `ncu --page source --csv --print-source sass` export of `body`'s rows
  under `header` (the kernel's name line first), as a file path."""
  path = tmp_path / "prof.csv"
  with open(path, "w") as f:
    f.write('"Kernel Name","kernel_mosaic_gpu_kernel",\n')
    f.write(",".join(f'"{h}"' for h in header) + "\n")
    for row in body:
      f.write(",".join(f'"{v}"' for v in row) + "\n")
  return str(path)


def test_sass_stalls_splits_samples_by_instruction_count_and_range(tmp_path):
  # An `ncu --page source --csv --print-source sass` export, cut to the columns
  # the tool reads (the real one has about 70): a loop body executed 400 times,
  # an epilogue 10 times, setup once.
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
            "stall_barrier", "stall_long_sb", "stall_long_sb (Not Issued)"]
  body = [("0x0", "  MOV R1, c[0x0][0x28]", 2, 1, 1, 0, 0, 0),
          ("0x10", "  HGMMA.64x256x16.F32.BF16 R24", 30, 20, 400, 0, 5, 5),
          ("0x20", "  @!P0 BRA 0x10", 50, 50, 400, 0, 48, 48),
          ("0x30", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", 12, 12, 10, 12, 0, 0),
          ("0x40", "  STSM.16.M88.4 [R5], R20", 6, 6, 10, 0, 1, 1)]
  rows = sass_stalls.load(_ncu_sass_csv(tmp_path, header, body))
  assert len(rows) == 5 and rows[2]["samples"] == 50 and rows[2]["executed"] == 400
  assert rows[2]["stalls"] == {"barrier": 0, "long_sb": 48}
  assert [i for i, _ in sass_stalls.top_instructions(rows, 2)] == [2, 1]
  assert sass_stalls.by_execution_count(rows) == [(400, 2, 80), (10, 2, 18), (1, 1, 2)]
  assert sass_stalls.by_region(rows, 2) == [(0, 1, 32), (2, 3, 62), (4, 4, 6)]
  assert sass_stalls.by_block(rows) == [(0, 0, 1, 2), (1, 2, 400, 80), (3, 4, 10, 18)]
  assert sass_stalls.executions(rows, "HGMMA") == (1, 400)
  assert sass_stalls.executions(rows, "BRA") == (1, 400)  # after its predicate
  assert sass_stalls.executions(rows, "FENCE") == (0, 0)
  text = sass_stalls.summarize(rows, top=3, region=2, count=("HGMMA",))
  assert "5 instructions, 100 stall samples" in text
  assert "x400" in text and "80  80.0%" in text
  assert "    1-2     x400            80  80.0%" in text  # the loop's block
  assert "HGMMA: 1 instructions, executed 400 times" in text
  assert "shared-memory wavefronts" not in text  # no Source Counters columns
  with open(tmp_path / "other.csv", "w") as f:
    f.write('"Address","Source"\n"0x0","MOV"\n')
  with pytest.raises(ValueError, match="no 'Warp Stall Sampling"):
    sass_stalls.load(str(tmp_path / "other.csv"))


def test_sass_stalls_shared_memory_wavefronts_by_opcode_and_count(tmp_path):
  # Source Counters' columns: a loop's wgmmas (ideal), a whole tile's stmatrix
  # (ideal) and a partial tile's copy of it conflicting 8 ways; a global load
  # has no shared wavefronts.
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Instructions Executed", "L1 Wavefronts Shared",
            "L1 Wavefronts Shared Ideal"]
  body = [("0x0", "  HGMMA.64x256x16.F32.BF16 R24", 5, 400, 8000, 8000),
          ("0x10", "  STSM.16.M88.4 [R4+0x400], R24", 1, 30, 120, 120),
          ("0x20", "  STSM.16.M88.4 [R4+0x440], R28", 1, 30, 120, 120),
          ("0x30", "  STSM.16.M88.4 [R4+0x400], R24", 1, 10, 320, 40),
          ("0x40", "  @P0 LDG.E R2, [R4]", 1, 10, 0, 0)]
  rows = sass_stalls.load(_ncu_sass_csv(tmp_path, header, body))
  assert rows[3]["shared"] == 320 and rows[3]["shared_ideal"] == 40
  # Most excess first; the two whole-tile stmatrix rows are one group.
  assert sass_stalls.shared_wavefronts(rows) == [
      ("STSM.16.M88.4", 10, 1, 320, 40), ("HGMMA.64x256x16.F32.BF16", 400, 1, 8000, 8000),
      ("STSM.16.M88.4", 30, 2, 240, 240)]
  text = sass_stalls.summarize(rows)
  assert "shared-memory wavefronts: 8560, of which 280 over ncu's ideal" in text
  assert "ideal 40 (8.0x)" in text


_PTX = """.visible .entry kernel_mosaic_gpu_kernel(
.maxntid 384, 1, 1
.minnctapersm 1
{
\tsetmaxnreg.dec.sync.aligned.u32 40;
\tsetmaxnreg.inc.sync.aligned.u32 232;
\tsetmaxnreg.inc.sync.aligned.u32 232;
}
"""


def test_ptxas_registers_rewrites_the_split_and_reads_the_report():
  assert ptxas_registers.counts(_PTX) == ptxas_registers.Split(232, 40, 384)
  split = ptxas_registers.Split(consumer=160, producer=24, threads=512)
  rewritten = ptxas_registers.variant(_PTX, split)
  assert ptxas_registers.counts(rewritten) == split
  assert rewritten.count("setmaxnreg.inc.sync.aligned.u32 160;") == 2
  # None keeps what the PTX has.
  assert ptxas_registers.counts(ptxas_registers.variant(
      _PTX, ptxas_registers.Split(consumer=240))) == ptxas_registers.Split(240, 40, 384)
  with pytest.raises(ValueError, match="no setmaxnreg.dec"):
    ptxas_registers.variant(".maxntid 384, 1, 1\n", ptxas_registers.Split(producer=24))
  with pytest.raises(ValueError, match=r"several setmaxnreg.inc counts: \[152, 232\]"):
    ptxas_registers.counts(_PTX + "setmaxnreg.inc.sync.aligned.u32 152;")
  # Three compute warpgroups at 160 and a memory one at 24 fit 64K registers;
  # at 40 they would not; two at 232 and one at 40 fit.
  assert not ptxas_registers.over_register_file(split)
  assert ptxas_registers.over_register_file(ptxas_registers.Split(160, 40, 512))
  assert not ptxas_registers.over_register_file(ptxas_registers.Split(232, 40, 384))

  # ptxas -v's words, as session 45 read them.
  spilled = ptxas_registers.parse(
      "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
      "instructions are serialized due to insufficient register resources\n"
      "    272 bytes stack frame, 800 bytes spill stores, 800 bytes spill loads\n"
      "ptxas info    : Used 128 registers, used 16 barriers\n")
  assert spilled == ptxas_registers.Report(128, 800, 800, "C7512", None)
  fatal = ptxas_registers.parse(
      "ptxas fatal   : (C7602) Insufficient registers (128) to compile instruction "
      "at line 643\nptxas fatal   : Ptx assembly aborted due to errors\n")
  assert fatal.fatal.endswith("Insufficient registers (128) to compile instruction at "
                              "line 643") and fatal.registers is None
  text = ptxas_registers.describe(ptxas_registers.Split(160, 40, 512), spilled)
  assert "over the register file" in text and "spills 800 B stored" in text
  assert "wgmmas serialized (C7512)" in text and "C7504" not in text
  # JAX 0.12's relocatable compile (session 67's dump): the split is not applied.
  ignored = ptxas_registers.parse(
      "ptxas info    : (C7504) Potential Performance Loss: 'setmaxnreg' ignored to "
      "maintain compatibility across compilation units.\n"
      "ptxas info    : Used 168 registers, used 16 barriers\n")
  assert ignored.setmaxnreg_ignored and not spilled.setmaxnreg_ignored
  assert "setmaxnreg ignored (C7504)" in ptxas_registers.describe(
      ptxas_registers.Split(232, 40, 384), ignored)


def test_sm90_compile_summarizes_each_kernel():
  """One line per kernel from its dumped PTX and ptxas report: the split, the
  spills; kernels without warp roles (no setmaxnreg) too."""
  ptx = (".maxntid 384, 1, 1\nsetmaxnreg.dec.sync.aligned.u32 40;\n"
         "setmaxnreg.inc.sync.aligned.u32 232;\n")
  report = ("ptxas warning : Registers are spilled to local memory in function 'k', "
            "44 bytes spill stores, 128 bytes spill loads\n"
            "    16 bytes stack frame, 44 bytes spill stores, 128 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 16 barriers\n")
  assert sm90_compile.kernel_summary(ptx, report) == (
      "threads  384  compute 232  memory  40: spills 44 B stored / 128 B loaded, "
      "168 registers at start")
  plain = sm90_compile.kernel_summary(
      ".maxntid 128, 1, 1\n", "ptxas info    : Used 40 registers, used 1 barriers\n")
  assert plain == ("threads 128  (no setmaxnreg): spills 0 B stored / 0 B loaded, "
                   "40 registers at start")
  assert sm90_compile.folder_name("ragged_dot M16384 G16 fp8 1x128/128x128") == (
      "ragged_dot_M16384_G16_fp8_1x128_128x128")
  names = ["kernel_10.ptxas", "kernel_2.ptxas", "body_1.ptxas", "kernel_0.ptxas"]
  ordered = sorted((pathlib.Path(n) for n in names), key=sm90_compile.kernel_order)
  assert [p.stem for p in ordered] == ["body_1", "kernel_0", "kernel_2", "kernel_10"]


def test_sm90_compile_flags_serialized_wgmmas_and_failed_compiles():
  """`--fail-on-serialized` reads the summary lines `compile_problem` prints."""
  split = ptxas_registers.Split(240, 24, 384)
  serialized = ptxas_registers.parse(
      "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
      "instructions are serialized due to insufficient register resources\n"
      "ptxas info    : Used 168 registers, used 16 barriers\n")
  clean = ptxas_registers.parse("ptxas info    : Used 168 registers, used 16 barriers\n")
  assert sm90_compile.is_bad("  body_1: " + ptxas_registers.describe(split, serialized))
  assert not sm90_compile.is_bad("  body_0: " + ptxas_registers.describe(split, clean))
  assert sm90_compile.is_bad("  failed: ValueError: no kernel")
  assert not sm90_compile.is_bad(sm90_compile.NO_KERNEL)
  # Another cause of serialization, under its own code.
  other = ptxas_registers.parse(
      "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async "
      "instructions are serialized due to the presence of Extern calls\n")
  assert other.serialized == "C7515"
  assert sm90_compile.is_bad("  body_2: " + ptxas_registers.describe(split, other))


def test_experiment_overlay_parts_keeps_package_sources_and_tests():
  parts = experiment_overlay.overlay_parts([
      "packages/gpu-mosaic/src/tokamax_gpu_mosaic/attention_kernel_bwd.py",
      "packages/gpu-mosaic/src/tokamax_gpu_mosaic/_common.py",
      "packages/gpu-mosaic/tests/test_attention.py",
      "packages/gpu-mosaic/CHANGELOG.md", "notes/MEASUREMENTS.md"])
  assert parts == ({"packages/gpu-mosaic/src/tokamax_gpu_mosaic"},
                   {"packages/gpu-mosaic/tests/test_attention.py"})


def test_experiment_overlay_restores_what_a_commit_took_out(tmp_path):
  # A repository where an experiment went in and was taken out again: the
  # overlay holds the experiment's package (all of it) and its test, and the
  # repository's files are as they were.
  repo = tmp_path / "repo"
  src = repo / "packages" / "p" / "src" / "pkg"
  src.mkdir(parents=True)
  (repo / "packages" / "p" / "tests").mkdir()
  git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True,
                                  capture_output=True)
  git("init", "-q")
  git("config", "user.email", "t@example.com")
  git("config", "user.name", "t")
  (src / "kernel.py").write_text("MAIN = True\n")
  (src / "other.py").write_text("OTHER = 1\n")
  (repo / "packages" / "p" / "tests" / "test_k.py").write_text("# main\n")
  git("add", "-A")
  git("commit", "-qm", "main")
  (src / "kernel.py").write_text("MAIN = False\n")
  (repo / "packages" / "p" / "tests" / "test_k.py").write_text("# experiment\n")
  git("commit", "-qam", "experiment")
  git("revert", "--no-edit", "HEAD")
  out = experiment_overlay.build("exp", "HEAD", tmp_path / "out", root=repo)
  assert (out / "pkg" / "kernel.py").read_text() == "MAIN = False\n"
  assert (out / "pkg" / "other.py").read_text() == "OTHER = 1\n"
  assert (out / "tests" / "test_k.py").read_text() == "# experiment\n"
  assert (src / "kernel.py").read_text() == "MAIN = True\n"
  listed = subprocess.run(["git", "-C", str(repo), "worktree", "list"], check=True,
                          capture_output=True, text=True).stdout
  assert len(listed.splitlines()) == 1


def test_guard_cost_variants_patch_what_they_say():
  from tokamax._src.ops.attention import large_logits  # pylint: disable=g-import-not-at-top
  unrolled = large_logits.UNROLLED_CHUNKS
  with guard_cost._variant("bypassed"):
    assert large_logits.guard(None, None, lambda: "backward alone") == "backward alone"
  with guard_cost._variant("rolled"):
    assert large_logits.UNROLLED_CHUNKS == 0
  assert large_logits.UNROLLED_CHUNKS == unrolled
  assert large_logits.guard is not guard_cost._bypass


def test_guard_cost_refuses_variants_whose_gradients_differ():
  def contender(scale):
    return argparse.Namespace(output={"query": np.ones(8) * scale})
  guard_cost._check_same({"bypassed": contender(1.0), "guarded": contender(1.0 + 1e-5)})
  with pytest.raises(SystemExit, match="guarded differs from bypassed"):
    guard_cost._check_same({"bypassed": contender(1.0), "guarded": contender(1.1)})


def test_step_anatomy_takes_each_kernels_median_over_alternating_rounds(monkeypatch):
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  order = []
  # Each program's kernel slows by 1 ms per call made before it (a warming chip):
  # the per-kernel median over alternating rounds, not the last round, is kept.
  def measure(compiled, aggregate):
    assert not aggregate
    def run(*args):
      del args
      order.append(compiled)
      slow = len(order) - 1
      return None, [(f"{compiled}_gemm", 2.0 + slow), ("shared", 1.0), ("shared", 0.5)]
    return run
  monkeypatch.setattr(profiler, "measure", measure)
  contenders = {name: argparse.Namespace(run=argparse.Namespace(compiled=name), flat_args=())
                for name in ("plain", "tokamax")}
  times = step_anatomy._kernel_times(contenders, rounds=3)
  assert order == ["plain", "tokamax", "tokamax", "plain", "plain", "tokamax"]
  assert times["plain"] == {"plain_gemm": (1, 5.0), "shared": (2, 1.5)}  # 2, 5, 6 -> 5
  assert times["tokamax"] == {"tokamax_gemm": (1, 4.0), "shared": (2, 1.5)}  # 3, 4, 7


def test_step_anatomy_host_share_times_every_program_and_variant():
  calls = {"a": 0, "b": 0}

  def program(name):
    def call(x):
      calls[name] += 1
      return x + 1
    return argparse.Namespace(run=argparse.Namespace(compiled=call), flat_args=(np.ones(4),))
  shares = step_anatomy._host_share({"a": program("a"), "b": program("b")}, rounds=2)
  # Each round runs one loop per program and variant, each after one untimed call.
  per_program = 2 * 2 * (1 + step_anatomy.benchmarking.LOOP_CALLS)
  assert calls == {"a": per_program, "b": per_program}
  for median, longest, loops in shares.values():
    assert 0 <= median <= longest
    assert set(loops) == set(step_anatomy._VARIANTS) and all(ms > 0 for ms in loops.values())
  assert step_anatomy.benchmarking.round_order("abc", 4) == list("bca")


_TOOLS = pathlib.Path(__file__).parent.parent / "tools"


@pytest.mark.parametrize("argv,says", [
    (["kernel_breakdown.py"], "nothing selected: give --model, or --op"),
    (["kernel_breakdown.py", "--launches", "--op", "layer_norm"],
     "--launches lists a model step's launches: it needs --model"),
    (["kernel_breakdown.py", "--model", "dense", "--size", "dim"],
     "--size takes KEY=VALUE; got ['dim']"),
    (["step_anatomy.py", "--size", "dim=x"], "--size dim=x: dim takes a positive integer"),
    (["tune.py", "--op", "layer_norm", "--call", "1024,abc"], "--call for layer_norm"),
    (["tune.py", "--op", "layer_norm", "--implementation", "nosuch"],
     "--implementation: no installed implementation is named 'nosuch'"),
    (["shape_sweep.py", "--op", "norms", "--implementation", "nosuch"],
     "--implementation: no installed implementation is named 'nosuch'"),
    (["none_check.py", "--op", "layer_norm", "--iterations", "0"],
     "--iterations: must be at least 1; got 0"),
    (["grid_check.py", "--device", "nosuch"],
     "--device nosuch: no shipped tuned data; the tuned folders are"),
])
def test_tools_refuse_what_would_select_nothing_or_crash(argv, says):
  """Each was an empty run with exit 0, a traceback, or an error naming the
  wrong flag; now a usage error (exit 2) naming the flag, before anything runs."""
  done = subprocess.run([sys.executable, str(_TOOLS / argv[0]), *argv[1:]],
                        cwd=_TOOLS, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  assert says in done.stderr


def test_drhs_ab_loads_the_other_version_beside_the_installed(tmp_path):
  other = tmp_path / "drhs_other.py"
  other.write_text(pathlib.Path(drhs_ab.current.__file__).read_text()
                   + "\nOTHER_VERSION = True\n")
  module = drhs_ab.load_other(str(other))
  assert module.OTHER_VERSION and not hasattr(drhs_ab.current, "OTHER_VERSION")
  assert module.grouped_transposed_matmul is not drhs_ab.current.grouped_transposed_matmul


@pytest.mark.parametrize("random", [False, True])
def test_drhs_ab_group_sizes_cover_the_rows(random):
  sizes = drhs_ab.group_sizes(65536, 256, random)
  assert len(sizes) == 256 and sizes.sum() == 65536 and (sizes >= 0).all()
  assert (len(set(sizes.tolist())) > 1) == random



@pytest.mark.parametrize("op", sorted(none_check.OPS))
def test_none_check_random_shapes_are_seeded_and_run(monkeypatch, op):
  # --random COUNT --seed S: the same shapes for a seed, others for another seed,
  # each a problem of the op; None timed against the op's named implementations.
  first = [p.name for p in none_check.random_problems(op, 6, 72)]
  assert first == [p.name for p in none_check.random_problems(op, 6, 72)]
  assert first != [p.name for p in none_check.random_problems(op, 6, 73)]
  assert {p.op for p in none_check.random_problems(op, 6, 72)} == {op}
  seen = []
  monkeypatch.setattr(none_check.bench_suite, "run_problem", _timed_rows(
      {"tokamax auto": 1.0, "tokamax mosaic_gpu": 1.0}, seen))
  monkeypatch.setattr(sys, "argv", ["none_check", "--op", op, "--random", "3",
                                    "--seed", "72", "--iterations", "1"])
  assert none_check.main() == 0
  assert [name for name, _ in seen] == first[:3]


def test_none_check_random_and_shape_exclude_each_other(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["none_check", "--random", "2", "--shape",
                                    "4096,2048,1024,8"])
  with pytest.raises(SystemExit):
    none_check.main()


def test_grid_check_other_kinds_predicts_each_call_from_the_other_head_sharing():
  """Two MHA and one GQA window call: each is predicted from the calls of the
  other head sharing alone, never from its own kind; the registry's order
  (cuDNN first) is scored beside."""
  def key(b, heads):
    q = f"bfloat16[{b},8192,16,128]"
    kv = f"bfloat16[{b},8192,{heads},128]"
    return (f"query={q} key={kv} value={kv} scale=0.088 is_causal=True "
            "local_window=(1024, 0)")
  def times(mosaic, cudnn):
    t = {"mosaic_gpu": mosaic, "cudnn": cudnn}
    return {"forward": t, "backward": dict(t), "step": {i: 2 * v for i, v in t.items()}}
  op = "dot_product_attention"
  mha2, mha4, gqa2 = key(2, 16), key(4, 16), key(2, 8)
  by = {(op, mha2): times(1.0, 1.2), (op, mha4): times(2.0, 1.8),
        (op, gqa2): times(0.9, 1.0)}
  rows = {(r[1], r[2]): r for r in grid_check.other_kind_only(by)}
  assert len(rows) == 9  # three calls, three directions
  # MHA B2 from GQA B2 alone (its own MHA B4 is not consulted): Mosaic GPU.
  _, _, _, chosen, regret, source, registry = rows[(mha2, "forward")]
  assert (chosen, regret, source) == ("mosaic_gpu", 0.0, gqa2)
  assert registry == pytest.approx(0.2)  # cuDNN first: 1.2 / 1.0
  # MHA B4 from GQA B2 too: Mosaic GPU, 2.0 / 1.8 - 1 behind.
  assert rows[(mha4, "forward")][3:5] == ("mosaic_gpu", pytest.approx(1 / 9))
  # GQA B2 from the MHA calls, equally near in the largest distance: MHA B2,
  # nearer in total.
  assert rows[(gqa2, "step")][5] == mha2


def test_grid_check_pick_answers_from_the_nearest_call_of_its_kind():
  """`--pick`: a norm call between grid calls takes the nearest one's fastest,
  per direction; a width with a tail past whole 1024-column pieces has no call
  of its kind here and takes the registry's first (`nearest.TILE_ALIGNED`)."""
  def key(rows, d):
    return (f"x=bfloat16[{rows},{d}] scale=bfloat16[{d}] epsilon=1e-06 "
            "subtract_mean=False")
  op = "layer_norm"
  by = {(op, key(4096, 4096)): {"forward": {"mosaic_gpu": 1.0, "triton": 0.9},
                                "backward": {"mosaic_gpu": 1.0, "triton": 1.1},
                                "step": {"mosaic_gpu": 2.0, "triton": 2.0}}}
  rows = {r[0]: r[1:] for r in grid_check.pick(by, op, key(8192, 4096))}
  assert rows["forward"] == ("triton", key(4096, 4096))
  assert rows["backward"] == ("mosaic_gpu", key(4096, 4096))
  registry_first = next(s.name for s in grid_check.tokamax.implementations()
                        if s.op == op)
  for direction, chosen, source in grid_check.pick(by, op, key(8192, 4608)):
    assert chosen == registry_first, direction
    assert source.startswith("registry order"), direction


@pytest.mark.parametrize("op,key,says", [
    ("nosuch", "x=bfloat16[8,4]",
     "--pick nosuch: no tuned data of that op for nvidia_h100_80gb_hbm3; it has"),
    # A key no call of the op has would fall to the registry's order unnoticed.
    ("layer_norm", "query=bfloat16[8,4]",
     "--pick layer_norm 'query=bfloat16[8,4]': not an args key of layer_norm"),
])
def test_grid_check_pick_refuses_what_it_cannot_answer(op, key, says):
  done = subprocess.run(
      [sys.executable, str(_TOOLS / "grid_check.py"), "--device",
       "nvidia_h100_80gb_hbm3", "--pick", op, key],
      cwd=_TOOLS, capture_output=True, text=True, timeout=300)
  assert done.returncode == 2, done.stderr[-2000:]
  assert says in done.stderr
