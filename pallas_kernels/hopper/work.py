"""Work items: which rows of which head one forward CTA (or one pass of a persistent
CTA) computes, and where they lie. One of the two extension points of the Hopper
pipeline (the other is ``addressing``).

A work-item kind is a hashable object with

- ``count``: the number of items, ``rows``: the query rows of one item
  (``consumers * block_q``), ``rows_per_position``: the rows that share one query
  position (1; the query heads of a KV head where an item packs them), all static;
- ``bind() -> bound``: in the kernel, before anything else is traced, the kind with
  its traced constants, which the warpgroups share. ``bound`` has
  ``per_cta(cta, n_ctas)``: how many items CTA ``cta`` of ``n_ctas`` walks (items
  ``cta, cta + n_ctas, ...``); ``at(w) -> item``: item ``w``, a tuple whose
  ``batch``, ``head`` and ``tile`` the kernel reads (``tile`` indexes its block
  ranges, in units of ``rows``); ``q_start(item, consumer)``: the first query row the
  consumer owns (its position, for the masks); and, given it, ``q_rows(item, q_start)``
  / ``stat_rows(item, q_start)``: the index of the consumer's ``block_q`` rows in Q and
  the output (``[batch, q_len, heads, d]``) and in the row statistic (``[batch,
  heads, q_len]``); ``block_range(spec, item, block_kv)``: the key blocks ``(lo,
  full_lo, full_hi, hi)`` the item's rows visit (``masking.kv_block_range``'s, with
  ``spec`` bound to the item's row where it has per-row lengths), and
  ``own_range(spec, q_start, block_kv)``: a consumer's;
- ``out_shapes(batch, q_len, heads, dv, dtype)``: the output and row statistic the
  kernel writes (what ``q_rows`` / ``stat_rows`` index).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from jattn.kernels.common.masking import (kv_block_range, packed_rows_block_range,
                                          split_block_range)
from jattn.kernels.hopper.addressing import dilated_head


class QueryTile(NamedTuple):
  batch: Any
  head: Any
  tile: Any


@dataclasses.dataclass(frozen=True)
class QueryTiles:
  """A tile of ``consumers * block_q`` query rows of one head and batch row; consumer
  ``c`` owns rows ``[(tile * consumers + c) * block_q, ... + block_q)``.

  ``tiles_fastest``: items ``w`` vary the tile fastest, then the head (CTAs running
  together share K and V in L2: the persistent kernel's order); else the head
  fastest, then the tile (uneven causal items: every head's heavy tiles start first).
  ``heavy_first``: tiles counted from the last (a mask with a right bound gives late
  tiles more keys: starting them first balances the tail)."""

  n_tiles: int
  n_heads: int
  n_batch: int
  block_q: int
  consumers: int
  tiles_fastest: bool
  heavy_first: bool

  rows_per_position = 1

  @property
  def count(self) -> int:
    return self.n_tiles * self.n_heads * self.n_batch

  @property
  def rows(self) -> int:
    return self.consumers * self.block_q

  def out_shapes(self, batch: int, q_len: int, heads: int, dv: int, dtype) -> tuple:
    return (jax.ShapeDtypeStruct((batch, q_len, heads, dv), dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32))

  def bind(self) -> "BoundQueryTiles":
    return BoundQueryTiles(self, *(jnp.int32(n) for n in (self.n_tiles, self.n_heads,
                                                          self.n_batch)))

  def order(self, w, n_tiles, n_heads, n_batch) -> QueryTile:
    """Item ``w`` (traced), given the item counts as int32 values."""
    del n_batch  # the slowest axis: what is left
    if self.tiles_fastest:
      tile, rest = lax.rem(w, n_tiles), lax.div(w, n_tiles)
      head, batch = lax.rem(rest, n_heads), lax.div(rest, n_heads)
    else:
      head, rest = lax.rem(w, n_heads), lax.div(w, n_heads)
      tile, batch = lax.rem(rest, n_tiles), lax.div(rest, n_tiles)
    if self.heavy_first:
      tile = n_tiles - 1 - tile
    return QueryTile(batch, head, tile)


class BoundQueryTiles(NamedTuple):
  """``QueryTiles`` in a kernel, with its item counts as int32 values."""

  kind: QueryTiles
  n_tiles: Any
  n_heads: Any
  n_batch: Any

  def per_cta(self, cta, n_ctas):
    return lax.div(self.n_tiles * self.n_heads * self.n_batch - cta + n_ctas - 1, n_ctas)

  def at(self, w) -> QueryTile:
    return self.kind.order(w, self.n_tiles, self.n_heads, self.n_batch)

  def q_start(self, item: QueryTile, consumer):
    return (item.tile * self.kind.consumers + consumer) * self.kind.block_q

  def q_rows(self, item: QueryTile, q_start):
    return item.batch, pl.ds(q_start, self.kind.block_q), item.head

  def stat_rows(self, item: QueryTile, q_start):
    return item.batch, item.head, pl.ds(q_start, self.kind.block_q)

  def out_rows(self, item: QueryTile, q_start):
    return self.q_rows(item, q_start)

  def block_range(self, spec, item: QueryTile, block_kv: int):
    rows = self.kind.rows
    return kv_block_range(spec, item.tile * rows, rows, block_kv)

  def own_range(self, spec, q_start, block_kv: int):
    return kv_block_range(spec, q_start, self.kind.block_q, block_kv)

  def own_masked_runs(self, spec) -> tuple[bool, bool]:
    """``visit_blocks``' masked runs of ``own_range``'s ranges."""
    return spec.masked_kv_runs


@dataclasses.dataclass(frozen=True)
class DilatedTiles(QueryTiles):
  """``QueryTiles`` of one dilated-attention pair (``rate`` r): Q is ``[segments, w / r,
  r * heads, d]`` (``[batch, seq, heads, d]`` reshaped), whose "head" ``(h mod r) *
  heads + h`` holds query head ``h``'s dilated rows (LongNet's head offsets); the
  output ``[segments, w / r, heads, dv]`` and row statistic ``[segments, heads, w / r]``
  hold them compactly."""

  rate: int = 1

  def out_shapes(self, batch: int, q_len: int, heads: int, dv: int, dtype) -> tuple:
    del heads  # Q's, r times the query heads
    return super().out_shapes(batch, q_len, self.n_heads, dv, dtype)

  def bind(self) -> "BoundDilatedTiles":
    return BoundDilatedTiles(self, *(jnp.int32(n) for n in (self.n_tiles, self.n_heads,
                                                            self.n_batch)))


class BoundDilatedTiles(BoundQueryTiles):
  """``DilatedTiles`` in a kernel."""

  def q_rows(self, item: QueryTile, q_start):
    return (item.batch, pl.ds(q_start, self.kind.block_q),
            dilated_head(item.head, self.kind.rate, self.n_heads))

  def out_rows(self, item: QueryTile, q_start):
    return item.batch, pl.ds(q_start, self.kind.block_q), item.head


class DecodeItem(NamedTuple):
  batch: Any
  head: Any  # the KV head
  tile: Any
  split: Any


@dataclasses.dataclass(frozen=True)
class DecodeItems:
  """Split-KV decoding's items: a tile of ``consumers * block_q`` rows of one KV head,
  its query heads packed (row ``r``: position ``r // group`` of head ``r % group``),
  against one of ``n_splits`` ranges of ``split_blocks`` key blocks. Q is laid out as
  ``[batch, rows, kv_heads, d]``; each split writes a partial output ``[batch,
  splits, rows, kv_heads, dv]`` and log-sum-exp ``[batch, splits, kv_heads, rows]``,
  merged by their log-sum-exp outside (``softmax.combine_partials``). Items vary the
  split fastest, then the tile, the KV head, the batch row."""

  n_tiles: int
  n_heads: int
  n_batch: int
  n_splits: int
  split_blocks: int
  block_q: int
  consumers: int
  group: int  # query heads per KV head: rows per position
  q_len: int  # query positions: rows past q_len * group pad the packing

  @property
  def count(self) -> int:
    return self.n_splits * self.n_tiles * self.n_heads * self.n_batch

  @property
  def rows(self) -> int:
    return self.consumers * self.block_q

  @property
  def rows_per_position(self) -> int:
    return self.group

  def out_shapes(self, batch: int, rows: int, heads: int, dv: int, dtype) -> tuple:
    return (jax.ShapeDtypeStruct((batch, self.n_splits, rows, heads, dv), dtype),
            jax.ShapeDtypeStruct((batch, self.n_splits, heads, rows), jnp.float32))

  def bind(self) -> "BoundDecodeItems":
    return BoundDecodeItems(self)


class BoundDecodeItems(NamedTuple):
  kind: DecodeItems

  def per_cta(self, cta, n_ctas):
    return lax.div(jnp.int32(self.kind.count) - cta + n_ctas - 1, n_ctas)

  def at(self, w) -> DecodeItem:
    k = self.kind
    split, rest = lax.rem(w, jnp.int32(k.n_splits)), lax.div(w, jnp.int32(k.n_splits))
    tile, rest = lax.rem(rest, jnp.int32(k.n_tiles)), lax.div(rest, jnp.int32(k.n_tiles))
    head, batch = lax.rem(rest, jnp.int32(k.n_heads)), lax.div(rest, jnp.int32(k.n_heads))
    return DecodeItem(batch, head, tile, split)

  def q_start(self, item: DecodeItem, consumer):
    return (item.tile * self.kind.consumers + consumer) * self.kind.block_q

  def q_rows(self, item: DecodeItem, q_start):
    return item.batch, pl.ds(q_start, self.kind.block_q), item.head

  def out_rows(self, item: DecodeItem, q_start):
    return item.batch, item.split, pl.ds(q_start, self.kind.block_q), item.head

  def stat_rows(self, item: DecodeItem, q_start):
    return item.batch, item.split, item.head, pl.ds(q_start, self.kind.block_q)

  def _range(self, spec, row_start, rows: int, block_kv: int):
    k = self.kind
    return packed_rows_block_range(spec, row_start, rows, group=k.group, q_len=k.q_len,
                                   block_k=block_kv)

  def block_range(self, spec, item: DecodeItem, block_kv: int):
    rows = self.kind.rows
    return split_block_range(self._range(spec, item.tile * rows, rows, block_kv), item.split,
                             self.kind.split_blocks)

  def own_range(self, spec, q_start, block_kv: int):
    return self._range(spec, q_start, self.kind.block_q, block_kv)

  def own_masked_runs(self, spec) -> tuple[bool, bool]:
    """Both sides: packed rows take the union of their positions' ranges."""
    del spec
    return True, True
