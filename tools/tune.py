"""Times every config in an implementation's search space at the reference shapes.

    python tools/tune.py --op layer_norm [--implementation triton] [--shape rms]
        [--grid] [--match num_warps=8 --match prefetch_qk=True]
    python tools/tune.py --op ragged_dot --implementation mosaic_gpu \
        --ab chain_items=False [--iterations 20]
    python tools/tune.py --model moe --ab chain_items=False

``--call SIZES`` (repeatable, one ``--op``) takes calls off the suites instead,
in tools/none_check.py's ``--shape`` forms (``--call 1,32768,16,16,64`` for
attention B1 T32768 N16 H64).

``--match FIELD=VALUE`` keeps only configs whose field prints as VALUE (repeatable;
the heuristic config is always timed, for reference).

``--profile-runs N`` times nothing: it runs each selected problem's call N
times (at the heuristic configs, not tuned data's, or with ``--ab``'s fields
replaced, as the A/B's second side), for a profiler around the command, e.g.
Nsight Compute:

    ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 ... \
        python tools/tune.py --op dot_product_attention --implementation mosaic_gpu \
        --shape 'B2 T8192 N16 H64$' --direction forward --profile-runs 3

(``--direction forward+backward`` runs the forward's kernels and the backward's
each time: count them in ``--launch-skip``.)

``--ab FIELD=VALUE`` (repeatable) is an A/B of one change instead of a sweep:
the heuristic configs against the same configs with the fields replaced, in
the forward and the backward Op alike (wherever the config has the field; in
one of them with ``--ab-side forward`` or ``backward``),
timed in alternation (`benchmarking.time_interleaved`), forward and
forward+backward; it prints both medians and their ratio. ``--ab-env
NAME=VALUE`` (repeatable, alone or with ``--ab``) is the A/B of a code change
behind an environment variable the code reads while tracing (a temporary
switch, taken out before the change lands): the second side is traced with
NAME=VALUE set; a call whose two sides compile to the same program is
reported and skipped (the switch does not reach it: e.g. the changed code path
runs at some calls only), and a run where no call's sides differ stops with an
error (the switch is read nowhere, or not while tracing). With ``--model``
(dense, moe, ...), the same for the tokamax training step of `python -m tokamax
bench --model` (``implementation=None``: dispatch picks the implementations as
it would; both sides run their heuristic configs, not tuned data's).

Forward configs are timed on the forward (with ``--training``: on forward+backward,
where the forward keeps the residuals a training step asks of it, e.g. the GLU's
projections); backward configs on forward+backward with the forward at its
heuristic config. Kernel time by `benchmarking.default_method` (CUPTI on NVIDIA GPUs;
CUDA events there for a program with an XLA conditional).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import os
import re

import jax

from tokamax._src import bench_models
from tokamax._src import bench_suite
from tokamax._src import benchmarking
from tokamax._src.ops.ragged_dot import problems as ragged_dot_problems
from tokamax._src.op import VjpOp
from tokamax._src.problem import Problem
from tokamax._src.tuning import context as tuning_context
from tokamax._src import registry

import none_check  # tools/none_check.py: the --shape forms of calls off the suite


class _Fixed:
  """A config source: a fixed config for one Op class, and it records the args."""

  def __init__(self, cls=None, config=None):
    self.cls, self.config, self.args = cls, config, {}

  def lookup(self, op, args):
    self.args.setdefault(type(op), args)
    return self.config if type(op) is self.cls else None


class _Replaced:
  """A config source: each Op's heuristic config with `fields` replaced, for
  the Ops whose config has all of them (the others keep their own choice).
  ``applied``: whether any lookup replaced them (else the A/B compares a
  config with itself: a misspelt field)."""

  def __init__(self, fields: dict[str, object], side: str = "both"):
    self.fields = fields
    self.side = side  # "both", or only the "forward" or "backward" Op's config
    self.applied = False

  def lookup(self, op, args):
    if self.side != "both" and isinstance(op, VjpOp) != (self.side == "backward"):
      return op.heuristic_config(args)
    config = op.heuristic_config(args)
    if not dataclasses.is_dataclass(config):
      return None
    names = {f.name for f in dataclasses.fields(config)}
    if not set(self.fields) <= names:
      return None
    # None is a value where the field's annotation admits it (`bool | None`:
    # the kernel's own rule).
    optional = {f.name for f in dataclasses.fields(config)
                if "None" in str(f.type) or "Optional" in str(f.type)}
    for key, value in self.fields.items():
      current = getattr(config, key)
      if value is None and key in optional:
        continue
      if current is not None and type(value) is not type(current):
        raise ValueError(f"--ab {key}={value!r}: {type(config).__name__}.{key} is "
                         f"a {type(current).__name__} ({current!r})")
    self.applied = True
    return dataclasses.replace(config, **self.fields)


def _literal(text: str):
  """A command-line value as the Python literal it spells (else the string)."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _field_values(fields: dict[str, str]) -> dict[str, object]:
  """``--ab``'s FIELD=VALUE pairs with each value as the literal it spells."""
  return {key: _literal(value) for key, value in fields.items()}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
  """`variables` set in os.environ inside the block, restored after it."""
  saved = {name: os.environ.get(name) for name in variables}
  os.environ.update(variables)
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def ab(title: str, builders: dict, fields: dict[str, str], iterations: int,
       side: str = "both", env: dict[str, str] | None = None) -> bool:
  """The heuristic configs against them with `fields` replaced (in the
  `side` Op's config: "both", "forward" or "backward") and the environment
  variables `env` set while tracing, interleaved.

  `builders`: per direction, ``() -> (jitted function, args)``, each call a new
  function (a jitted function traced once would keep the first side's
  configs), traced under the side's config source.

  Returns whether some direction's two sides compiled to different programs
  (with `env`, one whose sides do not is skipped, not timed: `require_env_read`).
  """
  env = env or {}
  differed = False
  replaced = _field_values(fields)
  label = ", ".join([f"{k}={v!r}" for k, v in replaced.items()]
                    + [f"${k}={v}" for k, v in env.items()])
  print(f"## {title}: heuristic vs {label}", flush=True)
  for direction, build in builders.items():
    if side == "backward" and direction == "forward" and not env:
      # No backward runs: both sides would be the same program.
      print(f"  {direction:<17} skipped: no backward runs", flush=True)
      continue
    contenders = {}
    changed = _Replaced(replaced, side)
    try:
      for name, source, variables in (("heuristic", _Replaced({}), {}),
                                      (label, changed, env)):
        if env:
          jax.clear_caches()  # no trace made under the other side's environment
        with tuning_context.use(source), environment(variables):
          f, fargs = build()
          contenders[name] = benchmarking.prepare(f, *fargs)
    except Exception as e:  # a config that fails is reported, the others go on
      print(f"  {direction:<17} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if replaced and not changed.applied:
      raise SystemExit(f"--ab {label}: no Op's config has these fields")
    same = _same_program(*contenders.values())
    differed = differed or not same
    if env and same:
      print(f"  {direction:<17} skipped: both sides compiled to the same program",
            flush=True)
      continue
    results = benchmarking.time_interleaved(contenders, iterations)
    base, other = (results[name] for name in contenders)
    if isinstance(base, Exception) or isinstance(other, Exception):
      print(f"  {direction:<17} failed: {base if isinstance(base, Exception) else other}",
            flush=True)
      continue
    a, b = base.median_evaluation_time_ms, other.median_evaluation_time_ms
    # Fields equal to what the heuristic already picks at this call (of several
    # calls, only some may differ): the ratio is then the run's noise, not the
    # fields' effect (session 89 read such a run at B4 T16384 as a 3% loss).
    same_note = "; the same program on both sides: an A/A run" if same else ""
    print(f"  {direction:<17} heuristic {a:8.3f} ms, {label} {b:8.3f} ms "
          f"(heuristic / other {a / b:.3f}, {base.method}, {iterations} rounds"
          f"{same_note})", flush=True)
  return differed


def require_env_read(env: dict[str, str], differed: list[bool]) -> None:
  """Stops a ``--ab-env`` run where no call's two sides compiled differently:
  nothing read the variables while tracing (or a cache outside JAX's kept the
  first side's code), so every ratio would have been an A/A run's."""
  if env and not any(differed):
    names = ", ".join(f"${k}={v}" for k, v in env.items())
    raise SystemExit(f"--ab-env {names}: both sides compiled to the same program at "
                     "every call (nothing read the variables while tracing, or a "
                     "cache outside JAX's kept the first side's code)")


def _same_program(a: benchmarking.Contender, b: benchmarking.Contender) -> bool:
  return _program_text(a.run.compiled) == _program_text(b.run.compiled)


# The compiled HLO's debug information: its tables of source files, functions,
# locations and stack frames (lines "FileNames", "1 "file.py"", ...), and each
# instruction's `metadata={...}`, which indexes them.
_DEBUG_TABLE_LINE = re.compile(r"(FileNames|FunctionNames|FileLocations|StackFrames|\d+ .*)$")
_METADATA = re.compile(r", metadata=\{[^{}]*\}")


def _program_text(compiled) -> str:
  """The compiled program's HLO without its debug information. An executable
  from JAX's persistent compilation cache lists the same tables in another order
  than a fresh compile of the same program (and carries the source locations of
  whichever call compiled it first), so two sides of one program would compare
  unequal with it (an A/A run read as an A/B)."""
  lines = compiled.as_text().splitlines()
  return "\n".join(_METADATA.sub("", line) for line in lines
                   if not _DEBUG_TABLE_LINE.match(line))


def problem_builders(problem: Problem, implementation: str, directions) -> dict:
  """`ab`'s builders for a benchmark problem: its forward, its forward+backward."""
  inputs = problem.make_inputs()

  def call():  # a new function per side (see `ab`)
    return lambda a: problem.call(a, implementation)
  builders = {"forward": lambda: (jax.jit(call()), (inputs,)),
              "forward+backward": lambda: bench_suite.fwd_bwd(call(), inputs)}
  return {d: builders[d] for d in directions}


def model_builders(model: str) -> tuple[str, dict]:
  """`ab`'s builder for a model of `python -m tokamax bench --model`: tokamax's
  training step at the bench's size for this device (`training_step` jits a
  new function per call)."""
  size = bench_models.make_size(model, quick=bench_suite.use_quick_shapes())
  params, x, dy = bench_models.inputs(model, size)
  step = lambda: (bench_models.training_step(model, size, "tokamax"), (params, x, dy))
  return f"model {model} {size.describe()}", {"training step": step}


def model_sizes(parser, model: str, items: list[str]) -> dict[str, str]:
  """``--size KEY=VALUE`` items as a dict, checked against `model`'s sizes
  (`bench_models.make_size`); a usage error of `parser` for a bad one."""
  try:
    sizes = bench_models.parse_sizes(items)
    bench_models.make_size(model, False, sizes)
  except ValueError as e:
    parser.error(str(e))
  return sizes


def check_implementations(parser, names) -> None:
  """A usage error of `parser` for an implementation name nothing installed has."""
  try:
    bench_suite.check_implementation_names(names)
  except bench_suite.UnknownImplementation as e:
    parser.error(f"--implementation: {e}")


def select_problems(parser, suite, ops, shape: str | None) -> list:
  """The problems of `suite` of the `ops` whose name `shape` (a regular
  expression) matches (`bench_suite.select_shapes`; "all" among `ops`: every
  op's); a usage error for an op the suites lack, a bad expression or a shape
  that matches none of the ops' problems."""
  try:
    bench_suite.check_ops(ops)
  except bench_suite.UnknownOp as e:
    parser.error(f"--op: {e}")
  problems = [p for p in suite if "all" in ops or p.op in ops]
  if not problems or not shape:
    return problems
  try:
    return bench_suite.select_shapes(problems, [shape], regex=True)
  except re.error as e:
    parser.error(f"--shape {shape!r} is not a regular expression: {e}")
  except bench_suite.NoMatchingShape as e:
    parser.error(f"--op {', '.join(ops)} --shape {shape!r} match no problem: {e}")


def call_problems(parser, ops, calls: list[str], suite_chosen) -> list:
  """The problems of `calls` (tools/none_check.py's --shape forms) of the one op
  in `ops`; a usage error beside --shape or --grid, or for a bad form."""
  if len(ops) != 1 or ops[0] not in none_check.OPS or suite_chosen:
    parser.error(f"--call takes one --op of {sorted(none_check.OPS)} and no "
                 "--shape or --grid")
  return none_check.problems_from(parser, ops[0], calls, flag="--call")


def profile_runs(title: str, builders: dict, fields: dict[str, str], runs: int) -> None:
  """Each direction's call `runs` times, untimed (`ab`'s builders; `fields`
  replaced in the configs where given, else the heuristic's)."""
  replaced = _field_values(fields)
  source = _Replaced(replaced)
  for direction, build in builders.items():
    with tuning_context.use(source):
      f, fargs = build()
      for _ in range(runs):
        jax.block_until_ready(f(*fargs))
    if replaced and not source.applied:
      raise SystemExit(f"--ab {replaced}: no Op's config has these fields")
    print(f"## {title} {direction}: ran {runs} times"
          f"{' with ' + str(replaced) if replaced else ''}", flush=True)


def _matches(config, match: dict[str, str]) -> bool:
  fields = dataclasses.asdict(config)
  return all(str(fields[key]) == value for key, value in match.items())


def _unknown_field(cls, match: dict[str, str]) -> str | None:
  """Why `match` cannot select configs of `cls` (a field it lacks), or None."""
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(match) - set(fields))
  if not unknown:
    return None
  return (f"{cls.__name__} has no field {unknown[0]!r} (--match); its fields: "
          f"{', '.join(fields)}")


