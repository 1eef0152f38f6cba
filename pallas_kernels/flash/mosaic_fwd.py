"""Forward pass of the Hopper attention kernels, in Pallas Mosaic GPU.

A work item is a query tile of ``2 * block_q`` rows of one head and batch row. Each
of the two consumer warpgroups owns ``block_q`` rows: QKᵀ and PV on wgmma from
shared memory, the row arithmetic in registers. The producer warpgroup streams K
and V tiles by TMA through ``stages`` slots. A shared *schedule* barrier makes the
consumers take turns on the tensor cores, so that one's row arithmetic overlaps
the other's matmuls (the ping-pong schedule of FlashAttention-3).

The grid is one-dimensional. Persistent CTAs (below) walk the items with query tiles
varying fastest, so that the CTAs running at once work on few heads and share their
K and V tiles in L2 (on the H100, 12-15% faster at (4, 4096, 16, 128) than a grid
whose batch and head varied fastest). One CTA per item (causal masks, windows) takes
the heads fastest, then the tiles: 1.02-1.06x the other order on the H100.

One CTA runs one item, or, persistent (``MosaicBlockConfig.persistent``; by default
where all items have the same work), one CTA per SM walks its share of the items.
The K/V ring then runs on from item to item, so the producer streams the next
item's first tiles while the consumers finish the last one, and each consumer
loads its next Q tile into a second buffer during the current item (where two fit
the shared memory).

The row arithmetic is a *row rule*: how a consumer turns each score tile into the
tile it multiplies with V, and how it finishes its rows. A rule is a hashable object
with ``n_inputs`` (extra kernel inputs it reads) and ``bind(inputs, ConsumerRows) ->
Rows``. Flash attention's is the online softmax (``SoftmaxRows``); parallel
retention's is its decay (``jattn.kernels.retention.mosaic.DecayRows``). The pipeline
is the same for both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.factored_functions import COL, ROW
from jattn.kernels.common.masking import MaskSpec, kv_block_range
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, LN2, LOG2E, log2_units
from jattn.kernels.flash import mosaic_pipeline as mp
from jattn.kernels.flash.mosaic_config import forward_q_buffers, output_view_rows
from jattn.kernels.flash.mosaic_inputs import PositionInputs, Tile, given_range, narrow


@dataclasses.dataclass(frozen=True)
class ConsumerRows:
  """What a consumer warpgroup's row rule may know of its rows: ``q_start`` (first
  row, in query coordinates), ``own = (lo, full_lo, full_hi, hi)`` (its key-block
  range, clamped to the CTA's, as ``visit_blocks`` walks it)."""

  batch: Any
  head: Any
  q_start: Any
  own: tuple
  block_q: int
  block_kv: int
  dtype: Any


class Rows(NamedTuple):
  """A row rule bound to one consumer's rows.

  ``init``: the row statistics before the first key block. ``update(s, stats, j,
  masked, tile) -> (p, acc_scale, stats, late)``: ``s`` the fp32 ``q kᵀ`` tile of
  key block ``j`` (``masked``: it needs the element mask; ``tile``: its positions and
  per-position inputs, a ``mosaic_inputs.Tile``), ``p`` the 16-bit tile multiplied
  with V, ``acc_scale`` a per-row factor for the accumulator (or None), ``late`` None
  or a function of the statistics that may run after the consumer's turn on the
  tensor cores. ``finish(acc, stats) -> (o, row_stat)``: the rows' fp32 output and
  the ``[block_q]`` float32 statistic the kernel saves.
  """

  init: tuple
  update: Callable
  finish: Callable


@dataclasses.dataclass(frozen=True)
class SoftmaxRows:
  """Flash attention's row rule: the online softmax (``softmax.online_softmax_step``'s:
  the running max in the logits' units, each weight ``exp2((s - m) * c)``), with the
  mask (segment ids, a mask function) and the score transform (soft-cap, a score
  function) of ``positions`` applied to the logits, and its dropout of the weights;
  saves the log-sum-exp (natural log; ``EMPTY_ROW_LSE`` for rows that see no key,
  whose output is zeros)."""

  spec: MaskSpec
  scale: float
  softcap: float | None = None
  positions: PositionInputs = PositionInputs()
  sinks: bool = False  # reads ``[q_heads]`` float32 sink logits

  @property
  def n_inputs(self) -> int:  # kernel inputs the rule reads
    return int(self.sinks)

  def bind(self, inputs, t: ConsumerRows) -> Rows:
    c = log2_units(self.scale, self.positions.score is not None or self.softcap is not None)

    def update(s, stats, j, masked, tile):
      m, l = stats
      s, _, _ = self.positions.logits(s, self.scale, self.softcap, tile)
      if masked:
        s = self.positions.apply_mask(s, self.spec, tile)
      m_next = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2((m - m_next) * c)
      p = jnp.exp2((s - lax.broadcast_in_dim(m_next, s.shape, [0])) * c)

      def late(stats):
        m, l = stats
        return m, l * alpha + p.sum(axis=1)

      # Dropout: the denominator counts every weight, V meets the kept ones (selected
      # in 16 bits: half the registers of an fp32 copy of the tile).
      p_v = p.astype(t.dtype)
      if self.positions.dropout:
        p_v = jnp.where(self.positions.kept(tile), p_v, jnp.zeros((), t.dtype))
      return p_v, alpha, (m_next, l), late

    def finish(acc, stats):
      m, l = stats
      empty = l == 0.0
      l_safe = jnp.where(empty, 1.0, l)
      # Dropout scales the kept weights by 1 / (1 - rate).
      l_out = l_safe * (1.0 - self.positions.dropout) if self.positions.dropout else l_safe
      o = acc * lax.broadcast_in_dim(1.0 / l_out, acc.shape, [0])
      return o, jnp.where(empty, EMPTY_ROW_LSE, m * (c * LN2) + jnp.log(l_safe))

    if self.sinks:  # every row's denominator starts at exp(sink)
      init = (mp.row_vector(inputs[0][t.head] * (LOG2E / c), t.block_q),
              mp.row_vector(1.0, t.block_q))
    else:
      init = (mp.row_vector(EMPTY_ROW_LSE, t.block_q), mp.row_vector(0.0, t.block_q))
    return Rows(init, update, finish)


class _Item(NamedTuple):
  """One work item: a query tile of ``CONSUMERS * block_q`` rows of one head and batch
  row, and the key blocks ``[c_lo, c_hi)`` its rows reach."""

  batch: Any
  head: Any
  tile: Any
  c_lo: Any
  c_hi: Any


def _kernel(*refs, rule, spec: MaskSpec, positions: PositionInputs, block_q: int, block_kv: int,
            stages: int, group: int, items: tuple[int, int, int], persistent: bool,
            q_buffers: int, **smem):
  n_in = 3 + positions.n_refs + rule.n_inputs
  (q_ref, k_ref, v_ref, *extra), (o_ref, stat_ref) = refs[:n_in], refs[n_in:]
  row_refs, col_refs, scalar_refs, ranges_ref, rule_inputs = positions.split(extra)
  n_q_tiles, n_heads, n_batch = (jnp.int32(n) for n in items)
  cta, n_ctas = lax.axis_index("cta"), jnp.int32(lax.axis_size("cta"))
  # This CTA's work items are cta, cta + n_ctas, ... Persistent CTAs take query tiles
  # fastest, so the CTAs running together share K and V in L2; one CTA per item takes
  # heads fastest (uneven causal items: every head's heavy tiles start first), as the
  # backward kernels do (bench/results/flash_fwd_grid_order.md).
  n_local = lax.div(n_q_tiles * n_heads * n_batch - cta + n_ctas - 1, n_ctas)
  wg = lax.axis_index("wg")
  n_kv_blocks = k_ref.shape[1] // block_kv
  dtype = q_ref.dtype
  width = v_ref.shape[-1]  # the output's head dim
  schedule, k_ready, v_ready = smem["schedule"], smem["k_ready"], smem["v_ready"]
  k_free, v_free, k_smem, v_smem = smem["k_free"], smem["v_free"], smem["k"], smem["v"]
  # The output goes to a tile of its own ("o"), to the Q tile (dv == dk), or to a view
  # of it ("q" is then a union of the two).
  q_view = "o" not in smem and width != q_ref.shape[-1]
  q_tiles, out_tiles = smem["q"] if q_view else (smem["q"], None)

  def item(t) -> _Item:
    w = t * n_ctas + cta
    if persistent:
      tile, rest = lax.rem(w, n_q_tiles), lax.div(w, n_q_tiles)
      head, batch = lax.rem(rest, n_heads), lax.div(rest, n_heads)
    else:
      head, rest = lax.rem(w, n_heads), lax.div(w, n_heads)
      tile, batch = lax.rem(rest, n_q_tiles), lax.div(rest, n_q_tiles)
    if spec.right is not None:  # heavy (late) tiles first: better tail balance
      tile = n_q_tiles - 1 - tile
    cta_range = kv_block_range(spec, tile * (mp.CONSUMERS * block_q), mp.CONSUMERS * block_q,
                               block_kv)
    if ranges_ref is not None:  # only the key blocks segment ids or a block mask allow
      cta_range = narrow(cta_range, given_range(ranges_ref, batch, head, tile * mp.CONSUMERS,
                                                mp.CONSUMERS))
    return _Item(batch, head, tile, *mp.clamp_range(cta_range[0], cta_range[3], n_kv_blocks))

  def take_turn():
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")

    def rows_of(it: _Item):
      q_start = (it.tile * mp.CONSUMERS + wg) * block_q
      return q_start, (it.batch, pl.ds(q_start, block_q), it.head)

    def load_q(t, buf):
      it = item(t)
      q_start, rows = rows_of(it)
      ready = smem["q_ready"].at[buf * mp.CONSUMERS + wg]
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tiles.at[buf, wg], ready)
      mp.copy_vectors(row_refs, [b.at[buf, wg] for b in positions.buffers(smem, ROW)],
                      it.batch, q_start, block_q, ready, it.head)

    def load_next_q(t, buf):
      @pl.when(t + 1 < n_local)
      def _():
        # The buffer's last output tile must have been read out first.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load_q(t + 1, buf)

    def work(t, first_use):
      """Work item ``t``; ``first_use``: the K/V ring's steps so far."""
      it = item(t)
      c_lo, c_hi = it.c_lo, it.c_hi
      buf = lax.rem(t, jnp.int32(q_buffers)) if persistent else 0
      q_smem = q_tiles.at[buf, wg]
      q_start, rows = rows_of(it)
      plgpu.barrier_wait(smem["q_ready"].at[buf * mp.CONSUMERS + wg])
      row_vectors = positions.load(smem, ROW, lambda b: b.at[buf, wg], mp.ROW)
      scalars = positions.read_scalars(scalar_refs, it.batch, it.head)
      if persistent and q_buffers == 2:
        load_next_q(t, 1 - buf)
      own = kv_block_range(spec, q_start, block_q, block_kv)
      if ranges_ref is not None:
        own = narrow(own, given_range(ranges_ref, it.batch, it.head,
                                      it.tile * mp.CONSUMERS + wg, 1))
      own = mp.clamp_own(own, c_lo, c_hi)
      row_rule = rule.bind(rule_inputs, ConsumerRows(it.batch, it.head, q_start, own, block_q,
                                                     block_kv, dtype))
      slot_of = lambda j: lax.rem(first_use + j - c_lo, jnp.int32(stages))

      @pl.when(c_hi > c_lo)
      def _():
        plgpu.barrier_wait(k_ready.at[slot_of(c_lo)])

      pl.when(wg == 1)(take_turn)  # consumer 1 starts half a step behind consumer 0

      def wait_next_k(j):
        @pl.when(j + 1 < c_hi)
        def _():
          plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

      def step(j, carry, masked):
        acc, stats = carry
        slot = slot_of(j)

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          take_turn()
          return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        col_vectors = ()
        if positions.needs(COL, masked):  # read before the slot is released
          col_vectors = positions.load(smem, COL, lambda b: b.at[slot], mp.COL)
        plgpu.barrier_arrive(k_free.at[slot])
        tile = Tile(s.shape, 0, q_start, j * block_kv, it.batch, it.head, row_vectors,
                    col_vectors, scalars)
        p, acc_scale, stats, late = row_rule.update(s, stats, j, masked, tile)
        if acc_scale is not None:
          acc = acc * lax.broadcast_in_dim(acc_scale, acc.shape, [0])
        # Finishing the row statistics before the turn change measured faster for d <= 128,
        # after it with dropout's per-weight work (H100, d128: 0.78x -> 0.87x the forward
        # without dropout).
        early_stats = width <= 128 and not positions.dropout
        if early_stats:
          if late is not None:
            stats = late(stats)
          acc, stats, p = lax.optimization_barrier((acc, stats, p))
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(schedule)
        if not early_stats and late is not None:
          stats = late(stats)

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p, v_smem.at[slot])
          wait_next_k(j)

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, stats

      def skip(j):
        slot = slot_of(j)
        take_turn()
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(schedule)
        wait_next_k(j)
        plgpu.barrier_arrive(v_free.at[slot])

      acc = plgpu.layout_cast(jnp.zeros((block_q, width), jnp.float32), plgpu.Layout.WGMMA)
      acc, stats = mp.visit_blocks((c_lo, c_hi), own, step, skip, (acc, row_rule.init))
      pl.when(wg == 0)(take_turn)

      o, row_stat = row_rule.finish(acc, stats)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores
      if "o" in smem:
        o_smem = smem["o"].at[wg]
      elif q_view:
        o_smem = out_tiles.at[buf, wg, pl.ds(0, block_q)]
      else:
        o_smem = q_smem
      o_smem[...] = o.astype(dtype)
      smem["stat"].at[wg][...] = row_stat
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows], commit_group=False)
      plgpu.copy_smem_to_gmem(smem["stat"].at[wg],
                              stat_ref.at[it.batch, it.head, pl.ds(q_start, block_q)],
                              commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      if persistent and q_buffers == 1:
        load_next_q(t, buf)
      return first_use + (c_hi - c_lo)

    if persistent:
      pl.when(n_local > 0)(lambda: load_q(jnp.int32(0), 0))
      lax.fori_loop(jnp.int32(0), n_local, work, jnp.int32(0))
    else:  # one item, outside any loop: the registers of the larger tiles stay unspilled
      load_q(0, 0)
      work(0, 0)  # (Python ints: constants captured by the wgmma scopes fail to lower)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == mp.PRODUCER)
  def _producer():
    plgpu.set_max_registers(mp.PRODUCER_REGISTERS, action="decrease")

    def work(t, first_use):
      it = item(t)
      mp.produce_kv(k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready, k_free, v_free),
                    batch=it.batch, head=it.head, group=group, first_block=it.c_lo,
                    n_steps=it.c_hi - it.c_lo, block_kv=block_kv, stages=stages,
                    cols=(col_refs, positions.buffers(smem, COL)),
                    first_slot_use=first_use)
      return first_use + (it.c_hi - it.c_lo)

    if persistent:
      lax.fori_loop(jnp.int32(0), n_local, work, jnp.int32(0))
    else:
      work(0, 0)


