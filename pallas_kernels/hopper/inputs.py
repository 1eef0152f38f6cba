"""What the Hopper kernels read beside Q, K and V: segment ids, the parts of
FlexAttention's score and mask functions (``factored_functions``) and dropout's hashes,
with the block ranges of segments or a block mask.

The inputs, in this order:
- *row* arrays ``[B', q_len_p]`` (or ``[B', H', q_len_p]``, per head), one value per
  query position (``B'`` is 1 or the batch), copied by TMA with each query tile and
  held as one vector per tile;
- *col* arrays ``[B', kv_len_p]``, one value per key position, copied with each key tile;
- *scalar* arrays ``[B', H']``, read from global memory per (batch row, query head):
  the functions' scalar parts, then with per-row lengths ``(q_len, kv_len)`` as two
  ``[batch, 1]`` arrays, which bind the mask spec's lengths (``MaskSpec.with_lengths``);
- optionally *ranges* ``[B', H', blocks, 4]``: per block of the kernel's own rows (query
  blocks in the forward and dQ kernels, key blocks in dK/dV), the
  ``(lo, full_lo, full_hi, hi)`` blocks of the other axis it visits, as
  ``masking.kv_block_range`` returns them; they narrow the mask spec's own range;
- optionally a dense *bias* ``[B', H', q_len_p, kv_len_p]`` (16-bit), added to the
  scaled logits (``DenseBias``): copied by TMA with each tile of the streamed axis, one
  ``[block_q, block_kv]`` tile per consumer, and read into the score tile's register
  layout (transposed in the dK/dV kernel, whose score tiles are transposed).

Segment ids are the first row and col arrays; then the mask's parts, then the score's
(or a dense bias's row shift), then dropout's hashes (``dropout.hash_arrays``: its row
array is per head, ``[B, H, q_len_p]``). Per-row lengths come with ranges
(``length_ranges``): the backward kernels' own block ranges do not know them (the
forward binds the lengths itself, ``forward._Forward.spec_of``, so for it they only
confirm).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.block_sparsity import EMPTY, FULL, retile
from jattn.kernels.common.dropout import keep
from jattn.kernels.common.factored_functions import COL, ROW, SCALAR, FactoredFunction
from jattn.kernels.common.masking import (MaskSpec, apply_mask, kv_block_range, narrow,
                                          q_block_range, segment_block_ranges)
from jattn.kernels.common.softmax import LOG2E, ScoreFunction, Softcap, log2_logits
from jattn.kernels.common.tiling import sequence_of_rows
from jattn.kernels.hopper import pipeline as mp


class Tile(NamedTuple):
  """A score tile's positions and the per-position inputs there: ``rows`` (query
  vectors, laid out along ``q_axis``), ``cols`` (key vectors, along the other axis),
  ``scalars``; ``b``, ``h`` the batch row and query head; ``row_group`` rows per query
  position (where a work item packs the query heads of one KV head: ``work``)."""

  shape: tuple
  q_axis: int
  q_start: Any
  k_start: Any
  b: Any
  h: Any
  rows: tuple = ()
  cols: tuple = ()
  scalars: tuple = ()
  row_group: int = 1
  bias: Any = None  # the dense bias at the tile, float32, shift taken off (``DenseBias``)

  def q_idx(self):
    """The query position of every element of the tile: a 2-D iota, not ``q_rows``
    broadcast, for which Mosaic's layout inference finds no solution in the mask and
    score functions (docs/backends.md)."""
    rows = mp.iota(self.shape, self.q_axis, self.q_start)
    return rows if self.row_group == 1 else lax.div(rows, jnp.int32(self.row_group))

  def q_rows(self):
    """The query positions of the tile's rows along ``q_axis``: one vector, which
    ``broadcast_rows`` spreads over the tile (a row's bounds cost one value, not a
    tile row)."""
    layout = mp.ROW if self.q_axis == 0 else mp.COL
    rows = plgpu.broadcasted_iota(jnp.int32, (self.shape[self.q_axis],), 0,
                                  layout=layout) + self.q_start
    return rows if self.row_group == 1 else lax.div(rows, jnp.int32(self.row_group))

  def broadcast_rows(self, x):
    return lax.broadcast_in_dim(x, self.shape, [self.q_axis])

  def k_idx(self):
    return mp.iota(self.shape, 1 - self.q_axis, self.k_start)

  def row(self, i: int):
    return lax.broadcast_in_dim(self.rows[i], self.shape, [self.q_axis])

  def col(self, i: int):
    return lax.broadcast_in_dim(self.cols[i], self.shape, [1 - self.q_axis])


@dataclasses.dataclass(frozen=True)
class DenseBias:
  """A dense bias as the Hopper kernels take it, in place of a score function (a
  ``FlexMods.score``): ``scale * q kᵀ + (bias - shift)``, the bias read per tile
  (``[B', H', q_len, kv_len]``, 16-bit) and, where ``shifted``, a float32 shift per
  row ``[B', H', q_len]`` taken off it first (``softmax.shared_row_shift``: rows of
  large values keep the small score)."""

  shifted: bool = False


@dataclasses.dataclass(frozen=True)
class PositionInputs:
  """Which per-position inputs a kernel reads (static): segment ids, the functions'
  parts, dropout's hashes (where ``dropout``, the rate, is > 0), and whether block
  ranges narrow its mask spec's."""

  segments: bool = False
  mask: FactoredFunction | None = None
  score: FactoredFunction | None = None
  ranges: bool = False
  dropout: float = 0.0  # the rate: weights kept where ``kept`` says
  lengths: bool = False  # per-row (q_len, kv_len): the last two scalars
  bias: DenseBias | None = None  # a dense bias read by tiles, its shift a row part

  @property
  def transforms(self) -> bool:
    """Whether the logits are transformed (a score function or a dense bias)."""
    return self.score is not None or self.bias is not None

  @property
  def _shift_row(self) -> int:
    return int(self.bias is not None and self.bias.shifted)

  @property
  def functions(self) -> tuple:
    return tuple(f for f in (self.mask, self.score) if f is not None)

  def _count(self, kind: str, functions=None) -> int:
    return sum(len(f.of_kind(kind)) for f in (self.functions if functions is None else functions))

  @property
  def n_rows(self) -> int:
    return self.segments + self._count(ROW) + self._shift_row + (self.dropout > 0)

  @property
  def n_cols(self) -> int:
    return self.segments + self._count(COL) + (self.dropout > 0)

  @property
  def vectors(self) -> tuple[int, int]:
    """``(n_rows, n_cols)``: the vectors a kernel holds in shared memory per tile."""
    return self.n_rows, self.n_cols

  @property
  def n_scalars(self) -> int:
    return self._count(SCALAR) + 2 * self.lengths

  @property
  def n_refs(self) -> int:
    return self.n_rows + self.n_cols + self.n_scalars + self.ranges + (self.bias is not None)

  def split(self, refs):
    """``(rows, cols, scalars, ranges or None, bias or None, the refs after them)``."""
    refs = list(refs)
    out = []
    for n in (self.n_rows, self.n_cols, self.n_scalars, self.ranges, self.bias is not None):
      out.append(refs[:n])
      refs = refs[n:]
    rows, cols, scalars, ranges, bias = out
    return rows, cols, scalars, ranges[0] if ranges else None, bias[0] if bias else None, refs

  def needs(self, kind: str, masked: bool) -> bool:
    """Whether a step reads the ``kind`` (``ROW`` or ``COL``) vectors: the score's and
    dropout's always, the mask's (and the segment ids) on masked tiles only."""
    score = self.score is not None and bool(self.score.of_kind(kind))
    mask = self.segments or (self.mask is not None and bool(self.mask.of_kind(kind)))
    shift = kind == ROW and self._shift_row
    return score or shift or self.dropout > 0 or (masked and mask)

  def read_scalars(self, refs, b, h) -> tuple:
    return tuple(ref[mp.shared_index(ref, 0, b), mp.shared_index(ref, 1, h)] for ref in refs)

  def vector_dtypes(self, inputs) -> tuple[tuple, tuple]:
    """The dtypes of the row and col arrays of ``inputs`` (``position_arrays``' order)."""
    rows, cols = inputs[:self.n_rows], inputs[self.n_rows:self.n_rows + self.n_cols]
    return tuple(x.dtype for x in rows), tuple(x.dtype for x in cols)

  def bias_dtype(self, inputs):
    """The dense bias's dtype among ``inputs`` (``position_arrays``' order), or None."""
    return inputs[self.n_refs - 1].dtype if self.bias is not None else None

  @staticmethod
  def scratch(row_dtypes: tuple, col_dtypes: tuple, row_shape: tuple, col_shape: tuple) -> dict:
    """Shared memory for the row and col vectors (``vector_dtypes``): ``row{i}`` of
    ``row_shape``, ``col{i}`` of ``col_shape``."""
    return {**{f"row{i}": plgpu.SMEM(row_shape, t) for i, t in enumerate(row_dtypes)},
            **{f"col{i}": plgpu.SMEM(col_shape, t) for i, t in enumerate(col_dtypes)}}

  def buffers(self, smem: dict, kind: str) -> list:
    """The ``scratch`` buffers of ``kind`` (``ROW`` or ``COL``)."""
    return [smem[f"{kind}{i}"] for i in range(self.n_rows if kind == ROW else self.n_cols)]

  def load(self, smem: dict, kind: str, at, layout) -> tuple:
    """The vectors of ``kind`` in registers: ``at(buffer)`` of each, in ``layout``."""
    return tuple(mp.load(at(buf), layout) for buf in self.buffers(smem, kind))

  def _parts(self, fn: FactoredFunction, tile: Tile) -> tuple:
    before = (self.mask,) if self.mask is not None and fn is not self.mask else ()
    at = {ROW: self.segments + self._count(ROW, before),
          COL: self.segments + self._count(COL, before), SCALAR: self._count(SCALAR, before)}
    out = []
    for part in fn.parts:
      i = at[part.kind]
      at[part.kind] += 1
      out.append(tile.row(i) if part.kind == ROW else tile.col(i) if part.kind == COL
                 else tile.scalars[i])
    return tuple(out)

  def bias_tile(self, tile: Tile, values):
    """``tile`` with the dense bias ``values`` (its tile in registers, shaped as the
    score tile) as float32, the row shift taken off first."""
    bias = values.astype(jnp.float32)
    if self.bias.shifted:  # the row before dropout's hash, after the functions' parts
      bias = bias - tile.row(self.n_rows - 1 - (self.dropout > 0))
    return tile._replace(bias=bias)

  def logits(self, qk, scale: float, softcap, tile: Tile, with_grad: bool = False):
    """``masking``'s ``log2_logits`` with the score function (or the soft-cap); with a
    dense bias, ``(scale * qk + bias, LOG2E, None)``: the scaled logits in natural
    units, which ``log2_units`` does not cover (``tile.bias`` None: ``qk`` holds the
    bias over the scale already)."""
    if self.bias is not None:
      x = qk * scale
      return (x if tile.bias is None else x + tile.bias), LOG2E, None
    if self.score is None:
      return log2_logits(qk, scale, Softcap.of(softcap), with_grad=with_grad)
    index = (tile.b, tile.h, tile.q_idx(), tile.k_idx())
    return log2_logits(qk, scale, ScoreFunction(self.score, self._parts(self.score, tile)), index,
                       with_grad)

  def kept(self, tile: Tile):
    """Dropout's keep-mask of the tile (its hashes are the last row and col vectors)."""
    return keep(tile.row(self.n_rows - 1), tile.col(self.n_cols - 1), self.dropout)

  def apply_mask(self, s, spec: MaskSpec, tile: Tile):
    """``s`` with -inf where the spec, the segment ids or the mask function refuse."""
    segments = (tile.row(0), tile.col(0)) if self.segments else ()
    if self.lengths:
      spec = spec.with_lengths(*tile.scalars[-2:])
    if self.mask is not None:
      spec = dataclasses.replace(spec, element_fn=self.mask,
                                 element_arrays=self._parts(self.mask, tile))
    # Row positions only where a bound reads them: an unused value leaves Mosaic's
    # layout inference unconstrained choices (it ran out of search on the H100).
    q_rows = tile.q_rows() if spec.bounds_rows else None
    q_tile = tile.q_idx() if spec.element_fn is not None else None
    return apply_mask(s, -jnp.inf, spec, q_rows, tile.k_idx(), *segments,
                      bh=(tile.b, tile.h), rows=tile.broadcast_rows, q_tile=q_tile)