def _field_value(text: str) -> tuple[str, str]:
  if "=" not in text:
    raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
  key, value = text.split("=", 1)
  return key, value


def tune(problem: Problem, implementation: str, iterations: int,
         directions=("forward", "forward+backward"), match=None,
         training: bool = False) -> None:
  entry = registry.find(problem.op, implementation)
  fwd_cls, bwd_cls = registry.forward_class(entry), registry.backward_class(entry)
  inputs = problem.make_inputs()
  capture = _Fixed()
  grad, grad_args = bench_suite.fwd_bwd(lambda a: problem.call(a, implementation), inputs)
  with tuning_context.use(capture):
    try:
      jax.block_until_ready(grad(*grad_args))
    except NotImplementedError:  # a forward-only implementation: tune the forward
      jax.block_until_ready(jax.jit(lambda a: problem.call(a, implementation))(inputs))
  print(f"## {problem.op} {problem.name} ({implementation})", flush=True)
  for cls, direction in ((fwd_cls, "forward"), (bwd_cls, "forward+backward")):
    if cls is None or cls not in capture.args or direction not in directions:
      continue
    why = _unknown_field(cls.config_cls, match or {})
    if why:
      print(f"  {direction:<17} skipped: {why}", flush=True)
      continue
    args = capture.args[cls]
    heuristic = cls().heuristic_config(args)
    configs = [c for c in cls().search_space(args) if _matches(c, match or {})]
    for config in dict.fromkeys([heuristic, *configs]):
      source = _Fixed(cls, config)
      try:
        with tuning_context.use(source):
          if direction == "forward" and not training:
            f, fargs = jax.jit(lambda a: problem.call(a, implementation)), (inputs,)
          else:
            f, fargs = bench_suite.fwd_bwd(lambda a: problem.call(a, implementation), inputs)
          ms, _ = benchmarking.kernel_time_ms(f, *fargs, iterations=iterations)
        mark = " (heuristic)" if config == heuristic else ""
        print(f"  {direction:<17} {ms:8.3f} ms  {dataclasses.asdict(config)}{mark}", flush=True)
      except Exception as e:  # a config that fails is reported, the sweep goes on
        print(f"  {direction:<17} failed: {type(e).__name__}: {str(e)[:150]}  {config}",
              flush=True)


