"""Measured times for a call tuned data never saw: those of the nearest measured call.

Tuned data is measured over a grid of shapes (`python -m tokamax autotune
--grid`); a call between grid points takes the implementation times of the
nearest measured call *of the same kind*:

- the same fields, the same dtypes (bfloat16 and float16 count as one: the
  kernels and their ranking are the same), the same ranks, equal non-numeric
  options (``is_causal``, the activation, ...), and, for arrays of one rank, the
  same axes of equal size (attention's query and key: MHA or GQA, self- or
  cross-attention), and, where an op's kernels take another path at sizes
  that are no multiple of a tile (`TILE_ALIGNED`: attention's lengths at 128
  and 8), the same largest tile dividing those sizes, and, where its backward
  does so also at multiples that are no power of two of the tile
  (`POWERS_OF_TWO`), for the backward and the step those count as no multiple;
- among those, the nearest by the largest ``|log2((a + 1) / (b + 1))|`` over
  the integers of the key (array dimensions, integer options such as a window
  size), then by their sum; float options (``scale``, ``epsilon``) are ignored.
  The largest, not the sum, so that a size several arrays share (T in query, key
  and value) counts once;
- within `radius_for(op)` octaves on every integer (`RADIUS`, 4x either way,
  unless the op's measurements say less): farther data says nothing about the
  call, and the registry's order stands (as where no call of its kind was
  measured), but where an op names axes whose agreement may go
  (`KIND_FALLBACK`: attention's head sharing), the nearest calls that differ
  from the call only there answer first;
- where an op's direction ranks its implementations by a size more than by the
  others (`SAME_SIZE_FIRST`: the attention forward by the head dim), a call of
  that size first; only where none is within the radius, one of any size;
- where an implementation's kernel computes whole tiles along a size
  (`WHOLE_TILES`: the Mosaic GPU GLU inference forward's rows), its time at each measured
  call is scaled by how much more (or less) padding the call's size has than the
  measured one's (`scale_for_whole_tiles`), as the others' is not: a call just
  past a multiple of the tile pays a whole tile more where they pay a row;
- a call about as near to several measured calls as to the nearest (within
  `TIE` octaves of the nearest one's distance, the largest and the total: a
  call halfway between grid points along the same sizes) takes all of them,
  each implementation's time the geometric mean of its times there (`blend`).

How well this transfers is measured, not assumed: notes/MEASUREMENTS.md
(session 13) compares the choice it makes at shapes off the grid with the fastest
implementation measured there.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable

RADIUS = 2.0
# ragged_dot's rankings change within an octave (notes/MEASUREMENTS.md, session
# 22, H200, random group sizes): triton's few wins on its grid (at most 7%) held
# 0.42 octave away and not 0.68 away (G160 K5120 N1536: 29% slower than
# mosaic_gpu there). Over 13 calls (6 off the grid, 7 grid points each predicted
# without itself) the worst regret was 1.29x forward and 1.23x forward+backward
# at radius 2, 1.07x and 1.02x at 0.5 (the one miss a grid point, which its own
# data covers).
RADIUS_BY_OP = {"ragged_dot": 0.5}


# Measured calls within TIE octaves of the nearest one's distance from a call,
# both the largest and the total, all answer for it (`nearest_keys`, `blend`).
# The nearest alone decides between two grid points by the +1 in the distance
# where the call is halfway between them, and rankings drift between grid
# points. Measured on the H200 data (notes/MEASUREMENTS.md, session 54, items 5,
# 9 and 16): the bench row B2 T8192 N32 K8 H128 causal sits one octave (3 in
# total: T in query, key and value) from B2 T4096 (mosaic_gpu's backward 0.7%
# faster) and from B2 T16384 (cuDNN's 11% faster); the nearest alone ran
# mosaic_gpu, 3.3% slower than cuDNN there, the blend of the two picks cuDNN.
# Attention leave-one-out (`tools/grid_check.py`, 63 calls), within 3% of the
# fastest, forward / backward / step: nearest alone 57 / 54 / 56; TIE 0.1: 57 /
# 55 / 56; 0.5: 59 / 55 / 56. (A tie on the largest distance alone scored 61 /
# 55 / 57, but blends calls of other head dims and head counts, one octave in
# H or N being as near as one in T.) The other ops score the same.
TIE = 0.5


def radius_for(op_name: str) -> float:
  """How far (octaves, on every integer of the key) an op's tuned data transfers."""
  return RADIUS_BY_OP.get(op_name, RADIUS)


