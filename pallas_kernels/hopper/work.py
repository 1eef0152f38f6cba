"""Work items: which rows of which head one forward CTA (or one pass of a persistent
CTA) computes, and where they lie. One of the two extension points of the Hopper
pipeline (the other is ``addressing``).

A work-item kind is a hashable object with

- ``count``: the number of items, ``rows``: the query rows of one item
  (``consumers * block_q``), both static;
- ``bind() -> bound``: in the kernel, before anything else is traced, the kind with
  its traced constants, which the warpgroups share. ``bound`` has
  ``per_cta(cta, n_ctas)``: how many items CTA ``cta`` of ``n_ctas`` walks (items
  ``cta, cta + n_ctas, ...``); ``at(w) -> item``: item ``w``, a tuple whose
  ``batch``, ``head`` and ``tile`` the kernel reads (``tile`` indexes its block
  ranges, in units of ``rows``); ``q_start(item, consumer)``: the first query row the
  consumer owns (its position, for the masks); and, given it, ``q_rows(item, q_start)``
  / ``stat_rows(item, q_start)``: the index of the consumer's ``block_q`` rows in Q and
  the output (``[batch, q_len, heads, d]``) and in the row statistic (``[batch,
  heads, q_len]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp


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

  @property
  def count(self) -> int:
    return self.n_tiles * self.n_heads * self.n_batch

  @property
  def rows(self) -> int:
    return self.consumers * self.block_q

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
