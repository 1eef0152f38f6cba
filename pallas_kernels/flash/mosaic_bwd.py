"""Backward flash attention for Hopper, in Pallas Mosaic GPU.

Two kernels, neither with atomics, so gradients are bitwise reproducible:
- dQ: one CTA per (query tile, query head, batch); consumers own query rows and
  stream K and V tiles, as in the forward pass.
- dK/dV: one CTA per (key tile, KV head, batch); consumers own key rows and
  stream Q, dO, lse and delta tiles of every query head of the group, so GQA
  sums over heads inside the kernel.
Causal masks and windows visit only the blocks the pattern reaches; the blocks
that straddle its edge apply the element mask (``masking.py``, shared with the
forward and the Triton kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.masking import (MaskSpec, apply_mask, kv_block_range, q_block_range,
                                          segment_block_ranges)
from jattn.kernels.common.softmax import LOG2E
from jattn.kernels.flash import mosaic_pipeline as mp


def _wgmma_pair(acc_a, a1, b1, acc_b, a2, b2):
  """Two wgmmas issued back to back and awaited once."""
  def run(refs):
    ref_a, ref_b = refs
    plgpu.wgmma(ref_a, a1, b1)
    plgpu.wgmma(ref_b, a2, b2)
  return pl.run_state(run)((plgpu.ACC.init(acc_a), plgpu.ACC.init(acc_b)))


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _dq_kernel(*refs, spec: MaskSpec, scale: float, block_q: int, block_kv: int, stages: int,
               group: int):
  if spec.segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, seg_ranges, dq_ref,
     q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, rows_ready, k_ready, v_ready,
     k_free, v_free, q_seg_smem, kv_seg_smem) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem, lse_smem,
     delta_smem, k_smem, v_smem, rows_ready, k_ready, v_ready, k_free, v_free) = refs
  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  tile = lax.axis_index("q_tiles")
  cta_q = tile * (mp.CONSUMERS * block_q)
  cta_range = kv_block_range(spec, cta_q, mp.CONSUMERS * block_q, block_kv)
  if spec.segments:
    cta_range = mp.narrow(cta_range, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS,
                                                      mp.CONSUMERS))
  c_lo, c_hi = mp.clamp_range(cta_range[0], cta_range[3], k_ref.shape[1] // block_kv)
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")
    q_start = cta_q + wg * block_q
    rows = (batch, pl.ds(q_start, block_q), head)
    row_stats = (batch, head, pl.ds(q_start, block_q))
    my = lambda ref: ref.at[wg]
    ready = rows_ready.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[rows], my(q_smem), ready)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], my(do_smem), ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[row_stats], my(lse_smem), ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[row_stats], my(delta_smem), ready)
    if spec.segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(q_start, block_q)], my(q_seg_smem),
                              ready)
    plgpu.barrier_wait(ready)
    lse = plgpu.load(my(lse_smem), layout=mp.ROW)
    delta = plgpu.load(my(delta_smem), layout=mp.ROW)
    q_seg = plgpu.load(my(q_seg_smem), layout=mp.ROW) if spec.segments else None
    c = scale * LOG2E
    shape = (block_q, block_kv)

    def step(j, dq, masked):
      slot = lax.rem(j - c_lo, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      s, dp = _wgmma_pair(_zeros(shape), my(q_smem), k_smem.at[slot].transpose((1, 0)),
                          _zeros(shape), my(do_smem), v_smem.at[slot].transpose((1, 0)))
      plgpu.barrier_arrive(v_free.at[slot])
      if masked:
        segments = mp.tile_segments(q_seg, kv_seg_smem.at[slot], shape) if spec.segments else ()
        s = apply_mask(s, -jnp.inf, spec, mp.iota(shape, 0, q_start),
                       mp.iota(shape, 1, j * block_kv), *segments)
      p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, shape, [0]))
      ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))

      def acc_dq(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

      dq = pl.run_state(acc_dq)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def skip(j):
      slot = lax.rem(j - c_lo, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])

    own = kv_block_range(spec, q_start, block_q, block_kv)
    if spec.segments:
      own = mp.narrow(own, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS + wg, 1))
    dq = mp.visit_blocks((c_lo, c_hi), own, step, skip, _zeros((block_q, head_dim)))
    my(q_smem)[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(my(q_smem), dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == mp.PRODUCER)
  def _producer():
    mp.produce_kv(k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready, k_free, v_free),
                  batch=batch, head=head, group=group, first_block=c_lo,
                  n_steps=c_hi - c_lo, block_kv=block_kv, stages=stages,
                  kv_seg=(kv_seg_ref, kv_seg_smem) if spec.segments else None)


def _dkv_kernel(*refs, spec: MaskSpec, scale: float, block_q: int, block_kv: int, stages: int,
                group: int):
  if spec.segments:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, seg_ranges, dk_ref,
     dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, q_ready, q_free,
     kv_seg_smem, q_seg_smem) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem,
     do_smem, lse_smem, delta_smem, kv_ready, q_ready, q_free) = refs
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  tile = lax.axis_index("kv_tiles")
  cta_k = tile * (mp.CONSUMERS * block_kv)
  cta_range = q_block_range(spec, cta_k, mp.CONSUMERS * block_kv, block_q)
  if spec.segments:  # only the query blocks whose segment ids can meet the CTA's keys
    cta_range = mp.narrow(cta_range, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS,
                                                      mp.CONSUMERS))
  c_lo, c_hi = mp.clamp_range(cta_range[0], cta_range[3], q_ref.shape[1] // block_q)
  n_blocks = c_hi - c_lo  # per query head; the stream covers `group` heads
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")
    k_start = cta_k + wg * block_kv
    keys = (batch, pl.ds(k_start, block_kv), kv_head)
    my = lambda ref: ref.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[keys], my(k_smem), kv_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[keys], my(v_smem), kv_ready.at[wg])
    if spec.segments:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, pl.ds(k_start, block_kv)], my(kv_seg_smem),
                              kv_ready.at[wg])
    plgpu.barrier_wait(kv_ready.at[wg])
    kv_seg = plgpu.load(my(kv_seg_smem), layout=mp.ROW) if spec.segments else None
    c = scale * LOG2E
    shape = (block_kv, block_q)  # transposed scores: keys on rows
    own = q_block_range(spec, k_start, block_kv, block_q)
    if spec.segments:
      own = mp.narrow(own, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS + wg, 1))

    def over_head(g, carry):
      first = g * n_blocks - c_lo  # stream position of block j is first + j

      def step(j, carry, masked):
        dk, dv = carry
        slot = lax.rem(first + j, jnp.int32(stages))
        plgpu.barrier_wait(q_ready.at[slot])
        s_t, dp_t = _wgmma_pair(_zeros(shape), my(k_smem), q_smem.at[slot].transpose((1, 0)),
                                _zeros(shape), my(v_smem), do_smem.at[slot].transpose((1, 0)))
        if masked:
          segments = ()
          if spec.segments:
            k_ids, q_ids = mp.tile_segments(kv_seg, q_seg_smem.at[slot], shape)
            segments = (q_ids, k_ids)
          s_t = apply_mask(s_t, -jnp.inf, spec, mp.iota(shape, 1, j * block_q),
                           mp.iota(shape, 0, k_start), *segments)
        lse = plgpu.load(lse_smem.at[slot], layout=mp.COL)
        delta = plgpu.load(delta_smem.at[slot], layout=mp.COL)
        p_t = jnp.exp2(s_t * c - lax.broadcast_in_dim(lse, shape, [1]))
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
        dv, dk = _wgmma_pair(dv, p_t.astype(dtype), do_smem.at[slot],
                             dk, ds_t.astype(dtype), q_smem.at[slot])
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

      def skip(j):
        slot = lax.rem(first + j, jnp.int32(stages))
        plgpu.barrier_wait(q_ready.at[slot])
        plgpu.barrier_arrive(q_free.at[slot])

      return mp.visit_blocks((c_lo, c_hi), own, step, skip, carry)

    acc = _zeros((block_kv, head_dim))
    dk, dv = lax.fori_loop(0, group, over_head, (acc, acc))
    my(k_smem)[...] = (dk * scale).astype(dtype)
    my(v_smem)[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(my(k_smem), dk_ref.at[keys], commit_group=False)
    plgpu.copy_smem_to_gmem(my(v_smem), dv_ref.at[keys], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == mp.PRODUCER)
  def _producer():
    plgpu.set_max_registers(mp.PRODUCER_REGISTERS, action="decrease")

    def copy(i, slot, barrier):
      head = kv_head * group + lax.div(i, n_blocks)
      start = (c_lo + lax.rem(i, n_blocks)) * block_q
      rows, stats = (batch, pl.ds(start, block_q), head), (batch, head, pl.ds(start, block_q))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], barrier)
      plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], barrier)
      if spec.segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(start, block_q)], q_seg_smem.at[slot],
                                barrier)

    mp.produce(group * n_blocks, stages, [(copy, q_ready, q_free)])


def _launch():
  return dict(num_threads=mp.CONSUMERS + 1, thread_name="wg", compiler_params=mp.compiler_params())


def _barrier(n, arrivals=1):
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


def mosaic_dq(q, k, v, do, lse2, delta, segments=None, *, spec: MaskSpec, scale: float,
              block_q: int, block_kv: int, stages: int):
  """dQ kernel on padded inputs (see :func:`mosaic_backward`); returns ``dq`` like ``q``.
  ``segments``: ``(q_seg, kv_seg, ranges)``, ``ranges`` of each ``block_q`` query block."""
  batch, q_len_p, q_heads, d = q.shape
  stages = max(1, min(stages, k.shape[1] // block_kv))
  copies = 2 if spec.segments else 1  # a K tile and its segment ids
  seg_smem = (plgpu.SMEM((mp.CONSUMERS, block_q), jnp.int32),
              plgpu.SMEM((stages, block_kv), jnp.int32)) if spec.segments else ()
  return plgpu.kernel(
      functools.partial(_dq_kernel, spec=spec, scale=scale, block_q=block_q, block_kv=block_kv,
                        stages=stages, group=q_heads // k.shape[2]),
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      scratch_types=(
          mp.tile_smem((mp.CONSUMERS, block_q, d), q.dtype),
          mp.tile_smem((mp.CONSUMERS, block_q, d), q.dtype),
          plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
          plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
          mp.tile_smem((stages, block_kv, d), q.dtype),
          mp.tile_smem((stages, block_kv, d), q.dtype),
          _barrier(mp.CONSUMERS, 3 + copies), _barrier(stages, copies), _barrier(stages),
          _barrier(stages, mp.CONSUMERS), _barrier(stages, mp.CONSUMERS),
          *seg_smem,
      ),
      grid=(q_len_p // (mp.CONSUMERS * block_q), q_heads, batch),
      grid_names=("q_tiles", "heads", "batch"),
      **_launch(),
  )(q, k, v, do, lse2, delta, *(segments or ()))


def mosaic_dkv(q, k, v, do, lse2, delta, segments=None, *, spec: MaskSpec, scale: float,
               block_q: int, block_kv: int, stages: int):
  """dK/dV kernel on padded inputs (see :func:`mosaic_backward`); returns ``(dk, dv)``.
  ``segments``: ``(q_seg, kv_seg, ranges)``, ``ranges`` of each ``block_kv`` key block."""
  batch, q_len_p, q_heads, d = q.shape
  kv_len_p, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  stages = max(1, min(stages, group * (q_len_p // block_q)))
  copies = 1 if spec.segments else 0  # the segment ids beside K/V and each Q tile
  seg_smem = (plgpu.SMEM((mp.CONSUMERS, block_kv), jnp.int32),
              plgpu.SMEM((stages, block_q), jnp.int32)) if spec.segments else ()
  return plgpu.kernel(
      functools.partial(_dkv_kernel, spec=spec, scale=scale, block_q=block_q,
                        block_kv=block_kv, stages=stages, group=group),
      out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      scratch_types=(
          mp.tile_smem((mp.CONSUMERS, block_kv, d), k.dtype),
          mp.tile_smem((mp.CONSUMERS, block_kv, d), k.dtype),
          mp.tile_smem((stages, block_q, d), q.dtype),
          mp.tile_smem((stages, block_q, d), q.dtype),
          plgpu.SMEM((stages, block_q), jnp.float32),
          plgpu.SMEM((stages, block_q), jnp.float32),
          _barrier(mp.CONSUMERS, 2 + copies), _barrier(stages, 4 + copies),
          _barrier(stages, mp.CONSUMERS),
          *seg_smem,
      ),
      grid=(kv_len_p // (mp.CONSUMERS * block_kv), kv_heads, batch),
      grid_names=("kv_tiles", "heads", "batch"),
      **_launch(),
  )(q, k, v, do, lse2, delta, *(segments or ()))


def mosaic_backward(q, k, v, do, lse2, delta, segments=None, *, spec: MaskSpec, scale: float,
                    blocks: tuple[int, int, int, int], stages: int):
  """Runs the Hopper dQ and dK/dV kernels on padded inputs.

  Args:
    q, do: ``[batch, q_len_p, q_heads, d_p]``; k, v: ``[batch, kv_len_p, kv_heads, d_p]``.
    lse2: ``[batch, q_heads, q_len_p]`` float32 log-sum-exp in base-2 units.
    delta: ``[batch, q_heads, q_len_p]`` float32, ``rowsum(o * do) - dlse``.
    blocks: ``(block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv)``; lengths are
      padded so that ``2 * block_q_dq`` and ``block_q_dkv`` divide ``q_len_p``, and
      ``block_kv_dq`` and ``2 * block_kv_dkv`` divide ``kv_len_p``.
    segments: with ``spec.segments``, ``(q_seg [batch, q_len_p], kv_seg [batch,
      kv_len_p])`` int32.

  Returns:
    ``(dq, dk, dv)`` shaped like ``q, k, v``.
  """
  bq_dq, bkv_dq, bq_dkv, bkv_dkv = blocks
  args = (q, k, v, do, lse2, delta)
  dq_segments = dkv_segments = None
  if spec.segments:
    q_seg, kv_seg = segments
    dq_segments = (q_seg, kv_seg, segment_block_ranges(q_seg, kv_seg, spec.q_len, spec.kv_len,
                                                       bq_dq, bkv_dq))
    dkv_segments = (q_seg, kv_seg, segment_block_ranges(kv_seg, q_seg, spec.kv_len, spec.q_len,
                                                        bkv_dkv, bq_dkv))
  dq = mosaic_dq(*args, dq_segments, spec=spec, scale=scale, block_q=bq_dq, block_kv=bkv_dq,
                 stages=stages)
  dk, dv = mosaic_dkv(*args, dkv_segments, spec=spec, scale=scale, block_q=bq_dkv,
                      block_kv=bkv_dkv, stages=stages)
  return dq, dk, dv
