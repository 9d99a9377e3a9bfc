"""RMSNorm with a hand-written backward (the kernel module, imported lazily)."""

import dataclasses

import jax
import jax.numpy as jnp

import tokamax


def _check(args):
  if args.subtract_mean:
    raise NotImplementedError("example_rms only does RMS normalization "
                              "(subtract_mean=False)")
  if args.offset is not None:
    raise NotImplementedError("example_rms has no offset")


@dataclasses.dataclass(frozen=True)
class ExampleRmsNorm(tokamax.Op):
  op_name = "layer_norm"
  name = "example_rms"

  def check_supported(self, args, device):
    _check(args)

  def forward(self, args, config):
    x = args.x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + args.epsilon)
    y = x * rstd[:, None]
    if args.scale is not None:
      y = y * args.scale.astype(jnp.float32)
    mean = jnp.zeros_like(rstd)
    return y.astype(args.x.dtype), {"mean": mean, "rstd": rstd}


@dataclasses.dataclass(frozen=True)
class ExampleRmsNormVjp(tokamax.VjpOp):
  op_name = "layer_norm"
  name = "example_rms"

  def check_supported(self, args, device, residuals=None):
    _check(args)
    if residuals is not None and "rstd" not in residuals:
      raise NotImplementedError("needs the forward's rstd residual")

  def backward(self, args, residuals, out, dout, config):
    x = args.x.astype(jnp.float32)
    rstd = residuals["rstd"][:, None]
    xhat = x * rstd
    dy = dout.astype(jnp.float32)
    grads = {}
    if args.scale is not None:
      grads["scale"] = jnp.sum(dy * xhat, axis=0)
      dy = dy * args.scale.astype(jnp.float32)
    d = x.shape[-1]
    dx = rstd * (dy - xhat * jnp.sum(dy * xhat, axis=-1, keepdims=True) / d)
    grads["x"] = dx
    return grads
