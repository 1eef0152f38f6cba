"""Forward flash attention kernel, lowered through Triton (Ampere and newer).

Grid: (query blocks, batch, query heads), the query blocks launched last first
(``launch.last_first``: a causal mask's heaviest tiles start first; docs/backends.md
has the measurement). Each program keeps one query tile in registers and streams
key/value tiles with an online softmax. Key blocks are
visited in three runs (masked, unmasked, masked) so that tiles wholly inside
the attention pattern skip the element mask; or, given block-sparse tile lists
(FlexAttention's block masks), the listed partial tiles masked and the full ones
unmasked. With segment ids, the runs are narrowed to the key blocks whose ids can meet
the query tile's, and tiles wholly inside one segment are unmasked
(``masking.segment_block_ranges``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.config import BlockConfig
from jattn.kernels.common.block_sparsity import list_specs, listed_tiles
from jattn.kernels.common.dropout import col_hash, keep, row_hash
from jattn.kernels.common.launch import (LENGTHS, SEGMENT_RANGE, last_first, row_stat_spec,
                                         tile_last_first, tile_spec, triton_call,
                                         whole_array_spec, whole_sequence_spec)
from jattn.kernels.common.element_functions import kernel_array
from jattn.kernels.common.masking import (MaskSpec, apply_mask, kv_block_range, range_tiles,
                                          run_tiles, segment_block_ranges, segment_masked_runs,
                                          split_extra_refs, with_segment_range)
from jattn.kernels.common.nonfinite import guard_values
from jattn.kernels.common.softmax import (dot, log2_logits, log2_units, online_softmax_finish,
                                          online_softmax_init, online_softmax_step)
from jattn.kernels.flash.triton_rows import BATCH_ROWS, PackedRows


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, seg_range_ref, sink_ref,
                    seed_ref, lengths_ref, *refs, spec: MaskSpec, scale: float, score,
                    block_q: int, block_k: int, lists: bool, dropout_rate: float, layout):
  spec, score, tile_lists, (o_ref, lse_ref) = split_extra_refs(refs, spec, score, lists)
  spec, rows_at = layout.bind(spec, lengths_ref, pl.program_id(1))
  tile = tile_last_first()
  q_start = tile * block_q
  bh = (pl.program_id(1), pl.program_id(2))
  q = rows_at.q_tile(q_ref, q_start, block_q)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  q_seg = q_seg_ref[...][:, None] if spec.segments else None
  rows = row_hash(seed_ref[0], *bh, q_idx) if dropout_rate else None

  def body(masked: bool, j, carry):
    k_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    k, v = rows_at.kv_tile(k_ref, k_slice), rows_at.kv_tile(v_ref, k_slice)
    if masked:  # masked weights must not meet a non-finite value (nonfinite.py)
      k, v = guard_values(k, v)
    s, c, _ = log2_logits(dot(q, k, 1, 1), scale, score, bh + (q_idx, k_idx))
    if masked:
      k_seg = kv_seg_ref[k_slice][None, :] if spec.segments else None
      s = apply_mask(s, -jnp.inf, spec, q_idx, k_idx, q_seg, k_seg, bh)
    kept = keep(rows, col_hash(seed_ref[1], k_idx), dropout_rate) if dropout_rate else None
    return online_softmax_step(carry, s, c, v, kept=kept)

  if lists:
    schedule = listed_tiles(tile_lists, tile)
  else:
    schedule = range_tiles(*with_segment_range(
        spec, kv_block_range(spec, q_start, block_q, block_k), seg_range_ref),
        segment_masked_runs(spec, spec.masked_kv_runs))
  sink = None if sink_ref is None else sink_ref[bh[1]]
  c = log2_units(scale, score is not None)
  carry = run_tiles(schedule, body, online_softmax_init(block_q, v_ref.shape[-1], sink, c))
  o, lse = online_softmax_finish(carry, c)
  if dropout_rate:
    o = o * (1.0 / (1.0 - dropout_rate))
  rows_at.store(o_ref, q_start, o.astype(o_ref.dtype))
  rows_at.store(lse_ref, q_start, lse)


def flash_forward(q, k, v, q_seg, kv_seg, *, spec: MaskSpec, scale: float, score,
                  config: BlockConfig, block_q: int, block_k: int, interpret: bool,
                  arrays=(), lists=None, sinks=None, dropout_rate: float = 0.0,
                  dropout_seed=None, lengths=None, layout=BATCH_ROWS):
  """Runs the forward kernel on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, d_p]`` with ``q_len_p % block_q == 0``.
    k, v: ``[batch, kv_len_p, kv_heads, d_p]`` / ``[..., dv_p]`` with
      ``kv_len_p % block_k == 0``.
    q_seg, kv_seg: ``[batch, q_len_p]`` / ``[batch, kv_len_p]`` int32, or None.
    sinks: float32 ``[q_heads_p]`` (padded to a power of two), or None.
    dropout_rate, dropout_seed: the rate and the ``[2]`` int32 seed words
      (``dropout.seed_of``) when > 0.
    lengths: ``[batch, 2]`` int32 ``(q_len, kv_len)`` per batch row when
      ``spec.lengths``, else None.
    layout: where the rows lie (``triton_rows``). ``PackedRows``: q ``[total_q_p,
      q_heads, d_p]``, k, v ``[total_k_p, kv_heads, ...]`` (each padded by a tile),
      ``lengths`` the ``[seqs + 1, 2]`` cumulative lengths; the batch axis below counts
      sequences, ``q_len_p`` is the longest one's, padded to the tile; no segment ids
      or dropout; rows no sequence covers are left unwritten.
    score: a score transform (``Softcap``, ``ScoreFunction``) or None.
    arrays: the arrays the score function, then the mask function, read.
    lists: ``block_sparsity.tile_lists`` at ``(block_q, block_k)``, or None.

  Returns:
    ``o`` like ``q`` and ``lse: [batch, q_heads, q_len_p]`` float32 (natural log).
  """
  if isinstance(layout, PackedRows):
    return _packed_forward(q, k, v, lengths, spec=spec, scale=scale, score=score,
                           config=config, block_q=block_q, block_k=block_k,
                           interpret=interpret, sinks=sinks, layout=layout)
  batch, q_len_p, q_heads, d = q.shape
  kv_len_p, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
  group = q_heads // kv_heads
  rev = lambda spec: last_first(spec, q_len_p // block_q)
  in_specs = [rev(tile_spec(block_q, d)), whole_sequence_spec(kv_len_p, d, group),
              whole_sequence_spec(kv_len_p, dv, group)]
  seg_ranges = None
  if spec.segments:  # tiles inside one segment run unmasked, those no id meets not at all
    seg_ranges = segment_block_ranges(q_seg, kv_seg, spec.q_len, spec.kv_len, block_q,
                                      block_k, uniform=True)
    in_specs += [rev(pl.BlockSpec((None, block_q), lambda i, b, h: (b, i))),
                 pl.BlockSpec((None, kv_len_p), lambda i, b, h: (b, 0)),
                 rev(SEGMENT_RANGE)]
  else:
    in_specs += [None, None, None]
  seed = dropout_seed if dropout_rate else None
  in_specs += [None if x is None else whole_array_spec(x) for x in (sinks, seed)]
  in_specs += [LENGTHS if spec.lengths else None]
  in_specs += [whole_array_spec(x) for x in arrays]
  if lists is not None:
    in_specs += list_specs(lists, per_head=True)
  kernel = functools.partial(_forward_kernel, spec=spec, scale=scale, score=score,
                             block_q=block_q, block_k=block_k, lists=lists is not None,
                             dropout_rate=dropout_rate, layout=layout)
  return triton_call(
      kernel,
      grid=(q_len_p // block_q, batch, q_heads),
      in_specs=in_specs,
      out_specs=[rev(tile_spec(block_q, dv)), rev(row_stat_spec(block_q))],
      out_shape=[jax.ShapeDtypeStruct((batch, q_len_p, q_heads, dv), q.dtype),
                 jax.ShapeDtypeStruct((batch, q_heads, q_len_p), jnp.float32)],
      name="jattn_flash_fwd", interpret=interpret, num_warps=config.num_warps,
      num_stages=config.num_stages,
  )(q, k, v, q_seg, kv_seg, seg_ranges, sinks, seed, lengths, *arrays, *(lists or ()))


def _packed_forward(q, k, v, cu, *, spec, scale, score, config, block_q, block_k, interpret,
                    sinks, layout: PackedRows):
  """``flash_forward`` on packed rows: ``(o [total_q_p, q_heads, dv_p], lse [q_heads,
  total_q_p])``."""
  total_q, q_heads, d = q.shape
  total_k, kv_heads, dv = k.shape[0], k.shape[1], v.shape[-1]
  group = q_heads // kv_heads
  seqs = cu.shape[0] - 1
  cu = kernel_array(cu)
  rows = lambda n, w, heads: pl.BlockSpec((n, None, w), lambda i, b, h: (0, heads(h), 0))
  kernel = functools.partial(_forward_kernel, spec=spec, scale=scale, score=score,
                             block_q=block_q, block_k=block_k, lists=False, dropout_rate=0.0,
                             layout=layout)
  return triton_call(
      kernel,
      grid=(-(-layout.max_q // block_q), seqs, q_heads),
      in_specs=[rows(total_q, d, lambda h: h), rows(total_k, d, lambda h: h // group),
                rows(total_k, dv, lambda h: h // group), None, None, None,
                None if sinks is None else whole_array_spec(sinks), None,
                whole_array_spec(cu)],
      out_specs=[rows(total_q, dv, lambda h: h),
                 pl.BlockSpec((None, total_q), lambda i, b, h: (h, 0))],
      out_shape=[jax.ShapeDtypeStruct((total_q, q_heads, dv), q.dtype),
                 jax.ShapeDtypeStruct((q_heads, total_q), jnp.float32)],
      name="jattn_flash_varlen_fwd", interpret=interpret, num_warps=config.num_warps,
      num_stages=config.num_stages,
  )(q, k, v, None, None, None, sinks, None, cu)
