"""What one Hopper CTA may use, in the units the kernels' cost models count: shared
memory in bytes, registers as fp32 accumulator values per consumer thread, and the
tile granularity every block size and head dim is padded to, and the head widths the
backward kernels take."""

from __future__ import annotations

from jattn.kernels.hopper.pipeline import CONSUMERS

MOSAIC_BLOCK = 64  # a wgmma instruction covers 64 rows per warpgroup
# Opt-in shared memory per CTA on sm_90; the kernels' models count what Mosaic GPU
# allocates against it (``pipeline.smem_bytes``).
HOPPER_SMEM_BYTES = 232448
# Consumer warpgroups hold 232 registers a thread, of which about 30 go to addresses
# and row statistics: accumulators beyond 200 fp32 values a thread spill.
MOSAIC_REGISTER_BUDGET = 200
THREADS_PER_WARPGROUP = 128

# The backward keeps a consumer's dK and dV accumulators (block_kv_dkv x (dk + dv) fp32)
# in registers: up to dk + dv = 256 with any tiles the cost model admits, up to 320
# (dk = 192, dv = 128) with the 64-row tiles of wide heads, whose dK/dV kernel feeds
# its own ring (no producer warpgroup). Wider heads take the Triton backward.
MOSAIC_MAX_BWD_WIDTH = 320
MOSAIC_MODELLED_BWD_WIDTH = 256


def mosaic_head_dim(head_dim: int) -> int:
  """Head dims are zero-padded to a multiple of 64 (the swizzled tile width)."""
  return -(-head_dim // MOSAIC_BLOCK) * MOSAIC_BLOCK


def fused_dq_columns(head_dim: int) -> int:
  """Head-dim columns of the fused dQ tile each consumer computes: with head dims that
  split into whole 64-wide tiles, the consumers share one dQ tile (each summing both
  consumers' dS over its half of the columns); else each its own, over all columns."""
  half = head_dim // CONSUMERS
  return half if half % MOSAIC_BLOCK == 0 else head_dim