# (array field, axis) where a call's own size comes first, per (op, direction).
# The attention forward's ranking follows the head dim, its backward's the batch
# and sequence sizes: H200 grid of session 32, leave-one-out
# (notes/MEASUREMENTS.md, session 32, item 9), forward 35/38 calls within 3%
# with the head dim first against 19/38 without; the backward 23/38 with it
# against 34/38 without. So the forward alone.
SAME_SIZE_FIRST = {("dot_product_attention", "forward"): (("query", -1),)}


# Sizes where being a multiple of a tile or not changes which kernel runs, per
# op: ((array field, axis), ...), (tile, ...), largest first. A call's kind
# then includes, for each such size, the largest of the tiles it is a multiple
# of (1 for none), so that calls of one kind do not answer for another.
#
# Attention's query and key lengths (H200, notes/MEASUREMENTS.md session 58):
# - at 128 (tokamax_gpu_mosaic's key blocks, `KEY_ROWS`): Mosaic GPU's
#   one-kernel backward takes only key lengths that are multiples of 128
#   without causal masking, and a forward whose last tile is partly padding
#   masks it. Forward+backward at B4 T3000 N16 H128 ran 1.044x cuDNN's where
#   the aligned grid points had it 1-4% ahead; the T1000, T4000 and T15000
#   grid points rank cuDNN's backward ahead at H128 in 7 of 8.
# - at 8 (TMA's row tiles, its `_common.TMA_TILE_ROWS`): it copies its inputs
#   padded. Its forward at B16 T1500 N16 H64 causal took 0.342 ms against
#   0.212 at T1536 and cuDNN's 0.210. Lengths of that kind have no grid
#   points: `None` takes the registry's order there (cuDNN first).
#
# The norms' width at 1024 and 128 (tokamax_gpu_mosaic's whole pieces and its
# narrowest tail, `layer_norm.PIECE` and `COLUMN_STEP`): past whole pieces the
# Mosaic GPU kernels run tail pieces of narrower vectors, with a warpgroup
# reduction each, and they refuse widths no multiple of 128. The grid's
# multiples of 1024 do not answer for tails: there on the H100 Triton's
# backward ran ahead (LayerNorm 8192 x 4096: 4%), while at 1280-14848
# columns with a tail the Mosaic GPU kernels ran forward+backward 1.0-1.39x
# as fast as Triton's, the forward within 3% or faster (notes/MEASUREMENTS.md,
# session 103). With no grid points of their own those widths keep the
# registry's order (Mosaic GPU first; it declines rows under 1024 columns).
TILE_ALIGNED = {"dot_product_attention": ((("query", 1), ("key", 1)), (128, 8)),
                "layer_norm": ((("x", -1),), (1024, 128))}


