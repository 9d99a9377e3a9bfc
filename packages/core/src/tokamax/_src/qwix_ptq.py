"""Qwix's post-training quantization (PTQ) reaching tokamax's ops.

``qwix.quantize_model(model, qwix.PtqProvider(rules), *inputs)`` quantizes a
Flax model by intercepting the JAX matmuls it calls (``jax.lax.dot_general``,
``jnp.einsum``, ...): where a rule matches the module, the weight a matmul
takes (a param of the module) is quantized and replaced in the module by
Qwix's ``WithAux`` (its ``QArray`` and how it was made), and the activation
is quantized on the fly where the rule sets ``act_qtype``. Its PTQ intercepts
no grouped matmul (its quantized training intercepts ``jax.lax.ragged_dot``),
so a model whose experts run through `tokamax.ragged_dot` would keep them
unquantized; `quantize_operands` does for tokamax's ops what
Qwix's PTQ does for its matmuls, with the same rules and the same quantized
params, so that the ops' quantized kernels run without extra user code.

Inside an op, Qwix intercepts nothing (`outside_interception`): its rules apply
to the op's call, once, not to the matmuls an implementation happens to make
(the XLA reference's, or a composed implementation's nested tokamax calls).

Qwix asks ``qwix._src.qconfig.get_current_rule(op_name)`` of a kernel for the
rule of its call (Qwix's interface for kernel authors, `qwix.pallas`); the
param replacement uses its PTQ provider's own functions. Those are Qwix's
internals (adapted to qwix 0.1.8, the version the tests install): where they
are missing, a matching rule (or, without ``get_current_rule``, any call once
Qwix is imported) raises rather than leave the weights unquantized. Core does
not import Qwix: nothing here runs unless the program imported it.

PTQ is told by its rules' class, Qwix's plain `QuantizationRule` (its
quantized training and LoRA rules subclass it); Qwix's ODML providers use that
class too and are taken for PTQ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import contextlib
import importlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

from tokamax._src import quantization

# The classes of rules Qwix's PTQ provider matches (`qwix.QuantizationRule`);
# its quantized training (`qwix.QtRule`) and LoRA (`qwix.LoraRule`) rules
# subclass it and ask for other computations.
_PTQ_RULE = "QuantizationRule"


def current_rule(op_name: str) -> Any:
  """The Qwix rule of an `op_name` call at the current module, where the call
  runs inside a Qwix-quantized model (``qwix.quantize_model``) and a PTQ rule
  with a ``weight_qtype`` matches; else None.

  Raises NotImplementedError for a matching quantized training or LoRA rule
  (those compute otherwise than a quantized matmul, or add adapters: the op
  would silently run without them) and for static activation scales."""
  if "qwix" not in sys.modules:
    return None
  get_current_rule = getattr(sys.modules.get("qwix._src.qconfig"), "get_current_rule",
                             None)
  if get_current_rule is None:
    raise NotImplementedError(
        f"tokamax's {op_name} cannot ask this Qwix "
        f"({getattr(sys.modules['qwix'], '__version__', '?')}) for its rules "
        "(qwix._src.qconfig.get_current_rule is gone); tokamax is tested with "
        "qwix 0.1.8")
  rule = get_current_rule(op_name)
  if rule is None:
    return None
  if type(rule).__name__ != _PTQ_RULE:
    raise NotImplementedError(
        f"tokamax's {op_name} takes Qwix's post-training quantization "
        f"(qwix.PtqProvider) rules only; a {type(rule).__name__} matched it "
        f"({rule}). Narrow the rule's module_path or op_names to leave "
        f"{op_name} out")
  if getattr(rule, "weight_qtype", None) is None:
    return None
  if getattr(rule, "act_static_scale", False):
    raise NotImplementedError(
        f"tokamax's {op_name} quantizes activations with dynamic scales only; "
        f"the Qwix rule {rule} asks for static ones (act_static_scale=True)")
  return rule


def quantize_operands(op_name: str, lhs: Any, rhs: Any, *, lhs_contracting: int,
                      rhs_contracting: int) -> tuple[Any, Any]:
  """`lhs` (an activation) and `rhs` (a weight, an activation, or a sequence of
  weights) of an `op_name` call as Qwix's PTQ would hand them to a matmul under
  the current rule (`current_rule`); unchanged where none applies.

  As Qwix's PTQ matmuls: scales per element of every axis but the contracting
  one, which is tiled by the rule's ``tile_size`` (a whole-axis scale without
  one); a weight not quantized yet (a param of the current module, found as
  Qwix finds it) is quantized with ``weight_qtype`` and replaces the param, so
  that the quantized model holds it; an rhs that is no param is an activation,
  quantized with ``act_qtype`` where the rule sets one (else left as is); lhs
  with ``act_qtype`` where set. An operand already quantized stays as it is.
  """
  rule = current_rule(op_name)
  if rule is None:
    return lhs, rhs
  qwix = _qwix_internals(op_name)
  with _naming(op_name, "rhs", rule):
    if isinstance(rhs, (tuple, list)):
      rhs = type(rhs)(_weight(qwix, rule, w, rhs_contracting) for w in rhs)
    else:
      rhs = _weight(qwix, rule, rhs, rhs_contracting)
  with _naming(op_name, "lhs", rule):
    lhs = _activation(qwix, rule, lhs, lhs_contracting)
  return lhs, rhs


@contextlib.contextmanager
def _naming(op_name: str, operand: str, rule):
  """Qwix's own errors quantizing an operand (e.g. "(4, 256, 768) cannot be
  tiled as {1: 100}"), raised again naming the op, the operand and the rule."""
  try:
    yield
  except ValueError as e:
    raise ValueError(f"the Qwix rule {rule} cannot quantize tokamax's {op_name} "
                     f"{operand}: {e}") from e


