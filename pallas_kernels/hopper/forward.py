"""The Hopper forward kernel, in Pallas Mosaic GPU, with a pluggable *row rule*.

A work item (``work``; today a query tile of ``2 * block_q`` rows of one head and
batch row) is split between two consumer warpgroups of ``block_q`` rows each: QKᵀ
and PV on wgmma from shared memory, the row arithmetic in registers. The producer
warpgroup streams K and V tiles by TMA through ``stages`` slots, from where the K/V
addressing (``addressing``) says they lie. A shared *schedule* barrier makes the
consumers take turns on the tensor cores, so that one's row arithmetic overlaps the
other's matmuls (the ping-pong schedule of FlashAttention-3).

The grid is one-dimensional. One CTA runs one item, or, persistent, one CTA per SM
walks its share of the items (query tiles fastest, so that the CTAs running at once
share K and V in L2). The K/V ring then runs on from item to item: the producer
streams the next item's first tiles while the consumers finish the last one, and each
consumer loads its next Q tile into a second buffer during the current item (where
two fit the shared memory).

With 8-bit inputs (FP8) the kernel differs in two places, both forced by the 8-bit
wgmma: V comes transposed (``addressing.TransposedValuesKV``: ``[head_dim_v,
block_kv]`` tiles; the 8-bit wgmma reads B only with the reduced axis fastest), with
its keys in ``pipeline.EIGHT_BIT_KEY_ORDER`` within each group of 16, the order in
which the 8-bit weights' registers serve as the A operand as they lie
(``pipeline.eight_bit_operand``). The output takes its own dtype (``out_dtype``;
16-bit inputs: theirs).

The row rule says how a consumer turns each score tile into the tile it multiplies
with V, and how it finishes its rows. A rule is a hashable object with ``n_inputs``
(extra kernel inputs it reads), ``mma_row_sums(dtype)`` (whether, for inputs of that
dtype, the kernel sums its weights' rows on the tensor cores for it), ``reduces``
(whether it reduces rows across the warpgroup, for which Mosaic reserves shared
memory) and ``bind(inputs, ConsumerRows) -> Rows``. Flash
attention's is the online softmax (``flash.mosaic_fwd.SoftmaxRows``); parallel
retention's is its decay (``retention.mosaic.DecayRows``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.factored_functions import COL, ROW
from jattn.kernels.common.masking import MaskSpec, narrow
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import ContiguousKV
from jattn.kernels.hopper.budget import HOPPER_SMEM_BYTES, THREADS_PER_WARPGROUP
from jattn.kernels.hopper.inputs import (PositionInputs, Tile, copy_bias_tiles, given_range,
                                         own_blocks)
from jattn.kernels.hopper.work import QueryTiles


# Rows of the ones tile a rule's ``mma_row_sums`` multiplies its weights with: the
# narrowest wgmma (N = 8).
ONES_ROWS = 8


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
  per-position inputs, an ``inputs.Tile``), ``p`` the 16-bit tile multiplied
  with V, ``acc_scale`` a per-row factor for the accumulator (or None), ``late`` None
  or a function of the statistics that may run after the consumer's turn on the
  tensor cores. ``finish(acc, stats) -> (o, row_stat)``: the rows' fp32 output and
  the ``[block_q]`` float32 statistic the kernel saves; where the rule's
  ``mma_row_sums``, ``finish(acc, stats, row_sums)`` with ``row_sums`` the sums of
  its ``p`` tiles' rows (each scaled by the ``acc_scale`` after it, as the
  accumulator is), taken on the tensor cores by a wgmma with a ones tile.
  """

  init: tuple
  update: Callable
  finish: Callable


def output_view_rows(block_q: int, dk: int, dv: int) -> int | None:
  """Rows of the ``dv``-wide view under which a consumer's Q tile (``block_q x dk``)
  takes the forward's output tile: the view has exactly the tile's bytes, so each
  consumer's output lands in its own Q tile (``block_q`` for ``dv == dk``). None where
  no such view exists (``dv > dk``, or rows that are not whole 8-row swizzle tiles):
  the output then has a tile of its own."""
  rows, rest = divmod(block_q * dk, dv)
  return rows if dv <= dk and not rest and rows % 8 == 0 else None


