"""The window attention kernels' default tiles (a config heuristic; the config is
the shared ``BlockConfig``)."""

from __future__ import annotations

from jattn.kernels.common.config import BlockConfig


def default_window_config(head_dim: int, dtype_bytes: int) -> BlockConfig:
  """Tiles for windows of up to a few hundred tokens: 64-sided everywhere (a starting
  point to tune on the GPU; fp32 halves the key tiles for shared memory)."""
  del head_dim  # small head dims (DAT: 30-60) all pad to <= 64
  block_k = 32 if dtype_bytes >= 4 else 64
  return BlockConfig(block_q=64, block_k=block_k, num_warps=4, num_stages=2,
                     block_q_dkv=block_k, block_k_dkv=64, block_q_dq=64, block_k_dq=block_k,
                     bwd_num_warps=4, bwd_num_stages=2)