# Calls whose backward ranks otherwise where the number of tiles in a length is
# a power of two or not, per op: ((array field, axis), tile, whether a call's
# key is one of those calls). For the backward (and the training step, which
# ranks as its backward does), where that length is a multiple of the tile but
# no power of two of them, the call's `TILE_ALIGNED` sizes that are multiples
# of the tile count as multiples of the next tile only (`_kind`): it answers
# for, and is answered by, the calls of lengths no multiple of the tile.
#
# Attention without causal masking, H128, and MHA at H64 (H200): Mosaic GPU's
# one-kernel backward (dQ in the dK/dV kernel), which the grid's powers of two
# measure, has every key block of a head resident at once; where the blocks of
# whole heads do not fill the SMs it ran behind cuDNN (session 77, forward+
# backward against cuDNN's: B1 T10240 N16 (80 blocks a head) 1.25x, B2 T6144
# 1.07x, B1 T15616 1.04x, B4 T3072 1.03x; at B1 T8192 and B4 T4096 it ran
# 1-2% ahead). Since session 78 Mosaic GPU runs its two-kernel backward there
# in all three (`tokamax_gpu_mosaic.attention._fuses_dq_by_default`), as where
# the length is no multiple of 128: at B1 T15616 N8 K1 H128 (122 blocks)
# the nearest point, B2 T16384 (the one-kernel backward, 1.3% ahead of
# cuDNN's), put Mosaic GPU first; it ran 1.10x cuDNN forward+backward there, as
# the two-kernel one does at B2 T15000 (session 74, item 3). Either way the
# unaligned lengths' data (cuDNN's backward first at H128 in 7 of their 8
# points, session 58) ranks those calls as they run.
def _attention_one_kernel_backward_at_powers_of_two(key: str) -> bool:
  causal = dict(_fields(key)).get("is_causal", "").strip()
  n, h, k = _sizes_at(key, (("query", 2), ("query", -1), ("key", 2)))
  return causal == "False" and (h == 128 or (h == 64 and n == k))


POWERS_OF_TWO = {"dot_product_attention": (("key", 1), 128,
                                           _attention_one_kernel_backward_at_powers_of_two)}


# Where no measured call of a call's kind is within the radius, the measured
# calls that differ from it only in whether two arrays agree on an axis, per
# op: ((array field, array field, axis), ...); the nearest of those answer for
# it before the registry's order does (`op_nearest_keys`).
#
# Attention's head sharing: MHA (as many key as query heads) and GQA or MQA are
# kinds apart (`_equal_positions`), so a call of one with points of the other
# alone near took the registry's order, cuDNN first: the H200 grid has sliding
# windows under GQA only. Measured on the shipped grids (`python
# tools/grid_check.py --device D`, its "other kinds alone" part;
# notes/MEASUREMENTS.md, session 86): each attention grid call with a call of
# the other head sharing within the radius (133 of the H200's 179, 66 of the
# H100's), predicted from those alone, picked within 3% of the fastest at 130
# / 118 / 121 of the H200's 133 (forward / backward / step; worst regret 8.7 /
# 12.4 / 12.3%), the registry's order at 50 / 68 / 62 (worst 54 / 39 / 41%);
# at 64 / 58 / 59 of the H100's 66 against 39 / 31 / 31.
KIND_FALLBACK = {"dot_product_attention": (("query", "key", 2), ("query", "value", 2))}


# Implementations whose kernels compute whole tiles along a size, per (op,
# direction): {implementation: ((array field, axis), tile)}. Between grid points
# such an implementation's time follows its size rounded up to the tile, the
# others' (cuBLAS picks its tiles per shape) the size itself.
#
# The GLU forward at K4096 N14336 on the H200 (notes/MEASUREMENTS.md, session
# 73, item 3), mosaic_gpu (tiles of 128 rows, the config every grid point tuned
# to) against the composed implementation, ms: M1024 0.315 / 0.322 (the grid
# point), M1025 0.362 / 0.334, M1080 0.357 / 0.342, M1152 0.359 / 0.368, M2049
# 0.688 / 0.644, M4097 1.268 / 1.269, M16383 5.012 / 4.991: Mosaic GPU's time
# stays flat from 1025 to 1152 rows (nine row tiles) as the composed one's grows
# with the rows, so the grid point at M1024 ranked it first where it ran up to
# 8% slower. Its backward does not follow (dx's and dw's matmuls tile M
# otherwise): at M1025 it ran 0.664 against the composed 0.692; nor does a
# training step's forward (XLA's matmuls, keeping the projections), so the
# step's sums (`AutotuningResult.step_times`) are not scaled. (The tile is the
# shipped data's block_m; a result tuned to block_m 256 pads to 256, and grouped
# calls pad each group: neither is in the shipped data.)
WHOLE_TILES = {("gated_linear_unit", "forward"): {"mosaic_gpu": (("x", 0), 128)}}


