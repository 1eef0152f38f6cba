"""Forward flash attention for Hopper, in Pallas Mosaic GPU.

One CTA per (query tile of ``2 * block_q`` rows, query head, batch). Each of the
two consumer warpgroups owns ``block_q`` rows: QKᵀ and PV on wgmma from shared
memory, the online softmax in registers. The producer warpgroup streams K and V
tiles by TMA through ``stages`` slots. A shared *schedule* barrier makes the
consumers take turns on the tensor cores, so that one's softmax overlaps the
other's matmuls (the ping-pong schedule of FlashAttention-3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.masking import (MaskSpec, apply_mask, kv_block_range,
                                          segment_block_ranges)
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, LN2, LOG2E
from jattn.kernels.flash import mosaic_pipeline as mp


def _kernel(*refs, spec: MaskSpec, scale: float, block_q: int, block_kv: int, stages: int,
            group: int, n_q_tiles: int):
  if spec.segments:
    (q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, seg_ranges, o_ref, lse_ref, qo_smem, k_smem,
     v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free, schedule, q_seg_smem,
     kv_seg_smem) = refs
  else:
    (q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem, lse_smem, q_ready, k_ready,
     v_ready, k_free, v_free, schedule) = refs
  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  tile = lax.axis_index("q_tiles")
  if spec.right is not None:  # heavy (late) tiles first: better tail balance
    tile = n_q_tiles - 1 - tile
  wg = lax.axis_index("wg")
  cta_q = tile * (mp.CONSUMERS * block_q)
  n_kv_blocks = k_ref.shape[1] // block_kv
  cta_range = kv_block_range(spec, cta_q, mp.CONSUMERS * block_q, block_kv)
  if spec.segments:  # only the key blocks whose segment ids can meet the CTA's rows
    cta_range = mp.narrow(cta_range, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS,
                                                      mp.CONSUMERS))
  c_lo, c_hi = mp.clamp_range(cta_range[0], cta_range[3], n_kv_blocks)
  n_steps = c_hi - c_lo
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]

  def take_turn():
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")
    q_smem = qo_smem.at[wg]
    q_start = cta_q + wg * block_q
    rows = (batch, pl.ds(q_start, block_q), head)
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_ready.at[wg])
    if spec.segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(q_start, block_q)],
                              q_seg_smem.at[wg], q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])
    q_seg = plgpu.load(q_seg_smem.at[wg], layout=mp.ROW) if spec.segments else None

    @pl.when(n_steps > 0)
    def _():
      plgpu.barrier_wait(k_ready.at[0])

    pl.when(wg == 1)(take_turn)  # consumer 1 starts half a step behind consumer 0
    c = scale * LOG2E  # logits in base-2 units

    def wait_next_k(j):
      nxt = j + 1 - c_lo
      @pl.when(j + 1 < c_hi)
      def _():
        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.int32(stages))])

    def step(j, carry, masked):
      acc, m, l = carry
      slot = lax.rem(j - c_lo, jnp.int32(stages))

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        take_turn()
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
      if masked:
        segments = mp.tile_segments(q_seg, kv_seg_smem.at[slot], s.shape) if spec.segments else ()
      plgpu.barrier_arrive(k_free.at[slot])
      if masked:
        s = apply_mask(s, -jnp.inf, spec, mp.iota(s.shape, 0, q_start),
                       mp.iota(s.shape, 1, j * block_kv), *segments)
      m_next = jnp.maximum(m, s.max(axis=1) * c)
      alpha = jnp.exp2(m - m_next)
      p = jnp.exp2(s * c - lax.broadcast_in_dim(m_next, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p_lo = p.astype(dtype)
      # Ordering the row sum before the turn change measured faster for d <= 128.
      if head_dim <= 128:
        l = l * alpha + p.sum(axis=1)
        acc, l, m_next, p_lo = lax.optimization_barrier((acc, l, m_next, p_lo))
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(schedule)
      if head_dim > 128:
        l = l * alpha + p.sum(axis=1)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
        wait_next_k(j)

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_next, l

    def skip(j):
      slot = lax.rem(j - c_lo, jnp.int32(stages))
      take_turn()
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(v_ready.at[slot])
      plgpu.barrier_wait(schedule)
      wait_next_k(j)
      plgpu.barrier_arrive(v_free.at[slot])

    carry = (plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((block_q,), EMPTY_ROW_LSE, jnp.float32), mp.ROW),
             plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), mp.ROW))
    own = kv_block_range(spec, q_start, block_q, block_kv)
    if spec.segments:
      own = mp.narrow(own, mp.segment_range(seg_ranges, batch, tile * mp.CONSUMERS + wg, 1))
    acc, m, l = mp.visit_blocks((c_lo, c_hi), own, step, skip, carry)
    pl.when(wg == 0)(take_turn)

    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
    q_smem[...] = acc.astype(dtype)
    lse_smem.at[wg][...] = jnp.where(empty, EMPTY_ROW_LSE, m * LN2 + jnp.log(l_safe))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[rows], commit_group=False)
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(q_start, block_q)],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == mp.PRODUCER)
  def _producer():
    mp.produce_kv(k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready, k_free, v_free),
                  batch=batch, head=head, group=group, first_block=c_lo, n_steps=n_steps,
                  block_kv=block_kv, stages=stages,
                  kv_seg=(kv_seg_ref, kv_seg_smem) if spec.segments else None)


def mosaic_forward(q, k, v, segments=None, *, spec: MaskSpec, scale: float, block_q: int,
                   block_kv: int, stages: int):
  """Runs the Hopper forward kernel on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, d_p]``, ``q_len_p % (2 * block_q) == 0``, ``d_p % 64 == 0``.
    k, v: ``[batch, kv_len_p, kv_heads, d_p]`` with ``kv_len_p % block_kv == 0``.
    segments: with ``spec.segments``, ``(q_seg [batch, q_len_p], kv_seg [batch,
      kv_len_p])`` int32.

  Returns:
    ``o`` like ``q`` and ``lse: [batch, q_heads, q_len_p]`` float32 (natural log).
  """
  batch, q_len_p, q_heads, d = q.shape
  kv_heads = k.shape[2]
  n_q_tiles = q_len_p // (mp.CONSUMERS * block_q)
  stages = max(1, min(stages, k.shape[1] // block_kv))
  kernel = functools.partial(_kernel, spec=spec, scale=scale, block_q=block_q,
                             block_kv=block_kv, stages=stages, group=q_heads // kv_heads,
                             n_q_tiles=n_q_tiles)
  barrier = lambda n, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
  copies = 2 if spec.segments else 1  # a Q or K tile, and its segment ids
  seg_smem = (plgpu.SMEM((mp.CONSUMERS, block_q), jnp.int32),
              plgpu.SMEM((stages, block_kv), jnp.int32)) if spec.segments else ()
  if spec.segments:  # the key blocks each consumer's query block can meet
    q_seg, kv_seg = segments
    segments = (q_seg, kv_seg, segment_block_ranges(q_seg, kv_seg, spec.q_len, spec.kv_len,
                                                    block_q, block_kv))
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((batch, q_heads, q_len_p), jnp.float32)),
      scratch_types=(
          mp.tile_smem((mp.CONSUMERS, block_q, d), q.dtype),
          mp.tile_smem((stages, block_kv, d), q.dtype),
          mp.tile_smem((stages, block_kv, d), q.dtype),
          plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
          barrier(mp.CONSUMERS, copies), barrier(stages, copies), barrier(stages),
          barrier(stages, mp.CONSUMERS), barrier(stages, mp.CONSUMERS),
          plgpu.Barrier(num_arrivals=mp.CONSUMERS),
          *seg_smem,
      ),
      grid=(n_q_tiles, q_heads, batch),
      grid_names=("q_tiles", "heads", "batch"),
      num_threads=mp.CONSUMERS + 1,
      thread_name="wg",
      compiler_params=mp.compiler_params(),
  )(q, k, v, *(segments or ()))
