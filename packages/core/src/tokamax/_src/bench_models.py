"""`python -m tokamax bench --model {dense,moe,flax-dense}`: one training step,
tokamax vs plain JAX (or plain Flax).

Each model is written twice with the same parameters and inputs:

* ``tokamax``: every heavy op through tokamax with ``implementation=None``.
* ``plain``: the program a user writes today without tokamax: jnp RMSNorm,
  `jax.nn.dot_product_attention` (``implementation="cudnn"`` on NVIDIA GPUs),
  SwiGLU as one matmul with the fused gate/up weight (`plain_glu`),
  `jax.lax.ragged_dot`.

The step is ``jax.value_and_grad`` of ``sum(out * dy)`` (random ``dy``) over the
parameters and the input, timed with `benchmarking.time_interleaved` (by default
CUPTI kernel time on NVIDIA GPUs, CUDA events there where a program holds an XLA
conditional, wall clock elsewhere; `run_model`'s `method` picks another). The tokamax step's loss and gradients are
checked against the plain step's (relative L2, the worst leaf reported; the loss
against the L2 norm of its terms, see `loss_error`).

Models (shared/BENCHMARKS.md):

* ``dense``: a decoder block: RMSNorm -> causal GQA attention (q/k/v/o
  projections) -> residual -> RMSNorm -> SwiGLU FFN (weights ``[D, 2, F]``) ->
  down projection -> residual. Default Llama-3-8B-sized.
* ``moe``: an MoE FFN: router, top-k, softmax over the chosen logits, tokens
  sorted by expert (the single-device case of `tokamax.moe_all_to_all`'s routing:
  row gathers whose transposes are gathers), SwiGLU experts (gate and up fused as
  ``[E, D, 2F]``, then down ``[E, F, D]``), outputs combined with the gates.
  Default Mixtral-like. Both programs share the routing; only the experts differ:
  two `jax.lax.ragged_dot`s around the bf16 activation in the plain program, a
  grouped `tokamax.gated_linear_unit` and a `tokamax.ragged_dot` in tokamax's.
* ``flax-dense``: the decoder layer of the repository's ``examples/llama_nnx.py``
  (Flax NNX: RMSNorm -> causal GQA attention with RoPE -> RMSNorm -> SwiGLU, with
  residuals) at the ``dense`` sizes, built from `tokamax.flax`'s modules against
  the same layer in plain Flax: `nnx.RMSNorm`, `nnx.dot_product_attention`
  (Flax's default attention: XLA, K/V heads repeated, a causal mask; not cuDNN as
  in ``dense``) and the fused-kernel SwiGLU. Same parameters. Needs Flax and the
  repository checkout (run from its root); not part of ``--model all``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import tokamax
from tokamax import testing
from tokamax._src import benchmarking
from tokamax._src.ops.gated_linear_unit.problems import plain_glu
from tokamax._src.ops.ragged_dot import moe as moe_lib

F32 = jnp.float32

def pair_tolerance(dtype) -> float:
  """Relative L2 error allowed between two programs in `dtype`: each within the
  conformance tolerance of the exact result (float32 as on a GPU, TF32 matmuls),
  so at most twice that apart."""
  return 2 * testing.tolerance(dtype, gpu=True)[0]


@dataclasses.dataclass
class DenseSize:
  dim: int = 4096
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  ffn: int = 14336
  batch: int = 2
  seq: int = 4096
  dtype: str = "bfloat16"

  def describe(self) -> str:
    return (f"D{self.dim} N{self.heads} K{self.kv_heads} H{self.head_dim} F{self.ffn} "
            f"B{self.batch} T{self.seq}" + _dtype_suffix(self.dtype))

  def flops(self) -> float:
    """FLOPs of one training step: 3x the forward's matmuls, 3.5x its attention."""
    bt, d, f = self.batch * self.seq, self.dim, self.ffn
    nh, kh = self.heads * self.head_dim, self.kv_heads * self.head_dim
    matmul = 2 * bt * d * (2 * nh + 2 * kh) + 2 * bt * d * 2 * f + 2 * bt * f * d
    attention = 4 * self.batch * self.heads * self.seq**2 * self.head_dim / 2
    return 3 * matmul + 3.5 * attention