def scale_for_whole_tiles(op_name: str, direction: str, key: str, measured_key: str,
                          times: dict[str, float]) -> dict[str, float]:
  """`times` measured at `measured_key`, each `WHOLE_TILES` implementation's
  scaled to the call at `key` relative to the others' (which stand as
  measured: only the ranking matters): by its padding there (the size rounded
  up to the tile, over the size) over its padding at the measured call."""
  tiled = WHOLE_TILES.get((op_name, direction))
  if not tiled or key == measured_key:
    return times
  out = dict(times)
  for impl, ((field, axis), tile) in tiled.items():
    (size,), (measured,) = _sizes_at(key, ((field, axis),)), _sizes_at(
        measured_key, ((field, axis),))
    if impl in out and size and measured:
      out[impl] *= _padding(size, tile) / _padding(measured, tile)
  return out


def _padding(size: int, tile: int) -> float:
  """`size` rounded up to a multiple of `tile`, over `size`."""
  return -(-size // tile) * tile / size


def tile_aligned(op_name: str, directions: Iterable[str] = ("forward",)) -> tuple | None:
  """`TILE_ALIGNED`'s (axes, tiles) for an op, or None; where `directions`
  include the backward and the op has `POWERS_OF_TWO`, (axes, tiles, its
  entry)."""
  aligned = TILE_ALIGNED.get(op_name)
  powers = POWERS_OF_TWO.get(op_name)
  if aligned is None or powers is None or "backward" not in directions:
    return aligned
  return (*aligned, powers)


def same_size_first(op_name: str, direction: str) -> tuple[tuple[str, int], ...]:
  """The (array field, axis) pairs whose size a measurement of `direction`
  should share with the call, where one that does is near (`SAME_SIZE_FIRST`)."""
  return SAME_SIZE_FIRST.get((op_name, direction), ())


# "name=value" fields, separated by spaces; a value may itself hold spaces
# ("local_window_size=(1024, 0)"), so a field starts only where "name=" does.
_FIELD = re.compile(r"(?:^| )([A-Za-z_][A-Za-z0-9_]*)=")
_ARRAY = re.compile(r"^([a-z0-9_]+)\[([0-9,]*)\]$")
_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"^-?[0-9.]+(?:e-?[0-9]+)?$|^-?inf$|^nan$")
_SAME_DTYPE = {"float16": "bfloat16"}


def _fields(key: str) -> list[tuple[str, str]]:
  starts = list(_FIELD.finditer(key))
  out = []
  for m, nxt in zip(starts, starts[1:] + [None]):
    end = nxt.start() if nxt is not None else len(key)
    out.append((m.group(1), key[m.end():end]))
  return out


@functools.lru_cache(maxsize=4096)
def parse(key: str) -> tuple[tuple, tuple[int, ...]]:
  """``(kind, numbers)`` of an args key: what must match (with an op's tile
  kinds besides: `_kind`), and the integers to measure the distance on (in
  field order, so equal kinds align them)."""
  kind, numbers, arrays = [], [], []
  for name, value in _fields(key):
    array = _ARRAY.match(value)
    if array:
      dtype, dims = array.groups()
      dims = [int(d) for d in dims.split(",") if d]
      kind.append((name, _SAME_DTYPE.get(dtype, dtype), len(dims)))
      numbers += dims
      arrays.append((name, dims))
    elif _FLOAT.match(value) and not _INT.fullmatch(value):
      kind.append((name, "float"))
    elif re.fullmatch(r"[-0-9(), ]+", value) and _INT.search(value):
      ints = [int(i) for i in _INT.findall(value)]
      kind.append((name, "ints", len(ints)))
      numbers += ints
    else:
      kind.append((name, value))
  kind += _equal_positions(arrays)
  return tuple(kind), tuple(numbers)


