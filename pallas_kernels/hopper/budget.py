"""What one Hopper CTA may use, in the units the kernels' cost models count: shared
memory in bytes, registers as fp32 accumulator values per consumer thread, and the
tile granularity every block size and head dim is padded to."""

from __future__ import annotations

MOSAIC_BLOCK = 64  # a wgmma instruction covers 64 rows per warpgroup
MOSAIC_SMEM_OVERHEAD = 4 * 1024  # barriers and alignment
# Opt-in shared memory per CTA on sm_90, less the overhead.
HOPPER_SMEM_BYTES = 232448 - MOSAIC_SMEM_OVERHEAD
# Consumer warpgroups hold 232 registers a thread, of which about 30 go to addresses
# and row statistics: accumulators beyond 200 fp32 values a thread spill.
MOSAIC_REGISTER_BUDGET = 200
THREADS_PER_WARPGROUP = 128


def mosaic_head_dim(head_dim: int) -> int:
  """Head dims are zero-padded to a multiple of 64 (the swizzled tile width)."""
  return -(-head_dim // MOSAIC_BLOCK) * MOSAIC_BLOCK