@dataclasses.dataclass
class MoeSize:
  tokens: int = 8192
  dim: int = 4096
  ffn: int = 14336
  experts: int = 8
  top_k: int = 2
  dtype: str = "bfloat16"

  def describe(self) -> str:
    return (f"tokens{self.tokens} D{self.dim} F{self.ffn} E{self.experts} "
            f"top{self.top_k}" + _dtype_suffix(self.dtype))

  def flops(self) -> float:
    """3 x 2*M*K*N per ragged_dot (forward, and the two matmuls of its backward)."""
    m = self.tokens * self.top_k
    return 3 * (2 * m * self.dim * 2 * self.ffn + 2 * m * self.ffn * self.dim)


# Small sizes for platforms other than GPUs (and `--quick`): seconds on a CPU.
QUICK = {
    "dense": DenseSize(dim=256, heads=4, kv_heads=2, head_dim=64, ffn=512, batch=1, seq=256),
    "moe": MoeSize(tokens=512, dim=256, ffn=512, experts=8, top_k=2),
}
QUICK["flax-dense"] = QUICK["dense"]
FULL = {"dense": DenseSize(), "moe": MoeSize(), "flax-dense": DenseSize()}
MODELS = ("dense", "moe")  # --model all: the plain-JAX pairs
FLAX_MODELS = ("flax-dense",)


def _dtype_suffix(dtype: str) -> str:
  return "" if dtype == "bfloat16" else f" {dtype}"


def parse_sizes(items: list[str]) -> dict[str, str]:
  """``--size KEY=VALUE`` items as a dict (ValueError for one without ``=``)."""
  if any("=" not in kv for kv in items):
    raise ValueError(f"--size takes KEY=VALUE; got {items}")
  return dict(kv.split("=", 1) for kv in items)


def make_size(model: str, quick: bool, overrides: dict[str, str] | None = None):
  """The model's size: the full or quick defaults with ``KEY=VALUE`` overrides.

  A key that only the other model has (``seq`` for moe) is ignored; one that no
  model has is an error.
  """
  size = dataclasses.replace(QUICK[model] if quick else FULL[model])
  fields = {f.name for f in dataclasses.fields(size)}
  known = {f.name for m in FULL.values() for f in dataclasses.fields(m)}
  for key, value in (overrides or {}).items():
    key = key.replace("-", "_")
    if key not in known:
      raise ValueError(f"--size {key}=...: no model has a size {key!r}; "
                       f"{model} has {', '.join(sorted(fields))}")
    if key in fields:
      setattr(size, key, _size_value(key, value))
  _check_together(size)
  return size


def _check_together(size) -> None:
  """Sizes that are fine alone but not together (ValueError naming both)."""
  if isinstance(size, MoeSize) and size.top_k > size.experts:
    raise ValueError(f"--size top_k={size.top_k}: each token picks top_k of the "
                     f"experts={size.experts}; top_k must be at most experts")
  if isinstance(size, DenseSize) and size.heads % size.kv_heads:
    raise ValueError(f"--size heads={size.heads} kv_heads={size.kv_heads}: the "
                     "query heads must be a multiple of the key/value heads")


_MODEL_DTYPES = ("bfloat16", "float16", "float32")


def _size_value(key: str, value: str):
  """A `--size` value as its field takes it (ValueError naming what is wrong):
  one of `_MODEL_DTYPES` for ``dtype``, else a positive integer."""
  if key == "dtype":
    if value not in _MODEL_DTYPES:
      raise ValueError(f"--size dtype={value}: the models run in "
                       f"{', '.join(_MODEL_DTYPES)}")
    return value
  try:
    number = int(value)
  except ValueError:
    number = 0
  if number < 1:
    raise ValueError(f"--size {key}={value}: {key} takes a positive integer")
  return number


def _init(key, shape, fan_in, dtype):
  return (jax.random.normal(key, shape, F32) * fan_in**-0.5).astype(dtype)


def _is_nvidia_gpu() -> bool:
  return benchmarking.is_nvidia_gpu(jax.devices()[0])


# ------------------------------------------------------------------------- dense


def dense_inputs(size: DenseSize, seed: int = 0) -> tuple[dict, jax.Array, jax.Array]:
  """(params, x, dy)."""
  d, f, dt = size.dim, size.ffn, jnp.dtype(size.dtype)
  nh, kh = size.heads * size.head_dim, size.kv_heads * size.head_dim
  ks = jax.random.split(jax.random.key(seed), 10)
  params = dict(
      norm1=(1 + 0.1 * jax.random.normal(ks[0], (d,), F32)).astype(dt),
      wq=_init(ks[1], (d, nh), d, dt), wk=_init(ks[2], (d, kh), d, dt),
      wv=_init(ks[3], (d, kh), d, dt), wo=_init(ks[4], (nh, d), nh, dt),
      norm2=(1 + 0.1 * jax.random.normal(ks[5], (d,), F32)).astype(dt),
      w_glu=_init(ks[6], (d, 2, f), d, dt), w_down=_init(ks[7], (f, d), f, dt))
  shape = (size.batch, size.seq, d)
  x = jax.random.normal(ks[8], shape, F32).astype(dt)
  dy = jax.random.normal(ks[9], shape, F32).astype(dt)
  return params, x, dy


