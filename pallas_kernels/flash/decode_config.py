"""The split-KV decode kernels' config and its cost model: how many programs split one
(batch row, KV head) cache.

A decode step is memory-bound: its time is the K/V bytes over the bandwidth the
running programs draw, and a program streams at a bounded rate. So the cache must be
split over enough programs to fill every SM, but each split adds a fixed cost (its
launch, its query tile, its partial ``(o, lse)`` written and merged) and splits past
the point where every SM is busy only add that cost. The model, in units of one key
block read by one program:

    time(n) = waves(n) * (ceil(blocks / n) + FIXED_BLOCKS) + merge(n)

with ``waves(n) = ceil(items * n / (sms * RESIDENT))`` (items: batch x KV heads x row
tiles; ``RESIDENT`` programs share an SM) and ``merge(n)`` the partials' bytes written
and read back, over what one SM-wave of block reads moves. ``decode_config`` picks the
``n`` of least time (the smallest of equals).
"""

from __future__ import annotations

import dataclasses

from jattn.kernels.common.config import clamp_block
from jattn.kernels.hopper.budget import HOPPER_SMEM_BYTES
from jattn.kernels.hopper.forward import forward_smem_bytes
from jattn.kernels.hopper.pipeline import CONSUMERS

# Programs that stream together on one SM: with 64-key tiles in 3 stages, shared memory
# holds 2 to 4 (head dims 128 to 64), and programs beyond the slots still help hide the
# memory latency (measured: docs/backends.md).
RESIDENT = 4
# A program's fixed cost (launch, query tile, partial written), in key-block reads.
FIXED_BLOCKS = 2
# Query rows a decode tile holds at most: more positions take several row tiles.
MAX_BLOCK_M = 128
# At most this many query positions run the decode kernels (decode, speculative
# decoding, chunked prefill); more run the flash kernels.
DECODE_MAX_Q_LEN = 64
# The Hopper decode kernel: packed query rows per consumer warpgroup (a wgmma's M), keys
# per tile, and the deepest K/V ring it takes.
MOSAIC_DECODE_ROWS = 64
MOSAIC_DECODE_BLOCK_K = 64
MOSAIC_DECODE_MAX_STAGES = 4


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The decode kernels' tiles and split: ``block_m`` packed query rows (the query
  heads of one KV head times the positions), ``block_k`` keys per step, ``splits``
  programs per (batch row, KV head, row tile)."""

  block_m: int = 16
  block_k: int = 64
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 3


def split_time(splits: int, items: int, blocks: int, slots: int, merge_blocks: float) -> float:
  """The model's time of ``splits`` (see the module docstring): ``slots`` programs
  stream at once; ``merge_blocks``: one split's partials in key-block reads."""
  waves = -(-items * splits // slots)
  return waves * (-(-blocks // splits) + FIXED_BLOCKS) + items * splits * merge_blocks / slots


def best_splits(items: int, blocks: int, slots: int, merge_blocks: float) -> int:
  """The number of splits of least modelled time (the smallest of equals)."""
  return min(range(1, blocks + 1),
             key=lambda n: (split_time(n, items, blocks, slots, merge_blocks), n))


def decode_config(batch: int, q_len: int, q_heads: int, kv_heads: int, kv_len: int,
                  head_dim: int, value_head_dim: int, itemsize: int,
                  sm_count: int | None) -> DecodeConfig:
  """The decode config for a problem on a device with ``sm_count`` SMs (None: a
  CPU, where interpret mode runs a small made-up device of 4 SMs)."""
  group = q_heads // kv_heads
  block_m = clamp_block(MAX_BLOCK_M, q_len * group)
  row_tiles = -(-q_len * group // block_m)
  # 64-key tiles (the measured best: docs/backends.md); at head dim 64, 128 keys move the
  # same bytes a step.
  block_k = 64 if max(head_dim, value_head_dim) > 64 else 128
  block_k = clamp_block(block_k, kv_len)
  blocks = -(-kv_len // block_k)
  items = batch * kv_heads * row_tiles
  block_bytes = block_k * (head_dim + value_head_dim) * itemsize
  merge_blocks = 2 * block_m * (value_head_dim + 1) * 4 / block_bytes
  splits = best_splits(items, blocks, (sm_count or 4) * RESIDENT, merge_blocks)
  return DecodeConfig(block_m=block_m, block_k=block_k, splits=splits,
                      num_warps=4 if block_m <= 64 else 8, num_stages=3)


def mosaic_decode_stages(head_dim: int, value_head_dim: int, itemsize: int) -> int:
  """The deepest K/V ring (at most ``MOSAIC_DECODE_MAX_STAGES``) with which the Hopper
  decode kernel's tiles fit the shared memory at these head dims (multiples of 64);
  0 where not even one stage does."""
  fits = lambda stages: forward_smem_bytes(
      MOSAIC_DECODE_ROWS, MOSAIC_DECODE_BLOCK_K, stages, head_dim, value_head_dim, itemsize,
      1, ones_tile=True) <= HOPPER_SMEM_BYTES
  return next((s for s in range(MOSAIC_DECODE_MAX_STAGES, 0, -1) if fits(s)), 0)


def mosaic_decode_config(batch: int, q_len: int, q_heads: int, kv_heads: int, kv_len: int,
                         head_dim: int, value_head_dim: int, itemsize: int,
                         sm_count: int | None) -> DecodeConfig:
  """The Hopper decode kernel's config: one CTA per SM (its K/V ring fills the shared
  memory) over tiles of 128 packed rows, 64-key tiles in the deepest ring up to 4
  stages that fits (``mosaic_decode_stages``: 4 up to head dim 128, 3 at 192, 2 at
  256); the split by the same model."""
  rows = CONSUMERS * MOSAIC_DECODE_ROWS
  row_tiles = -(-q_len * (q_heads // kv_heads) // rows)
  block_k = MOSAIC_DECODE_BLOCK_K
  blocks = -(-kv_len // block_k)
  block_bytes = block_k * (head_dim + value_head_dim) * itemsize
  merge_blocks = 2 * rows * (value_head_dim * itemsize + 4) / block_bytes
  splits = best_splits(batch * kv_heads * row_tiles, blocks, sm_count or 4, merge_blocks)
  return DecodeConfig(block_m=rows, block_k=block_k, splits=splits, num_warps=4,
                      num_stages=max(1, mosaic_decode_stages(head_dim, value_head_dim,
                                                             itemsize)))
