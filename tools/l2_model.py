"""A model of the L2 traffic of ragged_dot's Mosaic GPU forward item schedule.

    python tools/l2_model.py [--m 65536 --k 7168 --n 2048 --g 256] [--equal]
        [--block-m 128] [--cta-n 256] [--order group|snake] [--width 8]
        [--schedule static|dynamic|wave_barrier|sharer_sync]
        [--jitter 0.03] [--sm-bias 0.0] [--l2-mb 50] [--sms 132]

The kernel (`tokamax_gpu_mosaic.ragged_dot_kernel`) deals its work items (a row
tile x a column tile) to a persistent grid round robin, in the order of its
work-item table; each item streams ``K / 64`` k-slices of its lhs rows and of
its group's weight columns. Readers of one slice share it through L2 only if
they read it close enough in time. This model replays the kernel's own tables
(`work_items`, `ordered_items`, or `planar_snake` for the snake order) through
a least-recently-used cache of `--l2-mb` and prints the bytes that miss
(DRAM reads) beside the bytes requested and the distinct operand bytes.

Time: every matmul item takes one unit, its k-slices read evenly over it,
times ``(1 + sm_bias_s) * (1 + jitter * N(0, 1))`` per item (a fixed speed per
block, then noise per item); zero items take a hundredth. Schedules:

- ``static``: the kernel's round-robin deal (block ``L % sms`` runs index L);
- ``dynamic``: each index goes to the block that is free first;
- ``wave_barrier``: the deal, all blocks waiting for the slowest between waves;
- ``sharer_sync``: the deal, each sharer block of the table (a band's row
  tiles of one column tile, `RaggedDotConfig.sync_sharers`) starting
  together, when the last of its blocks is free.

Not modelled: bandwidth (a miss costs no time, so blocks that miss do not fall
behind), L2's partitions and hashing, writes, the fill of a block's first
item. It says what the order and the schedule let L2 share, not how fast the
kernel runs. H200 (notes/MEASUREMENTS.md, session 39): Nsight Compute counted
12.9 GB of DRAM traffic at M65536 K7168 N2048 G256 random; this model gives
8.73 GB of reads in lockstep and 13.65 GB with 3% noise per item.
"""

from __future__ import annotations

import argparse
import collections
import heapq
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

A_ROWS = 8  # lhs rows per cached unit (swizzled TMA reads rows 8 at a time)
BLOCK_K = 64  # columns of a k-slice (the kernels' block_k)


class Row(NamedTuple):
  """One linear index of the kernel's item loop."""

  row0: int  # first lhs row of the tile
  group: int  # rhs group, -1 for zero and past-the-end items
  matmul: bool  # whether it runs a K loop
  col: int  # column tile
  first: int = 0  # group order: its sharer block, indices [first, first + sharers)
  sharers: int = 1
  lo: int = 0  # rows [lo, hi) of the tile belong to its group
  hi: int = 0