def own_output_tile(block_q: int, dk: int, dv: int, nbytes: int, out_nbytes: int) -> bool:
  """Whether the output needs a shared-memory tile of its own (else it takes a view of
  its Q tile: ``output_view_rows``; never where the output's dtype differs)."""
  return out_nbytes != nbytes or output_view_rows(block_q, dk, dv) is None


@functools.lru_cache(maxsize=4096)  # every "auto" choice on a GPU asks it
def forward_smem_bytes(block_q: int, block_kv: int, stages: int, dk: int, dv: int,
                       nbytes: int, q_buffers: int, out_nbytes: int | None = None,
                       ones_tile: bool = False, vectors: tuple[int, int] = (0, 0),
                       reduces: bool = True, bias_nbytes: int = 0) -> int:
  """Shared memory of the forward kernel as Mosaic GPU counts it (``_scratch``'s
  buffers: ``q_buffers`` Q tiles per consumer, which take the output tile where
  ``output_view_rows`` says so, else it has its own; ``stages`` K and V slots; with
  ``ones_tile`` the ones tile of a rule's ``mma_row_sums``; ``vectors``: the
  ``(row, col)`` counts of per-position vectors, 4-byte values; the barriers).
  ``out_nbytes``: the output's bytes per value (default ``nbytes``); ``reduces``: the
  rule reduces rows (``Rows.reduces``); ``bias_nbytes``: a dense bias's bytes per
  value (its tiles per slot and consumer), 0 for none."""
  dtype = mp.stand_in_dtype(nbytes)
  out_dtype = mp.stand_in_dtype(nbytes if out_nbytes is None else out_nbytes)
  rows, cols = vectors
  scratch = _scratch(dtype, dk, dv, block_q, block_kv, stages, q_buffers,
                     (jnp.int32,) * rows, (jnp.int32,) * cols, out_dtype, nbytes == 1,
                     ones_tile, mp.stand_in_dtype(bias_nbytes) if bias_nbytes else None)
  return mp.smem_bytes(scratch, reduces)


def forward_q_buffers(block_q: int, block_kv: int, stages: int, dk: int, dv: int,
                      nbytes: int, out_nbytes: int | None = None, ones_tile: bool = False,
                      vectors: tuple[int, int] = (0, 0), reduces: bool = True,
                      bias_nbytes: int = 0) -> int:
  """2 (the next work item's Q prefetched) where that fits the shared memory, else 1."""
  double = forward_smem_bytes(block_q, block_kv, stages, dk, dv, nbytes, 2, out_nbytes,
                              ones_tile, vectors, reduces, bias_nbytes)
  return 2 if double <= HOPPER_SMEM_BYTES else 1


def forward_cost(block_q: int, block_kv: int, stages: int, dk: int, dv: int,
                 nbytes: int, out_nbytes: int | None = None, ones_tile: bool = False,
                 vectors: tuple[int, int] = (0, 0), reduces: bool = True,
                 bias_nbytes: int = 0) -> tuple[int, float]:
  """The forward kernel's shared-memory bytes (``forward_smem_bytes`` with one Q
  buffer: it takes a second where that fits) and fp32 accumulators per consumer
  thread (O, the logits, a dense bias's tile and, with ``ones_tile``, the row sums)."""
  smem = forward_smem_bytes(block_q, block_kv, stages, dk, dv, nbytes, 1, out_nbytes,
                            ones_tile, vectors, reduces, bias_nbytes)
  # (a bias tile: its 16-bit values, two per register)
  accumulators = block_q * (dv + block_kv + bool(bias_nbytes) * block_kv // 2
                            + ones_tile * ONES_ROWS)
  return smem, accumulators / THREADS_PER_WARPGROUP


class _Item(NamedTuple):
  """One work item (``work``'s) and the key blocks ``[c_lo, c_hi)`` its rows reach."""

  work: Any
  c_lo: Any
  c_hi: Any

  @property
  def batch(self):
    return self.work.batch

  @property
  def head(self):
    return self.work.head

  @property
  def tile(self):
    return self.work.tile


class _Rows(NamedTuple):
  """One consumer's rows in one work item, as its block steps read them."""

  item: _Item
  q_start: Any
  q_smem: Any
  row_vectors: tuple
  scalars: tuple
  rule: Rows
  slot_of: Callable


