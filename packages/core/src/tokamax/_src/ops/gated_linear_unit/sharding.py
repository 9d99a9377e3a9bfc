"""How a gated_linear_unit call is split over a mesh (see `tokamax._src.sharding`)."""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from tokamax._src import sharding
from tokamax._src import activation as activation_lib


def gated_linear_unit_plan(mesh, shapes, specs, supports) -> sharding.Plan:
  """GLU: each row dim of x split; weights split on N (tensor parallel: the
  output is split on N). The contraction dim K is never split (replicated).

  The activation decides what may split: rows where each row computes alone
  (elementwise, or shown by `activation.rows_independent`; with traced params,
  by `closure.hoist_traced_closure`'s one-row trace), N where it is elementwise.
  Otherwise those dims stay whole: a split would silently change the result."""
  del supports
  params = None if shapes.activation_params is None else P(None)
  if shapes.group_sizes is not None:
    # Grouped (MoE experts): replicated. Expert parallelism runs the op inside
    # `shard_map`, where it sees each device's own experts and rows.
    return sharding.Plan(
        args=dataclasses.replace(shapes, x=P(None, None), weights=P(None, None, None, None),
                                 group_sizes=P(None), activation_params=params),
        out=P(None, None), residuals={"projections": P(None, None, None)},
        whole=params is not None)
  *rows, _ = shapes.x.shape
  n = shapes.weights.shape[2]
  mx = sharding.fit_each(mesh, specs.x[:-1], rows)
  # (With traced params the activation takes them too: no plain elementwise map.)
  elementwise = params is None and _elementwise(shapes.activation)
  whole = params is not None and not shapes.activation.rows_independent
  if whole:
    # Traced at the call's whole gate shape, and not shown to compute row by row
    # (`closure.hoist_traced_closure`): it runs whole, replicated.
    mx = tuple(() for _ in rows)
  elif (params is None and any(mx) and not elementwise
        and not activation_lib.rows_independent(shapes.activation, n)):
    # An activation that mixes rows (a column mean) sees all of them: a shard of
    # the rows would get another result (replicated rows instead).
    mx = tuple(() for _ in rows)
  nx = sharding.fit(mesh, specs.weights[2], n, sharding.joined(mx))
  if nx and not elementwise:
    # An activation that mixes a row's N columns needs whole rows, and so does
    # one with traced params (traced at whole rows).
    nx = ()
  M = tuple(sharding.entry(axes) for axes in mx)
  N = sharding.entry(nx)
  arg_specs = dataclasses.replace(shapes, x=P(*M, None), weights=P(None, None, N),
                                  activation_params=params)
  return sharding.Plan(args=arg_specs, out=P(*M, N), residuals={"projections": P(*M, None, N)},
                       whole=whole)


def _elementwise(activation) -> bool:
  try:
    activation_lib.check_elementwise_activation(activation)
  except NotImplementedError:
    return False
  return True
