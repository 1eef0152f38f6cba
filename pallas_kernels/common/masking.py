"""Masks shared by the flash (Triton and Hopper) and parallel-retention kernels: which
(query, key) pairs may attend, and which key (or query) blocks a tile must visit,
with or without element masks.

Positions are absolute: query row ``i`` sits at key position ``i + offset`` with
``offset = kv_len - q_len`` (bottom-right alignment, as flash-attn does).
Causal attention is the window ``right = 0``.

Per-sequence lengths (``MaskSpec.lengths``): ``q_len`` and ``kv_len`` differ per batch
row, and a kernel binds them (``with_lengths``, traced values) before it asks for a
mask or a block range; rows at or past ``q_len`` then see no key. The block-range
functions also run on the host on arrays of lengths and tile starts (every operation
is elementwise), which is how the Hopper kernels get them (``hopper.inputs``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.element_functions import TileFunction
from jattn.kernels.common.softmax import ScoreFunction


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static description of the attention pattern.

  Attributes:
    q_len, kv_len: true (unpadded) sequence lengths.
    left, right: window bounds; query at absolute position ``a`` sees keys in
      ``[a - left, a + right]``. ``None`` means unbounded on that side.
    kv_padded: whether keys past ``kv_len`` exist in the padded buffers.
    segments: whether segment ids restrict attention further.
    segment_tiles: with ``segments``, the block ranges the kernel is given say which
      tiles lie wholly inside one segment (``segment_block_ranges(..., uniform=True)``,
      or for packed sequences ``packed_ranges``), and only the others need the element
      mask; without, every tile is masked.
    element_fn: a user mask ``(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
      ``mask_mod``) evaluated on each tile, reading ``element_arrays`` (refs inside
      a kernel); every tile is then masked, unless a block-sparse schedule says
      which tiles it allows wholly.
  """

  q_len: int  # or, bound to per-row lengths (``with_lengths``), int32 values
  kv_len: int
  left: int | None = None
  right: int | None = None
  kv_padded: bool = False
  segments: bool = False
  element_fn: TileFunction | None = None
  element_arrays: tuple = ()
  lengths: bool = False
  lengths_bound: bool = False
  segment_tiles: bool = False

  @property
  def every_tile_masked(self) -> bool:
    return (self.segments and not self.segment_tiles) or self.element_fn is not None

  @property
  def bounds_rows(self) -> bool:
    """Whether the element mask bounds rows by their query positions (else its
    ``q_idx`` may be None)."""
    return self.right is not None or self.left is not None or self.lengths

  @property
  def skips_tiles(self) -> bool:
    """Whether ``kv_block_range`` / ``q_block_range`` (narrowed by segment ranges) may
    leave tiles of the padded grid unvisited: the bounds the rows have, or segments."""
    return self.bounds_rows or self.segments

  @property
  def unbound_lengths(self) -> bool:
    """Per-row lengths not yet bound: the block ranges are the whole padded grid's."""
    return self.lengths and not self.lengths_bound

  def with_lengths(self, q_len, kv_len) -> "MaskSpec":
    """The spec of one batch row (or of arrays of rows) with lengths ``q_len`` and
    ``kv_len`` (int32, traced or arrays): keys at or past ``kv_len`` and query rows at
    or past ``q_len`` see nothing; query ``i`` sits at key position ``i + kv_len -
    q_len``."""
    return dataclasses.replace(self, q_len=q_len, kv_len=kv_len, kv_padded=True,
                               lengths_bound=True)

  @property
  def offset(self) -> int:
    return self.kv_len - self.q_len

  @property
  def masked_kv_runs(self) -> tuple[bool, bool]:
    """Whether ``kv_block_range`` can give masked key blocks before its unmasked ones
    and after them. A loop over its result leaves out a side that cannot (the code of
    a masked step is the largest part of a kernel); this reads the fields that
    function reads, and tests check the two against each other."""
    if self.every_tile_masked:
      return False, True  # (lo, lo, lo, hi): every block after the empty unmasked run
    bound = not self.unbound_lengths  # (unbound: the padded grid, no rows' bounds)
    return (bound and self.left is not None,
            self.kv_padded or (bound and (self.right is not None or self.lengths)))

  @property
  def masked_q_runs(self) -> tuple[bool, bool]:
    """``masked_kv_runs`` of ``q_block_range``: masked query blocks before and after
    its unmasked ones."""
    if self.every_tile_masked:
      return False, True
    bound = not self.unbound_lengths
    return (bound and self.right is not None,
            self.kv_padded or (bound and (self.left is not None or self.lengths)))

  @staticmethod
  def build(q_len, kv_len, *, causal, local_window, kv_padded, segments,
            lengths: bool = False) -> "MaskSpec":
    """``lengths``: per-row lengths, bound in the kernels (``q_len``, ``kv_len`` here are
    the arrays' own)."""
    left, right = local_window if local_window is not None else (None, None)
    if causal:
      right = 0 if right is None else min(right, 0)
    return MaskSpec(q_len, kv_len, left, right, kv_padded, segments, lengths=lengths)


