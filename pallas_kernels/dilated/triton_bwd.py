"""Dilated attention gradient kernels for one (w, r) pair (Triton-lowered Pallas): dQ
and dK/dV on the row view of ``triton_fwd``.

With the final ``o``, ``lse`` of the mixture, each pair's gradient is plain attention
backward with ``p = exp(s - lse)`` and ``delta = rowsum(do · o)`` (the mixing weights'
gradient folds into both), accumulated into float32 dQ and per-query-head dK / dV
(aliased), deterministically.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn.kernels.common.launch import triton_call
from jattn.kernels.common.nonfinite import clear_nonfinite_rows, guard_values
from jattn.kernels.common.softmax import LOG2E, backward_probs, dot
from jattn.kernels.dilated.triton_fwd import (PairGeometry, cdiv, iota, kv_rows, row_tile,
                                              split_loop, stat_tile)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_in_ref, dq_ref, *,
               geo: PairGeometry, block_q: int, block_k: int, fast: bool):
  del dq_in_ref
  head = pl.program_id(2)
  q_start = pl.program_id(0) * block_q
  q, do = q_ref[...], do_ref[...]
  q_idx = iota(q_start, 0, (block_q, 1))
  lse2 = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]

  def body(masked, j, dq):
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = k_ref[cols, :], v_ref[cols, :]
    k_scored = k
    if masked:  # as the forward; and masked dS must not meet a non-finite key row
      k_scored, v = guard_values(k, v)
      mask = geo.mask(q_idx, iota(j * block_k, 1, (1, block_k)), head)
      k = clear_nonfinite_rows(k)
    s = dot(q, k_scored, 1, 1, fast) * (geo.scale * LOG2E)
    p = backward_probs(s - lse2)
    if masked:
      p = jnp.where(mask, p, 0.0)
    ds = p * (dot(do, v, 1, 1, fast) - delta)
    if masked:
      ds = jnp.where(mask, ds, 0.0)
    return dq + dot(ds.astype(k.dtype), k, 1, 0, fast)

  lo, hi = geo.key_range(q_start, block_q)
  dq = split_loop(lo // block_k, cdiv(hi, block_k),
                   geo.full_key_tiles(q_start, block_q, block_k, head), body,
                   jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] += dq * geo.scale


def _dkv_kernel(k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_in_ref, dv_in_ref,
                dk_ref, dv_ref, *, geo: PairGeometry, block_q: int, block_k: int, fast: bool):
  del dk_in_ref, dv_in_ref
  head = pl.program_id(2)
  k_start = pl.program_id(0) * block_k
  # Guarded for every tile (nonfinite.py): the rows of a tile without a mask all see a
  # key whose value is not finite, and are NaN either way.
  k_scored, v = guard_values(k_ref[...], v_ref[...])
  k_idx = iota(k_start, 0, (block_k, 1))  # tiles kept transposed: [keys, queries]

  def body(masked, i, carry):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    s_t = dot(k_scored, q, 1, 1, fast) * (geo.scale * LOG2E)
    if masked:  # masked dS must not meet a non-finite query row
      mask = geo.mask(iota(i * block_q, 1, (1, block_q)), k_idx, head)
      q = clear_nonfinite_rows(q)
    lse2 = lse_ref[rows][None, :]
    p_t = backward_probs(s_t - lse2)
    if masked:
      p_t = jnp.where(mask, p_t, 0.0)
    dv = dv + dot(p_t.astype(do.dtype), do, 1, 0, fast)
    ds_t = p_t * (dot(v, do, 1, 1, fast) - delta_ref[rows][None, :])
    if masked:
      ds_t = jnp.where(mask, ds_t, 0.0)
    return dk + dot(ds_t.astype(q.dtype), q, 1, 0, fast), dv

  lo, hi = geo.query_range(k_start, block_k)
  zeros = jnp.zeros(k_scored.shape, jnp.float32)
  dk, dv = split_loop(lo // block_q, cdiv(hi, block_q),
                       geo.full_query_tiles(k_start, block_k, block_q, head), body,
                       (zeros, zeros))
  dk_ref[...] += dk * geo.scale
  dv_ref[...] += dv


def pair_backward(q5, k5, v5, do5, lse, delta, dq_acc, dk_acc, dv_acc, *, geo: PairGeometry,
                  dq_blocks: tuple[int, int], dkv_blocks: tuple[int, int], num_warps: int,
                  num_stages: int, interpret: bool):
  """Adds one pair's gradients to the float32 accumulators.

  Args:
    dq_blocks, dkv_blocks: ``(query rows, key rows)`` tiles of the two kernels.
    q5, do5: ``[batch, rows, r, heads, d]``; k5, v5: ``[batch, rows, r, kv_heads, d]``;
      lse, delta: ``[batch, heads, rows, r]`` float32 of the whole mixture (lse as
        ``softmax.backward_lse`` gives it);
      dq_acc, dk_acc, dv_acc: ``[batch, rows, r, heads, d]`` float32 (dK / dV per
      query head: the caller sums each kv head's group).

  Returns:
    the updated ``(dq_acc, dk_acc, dv_acc)``.
  """
  batch, rows, rate, heads, d = q5.shape
  fast = not interpret
  launch = dict(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
  acc_shape = jax.ShapeDtypeStruct(dq_acc.shape, jnp.float32)
  dq_acc = triton_call(
      functools.partial(_dq_kernel, geo=geo, block_q=dq_blocks[0], block_k=dq_blocks[1],
                        fast=fast),
      grid=(rows // dq_blocks[0], batch, heads),
      in_specs=[row_tile(dq_blocks[0], d, rate), kv_rows(rows, d, rate, geo.group),
                kv_rows(rows, d, rate, geo.group), row_tile(dq_blocks[0], d, rate),
                stat_tile(dq_blocks[0], rate), stat_tile(dq_blocks[0], rate),
                row_tile(dq_blocks[0], d, rate)],
      out_specs=row_tile(dq_blocks[0], d, rate), out_shape=acc_shape,
      input_output_aliases={6: 0}, name="jattn_dilated_dq", **launch,
  )(q5, k5, v5, do5, lse, delta, dq_acc)
  whole_q = pl.BlockSpec((None, rows, None, None, d), lambda j, b, h: (b, 0, h % rate, h, 0))
  whole_stat = pl.BlockSpec((None, None, rows, None), lambda j, b, h: (b, h, 0, h % rate))
  block_q, block_k = dkv_blocks
  kv_tile = pl.BlockSpec((None, block_k, None, None, d),
                         lambda j, b, h: (b, j, h % rate, h // geo.group, 0))
  dk_acc, dv_acc = triton_call(
      functools.partial(_dkv_kernel, geo=geo, block_q=block_q, block_k=block_k, fast=fast),
      grid=(rows // block_k, batch, heads),
      in_specs=[kv_tile, kv_tile, whole_q, whole_q, whole_stat, whole_stat,
                row_tile(block_k, d, rate), row_tile(block_k, d, rate)],
      out_specs=[row_tile(block_k, d, rate), row_tile(block_k, d, rate)],
      out_shape=[acc_shape, acc_shape], input_output_aliases={6: 0, 7: 1},
      name="jattn_dilated_dkv", **launch,
  )(k5, v5, q5, do5, lse, delta, dk_acc, dv_acc)
  return dq_acc, dk_acc, dv_acc
