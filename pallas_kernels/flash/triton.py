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

from jattn.kernels.common.block_sparsity import retile, tile_lists
from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.element_functions import TileFunction, kernel_array
from jattn.kernels.common.dropout import backward_rows
from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import (ScoreFunction, Softcap, backward_delta, backward_lse,
                                          floor_sinks)
from jattn.kernels.common.tiling import pad_rows, pad_to, tile_axis


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


def kernel_tiles(config: BlockConfig, q_len: int, kv_len: int):
  """``(q tiles (fwd, dkv, dq), k tiles (fwd, dkv, dq), q_len_p, kv_len_p)``."""
  bq, q_len_p = tile_axis(q_len, (config.block_q, config.block_q_dkv, config.block_q_dq))
  bk, kv_len_p = tile_axis(kv_len, (config.block_k, config.block_k_dkv, config.block_k_dq))
  return bq, bk, q_len_p, kv_len_p


def _mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mods, lengths):
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=kv_len_p != kv_len, segments=segments,
                        lengths=lengths is not None)
  return dataclasses.replace(spec, element_fn=mods.mask)


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
                          dropout_seed=None, lengths=None):
  """Gradients ``(dq, dk, dv)`` (like q, k, v) given the rows' ``o`` and ``lse``, the
  output's cotangent ``do`` and the lse's ``dlse``. Shapes and ``lengths`` as
  ``flash_triton_forward`` (sinks need nothing here: ``lse`` holds them)."""
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
  dq, dk, dv = flash_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, dv_p),
      pad_to(do.astype(q.dtype), q_len_p, dv_p), lse2, pad_rows(delta, q_len_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=_mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mods, lengths),
      scale=scale, score=_score(softcap, mods), config=config,
      blocks=(bq[1], bk[1], bq[2], bk[2]), interpret=interpret, arrays=mods.arrays,
      lists=lists, dropout_rate=dropout_rate, dropout_seed=dropout_seed, lengths=lengths)
  return (dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim],
          dv[:, :kv_len, :, :dv_width])
