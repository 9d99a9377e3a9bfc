"""How a layer_norm call is split over a mesh (see `tokamax._src.sharding`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tokamax._src import sharding


def layer_norm_plan(mesh, shapes, specs, supports) -> sharding.Plan:
  """Layer/RMS norm: each row dim split freely; a split feature axis runs a jnp
  path whose statistics (sum and sum of squares) are psum'd across feature
  shards (it sees the local rows flattened, ``[R, D]``)."""
  del supports
  *rows, d = shapes.x.shape
  rx = sharding.fit_each(mesh, specs.x[:-1], rows)
  fx = sharding.fit(mesh, specs.x[-1], d, sharding.joined(rx))
  R = tuple(sharding.entry(axes) for axes in rx)
  F = sharding.entry(fx)
  arg_specs = dataclasses.replace(
      shapes, x=P(*R, F), scale=None if shapes.scale is None else P(F),
      offset=None if shapes.offset is None else P(F))
  plan = sharding.Plan(args=arg_specs, out=P(*R, F),
              residuals={"mean": P(*R), "rstd": P(*R)})
  if fx:
    plan.forward = lambda mesh, a, run: _feature_sharded_layer_norm(a, fx, d)
    plan.backward = (lambda mesh, a, res, out, dout, run:
                     _feature_sharded_layer_norm_grad(a, dout, fx, d))
  return plan


def _norm_stats(a, fx, d):
  xf = a.x.astype(jnp.float32)
  if a.subtract_mean:
    mean = sharding.psum(jnp.sum(xf, axis=-1), fx) / d
  else:
    mean = jnp.zeros(xf.shape[:-1], jnp.float32)
  centered = xf - mean[:, None]
  var = sharding.psum(jnp.sum(jnp.square(centered), axis=-1), fx) / d
  rstd = jax.lax.rsqrt(var + a.epsilon)
  return centered * rstd[:, None], mean, rstd


def _feature_sharded_layer_norm(a, fx, d):
  xhat, mean, rstd = _norm_stats(a, fx, d)
  y = xhat
  if a.scale is not None:
    y = y * a.scale.astype(jnp.float32)
  if a.offset is not None:
    y = y + a.offset.astype(jnp.float32)
  return y.astype(a.x.dtype), {"mean": mean, "rstd": rstd}


def _feature_sharded_layer_norm_grad(a, dout, fx, d):
  xhat, _, rstd = _norm_stats(a, fx, d)
  dy = dout.astype(jnp.float32)
  g = dy if a.scale is None else dy * a.scale.astype(jnp.float32)
  proj = sharding.psum(jnp.sum(g * xhat, axis=-1, keepdims=True), fx) / d
  dx = g - xhat * proj
  if a.subtract_mean:
    dx = dx - sharding.psum(jnp.sum(g, axis=-1, keepdims=True), fx) / d
  grads = {"x": (dx * rstd[:, None]).astype(a.x.dtype)}
  if a.scale is not None:
    grads["scale"] = jnp.sum(dy * xhat, axis=0).astype(a.scale.dtype)
  if a.offset is not None:
    grads["offset"] = jnp.sum(dy, axis=0).astype(a.offset.dtype)
  return grads
