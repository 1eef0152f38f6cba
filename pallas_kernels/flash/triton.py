"""Host side of the Triton-lowered flash attention: pads inputs to the tile grid, runs
the forward kernel, or the dK/dV and dQ kernels given the saved ``(o, lse)``.

The backward takes any ``(o, lse)`` of the rows, not only this forward's: given the
final statistics of a larger softmax (a ring's, a mixture's), it returns this block's
share of the gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jattn.kernels.common.block_sparsity import retile, tile_lists
from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.element_functions import TileFunction, kernel_array
from jattn.kernels.common.dropout import backward_rows
from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import (EMPTY_ROW_LSE, ScoreFunction, Softcap,
                                          backward_delta, backward_lse, floor_sinks)
from jattn.kernels.common.tiling import packed_positions, pad_rows, pad_to, tile_axis


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class FlexMods:
  """FlexAttention's functions and block mask as the kernels take them.

  Attributes:
    score, mask: the score / mask function as the kernels evaluate it, or None: a
      ``TileFunction`` (Triton kernels) or a ``FactoredFunction`` (Hopper kernels).
    score_arrays, mask_arrays: the arrays each reads: the ``TileFunction``'s
      (``kernel_array``), or the ``FactoredFunction``'s parts (``part_arrays``).
    block_kinds: ``[batch or 1, heads or 1, q_blocks, kv_blocks]`` EMPTY / PARTIAL /
      FULL per block of ``block = (block_q, block_kv)`` positions, or None (every
      tile visited, and masked when there is a mask).
  """

  score: TileFunction | None = None
  score_arrays: tuple = ()
  mask: TileFunction | None = None
  mask_arrays: tuple = ()
  block_kinds: Any = None
  block: tuple[int, int] | None = None

  def tree_flatten(self):
    return ((self.score_arrays, self.mask_arrays, self.block_kinds),
            (self.score, self.mask, self.block))

  @classmethod
  def tree_unflatten(cls, aux, children):
    (score_arrays, mask_arrays, kinds), (score, mask, block) = children, aux
    return cls(score, tuple(score_arrays), mask, tuple(mask_arrays), kinds, block)

  @property
  def arrays(self) -> tuple:
    return tuple(self.score_arrays) + tuple(self.mask_arrays)

  def lists(self, tiles, padded, lengths, transpose: bool = False):
    """``tile_lists`` for a kernel's ``tiles`` over the ``padded`` lengths (None
    without a block mask)."""
    if self.block_kinds is None:
      return None
    counts = (padded[0] // tiles[0], padded[1] // tiles[1])
    return tile_lists(retile(self.block_kinds, self.block, tiles, counts, lengths),
                      transpose=transpose)
from jattn.kernels.flash.triton_bwd import flash_backward
from jattn.kernels.flash.triton_fwd import flash_forward
from jattn.kernels.flash.triton_rows import PackedRows


def kernel_tiles(config: BlockConfig, q_len: int, kv_len: int):
  """``(q tiles (fwd, dkv, dq), k tiles (fwd, dkv, dq), q_len_p, kv_len_p)``."""
  bq, q_len_p = tile_axis(q_len, (config.block_q, config.block_q_dkv, config.block_q_dq))
  bk, kv_len_p = tile_axis(kv_len, (config.block_k, config.block_k_dkv, config.block_k_dq))
  return bq, bk, q_len_p, kv_len_p


def _mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mods, lengths):
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=kv_len_p != kv_len, segments=segments,
                        lengths=lengths is not None)
  # With segment ids the kernels are given block ranges that say which tiles need no mask.
  return dataclasses.replace(spec, element_fn=mods.mask, segment_tiles=segments)


def _score(softcap, mods):
  if softcap is not None:
    return Softcap(softcap)
  return None if mods.score is None else ScoreFunction(mods.score)


def flash_triton_forward(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, local_window,
                         softcap, config: BlockConfig, interpret: bool,
                         mods: FlexMods = FlexMods(), sinks=None, dropout_rate: float = 0.0,
                         dropout_seed=None, lengths=None):
  """Flash attention forward.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, head_dim_v]``.
    q_seg, kv_seg: ``[batch, q_len]`` / ``[batch, kv_len]`` int32, or None.
    mods: FlexAttention's functions and block mask (a score function excludes
      ``softcap``).
    sinks: ``[q_heads]`` float32 logits joining every row's denominator, or None.
    dropout_rate, dropout_seed: dropout of the weights (rate > 0) and its ``[2]``
      int32 seed (``dropout.seed_of``).
    lengths: ``[batch, 2]`` int32 ``(q_len, kv_len)`` of each batch row (in ``[0,
      q_len]`` and ``[0, kv_len]``), or None: the rows past a row's ``q_len`` see no
      key, and the mask aligns on these lengths.

  Returns:
    ``(o, lse)``: ``o: [batch, q_len, q_heads, head_dim_v]``; ``lse: [batch, q_heads,
    q_len]`` float32.
  """
  q_len, kv_len, head_dim, dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p = kernel_tiles(config, q_len, kv_len)
  d_p = padded_head_dim(head_dim)
  o, lse = flash_forward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p),
      pad_to(v, kv_len_p, padded_head_dim(dv)),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=_mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mods, lengths),
      scale=scale, score=_score(softcap, mods), config=config, block_q=bq[0], block_k=bk[0],
      interpret=interpret, arrays=mods.arrays,
      lists=mods.lists((bq[0], bk[0]), (q_len_p, kv_len_p), (q_len, kv_len)),
      sinks=None if sinks is None else kernel_array(floor_sinks(sinks)),
      dropout_rate=dropout_rate, dropout_seed=dropout_seed, lengths=lengths)
  return o[:, :q_len, :, :dv], lse[:, :, :q_len]


def flash_triton_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, *, causal: bool, scale: float,
                          local_window, softcap, config: BlockConfig, interpret: bool,
                          mods: FlexMods = FlexMods(), dropout_rate: float = 0.0,
                          dropout_seed=None, lengths=None, ds_dtype=None):
  """Gradients ``(dq, dk, dv)`` (like q, k, v) given the rows' ``o`` and ``lse``, the
  output's cotangent ``do`` and the lse's ``dlse``. Shapes and ``lengths`` as
  ``flash_triton_forward`` (sinks need nothing here: ``lse`` holds them). With
  ``ds_dtype``, also dS ``[batch, q_heads, q_len, kv_len]`` (``flash_backward``)."""
  q_len, kv_len, head_dim, dv_width = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p = kernel_tiles(config, q_len, kv_len)
  d_p, dv_p = padded_head_dim(head_dim), padded_head_dim(dv_width)
  lse, delta = backward_rows(lse, backward_delta(o, do, dlse), dropout_rate)
  lse2 = backward_lse(lse, q_len_p, mods.score is not None)
  padded, true = (q_len_p, kv_len_p), (q_len, kv_len)
  lists = None
  if mods.block_kinds is not None:
    lists = (mods.lists((bq[1], bk[1]), padded, true, transpose=True),
             mods.lists((bq[2], bk[2]), padded, true))
  dq, dk, dv, *ds = flash_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, dv_p),
      pad_to(do.astype(q.dtype), q_len_p, dv_p), lse2, pad_rows(delta, q_len_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=_mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mods, lengths),
      scale=scale, score=_score(softcap, mods), config=config,
      blocks=(bq[1], bk[1], bq[2], bk[2]), interpret=interpret, arrays=mods.arrays,
      lists=lists, dropout_rate=dropout_rate, dropout_seed=dropout_seed, lengths=lengths,
      ds_dtype=ds_dtype)
  return (dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim],
          dv[:, :kv_len, :, :dv_width]) + tuple(x[:, :, :q_len, :kv_len] for x in ds)


def _packed_spec(max_q: int, max_k: int, causal: bool, local_window) -> MaskSpec:
  return MaskSpec.build(max_q, max_k, causal=causal, local_window=local_window, kv_padded=True,
                        segments=False, lengths=True)


def _packed_lengths(cu_q, cu_k, total_q: int, total_k: int):
  """``PackedRows``' ``[seqs + 1, 2]`` int32 cumulative lengths of queries and keys, each
  kept within its packed rows (traced values are unchecked)."""
  return jnp.stack([jnp.clip(cu_q.astype(jnp.int32), 0, total_q),
                    jnp.clip(cu_k.astype(jnp.int32), 0, total_k)], axis=1)


def _pad_packed(x, rows: int, width: int):
  return jnp.pad(x, [(0, rows - x.shape[0]), (0, 0), (0, width - x.shape[-1])])


def flash_triton_varlen_forward(q, k, v, cu_q, cu_k, *, max_q: int, max_k: int, causal: bool,
                                scale: float, local_window, softcap, config: BlockConfig,
                                interpret: bool, sinks=None):
  """Flash attention forward over packed sequences.

  Args:
    q: ``[total_q, q_heads, head_dim]``; k: ``[total_k, kv_heads, head_dim]``; v:
      ``[total_k, kv_heads, head_dim_v]``.
    cu_q, cu_k: ``[seqs + 1]`` int32 cumulative lengths: sequence ``s`` is rows
      ``[cu_q[s], cu_q[s + 1])`` of q and ``[cu_k[s], cu_k[s + 1])`` of k and v.
    max_q, max_k: bounds of the lengths (the grid's extent); a longer sequence's rows
      past them are not computed (zeros) and its keys past them not seen.
    sinks: ``[q_heads]`` float32 logits joining every row's denominator, or None.

  Returns:
    ``(o [total_q, q_heads, head_dim_v], lse [q_heads, total_q] float32)``; rows no
    sequence holds give zeros and the lse of a row that sees no key (``EMPTY_ROW_LSE``,
    the sink's logit with sinks).
  """
  total_q, dv = q.shape[0], v.shape[-1]
  cu = _packed_lengths(cu_q, cu_k, total_q, k.shape[0])
  bq, bk, _, _ = kernel_tiles(config, max_q, max_k)
  d_p = padded_head_dim(q.shape[-1])
  o, lse = flash_forward(
      _pad_packed(q, total_q + bq[0], d_p), _pad_packed(k, k.shape[0] + bk[0], d_p),
      _pad_packed(v, k.shape[0] + bk[0], padded_head_dim(dv)), None, None,
      spec=_packed_spec(max_q, max_k, causal, local_window), scale=scale,
      score=Softcap.of(softcap), config=config, block_q=bq[0], block_k=bk[0],
      interpret=interpret, sinks=None if sinks is None else kernel_array(floor_sinks(sinks)),
      lengths=cu, layout=PackedRows(max_q, max_k))
  valid = packed_positions(cu[:, 0], total_q, max_q)[2]
  empty = EMPTY_ROW_LSE if sinks is None else floor_sinks(sinks)[:, None]
  return (jnp.where(valid[:, None, None], o[:total_q, :, :dv], 0).astype(q.dtype),
          jnp.where(valid[None], lse[:, :total_q], empty))


def flash_triton_varlen_backward(q, k, v, cu_q, cu_k, o, lse, do, dlse, *, max_q: int,
                                 max_k: int, causal: bool, scale: float, local_window, softcap,
                                 config: BlockConfig, interpret: bool):
  """Gradients ``(dq, dk, dv)`` over packed sequences given the rows' ``o`` and ``lse``
  (``[q_heads, total_q]``) and the cotangents ``do``, ``dlse``; shapes as
  ``flash_triton_varlen_forward``'s."""
  total_q, total_k = q.shape[0], k.shape[0]
  cu = _packed_lengths(cu_q, cu_k, total_q, total_k)
  bq, bk, _, _ = kernel_tiles(config, max_q, max_k)
  rows_q, rows_k = total_q + max(bq), total_k + max(bk)
  d_p, dv_p = padded_head_dim(q.shape[-1]), padded_head_dim(v.shape[-1])
  delta = backward_delta(o[None], do[None], dlse[None])[0]
  dq, dk, dv = flash_backward(
      _pad_packed(q, rows_q, d_p), _pad_packed(k, rows_k, d_p), _pad_packed(v, rows_k, dv_p),
      _pad_packed(do.astype(q.dtype), rows_q, dv_p), backward_lse(lse, rows_q, False),
      pad_rows(delta, rows_q), None, None,
      spec=_packed_spec(max_q, max_k, causal, local_window), scale=scale,
      score=Softcap.of(softcap), config=config, blocks=(bq[1], bk[1], bq[2], bk[2]),
      interpret=interpret, lengths=cu, layout=PackedRows(max_q, max_k))
  valid_q = packed_positions(cu[:, 0], total_q, max_q)[2][:, None, None]
  valid_k = packed_positions(cu[:, 1], total_k, max_k)[2][:, None, None]
  return (jnp.where(valid_q, dq[:total_q, :, :q.shape[-1]], 0),
          jnp.where(valid_k, dk[:total_k, :, :k.shape[-1]], 0),
          jnp.where(valid_k, dv[:total_k, :, :v.shape[-1]], 0))