def _weight(qwix, rule, w: Any, contracting: int) -> Any:
  """`w` quantized as a weight where it is a param of the current module (the
  param replaced), else as an activation (`quantize_operands`)."""
  if quantization.is_quantized(w) or not hasattr(w, "ndim"):
    return w
  name = qwix.flax_util.find_param(w)
  if name is None:
    if rule.act_qtype is None:
      raise NotImplementedError(
          f"a Qwix PTQ rule ({rule}) matched this call, but its weight "
          f"{tuple(w.shape)} is no param Qwix can trace back to the module (a "
          "param computed on, or two of one shape both cast): pass the param "
          "itself, or quantize it with qwix.quantize / tokamax.quantize first")
    return _activation(qwix, rule, w, contracting)
  how = _how(qwix, rule, w.ndim, contracting, rule.weight_qtype,
             rule.weight_calibration_method)
  return qwix.ptq.create_quantized_param(name, w, how).array


def _activation(qwix, rule, x: Any, contracting: int) -> Any:
  """`x` quantized with the rule's ``act_qtype`` where it sets one, its
  gradient straight through to `x` (as Qwix's PTQ matmuls give it): a
  `QuantizedArray` with `x` as its source where the scheme is one tokamax's
  kernels take, else the array it stands for."""
  if rule.act_qtype is None or quantization.is_quantized(x) or not hasattr(x, "ndim"):
    return x
  # Qwix rounds an array being differentiated otherwise than it does a plain
  # one (the values differed by a step in 2 of 3 elements); the gradient goes
  # to `x` below anyway.
  how = _how(qwix, rule, x.ndim, contracting, rule.act_qtype, rule.act_calibration_method)
  q = qwix.qarray.quantize(jax.lax.stop_gradient(x), how)
  if quantization.qwix_kernel_scheme(q):
    return quantization.QuantizedArray(q.qvalue, q.scale.astype(jnp.float32),
                                       dtype=x.dtype, source=x)
  # x - x is exactly 0: the forward is the dequantized array itself.
  stands_for = jax.lax.stop_gradient(qwix.qarray.dequantize(q).astype(x.dtype))
  return stands_for + (x - jax.lax.stop_gradient(x))


def outside_interception(fn: Callable) -> Callable:
  """`fn` run with Qwix's interceptions off where Qwix is loaded (the module
  docstring), as Qwix runs `pallas_call`s; `fn` itself otherwise."""
  interception = sys.modules.get("qwix._src.interception")
  disable = getattr(interception, "disable_interceptions", None)
  return fn if disable is None else disable(fn)


def _how(qwix, rule, ndim: int, contracting: int, qtype, calibration_method):
  """Qwix's ``HowToQuantize`` of a rank-`ndim` operand contracting along
  `contracting`, as its PTQ matmuls make it (`quantize_operands`)."""
  contracting %= ndim
  if isinstance(rule.tile_size, Mapping):
    tiled = dict(rule.tile_size)
  else:
    tiled = {contracting: rule.tile_size} if rule.tile_size else {}
  channelwise = [a for a in range(ndim) if a != contracting and a not in tiled]
  return qwix.qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise,
                                   tiled_axes=tiled, calibration_method=calibration_method)


class _Internals:
  """The Qwix modules `quantize_operands` uses."""

  def __init__(self, flax_util, ptq, qarray):
    self.flax_util, self.ptq, self.qarray = flax_util, ptq, qarray


def _qwix_internals(op_name: str) -> _Internals:
  """Qwix's param lookup, PTQ param replacement and quantization (module
  docstring); NotImplementedError naming the version where they moved."""
  try:
    internals = _Internals(importlib.import_module("qwix._src.utils.flax_util"),
                           importlib.import_module("qwix._src.providers.ptq"),
                           importlib.import_module("qwix._src.core.qarray"))
    for module, attr in ((internals.flax_util, "find_param"),
                         (internals.ptq, "create_quantized_param"),
                         (internals.qarray, "HowToQuantize"),
                         (internals.qarray, "quantize")):
      getattr(module, attr)
  except (ImportError, AttributeError) as e:
    version = getattr(sys.modules.get("qwix"), "__version__", "?")
    raise NotImplementedError(
        f"a Qwix PTQ rule matched tokamax's {op_name}, but this Qwix ({version}) "
        f"lacks the functions tokamax quantizes its weights with ({e}); tokamax "
        "is tested with qwix 0.1.8") from e
  return internals