def rows_forward(q, k, v, inputs=(), *, rule, spec: MaskSpec, block_q: int, block_kv: int,
                 stages: int, persistent: bool | None = None,
                 positions: PositionInputs = PositionInputs()):
  """Runs the Hopper forward kernel with row rule ``rule`` on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, dk_p]``, ``q_len_p % (2 * block_q) == 0``; k:
      ``[batch, kv_len_p, kv_heads, dk_p]``, v: ``[batch, kv_len_p, kv_heads, dv_p]``,
      ``kv_len_p % block_kv == 0``; head dims multiples of 64.
    inputs: the per-position arrays of ``positions`` (``mosaic_inputs.position_arrays``;
      ranges per ``block_q`` query block over ``block_kv`` key blocks), then the
      ``rule.n_inputs`` arrays the rule reads.
    persistent: one CTA per SM walking the work items, or one CTA per item; None:
      persistent where every item has the same work (no mask but padding).

  Returns:
    ``o: [batch, q_len_p, q_heads, dv_p]`` in q's dtype and the rule's row statistic
    ``[batch, q_heads, q_len_p]`` float32.
  """
  batch, q_len_p, q_heads, dk = q.shape
  dv = v.shape[-1]
  if persistent is None:
    persistent = (spec.left is None and spec.right is None and not spec.every_tile_masked
                  and not positions.ranges)
  n_q_tiles = q_len_p // (mp.CONSUMERS * block_q)
  n_items = n_q_tiles * q_heads * batch
  stages = max(1, min(stages, k.shape[1] // block_kv))
  q_buffers = forward_q_buffers(block_q, block_kv, stages, dk, dv, q.dtype.itemsize) if (
      persistent) else 1
  barrier = lambda n, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
  q_tiles = mp.tile_smem((q_buffers, mp.CONSUMERS, block_q, dk), q.dtype)
  out_rows = output_view_rows(block_q, dk, dv)
  q_view = out_rows is not None and dv != dk
  smem = dict(
      # A consumer writes its output once its last QKᵀ has run: the Q tile is free then.
      q=plgpu.RefUnion(q_tiles, mp.tile_smem((q_buffers, mp.CONSUMERS, out_rows, dv),
                                             q.dtype)) if q_view else q_tiles,
      k=mp.tile_smem((stages, block_kv, dk), q.dtype),
      v=mp.tile_smem((stages, block_kv, dv), q.dtype),
      stat=plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
      q_ready=barrier(q_buffers * mp.CONSUMERS, 1 + positions.n_rows),
      k_ready=barrier(stages, 1 + positions.n_cols),
      v_ready=barrier(stages), k_free=barrier(stages, mp.CONSUMERS),
      v_free=barrier(stages, mp.CONSUMERS), schedule=plgpu.Barrier(num_arrivals=mp.CONSUMERS))
  if out_rows is None:
    smem["o"] = mp.tile_smem((mp.CONSUMERS, block_q, dv), q.dtype)
  smem.update(positions.scratch(inputs, (q_buffers, mp.CONSUMERS, block_q), (stages, block_kv)))
  kernel = functools.partial(_kernel, rule=rule, spec=spec, positions=positions,
                             block_q=block_q, block_kv=block_kv,
                             stages=stages, group=q_heads // k.shape[2],
                             items=(n_q_tiles, q_heads, batch), persistent=persistent,
                             q_buffers=q_buffers)
  return mp.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((batch, q_len_p, q_heads, dv), q.dtype),
                jax.ShapeDtypeStruct((batch, q_heads, q_len_p), jnp.float32)),
      scratch_types=smem,
      grid=(min(n_items, mp.num_sms()) if persistent else n_items,),
      grid_names=("cta",),
  )(q, k, v, *inputs)


def mosaic_forward(q, k, v, inputs=(), *, spec: MaskSpec, scale: float, block_q: int,
                   block_kv: int, stages: int, softcap: float | None = None,
                   persistent: bool | None = None,
                   positions: PositionInputs = PositionInputs(), sinks=None):
  """Flash attention's Hopper forward kernel on padded inputs (see ``rows_forward``):
  ``(o, lse)``, ``lse: [batch, q_heads, q_len_p]`` float32 in natural log.
  ``inputs``: the per-position arrays of ``positions``; ``sinks``: ``[q_heads]``
  float32 or None."""
  rule = SoftmaxRows(spec, scale, softcap, positions, sinks is not None)
  inputs = tuple(inputs) + (() if sinks is None else (sinks,))
  return rows_forward(q, k, v, inputs, rule=rule,
                      spec=spec, block_q=block_q, block_kv=block_kv, stages=stages,
                      persistent=persistent, positions=positions)