def bind_lengths(spec: MaskSpec, lengths_ref) -> MaskSpec:
  """In a kernel, ``spec`` with its batch row's ``(q_len, kv_len)`` from ``lengths_ref``
  (``[2]`` int32) when it has per-row lengths."""
  return spec.with_lengths(lengths_ref[0], lengths_ref[1]) if spec.lengths else spec


def element_mask(spec: MaskSpec, q_idx, k_idx, q_seg=None, k_seg=None, bh=None,
                 rows=lambda x: x, q_tile=None):
  """Boolean mask for a tile's query-row indices ``q_idx`` and key indices ``k_idx``
  (and segment ids; and ``bh = (batch row, query head)`` for ``element_fn``), or None
  when the spec restricts nothing.

  ``q_idx`` is one index per query row: shaped to broadcast against ``k_idx``, or a
  vector that ``rows`` broadcasts to the tile (the Hopper kernels' layouts), which
  then pass the tile-shaped index ``q_tile`` for ``element_fn``; None where
  ``spec.bounds_rows`` is False. The window, causal, key-padding and per-row-length
  conditions fold into one key bound per row on each side, so a tile pays one
  comparison per side, not up to four: the element mask is on a masked tile's
  critical path."""
  assert not spec.unbound_lengths, "bind the lengths first (MaskSpec.with_lengths)"
  hi = lo = None  # per row: the last and first key it sees
  if spec.bounds_rows:
    q_abs = q_idx + spec.offset
    if spec.right is not None:
      hi = q_abs + spec.right
    if spec.left is not None:
      lo = q_abs - spec.left
    if spec.lengths or (spec.kv_padded and hi is not None):
      last = spec.kv_len - 1
      hi = q_abs * 0 + last if hi is None else jnp.minimum(hi, last)
    if spec.lengths:  # rows at or past q_len see nothing
      hi = jnp.where(q_idx < spec.q_len, hi, -1)
  mask = None

  def conj(m, new):
    return new if m is None else jnp.logical_and(m, new)

  if hi is not None:
    mask = conj(mask, k_idx <= rows(hi))
  elif spec.kv_padded:
    mask = conj(mask, k_idx < spec.kv_len)
  if lo is not None:
    mask = conj(mask, k_idx >= rows(lo))
  if spec.segments:
    mask = conj(mask, q_seg == k_seg)
  if spec.element_fn is not None:
    q_tile = q_idx if q_tile is None else q_tile
    mask = conj(mask, spec.element_fn(spec.element_arrays, *bh, q_tile, k_idx))
  return mask


def apply_mask(x, fill, spec: MaskSpec, q_idx, k_idx, q_seg=None, k_seg=None, bh=None,
               rows=lambda x: x, q_tile=None):
  """``x`` where the pattern allows attention, ``fill`` elsewhere (``element_mask``'s
  arguments)."""
  mask = element_mask(spec, q_idx, k_idx, q_seg, k_seg, bh, rows, q_tile)
  return x if mask is None else jnp.where(mask, x, fill)


def _div_nonneg(x, d: int):
  # Kernel-side integer division; the callers clamp so that a negative numerator
  # and 0 lead to the same final block bound.
  return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def _cdiv_nonneg(x, d: int):
  return _div_nonneg(x + (d - 1), d)