def _with_equal_groups(problem: Problem) -> Problem:
  """A random-size ragged_dot problem rebuilt with equal group sizes; others as
  they are."""
  found = re.fullmatch(r"M(\d+) K(\d+) N(\d+) G(\d+) random", problem.name)
  if problem.op != "ragged_dot" or not found:
    return problem
  m, k, n, g = map(int, found.groups())
  return ragged_dot_problems.problem(m, k, n, g, random_sizes=False)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--op", action="append", default=[])
  parser.add_argument("--model", action="append", default=[],
                      help="with --ab: a model of `python -m tokamax bench --model` "
                           "(its tokamax training step)")
  parser.add_argument("--implementation", default="triton")
  parser.add_argument("--shape", help="a regular expression searched in the problem "
                                      "name (a plain substring; 'G16$' for the name's end)")
  parser.add_argument("--call", action="append", default=[], metavar="SIZES",
                      help="a call off the suites instead (repeatable), in "
                           "tools/none_check.py's --shape form for the one --op, "
                           "e.g. 1,32768,16,16,64 (dot_product_attention: "
                           "B,T,N,K,H[,causal[,W]], W a sliding window)")
  parser.add_argument("--iterations", type=none_check.positive_int, default=5)
  parser.add_argument("--direction", choices=("forward", "forward+backward"),
                      help="tune only the forward or only the backward configs")
  parser.add_argument("--training", action="store_true",
                      help="time forward configs in forward+backward")
  parser.add_argument("--grid", action="store_true",
                      help="the grid shapes (autotune --grid's) instead of the "
                           "reference shapes")
  parser.add_argument("--match", action="append", default=[], metavar="FIELD=VALUE",
                      type=_field_value,
                      help="only configs whose FIELD prints as VALUE (repeatable)")
  parser.add_argument("--ab", action="append", default=[], metavar="FIELD=VALUE",
                      type=_field_value,
                      help="A/B: the heuristic configs against them with FIELD "
                           "set to VALUE (repeatable), interleaved")
  parser.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE",
                      type=_field_value,
                      help="A/B: the second side traced with the environment "
                           "variable NAME set to VALUE (repeatable; a code "
                           "change behind a temporary switch)")
  parser.add_argument("--ab-side", choices=("both", "forward", "backward"),
                      default="both",
                      help="with --ab: replace the fields in both Ops' configs "
                           "(the default) or only the forward's or the backward's "
                           "(e.g. a backward kernel alone, timed in "
                           "forward+backward)")
  parser.add_argument("--equal-groups", action="store_true",
                      help="ragged_dot: each selected bf16 random-size problem "
                           "('... random') with equal group sizes instead (the same "
                           "M, K, N and G), e.g. to tell what the sizes' spread "
                           "costs in a profile; other problems run as they are")
  parser.add_argument("--profile-runs", type=int, metavar="N",
                      help="run each selected call N times, untimed, for a "
                           "profiler (with --ab: the replaced configs)")
  args = parser.parse_args()
  check_implementations(parser, [args.implementation])
  is_ab = bool(args.ab or args.ab_env)
  if not args.op and not (is_ab and args.model):
    parser.error("--op is required (or --model with --ab)")
  if args.model and not is_ab:
    parser.error("--model times a training step only in an A/B (--ab)")
  if args.ab_env and args.profile_runs is not None:
    parser.error("--profile-runs with --ab-env: set the variable on the command "
                 "line instead")
  if args.profile_runs is not None:
    if args.profile_runs < 1:
      parser.error(f"--profile-runs must be >= 1; got {args.profile_runs}")
    if args.model or args.training or args.match:
      parser.error("--profile-runs runs reference problems at the heuristic (or --ab) "
                   "configs: not with --model, --training or --match")
  match = dict(args.match)
  directions = (args.direction,) if args.direction else ("forward", "forward+backward")
  if args.call:
    problems = call_problems(parser, args.op, args.call, args.shape or args.grid)
  else:
    suite = bench_suite.grid_suite() if args.grid else bench_suite.reference_suite()
    problems = select_problems(parser, suite, args.op, args.shape)
  differed = []  # per A/B'd call: whether its two sides' programs differ
  for problem in problems:
    if args.equal_groups:
      problem = _with_equal_groups(problem)
    if args.profile_runs is not None:
      profile_runs(f"{problem.op} {problem.name} ({args.implementation})",
                   problem_builders(problem, args.implementation, directions),
                   dict(args.ab), args.profile_runs)
    elif is_ab:
      differed.append(ab(
          f"{problem.op} {problem.name} ({args.implementation})",
          problem_builders(problem, args.implementation, directions), dict(args.ab),
          args.iterations, args.ab_side, dict(args.ab_env)))
    else:
      tune(problem, args.implementation, args.iterations, directions, match,
           args.training)
  for model in args.model:
    differed.append(ab(*model_builders(model), dict(args.ab), args.iterations,
                       args.ab_side, dict(args.ab_env)))
  if is_ab:
    require_env_read(dict(args.ab_env), differed)


if __name__ == "__main__":
  main()