def group_sizes(m: int, g: int, equal: bool) -> np.ndarray:
  """The bench's split (`ragged_dot.problems.problem`): random cuts, or equal."""
  if equal:
    return np.full(g, m // g)
  cuts = np.sort(np.random.default_rng(0).integers(0, m, g - 1))
  return np.diff(np.concatenate([[0], cuts, [m]]))


def item_rows(sizes, m: int, n: int, block_m: int, cta_n: int, order: str,
              width: int) -> list[Row]:
  """The kernel's linear indices, in order, from its own table functions."""
  from tokamax_gpu_mosaic import ragged_dot_kernel as rdk
  ends = np.cumsum(sizes)
  starts = ends - sizes
  items = rdk.work_items(jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32),
                         m, block_m)
  n_tiles = -(-n // cta_n)
  if order == "group":
    table = np.asarray(rdk.ordered_items(items, n_tiles, width, sharers=True))
    return [Row(int(r[0]), int(r[1]), bool(r[1] >= 0 and r[3] > r[2]), int(r[4]),
                int(r[rdk._FIRST]), int(r[rdk._SHARERS]), int(r[2]), int(r[3]))
            for r in table]
  items = np.asarray(items)
  rows = []
  for index in range(items.shape[0] * n_tiles):
    ii, col = rdk.plgpu.planar_snake(jnp.int32(index), (items.shape[0], n_tiles), 1,
                                     width)
    r = items[int(ii)]
    rows.append(Row(int(r[0]), int(r[1]), bool(r[1] >= 0 and r[3] > r[2]), int(col),
                    lo=int(r[2]), hi=int(r[3])))
  return rows


def start_times(rows: list[Row], sms: int, schedule: str, jitter: float,
                sm_bias: float, seed: int = 1) -> list[tuple[float, float]]:
  """(start, duration) of every index, in the units of one matmul item."""
  rng = np.random.default_rng(seed)
  bias = 1 + sm_bias * rng.standard_normal(sms)
  clock = np.zeros(sms)
  free = [(0.0, s) for s in range(sms)]
  out = []
  for index, row in enumerate(rows):
    if schedule == "dynamic":
      _, sm = heapq.heappop(free)
    else:
      sm = index % sms
    if schedule == "wave_barrier" and sm == 0:
      clock[:] = clock.max()
    if schedule == "sharer_sync" and row.matmul and row.first == index:
      members = [L % sms for L in range(index, index + row.sharers)]
      clock[members] = clock[members].max()
    duration = bias[sm] * (1 + jitter * rng.standard_normal()) if row.matmul else 0.01
    out.append((clock[sm], duration))
    clock[sm] += duration
    if schedule == "dynamic":
      heapq.heappush(free, (clock[sm], sm))
  return out


def row_padding(rows: list[Row], m: int, block_m: int) -> tuple[float, float]:
  """(rows loaded, rows multiplied) / M over the matmul row tiles: whole tiles
  load; a compute warpgroup skips a 64-row half (128 of a 256-row tile) that
  holds no row of the item's group."""
  tiles = {(r.row0, r.group): (r.lo, r.hi) for r in rows if r.matmul}
  half = block_m // 2
  halves = sum(min(hi, half * (h + 1)) > max(lo, half * h)
               for lo, hi in tiles.values() for h in range(2))
  return len(tiles) * block_m / m, halves * half / m


class LruCache:
  """A least-recently-used cache of `capacity` bytes (the model's L2): counts
  the bytes that miss (`read` from DRAM) and the dirty bytes it evicts
  (`written` back); `flush` writes back what stays dirty at the end."""

  def __init__(self, capacity: float):
    self.capacity = capacity
    self.read = self.written = 0
    self._lines: collections.OrderedDict = collections.OrderedDict()  # key -> (bytes, dirty)
    self._used = 0

  def touch(self, key, size: int, *, dirty: bool = False, fill: bool = False) -> bool:
    """Accesses `key` (`size` bytes), writing it if `dirty`; returns whether it
    hit. ``fill``: a miss that overwrites the whole line (a first store), which
    reads nothing."""
    if key in self._lines:
      self._lines.move_to_end(key)
      self._lines[key] = (size, self._lines[key][1] or dirty)
      return True
    self.read += 0 if fill else size
    self._lines[key] = (size, dirty)
    self._used += size
    while self._used > self.capacity:
      _, (evicted, was_dirty) = self._lines.popitem(last=False)
      self._used -= evicted
      self.written += evicted if was_dirty else 0
    return False

  def flush(self) -> None:
    self.written += sum(size for size, dirty in self._lines.values() if dirty)
    self._lines.clear()
    self._used = 0


class Traffic(NamedTuple):
  requested: int  # bytes the items read
  dram: int  # of them, bytes that missed the model's L2
  makespan: float  # in items


def l2_traffic(rows: list[Row], times, m: int, k: int, block_m: int, cta_n: int,
               l2_bytes: float, itemsize: int = 2) -> Traffic:
  """Replays every k-slice read in time order through an LRU cache (lhs rows
  from `m` on are TMA's zero fill: no read)."""
  steps = -(-k // BLOCK_K)
  reads = []
  for row, (start, duration) in zip(rows, times):
    if row.matmul:
      reads += [(start + duration * j / steps, row.row0, row.group, row.col, j)
                for j in range(steps)]
  reads.sort()
  a_unit = A_ROWS * BLOCK_K * itemsize
  b_slice = BLOCK_K * cta_n * itemsize
  cache, requested = LruCache(l2_bytes), 0
  for _, row0, group, col, j in reads:
    keys = [(("B", group, col, j), b_slice)]
    last = min(row0 + block_m, m)
    keys += [(("A", u, j), a_unit) for u in range(row0 // A_ROWS, -(-last // A_ROWS))]
    for key, size in keys:
      requested += size
      cache.touch(key, size)
  makespan = max((s + d for s, d in times), default=0.0)
  return Traffic(requested, cache.read, makespan)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--m", type=int, default=65536)
  p.add_argument("--k", type=int, default=7168)
  p.add_argument("--n", type=int, default=2048)
  p.add_argument("--g", type=int, default=256)
  p.add_argument("--equal", action="store_true", help="equal group sizes (else random)")
  p.add_argument("--block-m", type=int, default=128)
  p.add_argument("--cta-n", type=int, default=256,
                 help="output columns of an item (2 x block_n; block_n for 256-row items)")
  p.add_argument("--order", choices=("group", "snake"), default="group")
  p.add_argument("--width", type=int, default=8, help="grid_tile_width")
  p.add_argument("--schedule", default="static",
                 choices=("static", "dynamic", "wave_barrier", "sharer_sync"))
  p.add_argument("--jitter", type=float, default=0.0, help="noise per item (std)")
  p.add_argument("--sm-bias", type=float, default=0.0, help="fixed speed spread per block")
  p.add_argument("--l2-mb", type=float, default=50.0)
  p.add_argument("--sms", type=int, default=132)
  a = p.parse_args(argv)
  if a.schedule == "sharer_sync" and a.order != "group":
    p.error("--schedule sharer_sync needs --order group (as sync_sharers does)")
  sizes = group_sizes(a.m, a.g, a.equal)
  rows = item_rows(sizes, a.m, a.n, a.block_m, a.cta_n, a.order, a.width)
  times = start_times(rows, a.sms, a.schedule, a.jitter, a.sm_bias)
  t = l2_traffic(rows, times, a.m, a.k, a.block_m, a.cta_n, a.l2_mb * 1e6)
  weights = a.g * a.k * a.n * 2
  loaded, multiplied = row_padding(rows, a.m, a.block_m)
  print(f"{a.schedule} {a.order} block_m={a.block_m} cta_n={a.cta_n} "
        f"jitter={a.jitter} sm_bias={a.sm_bias} L2={a.l2_mb} MB "
        f"{'equal' if a.equal else 'random'} groups: requested {t.requested / 1e9:.2f} GB, "
        f"DRAM reads {t.dram / 1e9:.2f} GB (distinct: weights {weights / 1e9:.2f}, "
        f"lhs {a.m * a.k * 2 / 1e9:.2f}), makespan {t.makespan:.1f} items; "
        f"rows loaded {loaded:.3f} x M, multiplied {multiplied:.3f} x M")


if __name__ == "__main__":
  main()