def copy_bias_tiles(bias_ref, tiles, batch, head, barrier):
  """TMA copies of a dense bias's tiles (``DenseBias``) of (batch row, query head):
  ``tiles`` yields ``(smem, rows, cols)``, each a shared-memory tile and the query and
  key slices it takes, completing on ``barrier``."""
  at = lambda rows, cols: bias_ref.at[mp.shared_index(bias_ref, 0, batch),
                                      mp.shared_index(bias_ref, 1, head), rows, cols]
  for smem, rows, cols in tiles:
    plgpu.copy_gmem_to_smem(at(rows, cols), smem, barrier)


def given_range(ranges_ref, b, heads, first_block, n_blocks: int):
  """The ``(lo, full_lo, full_hi, hi)`` of row block ``first_block`` of head ``heads``
  (one head, ``n_blocks == 1``), or the union ``(lo, lo, lo, hi)`` over ``n_blocks``
  blocks from ``first_block`` and the heads in ``heads`` (one or a list: what a CTA
  streams)."""
  heads = heads if isinstance(heads, (list, tuple)) else [heads]
  at = lambda h, i, c: ranges_ref[mp.shared_index(ranges_ref, 0, b),
                                  mp.shared_index(ranges_ref, 1, h), first_block + i, c]
  if n_blocks == 1 and len(heads) == 1:
    return tuple(at(heads[0], 0, c) for c in range(4))
  # Unions of the raw ends: an empty block's (n, n, n, 0) widens nothing.
  pairs = [(h, i) for h in heads for i in range(n_blocks)]
  lo, hi = at(*pairs[0], 0), at(*pairs[0], 3)
  for h, i in pairs[1:]:
    lo, hi = jnp.minimum(lo, at(h, i, 0)), jnp.maximum(hi, at(h, i, 3))
  return lo, lo, lo, jnp.maximum(hi, lo)


