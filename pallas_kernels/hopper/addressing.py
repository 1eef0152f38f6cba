"""K/V addressing: where a tile of keys (and of values) lies in global memory. One of
the two extension points of the Hopper pipeline (the other is ``work``).

An addressing is a hashable object with

- ``n_inputs``: how many extra kernel inputs it reads (index arrays such as a block
  table), passed after the kernel's other inputs;
- ``kv_len(k)``: the logical (padded) key positions per sequence, from K's shape;
- ``bind(refs) -> bound``: the bound addressing in a kernel, given its ``n_inputs``
  refs, with ``bound.tile(ref, batch, kv_head, start, size)``: the
  ``[size, head_dim]`` view of ``ref`` (K or V) holding logical key positions
  ``[start, start + size)`` of sequence ``batch`` and KV head ``kv_head``, which the
  producer copies by TMA, and ``bound.v_tile(ref, ...)``: the same for V, as V's tile
  lies (``[head_dim_v, size]`` where ``values_transposed``). ``start`` is a multiple of
  ``size`` (the key tile);
- ``values_transposed``: whether V's tiles come keys-fastest (the FP8 kernels'
  layout: an 8-bit wgmma reads its B operand only with the reduced axis fastest).

Per-position inputs of the keys (segment ids, a mask function's parts) stay in
logical order: only K and V move.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class ContiguousKV:
  """K and V as ``[batch, kv_len, kv_heads, head_dim]``: a sequence's keys lie in
  order in its batch row."""

  n_inputs = 0
  values_transposed = False

  def kv_len(self, k) -> int:
    return k.shape[1]

  def bind(self, refs) -> "ContiguousKV":
    del refs
    return self

  def tile(self, ref, batch, kv_head, start, size: int):
    return ref.at[batch, pl.ds(start, size), kv_head]

  def v_tile(self, ref, batch, kv_head, start, size: int):
    return self.tile(ref, batch, kv_head, start, size)


@dataclasses.dataclass(frozen=True)
class TransposedValuesKV(ContiguousKV):
  """K as ``ContiguousKV``'s, V transposed: ``[batch, kv_heads, head_dim_v, kv_len]``."""

  values_transposed = True

  def v_tile(self, ref, batch, kv_head, start, size: int):
    return ref.at[batch, kv_head, :, pl.ds(start, size)]


def dilated_head(head, rate: int, heads_per_offset: int, group: int = 1):
  """Where query head ``head`` finds its dilated rows in a pair's view ``[segments, w /
  r, r * n, d]`` of an array with ``n = heads_per_offset`` heads: view head ``(head mod
  r) * n + head // group`` (LongNet's offset ``head mod r``; ``group`` query heads per
  head of the array)."""
  slot = lax.rem(head, jnp.int32(rate))
  return slot * heads_per_offset + lax.div(head, jnp.int32(group))


@dataclasses.dataclass(frozen=True)
class DilatedKV(ContiguousKV):
  """K and V of one dilated-attention pair as ``[segments, w / r, r * kv_heads, d]``
  (``[batch, seq, kv_heads, d]`` reshaped: "head" ``o * kv_heads + j`` holds KV head
  ``j``'s positions ``≡ o (mod r)``). The kernel runs with ``group=1``, so its KV head
  is the query head ``h``, which reads KV head ``(h mod r) * kv_heads + h // group``:
  the dilated rows of its own offset (``DilatedTiles``)."""

  rate: int
  kv_heads: int
  group: int  # query heads per KV head

  def tile(self, ref, batch, kv_head, start, size: int):
    # kv_head is the query head (the kernel's group is 1)
    return ref.at[batch, pl.ds(start, size),
                  dilated_head(kv_head, self.rate, self.kv_heads, self.group)]


@dataclasses.dataclass(frozen=True)
class ContiguousQ:
  """The backward kernels' Q and dO as ``[batch, q_len, heads, d]``: query head ``h``'s
  rows in head ``h``. (Their outputs and row statistics are always laid out so.)"""

  def head(self, head):
    return head

  def n_heads(self, q) -> int:
    return q.shape[2]


@dataclasses.dataclass(frozen=True)
class DilatedQ(ContiguousQ):
  """Q and dO of one dilated-attention pair as ``DilatedKV``'s K and V:
  ``[segments, w / r, r * heads, d]``, query head ``h`` at view head ``(h mod r) *
  heads + h``; the kernels' dQ, dK, dV and row statistics hold each query head
  compactly (``[segments, w / r, heads, d]``, ``[segments, heads, w / r]``)."""

  rate: int
  heads: int

  def head(self, head):
    return dilated_head(head, self.rate, self.heads)

  def n_heads(self, q) -> int:
    return self.heads


@dataclasses.dataclass(frozen=True)
class PagedKV:
  """K and V as pages ``[num_pages, page_size, kv_heads, d]`` and a block table (one
  extra input, ``[batch, pages_per_seq]`` int32): keys ``[i * page_size, (i + 1) *
  page_size)`` of sequence ``b`` are page ``table[b, i]``. A tile lies in one page
  (``page_size`` a multiple of the key tile); page ids are clamped into the pool, so
  a bad table reads a wrong page, never out of bounds."""

  page_size: int
  pages_per_seq: int
  num_pages: int

  n_inputs = 1
  values_transposed = False

  def kv_len(self, k) -> int:
    return self.page_size * self.pages_per_seq

  def bind(self, refs) -> "_BoundPages":
    return _BoundPages(self, refs[0])


@dataclasses.dataclass(frozen=True)
class _BoundPages:
  kind: PagedKV
  table: object

  def tile(self, ref, batch, kv_head, start, size: int):
    page_size = jnp.int32(self.kind.page_size)
    page = self.table[batch, lax.div(start, page_size)]
    page = jnp.minimum(jnp.maximum(page, 0), self.kind.num_pages - 1)
    return ref.at[page, pl.ds(lax.rem(start, page_size), size), kv_head]

  v_tile = tile
