"""Backward flash attention kernels, lowered through Triton.

Two kernels, no atomics, so gradients are bitwise reproducible:
- dK/dV: grid (key blocks, batch, kv heads); each program owns one key/value
  tile and loops over the query heads of its group and the query blocks that see
  it, so grouped-query heads are summed in a fixed order.
- dQ: grid (query blocks, batch, query heads), the query blocks launched last first
  as in the forward; loops over key blocks.
Both recompute probabilities from the saved log-sum-exp (``softmax.backward_probs``).
Given block-sparse tile lists (FlexAttention's block masks), each visits only the
listed tiles.
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
from jattn.kernels.common.element_functions import kernel_array
from jattn.kernels.common.launch import (LENGTHS, SEGMENT_RANGE, last_first, row_stat_spec,
                                         tile_last_first, tile_spec, triton_call,
                                         whole_array_spec, whole_sequence_spec)
from jattn.kernels.common.masking import (MaskSpec, element_mask, kv_block_range,
                                          q_block_range, range_tiles, run_tiles,
                                          segment_block_ranges, segment_masked_runs,
                                          split_extra_refs, with_segment_range)
from jattn.kernels.common.nonfinite import clear_nonfinite_rows, guard_values
from jattn.kernels.common.softmax import backward_probs, dot, log2_logits, logit_grad
from jattn.kernels.flash.triton_rows import BATCH_ROWS, PackedRows


def _dropped(p, dp, rows, seed_ref, k_idx, rate: float):
  """Dropout in the backward: ``(weights that multiplied V, dP through the mask)``,
  the mask rebuilt from the positions as the forward drew it (``1 / (1 - rate)`` is
  in the rows' lse and delta: ``dropout.backward_rows``)."""
  if not rate:
    return p, dp
  kept = keep(rows, col_hash(seed_ref[1], k_idx), rate)
  return jnp.where(kept, p, 0.0), jnp.where(kept, dp, 0.0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
                seg_range_ref, seed_ref, lengths_ref, *refs, spec: MaskSpec, scale: float,
                score, block_q: int, block_k: int, group: int, lists: bool,
                dropout_rate: float, layout):
  spec, score, tile_lists, (dk_ref, dv_ref) = split_extra_refs(refs, spec, score, lists)
  spec, rows_at = layout.bind(spec, lengths_ref, pl.program_id(1))
  k_start = pl.program_id(0) * block_k
  batch_row, kv_head = pl.program_id(1), pl.program_id(2)
  # Guarded for every tile (nonfinite.py): the rows of a tile without a mask all see a
  # key whose value is not finite, and are NaN either way.
  k_scored, v = guard_values(rows_at.key_tile(k_ref, k_start, block_k),
                             rows_at.key_tile(v_ref, k_start, block_k))
  # Tiles are kept transposed ([keys, queries]) so no operand needs a transpose.
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
  k_seg = kv_seg_ref[...][:, None] if spec.segments else None

  def body(head, masked: bool, i, carry):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q = rows_at.q_rows(q_ref, q_slice, head)
    do = rows_at.q_rows(do_ref, q_slice, head)
    lse2 = rows_at.stat_rows(lse_ref, head, q_slice)
    delta = rows_at.stat_rows(delta_ref, head, q_slice)
    q_idx = i * block_q + lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
    bh = (batch_row, head)
    s_t, c, g_t = log2_logits(dot(k_scored, q, 1, 1), scale, score, bh + (q_idx, k_idx), True)
    mask = None
    if masked:  # masked dS must not meet a non-finite query row (nonfinite.py)
      q_seg = q_seg_ref[q_slice][None, :] if spec.segments else None
      mask = element_mask(spec, q_idx, k_idx, q_seg, k_seg, bh)
      q = clear_nonfinite_rows(q)
    p_t = backward_probs(s_t * c - lse2[None, :], dropout_rate)
    if mask is not None:
      p_t = jnp.where(mask, p_t, 0.0)
    rows = row_hash(seed_ref[0], batch_row, head, q_idx) if dropout_rate else None
    p_v, dp_t = _dropped(p_t, dot(v, do, 1, 1), rows, seed_ref, k_idx, dropout_rate)
    dv = dv + dot(p_v.astype(do.dtype), do, 1, 0)
    ds_t = logit_grad(p_t * (dp_t - delta[None, :]), g_t)
    if mask is not None:  # a NaN row's delta times a masked weight of 0
      ds_t = jnp.where(mask, ds_t, 0.0)
    dk = dk + dot(ds_t.astype(q.dtype), q, 1, 0)
    return dk, dv

  if not lists:
    ranges = range_tiles(*with_segment_range(
        spec, q_block_range(spec, k_start, block_k, block_q), seg_range_ref),
        segment_masked_runs(spec, spec.masked_q_runs))
  # Read here: interpret mode has no program ids inside loops.
  key_tile = pl.program_id(0) if lists else None

  def per_head(g, carry):
    head = kv_head * group + g
    if lists:  # the lists hold every head's rows, or one row set for all heads
      schedule = listed_tiles(tile_lists, key_tile,
                              head if tile_lists[0].shape[0] > 1 else 0)
    else:
      schedule = ranges
    return run_tiles(schedule, functools.partial(body, head), carry)

  dk, dv = lax.fori_loop(0, group, per_head,
                         tuple(jnp.zeros((block_k, ref.shape[-1]), jnp.float32)
                               for ref in (k_ref, v_ref)))
  rows_at.store_keys(dk_ref, k_start, (dk * scale).astype(dk_ref.dtype))
  rows_at.store_keys(dv_ref, k_start, dv.astype(dv_ref.dtype))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
               seg_range_ref, seed_ref, lengths_ref, *refs, spec: MaskSpec, scale: float,
               score, block_q: int, block_k: int, lists: bool, dropout_rate: float, layout,
               writes_ds: bool = False):
  spec, score, tile_lists, outs = split_extra_refs(refs, spec, score, lists)
  # With ``writes_ds``: dS ``[block_q, kv_len_p]`` rows out too (after dQ; before them,
  # where skipped tiles must read zeros, the zeros aliased to them).
  dq_ref, ds_ref = (outs[-2], outs[-1]) if writes_ds else (outs[0], None)
  spec, rows_at = layout.bind(spec, lengths_ref, pl.program_id(1))
  tile = tile_last_first()
  q_start = tile * block_q
  bh = (pl.program_id(1), pl.program_id(2))
  q = rows_at.q_tile(q_ref, q_start, block_q)
  do = rows_at.q_tile(do_ref, q_start, block_q)
  lse2 = rows_at.q_stat(lse_ref, q_start, block_q)
  delta = rows_at.q_stat(delta_ref, q_start, block_q)
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  q_seg = q_seg_ref[...][:, None] if spec.segments else None
  rows = row_hash(seed_ref[0], *bh, q_idx) if dropout_rate else None

  def body(masked: bool, j, dq):
    k_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = rows_at.kv_tile(k_ref, k_slice)
    v = rows_at.kv_tile(v_ref, k_slice)
    k_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    k_scored, mask = k, None
    if masked:  # as the forward; and masked dS must not meet a non-finite key row
      k_scored, v = guard_values(k, v)
      k_seg = kv_seg_ref[k_slice][None, :] if spec.segments else None
      mask = element_mask(spec, q_idx, k_idx, q_seg, k_seg, bh)
      k = clear_nonfinite_rows(k)
    s, c, g = log2_logits(dot(q, k_scored, 1, 1), scale, score, bh + (q_idx, k_idx), True)
    p = backward_probs(s * c - lse2[:, None], dropout_rate)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    _, dp = _dropped(p, dot(do, v, 1, 1), rows, seed_ref, k_idx, dropout_rate)
    ds = logit_grad(p * (dp - delta[:, None]), g)
    if mask is not None:
      ds = jnp.where(mask, ds, 0.0)
    if ds_ref is not None:
      ds_ref[:, k_slice] = ds.astype(ds_ref.dtype)
    return dq + dot(ds.astype(k.dtype), k, 1, 0)

  if lists:
    schedule = listed_tiles(tile_lists, tile)
  else:
    schedule = range_tiles(*with_segment_range(
        spec, kv_block_range(spec, q_start, block_q, block_k), seg_range_ref),
        segment_masked_runs(spec, spec.masked_kv_runs))
  dq = run_tiles(schedule, body, jnp.zeros(q.shape, jnp.float32))
  rows_at.store(dq_ref, q_start, (dq * scale).astype(dq_ref.dtype))