def own_blocks(block_range, masked_runs, ranges_ref, batch, head, tile, wg):
  """A consumer's block range of the other axis and its ``visit_blocks`` masked runs
  (``masked_runs``: the spec's for ``block_range``), narrowed where the kernel reads
  given ranges by that of its row block ``tile * CONSUMERS + wg``: a narrowed range may
  have masked blocks on both sides."""
  if ranges_ref is None:
    return block_range, masked_runs
  given = given_range(ranges_ref, batch, head, tile * mp.CONSUMERS + wg, 1)
  return narrow(block_range, given), (True, True)


# --- host side -------------------------------------------------------------------------------

def segment_ranges(row_seg, col_seg, row_len: int, col_len: int, row_block: int,
                   col_block: int, *, uniform: bool = True):
  """``ranges`` ``[batch, 1, row_blocks, 4]`` of segment ids: the blocks ids can meet,
  unmasked where both blocks hold one and the same id (``segment_block_ranges``;
  only a spec with ``segment_tiles`` runs them so; ``uniform=False``: every block
  masked, ``(first, first, first, end)``); ``(n, n, n, 0)`` where none can meet, so
  that unions skip it."""
  if uniform:
    return segment_block_ranges(row_seg, col_seg, row_len, col_len, row_block, col_block,
                                uniform=True)[:, None]
  first_end = segment_block_ranges(row_seg, col_seg, row_len, col_len, row_block, col_block)
  first, end = first_end[..., 0], first_end[..., 1]
  return jnp.stack([first, first, first, end], axis=-1)[:, None]