def _plain_rms_norm(x, scale, eps=1e-6):
  xf = x.astype(F32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale.astype(F32)
  return y.astype(x.dtype)


def dense_block(params: dict, x: jax.Array, size: DenseSize, program: str) -> jax.Array:
  """The decoder block; ``program`` is "tokamax" or "plain"."""
  b, t, d = x.shape
  n, k, h = size.heads, size.kv_heads, size.head_dim
  ours = program == "tokamax"
  norm = tokamax.rms_norm if ours else _plain_rms_norm
  y = norm(x, params["norm1"])
  q = (y @ params["wq"]).reshape(b, t, n, h)
  key = (y @ params["wk"]).reshape(b, t, k, h)
  value = (y @ params["wv"]).reshape(b, t, k, h)
  if ours:
    attn = tokamax.dot_product_attention(q, key, value, is_causal=True)
  else:
    attn = jax.nn.dot_product_attention(
        q, key, value, is_causal=True,
        implementation="cudnn" if _is_nvidia_gpu() else None)
  x = x + attn.reshape(b, t, n * h) @ params["wo"]
  y = norm(x, params["norm2"])
  if ours:
    hidden = tokamax.gated_linear_unit(y, params["w_glu"], activation=jax.nn.silu)
  else:
    hidden = plain_glu(y, params["w_glu"])
  return x + hidden @ params["w_down"]


# --------------------------------------------------------------------------- moe


def moe_inputs(size: MoeSize, seed: int = 0) -> tuple[dict, jax.Array, jax.Array]:
  """(params, x, dy)."""
  d, f, e, dt = size.dim, size.ffn, size.experts, jnp.dtype(size.dtype)
  ks = jax.random.split(jax.random.key(seed), 5)
  params = dict(w_router=_init(ks[0], (d, e), d, dt),
                w_gate_up=_init(ks[1], (e, d, 2 * f), d, dt),
                w_down=_init(ks[2], (e, f, d), f, dt))
  x = jax.random.normal(ks[3], (size.tokens, d), F32).astype(dt)
  dy = jax.random.normal(ks[4], (size.tokens, d), F32).astype(dt)
  return params, x, dy


def moe_ffn(params: dict, x: jax.Array, size: MoeSize, program: str) -> jax.Array:
  """The MoE FFN; ``program`` is "tokamax" or "plain" (only the experts differ: the
  plain program runs two `jax.lax.ragged_dot`s around the activation, tokamax's a
  grouped `tokamax.gated_linear_unit` and a `tokamax.ragged_dot`)."""
  m, d = x.shape
  e, k, f = size.experts, size.top_k, size.ffn
  logits = jnp.dot(x, params["w_router"], preferred_element_type=F32)
  top_logits, ids = jax.lax.top_k(logits, k)
  gates = jax.nn.softmax(top_logits, axis=-1)
  # Routing of moe_all_to_all on one device: slots sorted by expert.
  route = moe_lib.route(ids.reshape(-1).astype(jnp.int32), 1, e, m * k, k)
  take = moe_lib.take_rows
  rows = take(x, route.token_of_slot, route.slot_of_assignment, k)
  group_sizes = route.sent_counts[0]
  if program == "tokamax":
    # w_gate_up [E, D, 2F] holds the gate columns, then the up ones: [E, D, 2, F].
    act = tokamax.gated_linear_unit(rows, params["w_gate_up"].reshape(e, d, 2, f),
                                    activation=jax.nn.silu, group_sizes=group_sizes)
    out = tokamax.ragged_dot(act, params["w_down"], group_sizes)
  else:
    gate_up = jax.lax.ragged_dot(rows, params["w_gate_up"], group_sizes)
    act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]
    out = jax.lax.ragged_dot(act, params["w_down"], group_sizes)
  out = take(out, route.slot_of_assignment, route.assignment_of_slot, 1).reshape(m, k, d)
  return jnp.sum(out.astype(F32) * gates[..., None], axis=1).astype(x.dtype)


# -------------------------------------------------------------------- flax-dense

