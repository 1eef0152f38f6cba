"""Block sizes and launch parameters of the Triton-lowered flash attention kernels."""

from __future__ import annotations

import dataclasses

MIN_BLOCK = 16  # Triton's dot needs every tile side to be at least 16.


@dataclasses.dataclass(frozen=True)
class FlashBlockConfig:
  """Tile sizes and launch parameters for the forward, dK/dV and dQ kernels.

  Every block size must be a power of two and at least 16. They are clamped to
  the (padded) sequence lengths of a call, so one config serves every length.
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  block_q_dkv: int = 64
  block_k_dkv: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  bwd_num_warps: int = 8
  bwd_num_stages: int = 2

  def __post_init__(self):
    for field in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
      value = getattr(self, field)
      if value < MIN_BLOCK or value & (value - 1):
        raise ValueError(f"FlashBlockConfig.{field} must be a power of two >= {MIN_BLOCK}, got {value}")
    for field in ("num_warps", "bwd_num_warps"):
      value = getattr(self, field)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"FlashBlockConfig.{field} must be one of 1, 2, 4, 8, 16, got {value}")
    for field in ("num_stages", "bwd_num_stages"):
      if getattr(self, field) < 1:
        raise ValueError(f"FlashBlockConfig.{field} must be >= 1, got {getattr(self, field)}")


def next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
  """Head dims are padded with zeros to a power of two (>= 16) for the tiles."""
  return max(MIN_BLOCK, next_power_of_two(head_dim))


def clamp_block(block: int, length: int) -> int:
  """The block actually used for a sequence of ``length``: never larger than needed."""
  return max(MIN_BLOCK, min(block, next_power_of_two(length)))


def default_config(head_dim: int, dtype_bytes: int) -> FlashBlockConfig:
  """Heuristic defaults by padded head dim and element size (measured on H100)."""
  d = padded_head_dim(head_dim)
  if dtype_bytes >= 4:
    # fp32 tiles take twice the shared memory and registers of fp16 ones.
    return FlashBlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                            block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                            bwd_num_warps=4, bwd_num_stages=2)
  # d <= 64 and d <= 128: the winners of bench/flash.py --sweep on an H100
  # (bench/results/flash_sweep_{fwd,bwd}.json), fp16, causal and not.
  if d <= 64:
    return FlashBlockConfig(block_q=64, block_k=64, num_warps=4, num_stages=3,
                            block_q_dkv=64, block_k_dkv=64, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=4, bwd_num_stages=3)
  if d <= 128:
    return FlashBlockConfig(block_q=128, block_k=64, num_warps=4, num_stages=2,
                            block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=8, bwd_num_stages=3)
  return FlashBlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                          block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                          bwd_num_warps=8, bwd_num_stages=1)


MOSAIC_BLOCK = 64  # a wgmma instruction covers 64 rows per warpgroup
MOSAIC_MAX_BWD_HEAD_DIM = 128  # dK and dV accumulators of wider heads overflow registers


@dataclasses.dataclass(frozen=True)
class MosaicBlockConfig:
  """Tile sizes of the Hopper (Mosaic GPU) kernels.

  ``block_q`` / ``block_q_dq`` / ``block_kv_dkv`` are per consumer warpgroup: a CTA
  covers twice as many rows. Every block is a multiple of 64. ``stages`` is the
  depth of the shared-memory ring the producer warpgroup fills: at least 2 (a
  one-slot ring gave wrong dQ on the H100, see docs/backends.md).
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  bwd_stages: int = 2

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


def mosaic_head_dim(head_dim: int) -> int:
  """Head dims are zero-padded to a multiple of 64 (the swizzled tile width)."""
  return -(-head_dim // MOSAIC_BLOCK) * MOSAIC_BLOCK


def default_mosaic_config(head_dim: int) -> MosaicBlockConfig:
  """Hopper tiles by padded head dim: the winners of ``bench/flash.py --sweep-mosaic``
  on an H100 (bench/results/flash_sweep_mosaic.json), within 227 KB of shared memory."""
  d = mosaic_head_dim(head_dim)
  if d <= 64:  # small accumulators: 128 rows per warpgroup fit in registers
    return MosaicBlockConfig(block_q=128, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=3)
  if d <= 128:
    return MosaicBlockConfig(block_q=64, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=2)
  return MosaicBlockConfig(block_q=64, block_kv=64, stages=2)
