"""A computation that `jax.vmap` cannot batch as it is, and what to batch instead.

Some calls lower to something that batching would break: a `custom_partitioning`
call (vmap has no rule for it), or a persistent kernel whose blocks claim work
from one device-memory counter (Pallas batches a kernel into one launch whose
batch instances would share that counter). `vmap_fallback` runs such a call as
it is, and under `jax.vmap` batches another function that computes the same.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax


def _with_vmap_rule(call: Callable, rule: Callable) -> Callable:
  """`call` as a `custom_vmap` whose batching rule is ``rule(run, in_batched,
  *args)`` (`run`: the wrapped call itself), every output batched."""

  @jax.custom_batching.custom_vmap
  def run(*args):
    return call(*args)

  @run.def_vmap
  def _rule(axis_size, in_batched, *args):
    del axis_size
    out = rule(run, in_batched, *args)
    return out, jax.tree.map(lambda _: True, out)

  return run


def vmap_fallback(call: Callable, batched_call: Callable) -> Callable:
  """`call`, except under `jax.vmap`, where ``jax.vmap(batched_call)`` runs in
  its place (over the batched leaves of the positional arguments, which may be
  pytrees; every output batched).

  `batched_call` must compute what `call` computes, on the same positional
  arguments, with outputs of the same structure, and be batchable itself.
  Example, in a backend's kernel wrapper::

      run = tokamax.plugin.vmap_fallback(claiming_kernel, round_robin_kernel)
  """

  def vmapped(run, in_batched, *args):
    del run
    # `in_batched` mirrors the arguments: a pytree of flags per pytree argument.
    in_axes = jax.tree.map(lambda batched: 0 if batched else None, tuple(in_batched))
    return jax.vmap(batched_call, in_axes=in_axes)(*args)

  return _with_vmap_rule(call, vmapped)


def sequential_under_vmap(call: Callable) -> Callable:
  """`call`, except under `jax.vmap`, where it runs once per batch element
  (`lax.map` over the batched leaves of the positional arguments, which may be
  pytrees; the other leaves closed over), its outputs stacked.

  For a call that cannot be batched at all: JAX's TPU interpreter fails on the
  extra grid dimension that batching gives a `pallas_call`, so the tpu-mosaic
  kernels run through this when interpreted (on a TPU they batch as usual).
  Nested `vmap`s map each level. Like `vmap_fallback` (a `custom_vmap`), it
  has no reverse-mode derivative of its own: use it inside an Op's forward or
  backward (a custom VJP), where the kernels are."""

  def mapped(run, in_batched, *args):
    # `in_batched` mirrors the arguments: a flag per leaf, in flattening order.
    leaves, tree = jax.tree.flatten(args)
    flags = jax.tree.leaves(in_batched)

    def one(elements):
      it = iter(elements)
      element = [next(it) if batched else x for x, batched in zip(leaves, flags)]
      return run(*jax.tree.unflatten(tree, element))  # nested vmaps map again
    return lax.map(one, [x for x, batched in zip(leaves, flags) if batched])

  return _with_vmap_rule(call, mapped)
