"""Configs of the retention kernels (Triton-lowered Pallas) and their heuristics: the
parallel form's tiles (a ``BlockConfig``), the chunkwise form's ``ChunkwiseConfig``,
its default and its shared-memory model (``grad_kernel_bytes``, ``fitting_chunk``).
"""

from __future__ import annotations

import dataclasses

from jattn.kernels.common.config import (BlockConfig, SearchGrid, check_powers_of_two,
                                         default_block_config, padded_head_dim)


def default_parallel_config(head_dim: int, dtype_bytes: int) -> BlockConfig:
  """Flash attention's default tiles, except the forward for 2-byte dtypes at padded
  head dim 128: without a softmax, 8 warps on 128x32 tiles with 3 stages (the winner of
  ``bench/retention.py``'s sweep on an H100)."""
  config = default_block_config(head_dim, dtype_bytes)
  if dtype_bytes == 2 and padded_head_dim(head_dim) == 128:
    config = dataclasses.replace(config, block_q=128, block_k=32, num_warps=8, num_stages=3)
  return config


MIN_CHUNK = 16


def grad_kernel_bytes(chunk: int, dk: int, dv: int, itemsize: int) -> int:
  """Shared memory the per-chunk gradient kernel (the largest) is modelled to need.

  The chunk tiles of q, k, v, dO, the state and its gradient in the inputs' dtype,
  plus, for float32 inputs, a ``[chunk, chunk]`` float32 score tile; ``dk``, ``dv``
  are the padded head dims. It is exact (``TritonChunkwise.compile_misfit``): it matches
  what Triton asks for, except that it counts one configuration that compiles (2-byte
  dk = dv = 256 at chunk 32) as too large.
  """
  score_tile = 4 * chunk * chunk if itemsize == 4 else 0
  return itemsize * (chunk * 2 * (dk + dv) + 2 * dk * dv) + score_tile


def fitting_chunk(chunk: int, dk: int, dv: int, itemsize: int, smem_bytes: int) -> int | None:
  """The largest power-of-two chunk ``<= chunk`` whose kernels fit ``smem_bytes``
  (``dk``, ``dv``: unpadded head dims), or None when not even ``MIN_CHUNK`` does."""
  dk_p, dv_p = padded_head_dim(dk), padded_head_dim(dv)
  while chunk >= MIN_CHUNK:
    if grad_kernel_bytes(chunk, dk_p, dv_p, itemsize) <= smem_bytes:
      return chunk
    chunk //= 2
  return None


@dataclasses.dataclass(frozen=True)
class ChunkwiseConfig:
  """Chunk size, state tile side and launch parameters of the chunkwise kernels.

  ``chunk`` (a power of two >= ``MIN_CHUNK``) changes speed and shared memory, not
  the result. The two scans split the ``[dk, dv]`` state into ``state_block``-sided
  tiles, one program each: chunks are sequential, so the tiles are the parallelism
  when batch * heads is small.
  """

  chunk: int = 64
  state_block: int = 64
  scan_warps: int = 4
  scan_stages: int = 2
  out_warps: int = 4
  grad_warps: int = 8

  def __post_init__(self):
    check_powers_of_two(self, ("chunk", "state_block"), MIN_CHUNK)


def default_chunkwise_config(batch: int, heads: int, dk: int, dv: int, sm_count: int | None,
                             chunk: int = 64) -> ChunkwiseConfig:
  """The config for a problem and chunk: the largest state tile (64, 32, 16) that
  still gives the scans one program per SM.

  The scans walk the chunks in sequence, one program per (batch, head, state tile),
  so with few (batch, head) pairs the state is cut finer, for the SMs' sake.
  ``sm_count=None``: tiles of 64.
  """
  dk_p, dv_p = padded_head_dim(dk), padded_head_dim(dv)
  for block in (64, 32):
    tiles = max(1, dk_p // block) * max(1, dv_p // block)
    if sm_count is None or batch * heads * tiles >= sm_count:
      return ChunkwiseConfig(chunk=chunk, state_block=block)
  return ChunkwiseConfig(chunk=chunk, state_block=16)


# ChunkwiseConfig's search space: the chunk and state tiles first, then the warps of each kernel (no
# kernels named: the shared-memory model of the per-chunk gradient kernel prunes both).
CHUNKWISE_SEARCH = (
    SearchGrid("chunk", "fwd+bwd", {"chunk": (16, 32, 64, 128), "state_block": (16, 32, 64)}),
    SearchGrid("warps", "fwd+bwd", {"scan_warps": (2, 4, 8), "out_warps": (4, 8),
                                    "grad_warps": (4, 8)}),
)