def _equal_positions(arrays: list[tuple[str, list[int]]]) -> list[tuple]:
  """For each pair of (field, sizes) arrays of one rank, the axes where their
  sizes agree: ``("equal axes", field, field, (agree, ...))``.

  Attention's query and key agree on every axis in self-attention with as many
  key as query heads, not in GQA (N != K) or cross-attention (T != S). Measured
  (notes/MEASUREMENTS.md, session 13, item 7): with MHA and GQA calls as one
  kind, grid points of one were predicted from the other, and the training
  step's worst leave-one-out regret was 14% (H200) and 27% (H100); 5% and 11%
  apart.
  """
  out = []
  for i, (name_a, a) in enumerate(arrays):
    for name_b, b in arrays[i + 1:]:
      if len(a) == len(b):
        out.append(("equal axes", name_a, name_b, tuple(x == y for x, y in zip(a, b))))
  return out


def _without_agreement(kind: tuple, axes: tuple[tuple[str, str, int], ...]) -> tuple:
  """`kind` with whether the arrays of `axes` ((field, field, axis) triples,
  `KIND_FALLBACK`) agree there left out."""
  out = []
  for entry in kind:
    if entry[0] == "equal axes":
      _, a, b, agree = entry
      agree = tuple(None if (a, b, axis) in axes else same
                    for axis, same in enumerate(agree))
      entry = ("equal axes", a, b, agree)
    out.append(entry)
  return tuple(out)


