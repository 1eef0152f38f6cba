"""Block-sparse tile schedules: which key tiles a query tile visits (and the reverse),
from a per-block classification of a mask as empty, partial or full.

Host side, ``tile_lists`` re-tiles a block classification (made at any block size)
to a kernel's tiles and lists, per row of tiles, the partial tiles (run with the
element mask) and the full ones (run without); empty tiles are in neither list, so
no kernel visits them. Kernel side, ``listed_tiles`` is the loop schedule that walks
those lists (``masking.kv_block_range``'s counterpart for patterns given as data).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

EMPTY, PARTIAL, FULL = 0, 1, 2


def tile_kinds(any_allowed, all_allowed):
  """int8 EMPTY / PARTIAL / FULL from whether some pair of a tile may attend and whether
  every one may."""
  return jnp.where(any_allowed, jnp.where(all_allowed, FULL, PARTIAL), EMPTY).astype(jnp.int8)


# Mask elements evaluated per step of ``classify_blocks`` (bounds its memory).
_STEP_ELEMENTS = 1 << 25


def classify_blocks(allowed_at, batch: int, heads: int, lengths: tuple[int, int],
                    block: tuple[int, int]):
  """EMPTY / PARTIAL / FULL per ``block`` of a mask, evaluated one block row at a time.

  Args:
    allowed_at: ``(b, h, q_idx, kv_idx) -> bool`` on broadcastable int32 index arrays.
    batch, heads: how many batch rows and heads to evaluate (1: the mask does not
      depend on that index).
    lengths: ``(q_len, kv_len)``; positions past them count as neither allowed nor
      refused.

  Returns:
    int8 ``[batch, heads, q_blocks, kv_blocks]``.
  """
  (q_len, kv_len), (block_q, block_kv) = lengths, block
  q_blocks, kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
  kv = jnp.arange(kv_blocks * block_kv, dtype=jnp.int32)[None, None, None, :]

  def row(i):
    q = (i * block_q + jnp.arange(block_q, dtype=jnp.int32))[None, None, :, None]
    allowed = jnp.broadcast_to(allowed_at(b, h, q, kv), (batch, heads, block_q, kv.shape[-1]))
    real = (q < q_len) & (kv < kv_len)
    shape = (batch, heads, block_q, kv_blocks, block_kv)
    any_allowed = jnp.any((allowed & real).reshape(shape), axis=(2, 4))
    all_allowed = jnp.all((allowed | ~real).reshape(shape), axis=(2, 4))
    return tile_kinds(any_allowed, all_allowed)

  # Several block rows per step: one row per step is a sequential loop of small XLA
  # kernels, slower than the attention it classifies for long sequences.
  per_step = max(1, min(q_blocks, _STEP_ELEMENTS // (batch * heads * block_q * kv.shape[-1])))
  kinds = lax.map(row, jnp.arange(q_blocks, dtype=jnp.int32),
                  batch_size=per_step)  # [q_blocks, B, H, kv_blocks]
  return jnp.transpose(kinds, (1, 2, 0, 3))


def _overlap(tiles: int, tile: int, blocks: int, block: int, length: int):
  """``[tiles, blocks]`` float32: 1 where tile ``t`` and block ``m`` share a position
  below ``length``."""
  t = jnp.arange(tiles)[:, None]
  m = jnp.arange(blocks)[None, :]
  lo = jnp.maximum(t * tile, m * block)
  hi = jnp.minimum(jnp.minimum((t + 1) * tile, (m + 1) * block), length)
  return (lo < hi).astype(jnp.float32)


def retile(kinds, blocks: tuple[int, int], tiles: tuple[int, int], counts: tuple[int, int],
           lengths: tuple[int, int]):
  """The classification of a kernel's tiles from one made at other block sizes.

  Args:
    kinds: ``[..., q_blocks, kv_blocks]`` of EMPTY / PARTIAL / FULL at ``blocks``.
    tiles: the kernel's ``(tile_q, tile_k)``; counts: how many tiles along each axis.
    lengths: the true ``(q_len, kv_len)``; a key tile reaching past ``kv_len`` is
      never full (its padding needs the mask).

  Returns:
    ``[..., q_tiles, kv_tiles]`` int32: a tile is empty if every block it overlaps
    is, full if every one is full (and it has no key padding), partial otherwise.
  """
  oq = _overlap(counts[0], tiles[0], kinds.shape[-2], blocks[0], lengths[0])
  ok = _overlap(counts[1], tiles[1], kinds.shape[-1], blocks[1], lengths[1])
  count = lambda x: jnp.einsum("tm,...mn,un->...tu", oq, x.astype(jnp.float32), ok)
  nonempty = count(kinds != EMPTY) > 0
  full = (count(kinds != FULL) == 0) & ((jnp.arange(counts[1]) + 1) * tiles[1] <= lengths[1])
  return tile_kinds(nonempty, full).astype(jnp.int32)


def _listed(selected):
  """``(count [...], indices [..., n])``: along the last axis, how many are selected
  and their indices first, in order."""
  order = jnp.argsort(jnp.logical_not(selected), axis=-1, stable=True)
  return jnp.sum(selected, axis=-1, dtype=jnp.int32), order.astype(jnp.int32)


def tile_lists(kinds, *, transpose: bool = False) -> tuple:
  """``(partial count, partial tiles, full count, full tiles)`` int32 per row of a
  ``[..., rows, cols]`` tile classification: counts ``[..., rows]``, tiles
  ``[..., rows, cols]`` (the listed ones first). ``transpose``: per key tile, the
  query tiles (the dK/dV kernel's loop)."""
  if transpose:
    kinds = jnp.swapaxes(kinds, -1, -2)
  return _listed(kinds == PARTIAL) + _listed(kinds == FULL)


def listed_tiles(refs, row, head=None):
  """The loop schedule over the tiles ``tile_lists`` listed for tile row ``row``:
  ``[(lo, hi, index, masked)]`` as ``masking.run_tiles`` runs it. ``refs``:
  the four lists' refs for this batch row (``head`` selects the head when they
  hold every head's)."""
  at = (row,) if head is None else (head, row)
  partial_count, partial, full_count, full = refs
  return [(0, partial_count[at], lambda t: partial[at + (t,)], True),
          (0, full_count[at], lambda t: full[at + (t,)], False)]


def list_specs(lists, per_head: bool):
  """Block specs of ``tile_lists``' four arrays (``[B or 1, H or 1, rows(, cols)]``)
  on a ``(tiles, batch, heads)`` grid: with ``per_head`` the program's row of its
  head (forward, dQ: tile row = the program's tile), else every head's rows (dK/dV,
  whose program loops over its group's heads)."""
  specs = []
  for x in lists:
    batch = lambda b, x=x: b if x.shape[0] > 1 else 0
    head = lambda h, x=x: h if x.shape[1] > 1 else 0
    rest = (0,) * (x.ndim - 2)
    if per_head:
      specs.append(pl.BlockSpec((None, None) + x.shape[2:],
                                lambda i, b, h, batch=batch, head=head, rest=rest:
                                (batch(b), head(h)) + rest))
    else:
      specs.append(pl.BlockSpec((None,) + x.shape[1:],
                                lambda i, b, h, batch=batch, rest=rest: (batch(b), 0) + rest))
  return specs