def length_ranges(spec: MaskSpec, lengths, tiles: tuple[int, int], padded: tuple[int, int],
                  transpose: bool = False):
  """``ranges`` ``[batch, 1, row_tiles, 4]`` of per-row ``lengths`` (``[batch, 2]`` int32
  ``(q_len, kv_len)``): per query tile (``transpose``: per key tile) of the kernel's
  ``tiles = (tile_q, tile_kv)`` over the ``padded`` lengths, the blocks ``spec``
  bound to the row's lengths gives it (``(n, n, n, 0)`` where none)."""
  bound = spec.with_lengths(lengths[:, :1], lengths[:, 1:])
  axis = 1 if transpose else 0
  starts = jnp.arange(padded[axis] // tiles[axis], dtype=jnp.int32)[None, :] * tiles[axis]
  if transpose:
    ranges = q_block_range(bound, starts, tiles[1], tiles[0])
  else:
    ranges = kv_block_range(bound, starts, tiles[0], tiles[1])
  shape = (lengths.shape[0], starts.shape[1])
  return _empty_as_none(jnp.stack([jnp.broadcast_to(x, shape) for x in ranges],
                                  axis=-1)[:, None], padded[1 - axis] // tiles[1 - axis])


def _empty_as_none(ranges, n: int):
  """``ranges`` with every empty one as ``(n, n, n, 0)``, which widens no union."""
  empty = (ranges[..., 3] <= ranges[..., 0])[..., None]
  return jnp.where(empty, jnp.array([n, n, n, 0], jnp.int32), ranges).astype(jnp.int32)


def joint_ranges(a, b, n: int):
  """The blocks both ``ranges`` give (unmasked where both say so), over ``n`` blocks."""
  if a is None or b is None:
    return a if b is None else b
  return _empty_as_none(jnp.stack(narrow(tuple(a[..., i] for i in range(4)),
                                         tuple(b[..., i] for i in range(4))), axis=-1), n)


def packed_ranges(cu_seqlens, max_len: int, spec: MaskSpec, tiles: tuple[int, int],
                  padded: tuple[int, int], transpose: bool = False):
  """``ranges`` ``[1, 1, row_tiles, 4]`` of sequences packed in one batch row (the same
  packing for queries and keys: ``cu_seqlens`` ``[seqs + 1]``, each sequence cut to
  ``max_len`` positions), under ``spec``'s window (offset 0). A tile visits the key
  blocks some real row of it sees; a block is unmasked only where every row of the
  tile is real and sees all of it (``MaskSpec.segment_tiles``: tiles inside one
  sequence and below its diagonal run without the element mask). ``transpose``: per
  key tile, the query blocks that see it."""
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  axis = 1 if transpose else 0
  rows, other = padded[axis], padded[1 - axis]
  tile, block = tiles[axis], tiles[1 - axis]
  r = jnp.arange(rows, dtype=jnp.int32)
  seq = jnp.minimum(sequence_of_rows(cu, rows), cu.shape[0] - 2)
  first, end = cu[seq], jnp.minimum(cu[seq + 1], cu[seq] + max_len)
  real = (r >= cu[0]) & (r < end)
  # Rows see keys [start, stop) of their sequence; per key tile, the rows that see a key.
  before, after = (spec.right, spec.left) if transpose else (spec.left, spec.right)
  start = first if before is None else jnp.maximum(first, r - before)
  stop = end if after is None else jnp.minimum(end, r + after + 1)
  by_tile = lambda x: x.reshape(rows // tile, tile)
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.min(by_tile(jnp.where(real, start, big)), axis=1) // block
  hi = -(-jnp.max(by_tile(jnp.where(real, stop, 0)), axis=1) // block)
  full_lo = -(-jnp.max(by_tile(jnp.where(real, start, big)), axis=1) // block)
  full_hi = jnp.min(by_tile(jnp.where(real, stop, 0)), axis=1) // block
  lo = jnp.minimum(lo, hi)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  ranges = jnp.stack([lo, full_lo, full_hi, hi], axis=-1)[None, None]
  return _empty_as_none(ranges, other // block)


def mask_ranges(kinds, block: tuple[int, int], tiles: tuple[int, int],
                padded: tuple[int, int], lengths: tuple[int, int], transpose: bool = False):
  """``ranges`` ``[B', H', row_tiles, 4]`` of a block mask's classification ``kinds``
  (``[B', H', q_blocks, kv_blocks]`` at ``block``) re-tiled to a kernel's ``tiles``
  (``(tile_q, tile_kv)``) over ``padded`` lengths; ``transpose``: per key tile, the
  query tiles. Per row: the first to the last nonempty tile, and the first run of full
  tiles unmasked (tiles in range that are empty run masked: correct, and free of
  work only for masks whose blocks are contiguous per row, as causal, windows and
  documents are)."""
  counts = (padded[0] // tiles[0], padded[1] // tiles[1])
  kinds = retile(kinds, block, tiles, counts, lengths)
  if transpose:
    kinds = jnp.swapaxes(kinds, -1, -2)
  n = kinds.shape[-1]
  cols = jnp.arange(n, dtype=jnp.int32)
  nonempty, full = kinds != EMPTY, kinds == FULL
  lo = jnp.min(jnp.where(nonempty, cols, n), axis=-1)
  hi = jnp.max(jnp.where(nonempty, cols + 1, 0), axis=-1)
  full_lo = jnp.min(jnp.where(full, cols, n), axis=-1)
  after = (cols >= full_lo[..., None]) & ~full
  full_hi = jnp.min(jnp.where(after, cols, n), axis=-1)
  has_full = full_lo < n
  full_lo = jnp.where(has_full, full_lo, lo)
  full_hi = jnp.where(has_full, full_hi, lo)
  empty = hi == 0
  lo, full_lo, full_hi = (jnp.where(empty, n, x) for x in (lo, full_lo, full_hi))
  return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def as_vector_array(x, length: int):
  """A row or col part (``[B', positions]``, or ``[B', H', positions]`` per head) as a
  kernel copies it: int32 or float32, padded to ``length`` with its last value (padded
  positions then compute what the last real one does, never a 0/0 a zero would give;
  the Triton kernels clamp their indices alike)."""
  x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)
  pad = [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])]
  return jnp.pad(x, pad, mode="edge") if x.shape[-1] != length else x


def as_scalar_array(x):
  return x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)


def position_arrays(inputs: PositionInputs, segments=None, mask_parts=(), score_parts=(),
                    ranges=None, hashes=None, lengths=None, bias=(), *,
                    padded: tuple[int, int]) -> tuple:
  """The kernel's per-position input arrays in ``PositionInputs`` order: ``segments``
  ``(q_seg, kv_seg)`` (padded), the functions' parts (``part_arrays``), dropout's
  ``hashes`` (``dropout.hash_arrays`` at the padded lengths), per-row ``lengths``
  (``[batch, 2]`` int32), ``ranges`` and a ``DenseBias``'s arrays ``bias`` (the bias
  ``[B', H', q_len, kv_len]``, then its shift ``[B', H', q_len]`` where shifted)."""
  rows, cols, scalars = [], [], []
  if inputs.segments:
    rows.append(segments[0])
    cols.append(segments[1])
  for fn, parts in ((inputs.mask, mask_parts), (inputs.score, score_parts)):
    if fn is None:
      continue
    for part, x in zip(fn.parts, parts):
      if part.kind == ROW:
        rows.append(as_vector_array(x, padded[0]))
      elif part.kind == COL:
        cols.append(as_vector_array(x, padded[1]))
      else:
        scalars.append(as_scalar_array(x))
  if inputs.bias is not None and inputs.bias.shifted:
    rows.append(as_vector_array(bias[1], padded[0]))
  if inputs.dropout:
    rows.append(hashes[0])
    cols.append(hashes[1])
  if inputs.lengths:
    scalars += [lengths[:, :1], lengths[:, 1:]]
  tile = ()
  if inputs.bias is not None:
    b = bias[0]
    tile = (jnp.pad(b, [(0, 0), (0, 0), (0, padded[0] - b.shape[2]), (0, padded[1] - b.shape[3])])
            if b.shape[2:] != padded else b,)
  return (*rows, *cols, *scalars, *(() if ranges is None else (ranges,)), *tile)
