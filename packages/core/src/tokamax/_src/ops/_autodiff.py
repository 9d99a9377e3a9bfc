"""Backwards by JAX autodiff, shared by the ops' XLA implementations."""

from __future__ import annotations

import dataclasses

import jax


def vjp(fn, args, diff_fields):
  """``(fn(args), vjp)`` with `vjp` mapping a cotangent to ``{field: grad}``."""
  primals = {f: getattr(args, f) for f in diff_fields if getattr(args, f) is not None}
  out, vjp = jax.vjp(lambda p: fn(dataclasses.replace(args, **p)), primals)
  return out, vjp


def apply_vjp(vjp, out_dtype, dout):
  (grads,) = vjp(dout.astype(out_dtype))
  return grads


def backward(fn, args, diff_fields, dout):
  """Cotangents of `fn(args)` for `diff_fields` by JAX autodiff (recomputes fn)."""
  out, vjp_fn = vjp(fn, args, diff_fields)
  return apply_vjp(vjp_fn, out.dtype, dout)
