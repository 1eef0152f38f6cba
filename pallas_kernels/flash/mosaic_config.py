"""Tile sizes of the Hopper (Mosaic GPU) flash attention kernels."""

from __future__ import annotations

import dataclasses

from jattn.kernels.flash.mosaic_pipeline import CONSUMERS

MOSAIC_BLOCK = 64  # a wgmma instruction covers 64 rows per warpgroup
# The Hopper backward keeps a consumer's dK and dV accumulators (block_kv_dkv x (dk + dv)
# fp32) in registers: up to dk + dv = 256 with any tiles the cost model admits, up to 320
# (dk = 192, dv = 128: measured on the H100 at 4.4 ms against the Triton backward's
# 16.9 ms, bench/results/flash_dk192_backward_probe.json) with the 64-row tiles of wide
# heads.
# Wider heads run the Triton backward.
MOSAIC_MAX_BWD_WIDTH = 320
MOSAIC_MODELLED_BWD_WIDTH = 256


def mosaic_backward_runs(head_dim: int, value_head_dim: int) -> bool:
  """Whether the Hopper backward kernels take these head dims (else: Triton's)."""
  return mosaic_head_dim(head_dim) + mosaic_head_dim(value_head_dim) <= MOSAIC_MAX_BWD_WIDTH


@dataclasses.dataclass(frozen=True)
class MosaicBlockConfig:
  """Tile sizes of the Hopper (Mosaic GPU) kernels.

  ``block_q`` / ``block_q_dq`` / ``block_kv_dkv`` are per consumer warpgroup: a CTA
  covers twice as many rows. Every block is a multiple of 64. ``stages`` is the
  depth of the shared-memory ring the producer warpgroup fills: at least 2 (a
  one-slot ring gave wrong dQ on the H100; the cause was not found).

  ``fused_dq``: the backward computes dQ inside the dK/dV kernel and adds it into an
  fp32 buffer with TMA reduce-adds (5 matmuls per block pair instead of 7, but the
  sum order varies from run to run: ``deterministic=True`` calls, the default, run the
  two kernels whatever this says; head dims up to 128). Off by default: on the H100
  the reduce-adds made it slower at most shapes (bench/results/flash_fused_dq.md);
  the autotuner tries it.

  ``persistent``: the forward runs one CTA per SM, each walking its share of the
  (query tile, head, batch) work items, with K/V streaming on across items and the
  next item's Q tile loaded during the current one (where two Q buffers fit the
  shared memory). False: one CTA per work item. None (default): persistent exactly
  when every item has the same work (no causal mask, window or segment ids). On the
  H100 it measured 2-3% faster than one CTA per item without a mask, and up to 30%
  slower with causal masks, whose uneven items the hardware's dynamic CTA scheduling
  balances better than its static split (bench/results/flash_issue16_persistent.md).
  The autotuner tries both.
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  bwd_stages: int = 2
  fused_dq: bool = False
  persistent: bool | None = None

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                  "block_kv_dkv"):
      value = getattr(self, field)
      if value < MOSAIC_BLOCK or value % MOSAIC_BLOCK:
        raise ValueError(f"MosaicBlockConfig.{field} must be a positive multiple of "
                         f"{MOSAIC_BLOCK}, got {value}")
    for field in ("stages", "bwd_stages"):
      if getattr(self, field) < 2:
        raise ValueError(f"MosaicBlockConfig.{field} must be >= 2, got {getattr(self, field)}")


MOSAIC_SMEM_OVERHEAD = 4 * 1024  # barriers and alignment
# Opt-in shared memory per CTA on sm_90, less the overhead.
HOPPER_SMEM_BYTES = 232448 - MOSAIC_SMEM_OVERHEAD


def output_view_rows(block_q: int, dk: int, dv: int) -> int | None:
  """Rows of the ``dv``-wide view under which a consumer's Q tile (``block_q x dk``)
  takes the forward's output tile: the view has exactly the tile's bytes, so each
  consumer's output lands in its own Q tile (``block_q`` for ``dv == dk``). None where
  no such view exists (``dv > dk``, or rows that are not whole 8-row swizzle tiles):
  the output then has a tile of its own."""
  rows, rest = divmod(block_q * dk, dv)
  return rows if dv <= dk and not rest and rows % 8 == 0 else None


def forward_smem_bytes(block_q: int, block_kv: int, stages: int, dk: int, dv: int,
                       nbytes: int, q_buffers: int) -> int:
  """Shared memory of the Hopper forward kernel's tiles: ``q_buffers`` Q tiles per
  consumer (which take the output tile where ``output_view_rows`` says so, else an
  output tile of its own), ``stages`` K and V slots."""
  out = CONSUMERS * block_q * dv if output_view_rows(block_q, dk, dv) is None else 0
  return (q_buffers * CONSUMERS * block_q * dk + out + stages * block_kv * (dk + dv)) * nbytes


def forward_q_buffers(block_q: int, block_kv: int, stages: int, dk: int, dv: int,
                      nbytes: int) -> int:
  """2 (the next work item's Q prefetched) where that fits the shared memory, else 1."""
  double = forward_smem_bytes(block_q, block_kv, stages, dk, dv, nbytes, 2)
  return 2 if double <= HOPPER_SMEM_BYTES else 1


def mosaic_head_dim(head_dim: int) -> int:
  """Head dims are zero-padded to a multiple of 64 (the swizzled tile width)."""
  return -(-head_dim // MOSAIC_BLOCK) * MOSAIC_BLOCK


def default_mosaic_config(head_dim: int, value_head_dim: int | None = None) -> MosaicBlockConfig:
  """Hopper tiles by padded head dims (``value_head_dim``: V's, default ``head_dim``):
  the winners of ``bench/flash.py --sweep-mosaic`` on an H100
  (bench/results/flash_sweep_mosaic.json), within 227 KB of shared memory. Heads wider
  than 128 take 128-key forward tiles where those fit the shared memory (dk = 192 with
  dv = 128, whose output takes a view of the Q tile: 1.15-1.17x the forward's TFLOP/s
  of 64-key tiles on the H100, bench/results/flash_dk192_tiles.md), else 64."""
  dk = mosaic_head_dim(head_dim)
  dv = mosaic_head_dim(head_dim if value_head_dim is None else value_head_dim)
  d = max(dk, dv)
  if d <= 64:  # small accumulators: 128 rows per warpgroup fit in registers
    return MosaicBlockConfig(block_q=128, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=3)
  if d <= 128:
    return MosaicBlockConfig(block_q=64, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=2)
  wide_tiles = forward_smem_bytes(64, 128, 2, dk, dv, 2, 1) <= HOPPER_SMEM_BYTES
  return MosaicBlockConfig(block_q=64, block_kv=128 if wide_tiles else 64, stages=2)
