"""A model of the DRAM traffic of Mosaic GPU's causal attention dK/dV kernel,
alone or with dQ inside it (`AttentionVjpConfig.fuse_dq`), in its head-group
block order.

    python tools/l2_model_attention.py --call 8,4096,16,128 [--group 8 --group 4]
        [--two-kernels] [--l2-mb 50 --l2-mb 30] [--sms 132]

The kernel (`tokamax_gpu_mosaic.attention_kernel_bwd._DkvKernel`) runs one
block per 128 keys of one (batch row, head) pair, in groups of `--group` pairs
(`akc.block_position`: the key-block index slowest within a group); with dQ
inside, the highest key blocks first (`_DkvKernel.grid_group`), else the
lowest. Each block steps from its diagonal through the query tiles below it
(64 rows a step), reading the tile's Q and dO and, with dQ inside, adding into
the tile's float32 dQ in a fixed order: the highest key block first
(`_DkvKernel.dq_rank`), the first storing without a read. A block waits for
its turn at a tile; the SMs take the blocks in order as they free up.

This replays that through `tools/l2_model.py`'s least-recently-used cache of
`--l2-mb` (`LruCache`) and prints
the bytes read from and written to DRAM (dirty dQ lines written back when
evicted), against the least the kernel must move (each operand once). Each
step takes one unit of time. Not modelled: bandwidth (a miss costs no time),
L2's two partitions, its hashing and associativity, and lse and delta (a few
KB a tile). Like `tools/l2_model.py`, it says what the order lets L2 keep, not
how fast the kernel runs: the cliff where a group's working set outgrows the
cache moves with the capacity the real L2 gives (H100, B8 T4096 N16 H128
causal, dQ inside, group 8: Nsight Compute counted 1.62 GB read and 1.25 GB
written, notes/MEASUREMENTS.md session 84, where this model gives 0.54 GB each
at 40 MB and 8.4 GB / 4.5 GB at 30 MB).
"""

from __future__ import annotations

import argparse
import heapq
from typing import NamedTuple

import l2_model

KEY_ROWS = 128  # keys a block owns
QUERY_ROWS = 64  # query rows a step


class Call(NamedTuple):
  batch: int
  length: int  # T = S
  heads: int  # MHA
  head_dim: int
  itemsize: int = 2  # bf16


class Traffic(NamedTuple):
  read: int  # bytes from DRAM
  written: int  # bytes to DRAM
  least_read: int  # every operand once
  least_written: int
  steps: float  # the model's time: steps of the longest-running SM


def block_order(call: Call, group: int, fused: bool) -> list[tuple[int, int]]:
  """The (pair, key block) of each block in launch order."""
  pairs = call.batch * call.heads
  tiles = call.length // KEY_ROWS
  out = []
  for start in range(0, pairs, group):
    members = range(start, min(start + group, pairs))
    for t in range(tiles):
      out += [(p, tiles - 1 - t if fused else t) for p in members]
  return out


def simulate(call: Call, group: int, fused: bool, l2_bytes: float,
             sms: int = 132) -> Traffic:
  """DRAM bytes of the kernel's blocks in `block_order`, `sms` at a time."""
  if call.length % KEY_ROWS:
    raise ValueError(f"the model takes lengths that are multiples of {KEY_ROWS}")
  q_tile = QUERY_ROWS * call.head_dim * call.itemsize  # Q or dO
  dq_tile = QUERY_ROWS * call.head_dim * 4  # float32
  kv_block = 2 * KEY_ROWS * call.head_dim * call.itemsize  # K and V, or dK and dV
  query_tiles = call.length // QUERY_ROWS
  tiles = call.length // KEY_ROWS
  cache = l2_model.LruCache(l2_bytes)
  outputs = 0  # dK and dV bytes, written once per block (not through the cache)
  blocks = block_order(call, group, fused)
  events = [(0.0, i, i, 0) for i in range(min(sms, len(blocks)))]  # (time, seq, block, step)
  heapq.heapify(events)
  seq, launched, now = len(events), len(events), 0.0
  next_adder: dict[tuple[int, int], int] = {}  # (pair, tile) -> key block whose turn it is
  waiting: dict[tuple[int, int, int], tuple[int, int]] = {}
  stored: set[tuple[int, int]] = set()
  while events:
    now, _, b, step = heapq.heappop(events)
    pair, kb = blocks[b]
    j = kb * KEY_ROWS // QUERY_ROWS + step
    if j >= query_tiles:  # done: dK and dV out, the SM takes the next block
      outputs += kv_block
      if launched < len(blocks):
        heapq.heappush(events, (now, seq, launched, 0))
        seq, launched = seq + 1, launched + 1
      continue
    if fused:
      turn = next_adder.setdefault((pair, j), min(j * QUERY_ROWS // KEY_ROWS, tiles - 1))
      if turn != kb:
        waiting[(pair, j, kb)] = (b, step)
        continue
    cache.touch(("q", pair, j), q_tile)
    cache.touch(("do", pair, j), q_tile)
    if fused:
      cache.touch(("dq", pair, j), dq_tile, dirty=True, fill=(pair, j) not in stored)
      stored.add((pair, j))
      next_adder[(pair, j)] = kb - 1
      woken = waiting.pop((pair, j, kb - 1), None)
      if woken is not None:
        heapq.heappush(events, (now + 1, seq, *woken))
        seq += 1
    heapq.heappush(events, (now + 1, seq, b, step + 1))
    seq += 1
  if waiting:
    raise RuntimeError(f"{len(waiting)} blocks wait for a key block never launched")
  cache.flush()
  pairs = call.batch * call.heads
  read = cache.read + pairs * tiles * kv_block  # K and V, once per block
  operand = pairs * call.length * call.head_dim * call.itemsize
  dq = pairs * call.length * call.head_dim * 4  # float32
  least_written = 2 * operand + (dq if fused else 0)  # dK, dV (+ dQ)
  return Traffic(read, cache.written + outputs, 4 * operand, least_written, now)


def _call(text: str) -> Call:
  try:
    b, t, n, h = (int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected B,T,N,H (integers), got {text!r}") from None
  return Call(b, t, n, h)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--call", type=_call, required=True, metavar="B,T,N,H")
  parser.add_argument("--group", type=int, action="append", default=None,
                      help="(batch row, head) pairs a head group (default: 8)")
  parser.add_argument("--two-kernels", action="store_true",
                      help="the dK/dV kernel without dQ (longest blocks first)")
  parser.add_argument("--l2-mb", type=float, action="append", default=None)
  parser.add_argument("--sms", type=int, default=132)
  args = parser.parse_args()
  if args.call.length % KEY_ROWS:
    parser.error(f"--call: the model takes lengths that are multiples of {KEY_ROWS}, "
                 f"got T={args.call.length}")
  for l2_mb in args.l2_mb or [50.0]:
    for group in args.group or [8]:
      t = simulate(args.call, group, not args.two_kernels, l2_mb * 2**20, args.sms)
      print(f"B{args.call.batch} T{args.call.length} N{args.call.heads} "
            f"H{args.call.head_dim} {'two kernels' if args.two_kernels else 'dQ inside'} "
            f"group {group} L2 {l2_mb:g} MB: read {t.read / 1e9:.2f} GB "
            f"(least {t.least_read / 1e9:.2f}), written {t.written / 1e9:.2f} GB "
            f"(least {t.least_written / 1e9:.2f}), {t.steps:.0f} steps", flush=True)


if __name__ == "__main__":
  main()