FLAX_EXAMPLE = pathlib.Path("examples") / "llama_nnx.py"


@functools.cache
def flax_example():
  """The repository's examples/llama_nnx.py, imported (it imports Flax): looked for
  under the working directory, then in the checkout these sources are in."""
  candidates = [pathlib.Path.cwd() / FLAX_EXAMPLE,
                pathlib.Path(__file__).resolve().parents[5] / FLAX_EXAMPLE]
  path = next((c for c in candidates if c.is_file()), None)
  if path is None:
    raise FileNotFoundError(
        f"--model flax-dense runs the decoder layer of {FLAX_EXAMPLE} in the tokamax "
        f"repository; none at {', '.join(map(str, candidates))}: run from the "
        "repository's root")
  spec = importlib.util.spec_from_file_location("tokamax_llama_nnx_example", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look the module up
  spec.loader.exec_module(module)
  return module


@functools.cache
def _flax_layer(size_fields: tuple, seed: int):
  """``({"plain": f, "tokamax": f}, params)`` of the example's decoder layer."""
  size = DenseSize(*size_fields)
  example = flax_example()
  config = example.Config(dim=size.dim, num_heads=size.heads, num_kv_heads=size.kv_heads,
                          head_dim=size.head_dim, ffn_dim=size.ffn, dtype=size.dtype,
                          param_dtype=size.dtype)
  return example.decoder_layer_functions(config, seed)


def flax_dense_inputs(size: DenseSize, seed: int = 0) -> tuple[dict, jax.Array, jax.Array]:
  """(params, x, dy)."""
  params = _flax_layer(dataclasses.astuple(size), seed)[1]
  kx, kdy = jax.random.split(jax.random.key(seed + 1))
  shape = (size.batch, size.seq, size.dim)
  x = jax.random.normal(kx, shape, F32).astype(size.dtype)
  dy = jax.random.normal(kdy, shape, F32).astype(size.dtype)
  return params, x, dy


def flax_dense_layer(params: dict, x: jax.Array, size: DenseSize, program: str) -> jax.Array:
  """The example's decoder layer; ``program`` is "tokamax" or "plain"."""
  # The functions do not depend on the seed (only the parameters do).
  return _flax_layer(dataclasses.astuple(size), 0)[0][program](params, x)


# -------------------------------------------------------------------------- step


def forward_fn(model: str) -> Callable[..., jax.Array]:
  return {"dense": dense_block, "moe": moe_ffn, "flax-dense": flax_dense_layer}[model]


def inputs(model: str, size, seed: int = 0):
  return {"dense": dense_inputs, "moe": moe_inputs,
          "flax-dense": flax_dense_inputs}[model](size, seed)


def peer_label(model: str) -> str:
  """The implementation name of the model's plain row."""
  return "plain Flax" if model in FLAX_MODELS else "plain JAX"


def training_step(model: str, size, program: str) -> Callable[..., Any]:
  """``step(params, x, dy) -> (loss, (param grads, x grad))``, jitted."""
  forward = forward_fn(model)

  def loss(params, x, dy):
    out = forward(params, x, size, program)
    return jnp.sum(out.astype(F32) * dy.astype(F32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def relative_errors(actual, expected) -> dict[str, float]:
  """Relative L2 error of each leaf (float32 on device), keyed by its path."""
  errors = {}
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree_util.tree_leaves(expected)
  for (path, a), e in zip(flat_a, flat_e):
    a32, e32 = jnp.asarray(a, F32), jnp.asarray(e, F32)
    norm = jnp.sqrt(jnp.sum(e32 * e32))
    diff = jnp.sqrt(jnp.sum((a32 - e32) ** 2))
    rel = float(jnp.where(norm > 0, diff / jnp.where(norm > 0, norm, 1), diff))
    errors[jax.tree_util.keystr(path)] = rel
  return errors


def loss_error(model, size, params, x, dy, loss, expected_loss) -> float:
  """``|loss - expected| / ||out * dy||_2`` (the plain program's out).

  The loss is a sum of terms of random sign that mostly cancel, so its own
  relative error is meaningless; measured against the L2 norm of its terms it
  reads like the relative L2 error of the output.
  """
  forward = forward_fn(model)
  scale = jax.jit(lambda p, x, dy: jnp.sqrt(jnp.sum(
      (forward(p, x, size, "plain").astype(F32) * dy.astype(F32)) ** 2)))(params, x, dy)
  diff = abs(float(loss) - float(expected_loss))
  scale = float(scale)
  return diff / scale if scale > 0 else diff


def _step_names(errors: dict[str, float]) -> dict[str, float]:
  """Readable leaf names: (loss, ((params...), x)) -> loss, d params['wq'], dx."""
  out = {}
  for path, err in errors.items():
    if path == "[0]":
      name = "loss"
    elif path.startswith("[1][0]"):
      name = "d" + path[len("[1][0]"):]
    elif path == "[1][1]":
      name = "dx"
    else:
      name = path
    out[name] = err
  return out


def dispatch_summary(records) -> dict[str, dict[str, list[str]]]:
  """``{op: {"forward": [impls], "backward": [impls]}}`` from dispatch records."""
  summary: dict[str, dict[str, list[str]]] = {}
  for r in records:
    impls = summary.setdefault(r.op, {}).setdefault(r.direction, [])
    if r.implementation not in impls:
      impls.append(r.implementation)
  return summary


def describe_dispatch(dispatch: dict[str, list[str]]) -> str:
  """``"forward mosaic_gpu, backward triton"`` from one op's `dispatch_summary`."""
  return ", ".join(f"{direction} {','.join(impls)}"
                   for direction, impls in sorted(dispatch.items(), reverse=True))


def run_model(model: str, size, iterations: int = 10,
              method: str | None = None) -> tuple[list[dict], str]:
  """Times the tokamax and plain training steps; returns (rows, dispatch text).

  `method`: how to time (`benchmarking.METHODS`; None: the device's default).
  "loop" gives the wall time per step of steps issued back to back, what a
  training loop sees, where kernel time leaves out the gaps between kernels.

  Rows follow `bench.run_problem`'s format; the tokamax row carries ``rel_err``
  (the worst leaf of loss and gradients against the plain step), ``errors`` (every
  leaf), ``tol`` and ``dispatch``.
  """
  params, x, dy = inputs(model, size)
  base = dict(op=f"model {model}", shape=size.describe(), direction="training step")
  flops = size.flops()
  rows, outputs, contenders = [], {}, {}
  summary = {}
  peer = peer_label(model)
  labels = {"plain": peer, "tokamax": "tokamax auto"}
  for program, label in labels.items():
    step = training_step(model, size, program)
    try:
      with tokamax.record_dispatch() as records:
        contenders[label] = benchmarking.prepare(step, params, x, dy)
    except Exception as e:
      rows.append(dict(base, implementation=label,
                       error=f"{type(e).__name__}: {str(e)[:300]}"))
      continue
    outputs[program] = contenders[label].output
    if program == "tokamax":
      summary = dispatch_summary(records)
  # Both steps timed in alternation (benchmarking.time_interleaved says why).
  for label, data in benchmarking.time_interleaved(contenders, iterations,
                                                   method).items():
    if isinstance(data, Exception):
      rows.append(dict(base, implementation=label,
                       error=f"{type(data).__name__}: {str(data)[:300]}"))
      continue
    ms = data.median_evaluation_time_ms
    row = dict(base, implementation=label, ms=ms, method=data.method,
               rate=flops / (ms * 1e-3) / 1e12, unit="TFLOP/s")
    if label == labels["tokamax"]:
      row["dispatch"] = summary
    rows.append(row)
  times = {r["implementation"]: r["ms"] for r in rows if "ms" in r}
  tol = pair_tolerance(size.dtype)
  for r in rows:
    if "ms" in r and peer in times:
      r["vs_peer"] = times[peer] / r["ms"]
    if r["implementation"] == "tokamax auto" and "ms" in r and "plain" in outputs:
      errors = _step_names(relative_errors(outputs["tokamax"], outputs["plain"]))
      errors["loss"] = loss_error(model, size, params, x, dy, outputs["tokamax"][0],
                                  outputs["plain"][0])
      worst = max(errors, key=errors.get)
      r.update(rel_err=errors[worst], worst_leaf=worst, errors=errors, tol=tol)
  text = f"{model} ({size.describe()}): tokamax ran " + ("; ".join(
      f"{op} {describe_dispatch(d)}" for op, d in sorted(summary.items())) or "no op")
  tok = next((r for r in rows if r["implementation"] == "tokamax auto" and "rel_err" in r),
             None)
  if tok is not None:
    verdict = "ok" if tok["rel_err"] <= tol else "BEYOND TOLERANCE"
    text += (f"\n{model}: loss and gradients, tokamax vs plain: worst relative L2 "
             f"{tok['rel_err']:.3g} ({tok['worst_leaf']}), tolerance {tol:g}: {verdict}")
  return rows, text