def _blocks(length, block: int, ceil: bool = False):
  """Whole (``ceil``: and partial) blocks of a length: a Python int's folded here, a
  bound length's computed in the kernel."""
  if isinstance(length, int):
    return jnp.int32(-(-length // block) if ceil else length // block)
  return _cdiv_nonneg(length, block) if ceil else _div_nonneg(length, block)


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def kv_block_range(spec: MaskSpec, q_start, block_q: int, block_k: int):
  """Key blocks a query tile starting at row ``q_start`` visits.

  Returns int32 scalars ``lo <= full_lo <= full_hi <= hi``: blocks in
  ``[full_lo, full_hi)`` need no element mask, the rest of ``[lo, hi)`` does.
  With unbound lengths: every block of the padded grid (``full`` up to the padding),
  for a given range to narrow.
  """
  if spec.unbound_lengths:
    spec = dataclasses.replace(spec, left=None, right=None, lengths=False)
  q_first = q_start + spec.offset
  q_last = q_first + (block_q - 1)
  lo = jnp.int32(0)
  hi = _blocks(spec.kv_len, block_k, ceil=True)
  if spec.left is not None:
    lo = _div_nonneg(q_first - spec.left, block_k)
  if spec.right is not None:
    hi = jnp.minimum(hi, _cdiv_nonneg(q_last + spec.right + 1, block_k))
  if spec.lengths:  # a tile of padding rows sees nothing
    hi = jnp.where(q_start < spec.q_len, hi, lo)
  hi = jnp.maximum(hi, lo)
  if spec.every_tile_masked:
    return lo, lo, lo, hi
  full_lo = lo
  full_hi = _blocks(spec.kv_len, block_k) if spec.kv_padded else hi
  if spec.left is not None:
    full_lo = _cdiv_nonneg(q_last - spec.left, block_k)
  if spec.right is not None:
    full_hi = jnp.minimum(full_hi, _div_nonneg(q_first + spec.right + 1, block_k))
  if spec.lengths:  # padding rows need the mask
    full_hi = jnp.where(q_start + block_q <= spec.q_len, full_hi, full_lo)
  full_lo = _clamp(full_lo, lo, hi)
  full_hi = _clamp(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def packed_rows_block_range(spec: MaskSpec, row_start, rows: int, *, group: int, q_len: int,
                            block_k: int):
  """Key blocks ``(lo, full_lo, full_hi, hi)`` a tile of ``rows`` packed decode rows
  from ``row_start`` visits: row ``r`` holds query position ``r // group`` (the query
  heads of one KV head side by side), ``q_len`` positions in all.

  The rows past ``q_len * group`` only pad the packing: their outputs are dropped, so
  they need no mask and the tile's blocks run unmasked wherever every real position
  sees all of them (a per-row ``q_len`` of ``spec`` below the tile's last real
  position, whose rows must come out empty, masks every block).
  """
  first_q = lax.div(row_start, jnp.int32(group))
  last_q = jnp.minimum(lax.div(row_start + rows - 1, jnp.int32(group)), q_len - 1)
  # Key ranges grow with the position: the union of the first and last position's,
  # unmasked where both are.
  lo, full_lo, full_hi, _ = kv_block_range(spec, first_q, 1, block_k)
  last = jnp.minimum(last_q, spec.q_len - 1) if spec.lengths else last_q
  _, last_full_lo, last_full_hi, hi = kv_block_range(spec, last, 1, block_k)
  full_lo, full_hi = jnp.maximum(full_lo, last_full_lo), jnp.minimum(full_hi, last_full_hi)
  hi = jnp.where(first_q < q_len, jnp.maximum(hi, lo), lo)  # packing rows only: nothing
  if spec.lengths:
    hi = jnp.where(first_q < spec.q_len, hi, lo)
    full_hi = jnp.where(last_q < spec.q_len, full_hi, full_lo)
  full_lo = _clamp(full_lo, lo, hi)
  return lo, full_lo, _clamp(full_hi, full_lo, hi), hi


def narrow(block_range, given):
  """A ``kv_block_range``-style range restricted to a ``given`` one: blocks in both,
  unmasked only where both say so."""
  lo, full_lo, full_hi, hi = block_range
  g_lo, g_full_lo, g_full_hi, g_hi = given
  lo = jnp.maximum(lo, g_lo)
  hi = jnp.maximum(jnp.minimum(hi, g_hi), lo)
  full_lo = jnp.minimum(jnp.maximum(jnp.maximum(full_lo, g_full_lo), lo), hi)
  full_hi = jnp.minimum(jnp.maximum(jnp.minimum(full_hi, g_full_hi), full_lo), hi)
  return lo, full_lo, full_hi, hi


def with_segment_range(spec: MaskSpec, block_range, range_ref):
  """Inside a kernel, ``block_range`` narrowed to the tile's segment range
  (``segment_block_ranges(..., uniform=True)``'s ``[4]`` row, in ``range_ref``) when
  ``spec`` has segment tiles; as it is otherwise."""
  if not (spec.segments and spec.segment_tiles):
    return block_range
  return narrow(block_range, tuple(range_ref[i] for i in range(4)))


def segment_masked_runs(spec: MaskSpec, masked_runs: tuple[bool, bool]) -> tuple[bool, bool]:
  """``masked_runs`` of a block range after ``with_segment_range``: both sides where the
  segment range narrows it."""
  return (True, True) if spec.segments and spec.segment_tiles else masked_runs


def split_block_range(block_range, split, split_blocks: int):
  """``block_range`` restricted to split ``split`` of the key blocks: blocks
  ``[split * split_blocks, (split + 1) * split_blocks)``."""
  first, end = split * split_blocks, (split + 1) * split_blocks
  return narrow(block_range, (first, first, end, end))


def q_block_range(spec: MaskSpec, k_start, block_k: int, block_q: int):
  """Query blocks a key tile starting at key ``k_start`` is seen by (dK/dV pass).

  Same contract as :func:`kv_block_range`, over query blocks.
  """
  if spec.unbound_lengths:
    spec = dataclasses.replace(spec, left=None, right=None, lengths=False)
  k_first = k_start
  k_last = k_start + (block_k - 1)
  lo = jnp.int32(0)
  hi = _blocks(spec.q_len, block_q, ceil=True)
  if spec.right is not None:
    lo = _div_nonneg(k_first - spec.right - spec.offset, block_q)
  if spec.left is not None:
    hi = jnp.minimum(hi, _cdiv_nonneg(k_last + spec.left - spec.offset + 1, block_q))
  if spec.lengths:  # a tile of padding keys is seen by nothing
    hi = jnp.where(k_first < spec.kv_len, hi, lo)
  hi = jnp.maximum(hi, lo)
  if spec.every_tile_masked:
    return lo, lo, lo, hi
  full_lo, full_hi = lo, hi
  if spec.right is not None:
    full_lo = _cdiv_nonneg(k_last - spec.right - spec.offset, block_q)
  if spec.left is not None:
    full_hi = jnp.minimum(full_hi, _div_nonneg(k_first + spec.left - spec.offset + 1, block_q))
  if spec.lengths:  # the last, partial block of rows needs the mask
    full_hi = jnp.minimum(full_hi, _blocks(spec.q_len, block_q))
  if spec.kv_padded:
    full_hi = jnp.where(k_last < spec.kv_len, full_hi, full_lo)
  full_lo = _clamp(full_lo, lo, hi)
  full_hi = _clamp(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def range_tiles(lo, full_lo, full_hi, hi, masked_runs: tuple[bool, bool] = (True, True)):
  """The loop schedule of a ``kv_block_range`` / ``q_block_range`` result: masked,
  unmasked, masked runs of consecutive tiles, as ``[(lo, hi, index, masked)]``; without
  the masked run of a side ``masked_runs`` (``MaskSpec.masked_kv_runs``) rules out."""
  runs = [(lo, full_lo, None, True), (full_lo, full_hi, None, False), (full_hi, hi, None, True)]
  return [run for run, kept in zip(runs, (masked_runs[0], True, masked_runs[1])) if kept]


def run_tiles(schedule, body, carry):
  """Runs ``body(masked, tile, carry)`` over a schedule's loops: loop ``t`` in
  ``[lo, hi)`` visits tile ``index(t)`` (``t`` itself where ``index`` is None)."""
  for lo, hi, index, masked in schedule:
    if index is None:
      step = lambda t, c, masked=masked: body(masked, t, c)
    else:
      step = lambda t, c, masked=masked, index=index: body(masked, index(t), c)
    carry = lax.fori_loop(lo, hi, step, carry)
  return carry


def split_extra_refs(refs, spec: MaskSpec, score, lists: bool):
  """Inside a kernel, the refs after its fixed inputs: the score function's arrays,
  the mask function's, then (``lists``) the four block-sparse tile lists, then the
  outputs. Returns ``(spec, score)`` reading their arrays from those refs, the lists'
  refs (None without) and the output refs."""
  refs = list(refs)
  if isinstance(score, ScoreFunction):
    n = score.fn.num_arrays
    score, refs = dataclasses.replace(score, arrays=tuple(refs[:n])), refs[n:]
  if spec.element_fn is not None:
    n = spec.element_fn.num_arrays
    spec, refs = dataclasses.replace(spec, element_arrays=tuple(refs[:n])), refs[n:]
  tile_lists = None
  if lists:
    tile_lists, refs = tuple(refs[:4]), refs[4:]
  return spec, score, tile_lists, refs


def segment_block_ranges(row_seg, col_seg, row_len: int, col_len: int, row_block: int,
                         col_block: int, *, uniform: bool = False):
  """Per row block, the column blocks whose segment ids can meet its own (host side).

  ``row_seg: [batch, rows_p]``, ``col_seg: [batch, cols_p]`` int32 (padded; ids past
  ``row_len`` / ``col_len`` are ignored). A column block is visited when its id range
  ``[min, max]`` overlaps the row block's: every block that shares a segment, and for
  sorted ids (packed sequences) few others. Returns ``[batch, n_row_blocks, 2]`` int32
  ``(first, last + 1)``; ``(n_col_blocks, 0)`` where none can meet, so that the union
  of several rows' ranges is ``(min firsts, max ends)``. Symmetric: swap the
  arguments for the column blocks each row block reaches.

  ``uniform``: ``[batch, n_row_blocks, 4]`` ``(first, full_lo, full_hi, end)`` instead,
  where ``[full_lo, full_hi)`` is the first run of column blocks in which every id
  equals the row block's one id (empty where the row block holds several): there the
  segment ids mask nothing (the kernels' ``MaskSpec.segment_tiles``). For sorted ids
  that run is a document's interior. Blocks holding padding are never uniform.
  """
  def block_min_max(seg, length, block):
    valid = jnp.arange(seg.shape[1]) < length
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.where(valid, seg, big).reshape(seg.shape[0], -1, block).min(axis=2)
    hi = jnp.where(valid, seg, -big).reshape(seg.shape[0], -1, block).max(axis=2)
    return lo, hi

  r_lo, r_hi = block_min_max(row_seg, row_len, row_block)
  c_lo, c_hi = block_min_max(col_seg, col_len, col_block)
  meets = (r_lo[:, :, None] <= c_hi[:, None, :]) & (c_lo[:, None, :] <= r_hi[:, :, None])
  n_cols = meets.shape[2]
  cols = jnp.arange(n_cols, dtype=jnp.int32)
  first = jnp.min(jnp.where(meets, cols, n_cols), axis=2)
  end = jnp.max(jnp.where(meets, cols + 1, 0), axis=2)
  if not uniform:
    return jnp.stack([first, end], axis=2).astype(jnp.int32)
  # One id on both sides, in blocks without padding: a padding row's statistics may
  # be those of a row that sees nothing, which only the element mask keeps out.
  r_one = (r_lo == r_hi) & (jnp.arange(1, r_lo.shape[1] + 1) * row_block <= row_len)
  c_one = (c_lo == c_hi) & (jnp.arange(1, n_cols + 1) * col_block <= col_len)
  same = r_one[:, :, None] & c_one[:, None, :] & (r_lo[:, :, None] == c_lo[:, None, :])
  full_lo = jnp.min(jnp.where(same, cols, n_cols), axis=2)
  broken = ~same & (cols >= full_lo[:, :, None])
  full_hi = jnp.min(jnp.where(broken, cols, n_cols), axis=2)
  full_lo, full_hi = jnp.minimum(full_lo, end), jnp.minimum(full_hi, end)
  full_lo = jnp.clip(full_lo, first, jnp.maximum(end, first))
  full_hi = jnp.clip(full_hi, full_lo, jnp.maximum(end, first))
  return jnp.stack([first, full_lo, full_hi, end], axis=2).astype(jnp.int32)
