"""Split-KV decoding on Hopper: the shared forward kernel (``hopper.forward``) with the
online softmax row rule, run over ``hopper.work.DecodeItems``: each item is a tile of
packed query rows (the query heads of one KV head, ``decode_rows``) against one split
of the cache, whose partial ``(o, lse)`` the host merges. Per-row lengths are bound in
the kernel (``MaskSpec.with_lengths``); K and V come contiguous or paged
(``hopper.addressing.PagedKV``: pages a multiple of the key tile).
"""

from __future__ import annotations

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.tiling import pad_to, round_up
from jattn.kernels.flash.decode_config import (MOSAIC_DECODE_BLOCK_K, MOSAIC_DECODE_ROWS,
                                               DecodeConfig, mosaic_decode_stages)
from jattn.kernels.flash.decode_rows import full_lengths, merge_splits, pack_rows
from jattn.kernels.flash.mosaic_fwd import SoftmaxRows
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import ContiguousKV, PagedKV
from jattn.kernels.hopper.budget import MOSAIC_BLOCK, mosaic_head_dim
from jattn.kernels.hopper.forward import rows_forward
from jattn.kernels.hopper.inputs import PositionInputs, position_arrays
from jattn.kernels.hopper.work import DecodeItems

def mosaic_decode_runs(q_heads: int, kv_heads: int, head_dims: tuple[int, ...],
                       page_size: int | None = None,
                       block_kv: int = MOSAIC_DECODE_BLOCK_K) -> bool:
  """Whether the Hopper decode kernel takes the problem: a group that divides a
  consumer's rows (positions are whole in each), head dims that need no padding of the
  cache (multiples of 64) and whose tiles fit the shared memory (up to 384 at 16
  bits), and pages a multiple of the key tile."""
  group = q_heads // kv_heads
  return (MOSAIC_DECODE_ROWS % group == 0 and all(d % MOSAIC_BLOCK == 0 for d in head_dims)
          and mosaic_decode_stages(head_dims[0], head_dims[-1], 2) > 0
          and (page_size is None or page_size % block_kv == 0))


def mosaic_decode_preferred(q_len: int, group: int, head_dims: tuple[int, ...]) -> bool:
  """Whether the Hopper decode kernel is the faster of the two: where a KV head packs
  16 rows or more (its 64-row matmuls then carry work), or at head dim 64. With fewer
  rows at wider heads both stream at the memory bandwidth and the Triton kernel is the
  faster (the measurements: docs/backends.md)."""
  return q_len * group >= 16 or max(head_dims) <= 64


def flash_mosaic_decode(q, k, v, lengths, *, causal: bool, scale: float, local_window, softcap,
                        config: DecodeConfig, sinks=None, block_tables=None):
  """Flash attention forward for few query positions on Hopper. Arguments and results
  as ``triton_decode.flash_triton_decode``'s (``config.block_k``, ``splits`` and
  ``num_stages`` are the key tile, the splits and the ring's stages); the problem must
  pass ``mosaic_decode_runs``; 16-bit inputs."""
  batch, q_len, q_heads, head_dim = q.shape
  kv_heads, dv = k.shape[2], v.shape[-1]
  group = q_heads // kv_heads
  c = config
  rows = mp.CONSUMERS * MOSAIC_DECODE_ROWS
  rows_p = round_up(q_len * group, rows)
  if block_tables is None:
    kv_len = k.shape[1]
    kv_len_p = round_up(kv_len, c.block_k)
    addressing, extra = ContiguousKV(), ()
    k, v = pad_to(k, kv_len_p), pad_to(v, kv_len_p)
  else:
    page_size, per_seq = k.shape[1], block_tables.shape[1]
    kv_len = kv_len_p = page_size * per_seq
    addressing, extra = PagedKV(page_size, per_seq, k.shape[0]), (block_tables,)
  lengths = full_lengths(lengths, batch, q_len, kv_len)
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=True, segments=False, lengths=True)
  positions = PositionInputs(lengths=True)
  inputs = position_arrays(positions, lengths=lengths, padded=(rows_p, kv_len_p))
  n_blocks = kv_len_p // c.block_k
  split_blocks = -(-n_blocks // c.splits)
  items = DecodeItems(n_tiles=rows_p // rows, n_heads=kv_heads, n_batch=batch,
                      n_splits=-(-n_blocks // split_blocks), split_blocks=split_blocks,
                      block_q=MOSAIC_DECODE_ROWS, consumers=mp.CONSUMERS, group=group,
                      q_len=q_len)
  packed = pack_rows(q, kv_heads, rows_p, mosaic_head_dim(head_dim)).transpose(0, 2, 1, 3)
  o, lse = rows_forward(packed, k, v, (*inputs, *extra), rule=SoftmaxRows(spec, scale, softcap,
                                                                          positions),
                        spec=spec, block_q=MOSAIC_DECODE_ROWS, block_kv=c.block_k,
                        stages=c.num_stages, persistent=False, positions=positions,
                        addressing=addressing, items=items, group=1)
  # o: [batch, splits, rows_p, kv_heads, dv], lse: [batch, splits, kv_heads, rows_p]
  return merge_splits(o.transpose(0, 3, 1, 2, 4), lse.transpose(0, 2, 1, 3), sinks,
                      q_len=q_len, group=group, dv=dv, dtype=q.dtype)