def distance(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[float, float]:
  """(largest, total) octaves between two aligned integer tuples."""
  octaves = [abs(math.log2((abs(x) + 1) / (abs(y) + 1))) for x, y in zip(a, b)]
  return max(octaves, default=0.0), sum(octaves)


@functools.lru_cache(maxsize=4096)
def _sizes_at(key: str, axes: tuple[tuple[str, int], ...]) -> tuple:
  """The sizes of `key`'s arrays at `axes` ((field, axis) pairs; None where the
  key has no such array or axis)."""
  arrays = {name: m.group(2).split(",") for name, value in _fields(key)
            if (m := _ARRAY.match(value))}
  sizes = []
  for name, axis in axes:
    dims = arrays.get(name, [])
    sizes.append(int(dims[axis]) if -len(dims) <= axis < len(dims) and dims[axis]
                 else None)
  return tuple(sizes)


def nearest(key: str, measured: Iterable[str], radius: float = RADIUS,
            same_first: tuple[tuple[str, int], ...] = (),
            aligned: tuple | None = None) -> str | None:
  """The measured key of `key`'s kind nearest to it within `radius`, or None:
  the first of `nearest_keys`."""
  keys = nearest_keys(key, measured, radius, same_first, aligned)
  return keys[0] if keys else None


def nearest_keys(key: str, measured: Iterable[str], radius: float = RADIUS,
                 same_first: tuple[tuple[str, int], ...] = (),
                 aligned: tuple | None = None,
                 fallback: tuple[tuple[str, str, int], ...] = ()) -> list[str]:
  """The measured keys of `key`'s kind within `radius` and within `TIE` of the
  nearest one's distance (largest and total), nearest first (then in sorted
  order, so that the answer does not depend on the order the data was loaded
  in); [] where none is within `radius`.

  `same_first`: (array field, axis) pairs (`same_size_first`): the nearest of the
  keys of `key`'s sizes there if one is within `radius`, else of any.
  `aligned`: (axes, tiles) (`tile_aligned`): only keys whose sizes there are
  multiples of the same largest tile as `key`'s.
  `fallback`: (field, field, axis) triples (`KIND_FALLBACK`): where none of
  `key`'s kind is within `radius`, the same search over the keys that differ
  from it only in whether those arrays agree on those axes.
  """
  measured = sorted(set(measured))
  for without in ((), fallback) if fallback else ((),):
    if same_first:
      own = _sizes_at(key, same_first)
      same = [k for k in measured if _sizes_at(k, same_first) == own]
      found = _nearest(key, same, radius, aligned, without)
      if found:
        return found
    found = _nearest(key, measured, radius, aligned, without)
    if found:
      return found
  return []


def op_nearest_keys(op_name: str, key: str, measured: Iterable[str],
                    same_first: tuple[tuple[str, int], ...] = (),
                    directions: Iterable[str] = ("forward",)) -> list[str]:
  """`nearest_keys` under `op_name`'s rules for times of `directions`: its
  radius (`radius_for`), its tile kinds (`tile_aligned`) and the kinds that
  answer where its own has no call near (`KIND_FALLBACK`)."""
  return nearest_keys(key, measured, radius_for(op_name), same_first,
                      tile_aligned(op_name, directions),
                      KIND_FALLBACK.get(op_name, ()))


def op_kind(op_name: str, key: str, directions: Iterable[str] = ("forward",)) -> tuple:
  """What a measured call must share with `key` to answer for it under
  `op_name`'s rules for times of `directions` (before `KIND_FALLBACK`)."""
  return _kind(key, tile_aligned(op_name, directions))


def _largest_tile(size: int | None, tiles: tuple[int, ...]) -> int:
  """The first (largest) of `tiles` that divides `size`; 1 for none."""
  return next((t for t in tiles if size is not None and size % t == 0), 1)


@functools.lru_cache(maxsize=16384)
def _relaxed_kind(key: str, aligned: tuple | None,
                  without: tuple[tuple[str, str, int], ...]) -> tuple:
  """`_kind`, but for the agreements `without` names (none: `_kind` itself).
  Cached: dispatch compares a call's kind with every measured call's."""
  kind = _kind(key, aligned)
  return _without_agreement(kind, without) if without else kind


def _kind(key: str, aligned: tuple | None) -> tuple:
  """What a measured key must share with a call: `parse`'s kind, and the
  largest of the `aligned` tiles its sizes at the `aligned` axes are
  multiples of (`POWERS_OF_TWO`'s rule applied where `aligned` has it)."""
  kind = parse(key)[0]
  if aligned is None:
    return kind
  axes, tiles, *powers = aligned
  largest = [_largest_tile(s, tiles) for s in _sizes_at(key, axes)]
  if powers:
    (axis, tile, applies), = powers
    (size,) = _sizes_at(key, (axis,))
    if (applies(key) and size is not None and size % tile == 0
        and not _power_of_two(size // tile)):
      below = tuple(t for t in tiles if t < tile)
      largest = [_largest_tile(s, below) if t == tile else t
                 for s, t in zip(_sizes_at(key, axes), largest)]
  return kind + (("multiples of", tuple(largest)),)


def _power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _nearest(key: str, measured: list[str], radius: float,
             aligned: tuple | None = None,
             without: tuple[tuple[str, str, int], ...] = ()) -> list[str]:
  """The keys of `measured` (sorted) of `key`'s kind, but for the agreements
  `without` names (`_without_agreement`), nearest to it within `radius`, those
  within `TIE` of the nearest included, nearest first."""
  kind, numbers = _relaxed_kind(key, aligned, without), parse(key)[1]
  near = []
  for other in measured:
    if _relaxed_kind(other, aligned, without) != kind:
      continue
    other_numbers = parse(other)[1]
    d = distance(numbers, other_numbers)
    if d[0] <= radius:
      near.append((d, other))
  if not near:
    return []
  near.sort()
  (largest, total), _ = near[0]
  return [k for (l, t), k in near if l - largest <= TIE and t - total <= TIE]


def blend(times: list[dict[str, float]]) -> dict[str, float]:
  """``{implementation: ms}`` for a call between the measured calls whose
  `times` these are (nearest first): the geometric mean of each
  implementation's times, for the implementations measured at every one of
  them; +inf for one that failed at any (so that dispatch still tries it last).
  The geometric mean ranks as the mean of the log-time ratios does, so a call
  halfway between two points takes each implementation's lead halfway too.
  Where no implementation was measured at all of them, the nearest one's."""
  if len(times) <= 1:
    return dict(times[0]) if times else {}
  common = set.intersection(*(set(t) for t in times))
  if not common:
    return dict(times[0])
  blended = {impl: math.prod(t[impl] for t in times) ** (1 / len(times))
             for impl in sorted(common)}
  for t in times:
    blended.update({impl: math.inf for impl, ms in t.items() if ms == math.inf})
  return blended
