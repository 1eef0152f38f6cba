"""Split-KV decode attention, lowered through Triton (Ampere and newer): few query
positions (decode, speculative decoding, chunked prefill) against a long KV cache.

With few query rows the work is memory-bound: the kernel must read each K/V byte once
and keep every SM streaming. So

- the query heads that share a KV head are packed into one tile (``[q_len * group]``
  rows: row ``r`` is query position ``r // group`` of head ``r % group`` of the group),
  and the tile reads its KV head's keys once for all of them;
- the cache is split over ``splits`` programs per (batch row, KV head, row tile), each
  streaming its own range of key blocks with an online softmax, and writing a partial
  ``(o, lse)``;
- ``decode_rows.merge_splits`` merges the partials by their log-sum-exp, outside the
  kernel.

Grid: ``(splits, batch, kv_heads * row_tiles)``. Keys are those of the cache's
per-row lengths (``masking.MaskSpec.with_lengths``): a split past a row's length
visits nothing. The forward only: gradients come from the flash backward kernels,
which take any ``(o, lse)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.config import padded_head_dim
from jattn.kernels.common.launch import LENGTHS, triton_call
from jattn.kernels.common.masking import (MaskSpec, apply_mask, bind_lengths,
                                          packed_rows_block_range, range_tiles, run_tiles,
                                          split_block_range)
from jattn.kernels.common.nonfinite import guard_values
from jattn.kernels.common.softmax import (Softcap, dot, log2_logits, log2_units,
                                          online_softmax_finish, online_softmax_init,
                                          online_softmax_step)
from jattn.kernels.common.element_functions import kernel_array
from jattn.kernels.common.tiling import pad_last, pad_to, round_up
from jattn.kernels.flash.decode_config import DecodeConfig
from jattn.kernels.flash.decode_rows import full_lengths, merge_splits, pack_rows


@dataclasses.dataclass(frozen=True)
class ContiguousCache:
  """K/V as ``[batch, kv_len, kv_heads, d]``: a program's refs are its (batch row, KV
  head)'s ``[kv_len_p, d]`` keys, in order."""

  n_inputs = 0

  def specs(self, k, v, row_tiles: int) -> list:
    return [pl.BlockSpec((None, k.shape[1], None, x.shape[-1]),
                         lambda s, b, hr: (b, 0, hr // row_tiles, 0)) for x in (k, v)]

  def bind(self, refs, kv_len):
    del refs, kv_len
    return self

  def tile(self, ref, j, block_k: int):
    return ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k), :]


@dataclasses.dataclass(frozen=True)
class PagedCache:
  """K/V as pages ``[num_pages, page_size, kv_heads, d]`` and a block table
  ``[batch, pages_per_seq]``: key ``t`` of batch row ``b`` is in page ``table[b, t //
  page_size]``, slot ``t % page_size``. A program's refs are its KV head's pages and its
  row's table (padded to a power of two). Keys past the row's length read its last
  key's page (table entries past its pages are never read; page ids are clamped into
  the pages, so a bad table cannot read out of bounds)."""

  page_size: int
  num_pages: int
  table: Any = None  # bound: the row's table ref
  kv_len: Any = None  # bound: the row's length

  n_inputs = 1

  def specs(self, k, v, row_tiles: int) -> list:
    pages = [pl.BlockSpec((k.shape[0], k.shape[1], None, x.shape[-1]),
                          lambda s, b, hr: (0, 0, hr // row_tiles, 0)) for x in (k, v)]
    return pages

  def table_spec(self, table):
    return pl.BlockSpec((None, table.shape[1]), lambda s, b, hr: (b, 0))

  def bind(self, refs, kv_len):
    return dataclasses.replace(self, table=refs[0], kv_len=kv_len)

  def _page(self, t):
    page = self.table[lax.div(t, jnp.int32(self.page_size))]
    return jnp.minimum(jnp.maximum(page, 0), self.num_pages - 1)

  def tile(self, ref, j, block_k: int):
    start = j * block_k
    if self.page_size % block_k == 0:  # the tile lies in one page
      offset = pl.multiple_of(lax.rem(start, jnp.int32(self.page_size)), block_k)
      return ref[self._page(start), pl.ds(offset, block_k), :]
    t = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    t = jnp.minimum(t, jnp.maximum(self.kv_len - 1, 0))
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    return ref[self._page(t), lax.rem(t, jnp.int32(self.page_size)), cols]


def _decode_kernel(q_ref, k_ref, v_ref, lengths_ref, *refs, cache, spec: MaskSpec,
                   scale: float, score, group: int, q_len: int, block_m: int, block_k: int,
                   split_blocks: int, row_tiles: int):
  spec = bind_lengths(spec, lengths_ref)
  cache = cache.bind(refs[:cache.n_inputs], spec.kv_len)
  o_ref, lse_ref = refs[cache.n_inputs:]
  row_start = lax.rem(pl.program_id(2), jnp.int32(row_tiles)) * block_m
  q = q_ref[...]
  rows = row_start + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  q_idx = lax.div(rows, jnp.int32(group))  # the row's query position

  def body(masked: bool, j, carry):
    k, v = cache.tile(k_ref, j, block_k), cache.tile(v_ref, j, block_k)
    if masked:  # masked weights must not meet a non-finite value (nonfinite.py)
      k, v = guard_values(k, v)
    k_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    s, c, _ = log2_logits(dot(q, k, 1, 1), scale, score)
    if masked:
      s = apply_mask(s, -jnp.inf, spec, q_idx, k_idx)
    return online_softmax_step(carry, s, c, v)

  c = log2_units(scale, score is not None)
  blocks = split_block_range(packed_rows_block_range(spec, row_start, block_m, group=group,
                                                     q_len=q_len, block_k=block_k),
                             pl.program_id(0), split_blocks)
  carry = run_tiles(range_tiles(*blocks), body,
                    online_softmax_init(block_m, v_ref.shape[-1], None, c))
  o, lse = online_softmax_finish(carry, c)
  o_ref[...] = o
  lse_ref[...] = lse


def decode_forward(q, k, v, lengths, tables=(), *, cache, spec: MaskSpec, scale: float, score,
                   group: int, q_len: int, block_m: int, block_k: int, splits: int,
                   interpret: bool, num_warps: int, num_stages: int):
  """Runs the decode kernel on packed, padded inputs.

  Args:
    q: ``[batch, kv_heads, rows_p, d_p]``: each KV head's query rows (``q_len *
      group``, position-major), padded to a multiple of ``block_m``.
    k, v: the cache as ``cache`` lays it out (``ContiguousCache``: ``[batch, kv_len_p,
      kv_heads, d_p]`` / ``[..., dv_p]``, ``kv_len_p`` a multiple of ``block_k``;
      ``PagedCache``: pages). Split ``s`` takes key blocks ``[s * n, (s + 1) * n)`` of
      ``n = ceil(blocks / splits)``, ``spec.kv_len`` keys in all.
    lengths: ``[batch, 2]`` int32 ``(q_len, kv_len)`` per batch row (``spec.lengths``).
    tables: the cache's inputs (``PagedCache``: the block table, its columns a power
      of two).

  Returns:
    Partials ``o: [batch, kv_heads, splits, rows_p, dv_p]`` float32 and ``lse:
    [batch, kv_heads, splits, rows_p]`` float32 (``EMPTY_ROW_LSE`` where a split saw
    no key).
  """
  batch, kv_heads, rows_p, d = q.shape
  dv = v.shape[-1]
  row_tiles = rows_p // block_m
  n_blocks = -(-spec.kv_len // block_k)
  split_blocks = -(-n_blocks // splits)
  kernel = functools.partial(_decode_kernel, cache=cache, spec=spec, scale=scale, score=score,
                             group=group, q_len=q_len, block_m=block_m, block_k=block_k,
                             split_blocks=split_blocks, row_tiles=row_tiles)
  table_specs = [cache.table_spec(t) for t in tables]
  return triton_call(
      kernel,
      grid=(splits, batch, kv_heads * row_tiles),
      in_specs=[pl.BlockSpec((None, None, block_m, d),
                             lambda s, b, hr: (b, hr // row_tiles, hr % row_tiles, 0)),
                *cache.specs(k, v, row_tiles), LENGTHS, *table_specs],
      out_specs=[pl.BlockSpec((None, None, None, block_m, dv),
                              lambda s, b, hr: (b, hr // row_tiles, s, hr % row_tiles, 0)),
                 pl.BlockSpec((None, None, None, block_m),
                              lambda s, b, hr: (b, hr // row_tiles, s, hr % row_tiles))],
      out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_p, dv), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, splits, rows_p), jnp.float32)],
      name="jattn_flash_decode", interpret=interpret, num_warps=num_warps,
      num_stages=num_stages,
  )(q, k, v, lengths, *tables)


# --- host side ---------------------------------------------------------------------------

def flash_triton_decode(q, k, v, lengths, *, causal: bool, scale: float, local_window, softcap,
                        config: DecodeConfig, interpret: bool, sinks=None, block_tables=None):
  """Flash attention forward for few query positions, by the split-KV decode kernel.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, head_dim_v]``; or with ``block_tables``, pages
      ``[num_pages, page_size, kv_heads, head_dim(_v)]``.
    lengths: ``[batch, 2]`` int32 ``(q_len, kv_len)`` of each batch row (as
      ``flash_triton_forward``'s), or None (every row full).
    config: tiles, launch and the number of splits (``decode_config``).
    sinks: ``[q_heads]`` float32 logits joining every row's denominator, or None.
    block_tables: ``[batch, pages_per_seq]`` int32 (``PagedCache``), or None: k and
      v are contiguous. The cache then holds ``pages_per_seq * page_size`` keys.

  Returns:
    ``(o, lse)`` as ``flash_triton_forward``'s.
  """
  batch, q_len, q_heads, head_dim = q.shape
  kv_heads, dv = k.shape[2], v.shape[-1]
  group = q_heads // kv_heads
  c = config
  rows_p = round_up(q_len * group, c.block_m)
  d_p, dv_p = padded_head_dim(head_dim), padded_head_dim(dv)
  if block_tables is None:
    kv_len = k.shape[1]
    kv_len_p = round_up(kv_len, c.block_k)
    cache, tables = ContiguousCache(), ()
    k, v = pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, dv_p)
  else:
    kv_len = block_tables.shape[1] * k.shape[1]
    cache = PagedCache(page_size=k.shape[1], num_pages=k.shape[0])
    tables = (kernel_array(block_tables.astype(jnp.int32)),)
    k, v = pad_last(k, d_p), pad_last(v, dv_p)
  lengths = full_lengths(lengths, batch, q_len, kv_len)
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=True, segments=False, lengths=True)
  packed = pack_rows(q, kv_heads, rows_p, d_p)
  o, lse = decode_forward(packed, k, v, lengths, tables, cache=cache, spec=spec, scale=scale,
                          score=Softcap.of(softcap), group=group, q_len=q_len,
                          block_m=c.block_m, block_k=c.block_k, splits=c.splits,
                          interpret=interpret, num_warps=c.num_warps, num_stages=c.num_stages)
  return merge_splits(o, lse, sinks, q_len=q_len, group=group, dv=dv, dtype=q.dtype)