@dataclasses.dataclass(frozen=True)
class _Forward:
  """The forward kernel's refs and static parameters, and its pieces: the work items
  (``item``), the consumers (``consumer`` -> ``work`` -> ``step`` / ``skip`` ->
  ``write``) and the producer (``producer``)."""

  rule: Any
  spec: MaskSpec
  positions: PositionInputs
  items: Any  # bound work items (``work``)
  addressing: Any
  block_kv: int
  stages: int
  group: int
  persistent: bool
  q_buffers: int
  mma_sums: bool  # the rule's ``mma_row_sums`` for these inputs
  refs: dict
  smem: dict
  cta: Any
  n_ctas: Any
  n_local: Any
  wg: Any
  take_turn: Callable  # one function object: the ``pl.when``s of it share one traced body

  @property
  def block_q(self) -> int:
    return self.items.kind.block_q

  def spec_of(self, batch, head) -> MaskSpec:
    """The mask spec of a work item's row: with per-row lengths, bound to them (the
    last two scalar inputs)."""
    if not self.positions.lengths:
      return self.spec
    lengths = self.positions.read_scalars(self.refs["scalars"], batch, head)[-2:]
    return self.spec.with_lengths(*lengths)

  def item(self, t) -> _Item:
    """This CTA's ``t``-th work item (items ``cta, cta + n_ctas, ...``)."""
    w = t * self.n_ctas + self.cta
    it = self.items.at(w)
    cta_range = self.items.block_range(self.spec_of(it.batch, it.head), it, self.block_kv)
    if self.refs["ranges"] is not None:  # only the key blocks segment ids or a block mask allow
      cta_range = narrow(cta_range, given_range(self.refs["ranges"], it.batch, it.head,
                                                it.tile * self.items.kind.consumers,
                                                self.items.kind.consumers))
    n_kv_blocks = self.addressing.kv_len(self.refs["k"]) // self.block_kv
    return _Item(it, *mp.clamp_range(cta_range[0], cta_range[3], n_kv_blocks))

  def q_tiles(self):
    """The Q tiles and, where the output takes a view of them, that view (else None)."""
    q_view = "o" not in self.smem and self.refs["o"].shape[-1] != self.refs["q"].shape[-1]
    return self.smem["q"] if q_view else (self.smem["q"], None)

  def load_q(self, t, buf):
    it = self.item(t)
    q_start = self.items.q_start(it, self.wg)
    ready = self.smem["q_ready"].at[buf * mp.CONSUMERS + self.wg]
    plgpu.copy_gmem_to_smem(self.refs["q"].at[self.items.q_rows(it.work, q_start)],
                            self.q_tiles()[0].at[buf, self.wg], ready)
    mp.copy_vectors(self.refs["rows"],
                    [b.at[buf, self.wg] for b in self.positions.buffers(self.smem, ROW)],
                    it.batch, q_start, self.block_q, ready, it.head)

  def load_next_q(self, t, buf):
    @pl.when(t + 1 < self.n_local)
    def _():
      # The buffer's last output tile must have been read out first.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      self.load_q(t + 1, buf)

  def consumer(self):
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")
    if self.mma_sums:
      pl.when(self.wg == 0)(lambda: plgpu.copy_gmem_to_smem(
          self.refs["ones"], self.smem["ones"], self.smem["ones_ready"]))
      plgpu.barrier_wait(self.smem["ones_ready"])
    if self.persistent:
      pl.when(self.n_local > 0)(lambda: self.load_q(jnp.int32(0), 0))
      lax.fori_loop(jnp.int32(0), self.n_local, self.work, jnp.int32(0))
    else:  # one item, outside any loop: the registers of the larger tiles stay unspilled
      self.load_q(0, 0)
      self.work(0, 0)  # (Python ints: constants captured by the wgmma scopes fail to lower)
    plgpu.wait_smem_to_gmem(0)

  def work(self, t, first_use):
    """Work item ``t``; ``first_use``: the K/V ring's steps so far."""
    wg, block_q, block_kv = self.wg, self.block_q, self.block_kv
    it = self.item(t)
    c_lo, c_hi = it.c_lo, it.c_hi
    buf = lax.rem(t, jnp.int32(self.q_buffers)) if self.persistent else 0
    q_smem = self.q_tiles()[0].at[buf, wg]
    q_start = self.items.q_start(it, wg)
    plgpu.barrier_wait(self.smem["q_ready"].at[buf * mp.CONSUMERS + wg])
    row_vectors = self.positions.load(self.smem, ROW, lambda b: b.at[buf, wg], mp.ROW)
    scalars = self.positions.read_scalars(self.refs["scalars"], it.batch, it.head)
    if self.persistent and self.q_buffers == 2:
      self.load_next_q(t, 1 - buf)
    spec = self.spec_of(it.batch, it.head)
    own, masked_runs = own_blocks(self.items.own_range(spec, q_start, block_kv),
                                  self.items.own_masked_runs(spec), self.refs["ranges"],
                                  it.batch, it.head, it.tile, wg)
    own = mp.clamp_own(own, c_lo, c_hi)
    row_rule = self.rule.bind(self.refs["rule"], ConsumerRows(
        it.batch, it.head, q_start, own, block_q, block_kv, self.refs["q"].dtype))
    slot_of = lambda j: lax.rem(first_use + j - c_lo, jnp.int32(self.stages))
    rows = _Rows(it, q_start, q_smem, row_vectors, scalars, row_rule, slot_of)

    @pl.when(c_hi > c_lo)
    def _():
      plgpu.barrier_wait(self.smem["k_ready"].at[slot_of(c_lo)])

    pl.when(wg == 1)(self.take_turn)  # consumer 1 starts half a step behind consumer 0
    width = self.refs["o"].shape[-1]
    zeros = lambda n: plgpu.layout_cast(jnp.zeros((block_q, n), jnp.float32),
                                        plgpu.Layout.WGMMA)
    acc = (zeros(width),) + ((zeros(ONES_ROWS),) if self.mma_sums else ())
    acc, stats = mp.visit_blocks((c_lo, c_hi), own, functools.partial(self.step, rows),
                                 functools.partial(self.skip, rows), (acc, row_rule.init),
                                 masked_runs=masked_runs)
    pl.when(wg == 0)(self.take_turn)
    sums = (acc[1].max(axis=1),) if self.mma_sums else ()  # its columns are equal
    self.write(rows, buf, *row_rule.finish(acc[0], stats, *sums))
    if self.persistent and self.q_buffers == 1:
      self.load_next_q(t, buf)
    return first_use + (c_hi - c_lo)

  def wait_next_k(self, rows: _Rows, j):
    @pl.when(j + 1 < rows.item.c_hi)
    def _():
      plgpu.barrier_wait(self.smem["k_ready"].at[rows.slot_of(j + 1)])

  def step(self, rows: _Rows, j, carry, masked):
    """Key block ``j``: S = Q Kᵀ, the row rule, then O += P V."""
    smem, positions = self.smem, self.positions
    acc, stats = carry
    slot = rows.slot_of(j)

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, rows.q_smem, smem["k"].at[slot].transpose((1, 0)))
      self.take_turn()
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((self.block_q, self.block_kv), jnp.float32))
    col_vectors = ()
    if positions.needs(COL, masked):  # read before the slot is released
      col_vectors = positions.load(smem, COL, lambda b: b.at[slot], mp.COL)
    bias = (mp.load(smem["bias"].at[slot, self.wg], plgpu.Layout.WGMMA)
            if positions.bias is not None else None)
    plgpu.barrier_arrive(smem["k_free"].at[slot])
    tile = Tile(s.shape, 0, rows.q_start, j * self.block_kv, rows.item.batch, rows.item.head,
                rows.row_vectors, col_vectors, rows.scalars,
                self.items.kind.rows_per_position)
    if bias is not None:
      tile = positions.bias_tile(tile, bias)
    p, acc_scale, stats, late = rows.rule.update(s, stats, j, masked, tile)
    if acc_scale is not None:
      acc = tuple(a * lax.broadcast_in_dim(acc_scale, a.shape, [0]) for a in acc)
    v_tile = smem["v"].at[slot]
    if self.addressing.values_transposed:  # 8 bits: B keys-fastest, in the operand's order
      p, v_tile = mp.eight_bit_operand(p), v_tile.transpose((1, 0))
    # The row statistics finish before the turn change for heads up to 128 without
    # dropout, after it where dropout's per-weight work is better overlapped.
    early_stats = self.refs["o"].shape[-1] <= 128 and not positions.dropout
    if early_stats:
      if late is not None:
        stats = late(stats)
      acc, stats, p = lax.optimization_barrier((acc, stats, p))
    plgpu.barrier_arrive(smem["schedule"])
    plgpu.barrier_wait(smem["v_ready"].at[slot])
    plgpu.barrier_wait(smem["schedule"])
    if not early_stats and late is not None:
      stats = late(stats)

    def pv(acc_refs):
      plgpu.wgmma(acc_refs[0], p, v_tile)
      if len(acc_refs) > 1:  # the row sums of p: p times a ones tile
        plgpu.wgmma(acc_refs[1], p, smem["ones"].transpose((1, 0)))
      self.wait_next_k(rows, j)

    acc = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in acc))
    plgpu.barrier_arrive(smem["v_free"].at[slot])
    return acc, stats

  def skip(self, rows: _Rows, j):
    """Key block ``j``, which this consumer's rows do not see: the barriers alone."""
    smem = self.smem
    slot = rows.slot_of(j)
    self.take_turn()
    plgpu.barrier_arrive(smem["k_free"].at[slot])
    plgpu.barrier_arrive(smem["schedule"])
    plgpu.barrier_wait(smem["v_ready"].at[slot])
    plgpu.barrier_wait(smem["schedule"])
    self.wait_next_k(rows, j)
    plgpu.barrier_arrive(smem["v_free"].at[slot])

  def write(self, rows: _Rows, buf, o, row_stat):
    """Stores the rows' output (through its shared-memory tile) and statistic."""
    smem, wg, it = self.smem, self.wg, rows.item
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's stores
    out_tiles = self.q_tiles()[1]
    if "o" in smem:
      o_smem = smem["o"].at[wg]
    elif out_tiles is not None:
      o_smem = out_tiles.at[buf, wg, pl.ds(0, self.block_q)]
    else:
      o_smem = rows.q_smem
    o_smem[...] = o.astype(self.refs["o"].dtype)
    smem["stat"].at[wg][...] = row_stat
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem,
                            self.refs["o"].at[self.items.out_rows(it.work, rows.q_start)],
                            commit_group=False)
    plgpu.copy_smem_to_gmem(smem["stat"].at[wg],
                            self.refs["stat"].at[self.items.stat_rows(it.work, rows.q_start)],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()

  def bias_copies(self, it: _Item):
    """``produce_kv``'s ``tiles`` for a dense bias: each consumer's rows of it at the
    key tile."""
    return lambda key_start, slot, barrier: copy_bias_tiles(
        self.refs["bias"], ((self.smem["bias"].at[slot, wg],
                             pl.ds(self.items.q_start(it.work, wg), self.block_q),
                             pl.ds(key_start, self.block_kv)) for wg in range(mp.CONSUMERS)),
        it.batch, it.head, barrier)

  def producer(self):
    plgpu.set_max_registers(mp.PRODUCER_REGISTERS, action="decrease")
    smem = self.smem
    addressing = self.addressing.bind(self.refs["addressing"])

    def work(t, first_use):
      it = self.item(t)
      tiles = self.bias_copies(it) if self.positions.bias is not None else None
      mp.produce_kv(self.refs["k"], self.refs["v"], smem["k"], smem["v"],
                    (smem["k_ready"], smem["v_ready"], smem["k_free"], smem["v_free"]),
                    batch=it.batch, head=it.head, group=self.group, first_block=it.c_lo,
                    n_steps=it.c_hi - it.c_lo, block_kv=self.block_kv, stages=self.stages,
                    cols=(self.refs["cols"], self.positions.buffers(smem, COL)),
                    first_slot_use=first_use, addressing=addressing, tiles=tiles)
      return first_use + (it.c_hi - it.c_lo)

    if self.persistent:
      lax.fori_loop(jnp.int32(0), self.n_local, work, jnp.int32(0))
    else:
      work(0, 0)


def _kernel(*refs, rule, spec: MaskSpec, positions: PositionInputs, items: QueryTiles,
            addressing, block_kv: int, stages: int, group: int, persistent: bool,
            q_buffers: int, mma_sums: bool, **smem):
  n_in = 3 + positions.n_refs + rule.n_inputs + addressing.n_inputs + mma_sums
  (q_ref, k_ref, v_ref, *extra), (o_ref, stat_ref) = refs[:n_in], refs[n_in:]
  ones_ref = extra.pop() if mma_sums else None
  row_refs, col_refs, scalar_refs, ranges_ref, bias_ref, rest = positions.split(extra)
  named = dict(q=q_ref, k=k_ref, v=v_ref, o=o_ref, stat=stat_ref, rows=row_refs,
               cols=col_refs, scalars=scalar_refs, ranges=ranges_ref, bias=bias_ref,
               rule=rest[:rule.n_inputs], addressing=rest[rule.n_inputs:], ones=ones_ref)
  bound_items = items.bind()
  cta, n_ctas = lax.axis_index("cta"), jnp.int32(lax.axis_size("cta"))
  n_local = bound_items.per_cta(cta, n_ctas)
  def take_turn():  # the consumers alternate on the tensor cores
    plgpu.barrier_arrive(smem["schedule"])
    plgpu.barrier_wait(smem["schedule"])

  kernel = _Forward(rule, spec, positions, bound_items, addressing, block_kv, stages, group,
                    persistent, q_buffers, mma_sums, named, smem, cta, n_ctas, n_local,
                    lax.axis_index("wg"), take_turn)
  pl.when(kernel.wg < mp.CONSUMERS)(kernel.consumer)
  pl.when(kernel.wg == mp.PRODUCER)(kernel.producer)


def rows_forward(q, k, v, inputs=(), *, rule, spec: MaskSpec, block_q: int, block_kv: int,
                 stages: int, persistent: bool | None = None,
                 positions: PositionInputs = PositionInputs(), addressing=ContiguousKV(),
                 items=None, group: int | None = None, out_dtype=None):
  """Runs the Hopper forward kernel with row rule ``rule`` on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, dk_p]``, ``q_len_p % (2 * block_q) == 0``; k:
      ``[batch, kv_len_p, kv_heads, dk_p]``, v: ``[batch, kv_len_p, kv_heads, dv_p]``,
      ``kv_len_p % block_kv == 0`` (as ``addressing`` lays them out; these are
      ``ContiguousKV``'s shapes); head dims multiples of 64. 8-bit (FP8) inputs need an
      addressing whose ``values_transposed``.
    inputs: the per-position arrays of ``positions`` (``inputs.position_arrays``;
      ranges per ``block_q`` query block over ``block_kv`` key blocks), then the
      ``rule.n_inputs`` arrays the rule reads, then the ``addressing.n_inputs`` ones
      the addressing reads.
    persistent: one CTA per SM walking the work items, or one CTA per item; None:
      persistent where every item has the same work (no mask but padding).
    addressing: where K and V tiles lie (``addressing``; default contiguous).
    items: the work items (``work``; default ``QueryTiles`` of the shapes, query tiles
      fastest when persistent, heavy tiles first under a mask with a right bound).
    group: query heads per KV head (default ``q_heads // kv_heads``; 1 where the items
      pack a KV head's query heads into rows).
    out_dtype: the output's dtype (default q's).

  Returns:
    The outputs ``items.out_shapes`` gives: for ``QueryTiles``, ``o: [batch, q_len_p,
    q_heads, dv_p]`` in q's dtype and the rule's row statistic ``[batch, q_heads,
    q_len_p]`` float32.
  """
  batch, q_len_p, q_heads, dk = q.shape
  dv = v.shape[-2] if addressing.values_transposed else v.shape[-1]
  out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if (q.dtype.itemsize == 1) != addressing.values_transposed:
    raise ValueError("8-bit inputs need V transposed (addressing.TransposedValuesKV), and "
                     "only 8-bit ones take it")
  if persistent is None:
    persistent = (spec.left is None and spec.right is None and not spec.every_tile_masked
                  and not positions.ranges)
  if items is None:
    items = QueryTiles(q_len_p // (mp.CONSUMERS * block_q), q_heads, batch, block_q,
                       mp.CONSUMERS, tiles_fastest=persistent,
                       heavy_first=spec.right is not None)
  if positions.bias is not None and items.rows_per_position != 1:
    raise ValueError("a dense bias takes work items of one query head's rows")
  stages = max(1, min(stages, addressing.kv_len(k) // block_kv))
  mma_sums = rule.mma_row_sums(q.dtype)
  row_dtypes, col_dtypes = positions.vector_dtypes(inputs)
  bias_dtype = positions.bias_dtype(inputs)
  bias_nbytes = 0 if bias_dtype is None else bias_dtype.itemsize
  q_buffers = forward_q_buffers(block_q, block_kv, stages, dk, dv, q.dtype.itemsize,
                                out_dtype.itemsize, mma_sums,
                                (len(row_dtypes), len(col_dtypes)),
                                rule.reduces, bias_nbytes) if persistent else 1
  smem = _scratch(q.dtype, dk, dv, block_q, block_kv, stages, q_buffers, row_dtypes,
                  col_dtypes, out_dtype, addressing.values_transposed, mma_sums, bias_dtype)
  if mma_sums:  # the ones tile's source, copied in once per CTA
    inputs = (*inputs, jnp.ones((ONES_ROWS, block_kv), q.dtype))
  kernel = functools.partial(_kernel, rule=rule, spec=spec, positions=positions, items=items,
                             addressing=addressing, block_kv=block_kv, stages=stages,
                             group=q_heads // k.shape[2] if group is None else group,
                             persistent=persistent, q_buffers=q_buffers, mma_sums=mma_sums)
  return mp.kernel(
      kernel,
      out_type=items.out_shapes(batch, q_len_p, q_heads, dv, out_dtype),
      scratch_types=smem,
      grid=(min(items.count, mp.num_sms()) if persistent else items.count,),
      grid_names=("cta",),
  )(q, k, v, *inputs)


def _scratch(dtype, dk: int, dv: int, block_q: int, block_kv: int, stages: int,
             q_buffers: int, row_dtypes: tuple, col_dtypes: tuple, out_dtype,
             values_transposed: bool, ones_tile: bool, bias_dtype=None) -> dict:
  """The forward kernel's shared memory: tiles of ``dtype``, barriers, the per-position
  vectors (``PositionInputs.scratch``, of ``row_dtypes`` and ``col_dtypes``), with
  ``ones_tile`` the ones tile of the MMA row sums with its barrier, and with a
  ``bias_dtype`` a dense bias's tile per slot and consumer (copied with K)."""
  barrier = lambda n, arrivals=1: plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)
  q_tiles = mp.tile_smem((q_buffers, mp.CONSUMERS, block_q, dk), dtype)
  own_out = own_output_tile(block_q, dk, dv, jnp.dtype(dtype).itemsize,
                            jnp.dtype(out_dtype).itemsize)
  out_rows = None if own_out else output_view_rows(block_q, dk, dv)
  q_view = out_rows is not None and dv != dk
  smem = dict(
      # A consumer writes its output once its last QKᵀ has run: the Q tile is free then.
      q=plgpu.RefUnion(q_tiles, mp.tile_smem((q_buffers, mp.CONSUMERS, out_rows, dv),
                                             dtype)) if q_view else q_tiles,
      k=mp.tile_smem((stages, block_kv, dk), dtype),
      v=mp.tile_smem((stages, dv, block_kv) if values_transposed else (stages, block_kv, dv),
                     dtype),
      stat=plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
      q_ready=barrier(q_buffers * mp.CONSUMERS, 1 + len(row_dtypes)),
      k_ready=barrier(stages, 1 + len(col_dtypes) + (bias_dtype is not None) * mp.CONSUMERS),
      v_ready=barrier(stages), k_free=barrier(stages, mp.CONSUMERS),
      v_free=barrier(stages, mp.CONSUMERS), schedule=plgpu.Barrier(num_arrivals=mp.CONSUMERS))
  if own_out:
    smem["o"] = mp.tile_smem((mp.CONSUMERS, block_q, dv), out_dtype)
  if ones_tile:
    smem.update(ones=mp.tile_smem((ONES_ROWS, block_kv), dtype),
                ones_ready=plgpu.Barrier(num_arrivals=1))
  if bias_dtype is not None:
    smem["bias"] = mp.tile_smem((stages, mp.CONSUMERS, block_q, block_kv), bias_dtype)
  smem.update(PositionInputs.scratch(row_dtypes, col_dtypes, (q_buffers, mp.CONSUMERS, block_q),
                                     (stages, block_kv)))
  return smem