def flash_backward(q, k, v, do, lse, delta, q_seg, kv_seg, *, spec: MaskSpec, scale: float,
                   score, config: BlockConfig, blocks, interpret: bool, arrays=(),
                   lists=None, dropout_rate: float = 0.0, dropout_seed=None, lengths=None,
                   layout=BATCH_ROWS, ds_dtype=None):
  """Runs the dK/dV and dQ kernels on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, d_p]``, do: ``[..., dv_p]``; k: ``[batch, kv_len_p,
      kv_heads, d_p]``, v: ``[..., dv_p]``.
    lse, delta: ``[batch, q_heads, q_len_p]`` float32: the log-sum-exp as
      ``softmax.backward_lse`` gives it (base 2), and ``rowsum(o * do)`` minus any
      cotangent of the returned log-sum-exp. With dropout both carry
      ``1 / (1 - rate)`` (``dropout.backward_rows``).
    blocks: ``(block_q_dkv, block_k_dkv, block_q_dq, block_k_dq)``, dividing the
      padded lengths.
    arrays: the arrays the score function, then the mask function, read.
    lists: ``(dK/dV lists, dQ lists)``: ``block_sparsity.tile_lists`` at the dK/dV
      kernel's tiles (transposed: per key tile) and at the dQ kernel's; or None.
    dropout_rate, dropout_seed: the forward's dropout (its mask is rebuilt).
    lengths: ``[batch, 2]`` int32 per-row lengths when ``spec.lengths``, else None.
    layout: where the rows lie (``triton_rows``; ``PackedRows`` as ``flash_forward``
      takes it: ``lse``, ``delta`` ``[q_heads, total_q_p]``, ``lengths`` the cumulative
      lengths; rows no sequence covers are left unwritten).
    ds_dtype: also return dS, the gradient of the (transformed) scores, ``[batch,
      q_heads, q_len_p, kv_len_p]`` of this dtype (a dense bias's gradient, before
      its broadcast axes are summed): the dQ kernel writes each tile it computes,
      zeros elsewhere. Batch rows only (not ``PackedRows``).

  Returns:
    ``(dq, dk, dv)`` shaped like ``(q, k, v)`` (and ``ds`` with ``ds_dtype``).
  """
  if isinstance(layout, PackedRows):
    return _packed_backward(q, k, v, do, lse, delta, lengths, spec=spec, scale=scale,
                            score=score, blocks=blocks, layout=layout, interpret=interpret,
                            num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages)
  batch, q_len_p, q_heads, d = q.shape
  kv_len_p, kv_heads, dv_width = k.shape[1], k.shape[2], v.shape[-1]
  group = q_heads // kv_heads
  bq_dkv, bk_dkv, bq_dq, bk_dq = blocks
  launch = dict(interpret=interpret, num_warps=config.bwd_num_warps,
                num_stages=config.bwd_num_stages)
  seed = dropout_seed if dropout_rate else None
  # The seed's and the lengths' specs, after the segment ids'.
  scalar_specs = [None if seed is None else whole_array_spec(seed),
                  LENGTHS if spec.lengths else None]

  full_q = lambda width: pl.BlockSpec((None, q_len_p, q_heads, width),
                                      lambda j, b, h: (b, 0, 0, 0))
  full_rows = pl.BlockSpec((None, q_heads, q_len_p), lambda j, b, h: (b, 0, 0))
  k_tile, v_tile = tile_spec(bk_dkv, d), tile_spec(bk_dkv, dv_width)
  segments = (q_seg, kv_seg)
  seg_specs = [None, None, None]
  if spec.segments:  # tiles inside one segment run unmasked, those no id meets not at all
    segments += (segment_block_ranges(kv_seg, q_seg, spec.kv_len, spec.q_len, bk_dkv, bq_dkv,
                                      uniform=True),)
    seg_specs = [pl.BlockSpec((None, q_len_p), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, bk_dkv), lambda j, b, h: (b, j)), SEGMENT_RANGE]
  else:
    segments += (None,)
  extra = [whole_array_spec(x) for x in arrays]
  dkv_lists, dq_lists = lists if lists is not None else ((), ())
  dk, dv = triton_call(
      functools.partial(_dkv_kernel, spec=spec, scale=scale, score=score,
                        block_q=bq_dkv, block_k=bk_dkv, group=group, lists=bool(dkv_lists),
                        dropout_rate=dropout_rate, layout=layout),
      grid=(kv_len_p // bk_dkv, batch, kv_heads),
      in_specs=[full_q(d), k_tile, v_tile, full_q(dv_width), full_rows, full_rows, *seg_specs,
                *scalar_specs, *extra, *list_specs(dkv_lists, per_head=False)],
      out_specs=[k_tile, v_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      name="jattn_flash_bwd_dkv", **launch,
  )(q, k, v, do, lse, delta, *segments, seed, lengths, *arrays, *dkv_lists)

  rev = lambda spec: last_first(spec, q_len_p // bq_dq)  # as the forward's tiles
  row_tile = rev(row_stat_spec(bq_dq))
  segments = (q_seg, kv_seg, None)
  seg_specs = [None, None, None]
  if spec.segments:
    segments = (q_seg, kv_seg, segment_block_ranges(q_seg, kv_seg, spec.q_len, spec.kv_len,
                                                    bq_dq, bk_dq, uniform=True))
    seg_specs = [rev(pl.BlockSpec((None, bq_dq), lambda i, b, h: (b, i))),
                 pl.BlockSpec((None, kv_len_p), lambda i, b, h: (b, 0)), rev(SEGMENT_RANGE)]
  inputs = (q, k, v, do, lse, delta, *segments, seed, lengths, *arrays, *dq_lists)
  in_specs = [rev(tile_spec(bq_dq, d)), whole_sequence_spec(kv_len_p, d, group),
              whole_sequence_spec(kv_len_p, dv_width, group), rev(tile_spec(bq_dq, dv_width)),
              row_tile, row_tile, *seg_specs, *scalar_specs, *extra,
              *list_specs(dq_lists, per_head=True)]
  out_specs, out_shape = [rev(tile_spec(bq_dq, d))], [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  aliases = {}
  if ds_dtype is not None:
    ds_shape = jax.ShapeDtypeStruct((batch, q_heads, q_len_p, kv_len_p), ds_dtype)
    ds_rows = rev(pl.BlockSpec((None, None, bq_dq, kv_len_p), lambda i, b, h: (b, h, i, 0)))
    out_specs.append(ds_rows)
    out_shape.append(ds_shape)
    if dq_lists or spec.skips_tiles:  # skipped tiles' dS is the zeros it starts as
      aliases = {len(jax.tree.leaves(inputs)): 1}
      inputs += (jnp.zeros(ds_shape.shape, ds_dtype),)
      in_specs.append(ds_rows)
  outs = triton_call(
      functools.partial(_dq_kernel, spec=spec, scale=scale, score=score,
                        block_q=bq_dq, block_k=bk_dq, lists=bool(dq_lists),
                        dropout_rate=dropout_rate, layout=layout,
                        writes_ds=ds_dtype is not None),
      grid=(q_len_p // bq_dq, batch, q_heads), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases, name="jattn_flash_bwd_dq", **launch,
  )(*inputs)
  return (outs[0], dk, dv) + tuple(outs[1:])


def _packed_backward(q, k, v, do, lse, delta, cu, *, spec, scale, score, blocks,
                     layout: PackedRows, interpret, num_warps, num_stages):
  """``flash_backward`` on packed rows (``[total, heads, d]``)."""
  total_q, q_heads, d = q.shape
  total_k, kv_heads, dv_width = k.shape[0], k.shape[1], v.shape[-1]
  group = q_heads // kv_heads
  bq_dkv, bk_dkv, bq_dq, bk_dq = blocks
  seqs, cu = cu.shape[0] - 1, kernel_array(cu)
  launch = dict(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
  rows = lambda n, w, heads: pl.BlockSpec((n, None, w), lambda i, b, h: (0, heads(h), 0))
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, b, h: (0,) * x.ndim)
  stats = pl.BlockSpec((None, total_q), lambda i, b, h: (h, 0))
  kernel = lambda body, **kw: functools.partial(
      body, spec=spec, scale=scale, score=score, lists=False, dropout_rate=0.0,
      layout=layout, **kw)
  own_kv = lambda h: h
  dk, dv = triton_call(
      kernel(_dkv_kernel, block_q=bq_dkv, block_k=bk_dkv, group=group),
      grid=(-(-layout.max_k // bk_dkv), seqs, kv_heads),
      in_specs=[whole(q), rows(total_k, d, own_kv), rows(total_k, dv_width, own_kv), whole(do),
                whole(lse), whole(delta), None, None, None, None, whole_array_spec(cu)],
      out_specs=[rows(total_k, d, own_kv), rows(total_k, dv_width, own_kv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      name="jattn_flash_varlen_bwd_dkv", **launch,
  )(q, k, v, do, lse, delta, None, None, None, None, cu)
  kv_of = lambda h: h // group
  dq = triton_call(
      kernel(_dq_kernel, block_q=bq_dq, block_k=bk_dq),
      grid=(-(-layout.max_q // bq_dq), seqs, q_heads),
      in_specs=[rows(total_q, d, own_kv), rows(total_k, d, kv_of), rows(total_k, dv_width, kv_of),
                rows(total_q, dv_width, own_kv), stats, stats, None, None, None, None,
                whole_array_spec(cu)],
      out_specs=rows(total_q, d, own_kv),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name="jattn_flash_varlen_bwd_dq", **launch,
  )(q, k, v, do, lse, delta, None, None, None, None, cu)
  return dq, dk, dv
