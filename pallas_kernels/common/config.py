"""Tile configs of the Triton-lowered kernels, and the head-dim and tile arithmetic
every kernel family shares."""

from __future__ import annotations

import dataclasses

MIN_BLOCK = 16  # Triton's dot needs every tile side to be at least 16.
# The widest head any Pallas kernel here takes (its tiles and accumulators must fit
# shared memory and registers).
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiles and launch parameters of a Triton-lowered attention-shaped kernel family:
  a forward kernel (``block_q`` x ``block_k``), a dK/dV kernel and a dQ kernel.
  Flash, window, dilated and parallel-retention attention all run on it.

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
        raise ValueError(f"BlockConfig.{field} must be a power of two >= {MIN_BLOCK}, got {value}")
    for field in ("num_warps", "bwd_num_warps"):
      value = getattr(self, field)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"BlockConfig.{field} must be one of 1, 2, 4, 8, 16, got {value}")
    for field in ("num_stages", "bwd_num_stages"):
      if getattr(self, field) < 1:
        raise ValueError(f"BlockConfig.{field} must be >= 1, got {getattr(self, field)}")


def next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
  """Head dims are padded with zeros to a power of two (>= 16) for the tiles."""
  return max(MIN_BLOCK, next_power_of_two(head_dim))


def clamp_block(block: int, length: int) -> int:
  """The block actually used for a sequence of ``length``: never larger than needed."""
  return max(MIN_BLOCK, min(block, next_power_of_two(length)))


def default_block_config(head_dim: int, dtype_bytes: int) -> BlockConfig:
  """Heuristic defaults by padded head dim and element size (measured on H100)."""
  d = padded_head_dim(head_dim)
  if dtype_bytes >= 4:
    # fp32 tiles take twice the shared memory and registers of fp16 ones.
    return BlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                            block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                            bwd_num_warps=4, bwd_num_stages=2)
  # d <= 64 and d <= 128: the winners of bench/flash.py --sweep on an H100
  # (bench/results/flash_sweep_{fwd,bwd}.json), fp16, causal and not.
  if d <= 64:
    return BlockConfig(block_q=64, block_k=64, num_warps=4, num_stages=3,
                            block_q_dkv=64, block_k_dkv=64, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=4, bwd_num_stages=3)
  if d <= 128:
    return BlockConfig(block_q=128, block_k=64, num_warps=4, num_stages=2,
                            block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=8, bwd_num_stages=3)
  return BlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                          block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                          bwd_num_warps=8, bwd_num_stages=1)
