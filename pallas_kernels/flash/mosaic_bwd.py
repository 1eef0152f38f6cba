"""Backward flash attention for Hopper, in Pallas Mosaic GPU.

By default two kernels, neither with atomics, so gradients are bitwise reproducible:
- dQ: one CTA per (query tile, query head, batch); consumers own query rows and
  stream K and V tiles, as in the forward pass.
- dK/dV: one CTA per (key tile, KV head, batch); consumers own key rows and
  stream Q, dO, lse and delta tiles of every query head of the group, so GQA
  sums over heads inside the kernel.
With ``fused_dq`` (only for ``deterministic=False`` calls) the dK/dV kernel also
computes each block pair's dQ tile (``dS K``, dS through shared memory) and adds it
into an fp32 buffer in global memory with a TMA reduce-add: 5 matmuls per block pair
instead of 7, in an order that varies from run to run (FlashAttention-3's scheme).
Both grids vary the head fastest, then the tile, then the batch row: the CTAs running
at once spread over the heads, and with a causal mask every head's heaviest tiles
start first.
Causal masks and windows visit only the blocks the pattern reaches; the blocks
that straddle its edge apply the element mask (``masking.py``, shared with the
forward and the Triton kernels). Where the mask has a right bound (causal) the dK/dV
kernel walks its query blocks from the last one down. Past dk + dv = 256 the dK/dV
kernel has no producer warpgroup, for the consumers' registers (``mosaic_dkv``).

One dK/dV kernel body serves every configuration; what its modes change are pieces it
composes: the Q/dO stream with its walk order (``_QStream``), who fills that ring
(``_ProducerFeed``, ``_SelfFeed``), where lse and delta enter the scores
(``_LoadedStats``, ``_FoldedStats``) and what a block pair's dS feeds (``_DkvOnly``,
``_FusedDq``). Both kernels share the steps of a block pair's arithmetic
(``_masked_logits``, ``_probs_and_grad``) and of the block ranges (``own_blocks``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.factored_functions import COL, ROW
from jattn.kernels.common.masking import MaskSpec, kv_block_range, narrow, q_block_range
from jattn.kernels.common.softmax import LOG2E, backward_probs, logit_grad
from jattn.kernels.hopper.budget import MOSAIC_MODELLED_BWD_WIDTH, fused_dq_columns
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import ContiguousKV, ContiguousQ
from jattn.kernels.hopper.inputs import (PositionInputs, Tile, copy_bias_tiles, given_range,
                                         own_blocks)


def _wgmma_pair(acc_a, a1, b1, acc_b, a2, b2):
  """Two wgmmas issued back to back and awaited once."""
  def run(refs):
    ref_a, ref_b = refs
    plgpu.wgmma(ref_a, a1, b1)
    plgpu.wgmma(ref_b, a2, b2)
  return pl.run_state(run)((plgpu.ACC.init(acc_a), plgpu.ACC.init(acc_b)))


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


# --- pieces of both kernels ------------------------------------------------------------------

def _slot_vectors(positions: PositionInputs, smem: dict, kind: str, masked: bool, slot) -> tuple:
  """The ``kind`` vectors streamed with the other operand, from ring slot ``slot``, where
  the step reads them (``PositionInputs.needs``); they lie along the score tile's columns."""
  if not positions.needs(kind, masked):
    return ()
  return positions.load(smem, kind, lambda b: b.at[slot], mp.COL)


def _masked_logits(positions: PositionInputs, spec: MaskSpec, qk, scale: float, softcap,
                   at: Tile, masked: bool):
  """``(s, c, g)`` of a score tile (``PositionInputs.logits``: base-2 logits, their unit
  and the score transform's gradient), with the element mask where ``masked``."""
  s, c, g = positions.logits(qk, scale, softcap, at, with_grad=True)
  if masked:
    s = positions.apply_mask(s, spec, at)
  return s, c, g


def _probs_and_grad(s, c, dp, g, lse, delta, at: Tile, positions: PositionInputs):
  """``(p, ds, kept)``: the weights ``exp2(s c - lse)`` and the logits' gradient
  ``p (dp - delta)`` (through the score transform's ``g``), lse and delta broadcast
  along the tile's query axis. ``lse`` and ``delta`` are functions giving the vectors,
  called where each is first needed. With dropout dP counts only the kept weights
  (``kept``: the tile's keep-mask, else None), and lse and delta hold ``1 / (1 - rate)``
  (``dropout.backward_rows``)."""
  p = backward_probs(s * c - lax.broadcast_in_dim(lse(), at.shape, [at.q_axis]),
                     positions.dropout)
  kept = None
  if positions.dropout:
    kept = positions.kept(at)
    dp = jnp.where(kept, dp, 0.0)
  ds = logit_grad(p * (dp - lax.broadcast_in_dim(delta(), at.shape, [at.q_axis])), g)
  return p, ds, kept


@dataclasses.dataclass(frozen=True)
class _DsTiles:
  """A dQ consumer's rows of dS ``[batch, heads, q_len_p, kv_len_p]`` (a dense bias's
  gradient before its broadcast axes are summed), written through one shared-memory
  tile by TMA: each computed block's, and zeros at every other key block."""

  ref: Any
  tile: Any  # [block_q, block_kv] in shared memory
  batch: Any
  head: Any
  q_start: Any
  block_kv: int

  def _store(self, j):
    plgpu.copy_smem_to_gmem(self.tile, self.ref.at[self.batch, self.head,
                                                   pl.ds(self.q_start, self.tile.shape[0]),
                                                   pl.ds(j * self.block_kv, self.block_kv)])

  def zero_outside(self, own, n_blocks: int):
    """Zeros at the key blocks outside ``[lo, hi)`` of ``own`` (clamped to the CTA's),
    which the steps do not write."""
    self.tile[...] = plgpu.layout_cast(jnp.zeros(self.tile.shape, self.tile.dtype),
                                       plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    store = lambda j, carry: self._store(j) or carry
    lax.fori_loop(jnp.int32(0), own[0], store, None)
    lax.fori_loop(own[3], jnp.int32(n_blocks), store, None)

  def write(self, j, ds):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's last store has read it
    self.tile[...] = ds.astype(self.tile.dtype)
    plgpu.commit_smem()
    self._store(j)


# --- the dQ kernel ---------------------------------------------------------------------------

def _dq_kernel(*refs, spec: MaskSpec, positions: PositionInputs, scale: float, softcap,
               block_q: int, block_kv: int, stages: int, group: int, q_layout: ContiguousQ,
               addressing: ContiguousKV, **smem):
  n_in = 6 + positions.n_refs
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *extra), (dq_ref, *ds_ref) = (
      refs[:n_in], refs[n_in:])
  row_refs, col_refs, scalar_refs, ranges_ref, bias_ref, _ = positions.split(extra)
  q_smem, do_smem, k_smem, v_smem = smem["q"], smem["do"], smem["k"], smem["v"]
  k_ready, v_ready, k_free, v_free = (smem[n] for n in ("k_ready", "v_ready", "k_free", "v_free"))
  batch = lax.axis_index("batch")
  head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  tile = lax.axis_index("q_tiles")
  if spec.right is not None:  # heavy (late) query tiles first: a lighter tail, as forward
    tile = lax.axis_size("q_tiles") - 1 - tile
  cta_q = tile * (mp.CONSUMERS * block_q)
  cta_range = kv_block_range(spec, cta_q, mp.CONSUMERS * block_q, block_kv)
  if ranges_ref is not None:
    cta_range = narrow(cta_range, given_range(ranges_ref, batch, head, tile * mp.CONSUMERS,
                                              mp.CONSUMERS))
  c_lo, c_hi = mp.clamp_range(cta_range[0], cta_range[3], k_ref.shape[1] // block_kv)
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")
    q_start = cta_q + wg * block_q
    rows = (batch, pl.ds(q_start, block_q), head)
    q_rows = (batch, pl.ds(q_start, block_q), q_layout.head(head))
    row_stats = (batch, head, pl.ds(q_start, block_q))
    my = lambda ref: ref.at[wg]
    ready = smem["rows_ready"].at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], my(q_smem), ready)
    plgpu.copy_gmem_to_smem(do_ref.at[q_rows], my(do_smem), ready)
    plgpu.copy_gmem_to_smem(lse_ref.at[row_stats], my(smem["lse"]), ready)
    plgpu.copy_gmem_to_smem(delta_ref.at[row_stats], my(smem["delta"]), ready)
    mp.copy_vectors(row_refs, [my(b) for b in positions.buffers(smem, ROW)], batch, q_start,
                    block_q, ready, head)
    plgpu.barrier_wait(ready)
    lse = mp.load(my(smem["lse"]), mp.ROW)
    delta = mp.load(my(smem["delta"]), mp.ROW)
    row_vectors = positions.load(smem, ROW, my, mp.ROW)
    scalars = positions.read_scalars(scalar_refs, batch, head)
    shape = (block_q, block_kv)
    ds_out = _DsTiles(ds_ref[0], my(smem["ds"]), batch, head, q_start, block_kv) if ds_ref else None

    def step(j, dq, masked):
      slot = lax.rem(j - c_lo, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(v_ready.at[slot])
      s, dp = _wgmma_pair(_zeros(shape), my(q_smem), k_smem.at[slot].transpose((1, 0)),
                          _zeros(shape), my(do_smem), v_smem.at[slot].transpose((1, 0)))
      plgpu.barrier_arrive(v_free.at[slot])
      col_vectors = _slot_vectors(positions, smem, COL, masked, slot)
      at = Tile(shape, 0, q_start, j * block_kv, batch, head, row_vectors, col_vectors, scalars)
      if bias_ref is not None:
        at = positions.bias_tile(at, mp.load(smem["bias"].at[slot, wg], plgpu.Layout.WGMMA))
      s, c, g = _masked_logits(positions, spec, s, scale, softcap, at, masked)
      _, ds, _ = _probs_and_grad(s, c, dp, g, lambda: lse, lambda: delta, at, positions)
      if ds_out is not None:
        ds_out.write(j, ds)

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

    own, masked_runs = own_blocks(kv_block_range(spec, q_start, block_q, block_kv),
                                  spec.masked_kv_runs, ranges_ref, batch, head, tile, wg)
    if ds_out is not None:
      ds_out.zero_outside(mp.clamp_own(own, c_lo, c_hi), k_ref.shape[1] // block_kv)
    dq = mp.visit_blocks((c_lo, c_hi), own, step, skip, _zeros((block_q, head_dim)),
                         masked_runs=masked_runs)
    my(q_smem)[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(my(q_smem), dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == mp.PRODUCER)
  def _producer():
    plgpu.set_max_registers(mp.PRODUCER_REGISTERS, action="decrease")
    def bias_tiles(key_start, slot, barrier):  # each consumer's rows of the dense bias
      copy_bias_tiles(bias_ref, ((smem["bias"].at[slot, i], pl.ds(cta_q + i * block_q, block_q),
                                  pl.ds(key_start, block_kv)) for i in range(mp.CONSUMERS)),
                      batch, head, barrier)

    mp.produce_kv(k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready, k_free, v_free),
                  batch=batch, head=head, group=group, first_block=c_lo,
                  n_steps=c_hi - c_lo, block_kv=block_kv, stages=stages,
                  cols=(col_refs, positions.buffers(smem, COL)), addressing=addressing,
                  tiles=bias_tiles if bias_ref is not None else None)


# --- pieces of the dK/dV kernel --------------------------------------------------------------

def _dkv_cta_blocks(spec: MaskSpec, ranges_ref, batch, kv_head, tile, cta_k, *, group: int,
                    block_q: int, block_kv: int, n_q_blocks: int):
  """The query blocks ``[c_lo, c_hi)`` a dK/dV CTA streams for each query head: those its
  key tile's mask reaches, narrowed by the given ranges. Ranges per query head (a block
  mask's) differ within the group: the CTA streams their union, and each head's own
  range is narrowed inside the loop over heads."""
  cta_range = q_block_range(spec, cta_k, mp.CONSUMERS * block_kv, block_q)
  if ranges_ref is not None:
    per_head = ranges_ref.shape[1] > 1
    heads = [kv_head * group + g for g in range(group)] if per_head else kv_head
    cta_range = narrow(cta_range, given_range(ranges_ref, batch, heads, tile * mp.CONSUMERS,
                                              mp.CONSUMERS))
  return mp.clamp_range(cta_range[0], cta_range[3], n_q_blocks)


@dataclasses.dataclass(frozen=True)
class _QStream:
  """The dK/dV kernel's ring of Q, dO, lse and delta tiles (and the row vectors): each
  query head of the KV head's group in turn, its query blocks ``[c_lo, c_hi)``, one
  step per block (``n_steps = group * n_blocks``) through ``stages`` slots of ``smem``.

  ``descending`` (a mask with a right bound) walks each head's blocks from ``c_hi - 1``
  down: under a causal mask the key tiles' query ranges start at different blocks and
  end at the same one, so walking down keeps the CTAs of a head reading the same Q/dO
  blocks at about the same time, and those are shared in L2."""

  refs: tuple  # q, do, lse, delta in global memory
  q_layout: ContiguousQ  # where a query head's rows lie in q and do
  row_refs: list
  smem: dict
  positions: PositionInputs
  batch: Any
  kv_head: Any
  group: int
  c_lo: Any
  c_hi: Any
  n_blocks: Any  # per query head
  n_steps: Any
  block_q: int
  stages: int
  descending: bool
  bias: Any = None  # a dense bias in global memory: each consumer's keys of it per step
  key_start: Any = None  # the CTA's first key
  block_kv: int = 0

  def copy(self, i, slot, barrier):
    """TMA copies of step ``i`` (query head, then block) into ``slot``."""
    q_ref, do_ref, lse_ref, delta_ref = self.refs
    batch, block_q, smem = self.batch, self.block_q, self.smem
    head = self.kv_head * self.group + lax.div(i, self.n_blocks)
    block = lax.rem(i, self.n_blocks)
    start = (self.c_hi - 1 - block if self.descending else self.c_lo + block) * block_q
    rows = (batch, pl.ds(start, block_q), self.q_layout.head(head))
    stats = (batch, head, pl.ds(start, block_q))
    plgpu.copy_gmem_to_smem(q_ref.at[rows], smem["q"].at[slot], barrier)
    plgpu.copy_gmem_to_smem(do_ref.at[rows], smem["do"].at[slot], barrier)
    plgpu.copy_gmem_to_smem(lse_ref.at[stats], smem["lse"].at[slot], barrier)
    plgpu.copy_gmem_to_smem(delta_ref.at[stats], smem["delta"].at[slot], barrier)
    mp.copy_vectors(self.row_refs, [b.at[slot] for b in self.positions.buffers(smem, ROW)],
                    batch, start, block_q, barrier, head)
    if self.bias is not None:  # each consumer's keys
      copy_bias_tiles(self.bias, ((smem["bias"].at[slot, wg], pl.ds(start, block_q),
                                   pl.ds(self.key_start + wg * self.block_kv, self.block_kv))
                                  for wg in range(mp.CONSUMERS)), batch, head, barrier)

  def position(self, g, j):
    """The stream step of query block ``j`` of the group's head ``g``."""
    return g * self.n_blocks + (self.c_hi - 1 - j if self.descending else j - self.c_lo)

  def slot(self, pos):
    return lax.rem(pos, jnp.int32(self.stages))

  def wait(self, slot):
    plgpu.barrier_wait(self.smem["q_ready"].at[slot])

  def release(self, slot):
    plgpu.barrier_arrive(self.smem["q_free"].at[slot])

  def stat(self, name: str, slot):
    """``lse`` or ``delta`` of the slot's block: one value per query, a score column."""
    return mp.load(self.smem[name].at[slot], mp.COL)


@dataclasses.dataclass(frozen=True)
class _ProducerFeed:
  """The ring filled by the producer warpgroup (``mp.produce``); the consumers raise their
  registers, the producer lowers its own."""

  stream: _QStream
  wg: Any

  def start(self):
    plgpu.set_max_registers(mp.CONSUMER_REGISTERS, action="increase")

  def refill(self, pos):
    pass  # the producer refills the slots

  def run_producer(self):
    s = self.stream

    @pl.when(self.wg == mp.PRODUCER)
    def _producer():
      plgpu.set_max_registers(mp.PRODUCER_REGISTERS, action="decrease")
      mp.produce(s.n_steps, s.stages, [(s.copy, s.smem["q_ready"], s.smem["q_free"])])


@dataclasses.dataclass(frozen=True)
class _SelfFeed:
  """No producer warpgroup (wide heads): consumer 0 issues the ring's copies itself, the
  first ``stages`` steps before the loop (``mp.feed_first_slots``), then each slot one
  step behind the consumers (``mp.refeed``). The two consumers may then take 255
  registers each instead of 232 beside a producer; with 232 the compiler serializes
  their wgmmas and spills at these widths."""

  stream: _QStream
  wg: Any

  def start(self):
    s = self.stream
    mp.feed_first_slots(s.n_steps, s.stages, s.copy, s.smem["q_ready"], self.wg == 0)

  def refill(self, pos):
    s = self.stream
    mp.refeed(pos, s.n_steps, s.stages, s.copy, s.smem["q_ready"], s.smem["q_free"],
              self.wg == 0)

  def run_producer(self):
    pass  # the kernel runs without one (``mp.kernel(producer=False)``)


@dataclasses.dataclass(frozen=True)
class _LoadedStats:
  """S and dP start at zero; lse and delta are loaded after the matmuls (fewer live
  registers during them) and enter with the weights (``_probs_and_grad``)."""

  stream: _QStream
  positions: PositionInputs

  def inits(self, slot, shape):
    return _zeros(shape), _zeros(shape)

  def weights(self, s_t, c, dp_t, g_t, slot, at: Tile):
    return _probs_and_grad(s_t, c, dp_t, g_t, lambda: self.stream.stat("lse", slot),
                           lambda: self.stream.stat("delta", slot), at, self.positions)


@dataclasses.dataclass(frozen=True)
class _FoldedStats:
  """lse and delta folded into the accumulators' initial values: S starts at ``-lse / c``
  and dP at ``-delta``, so neither vector stays in registers beside the tiles. Only for
  plain logits (no score transform, no soft-cap) without dropout, and not for wide
  heads, where it spills (``mosaic_dkv``)."""

  stream: _QStream
  scale: float

  def inits(self, slot, shape):
    s_init = lax.broadcast_in_dim(self.stream.stat("lse", slot) * (-1.0 / (self.scale * LOG2E)),
                                  shape, [1])
    dp_init = lax.broadcast_in_dim(-self.stream.stat("delta", slot), shape, [1])
    return s_init, dp_init

  def weights(self, s_t, c, dp_t, g_t, slot, at: Tile):
    p_t = backward_probs(s_t * c)
    return p_t, p_t * dp_t, None


@dataclasses.dataclass(frozen=True)
class _DkvOnly:
  """A block pair's ``Pᵀ`` and ``dSᵀ`` feed dV and dK alone (dQ has its own kernel)."""

  stream: _QStream

  def accumulate(self, dk, dv, p_lo, ds_lo, slot, g, j, q_head):
    smem = self.stream.smem
    dv, dk = _wgmma_pair(dv, p_lo, smem["do"].at[slot], dk, ds_lo, smem["q"].at[slot])
    self.stream.release(slot)
    return dk, dv

  def skip(self, g, j, q_head, shape):
    pass  # nothing beyond the slot's barriers

  def finish(self):
    pass


@dataclasses.dataclass(frozen=True)
class _FusedDq:
  """FlashAttention-3's fused dQ: besides dV and dK, each block pair's dQ tile ``dS K``,
  added into the fp32 ``dq_ref`` in global memory by a TMA reduce-add (5 matmuls per
  block pair instead of 7; reduce-adds are not bitwise repeatable). The wgmma takes dS
  transposed from shared memory, double-buffered by stream position. ``shared``: the
  consumers split the head dim (``fused_dq_columns``), each summing both consumers' dS
  over its half of the columns, so they exchange dS at every block."""

  stream: _QStream
  dq_ref: Any
  wg: Any
  dtype: Any
  cols: int  # head-dim columns of this consumer's dQ tile
  shared: bool

  def _exchange(self, pos, ds):
    """Puts this consumer's dSᵀ tile where the dQ wgmma reads it (a buffer is rewritten
    only after both consumers passed the next exchange)."""
    smem = self.stream.smem
    buf = lax.rem(pos, jnp.int32(2))
    smem["ds"].at[buf, self.wg][...] = ds
    plgpu.commit_smem()
    if self.shared:
      plgpu.barrier_arrive(smem["ds_ready"])
    return buf

  def _issue(self, acc_ref, buf):
    """dQ tile of the block: ``dS K`` over this consumer's keys, or (shared) over both
    consumers' keys for this consumer's half of the columns."""
    smem, wg = self.stream.smem, self.wg
    if self.shared:
      plgpu.barrier_wait(smem["ds_ready"])
      cols = pl.ds(wg * self.cols, self.cols)
      for i in range(mp.CONSUMERS):
        plgpu.wgmma(acc_ref, smem["ds"].at[buf, i].transpose((1, 0)), smem["k"].at[i, :, cols])
    else:
      plgpu.wgmma(acc_ref, smem["ds"].at[buf, wg].transpose((1, 0)), smem["k"].at[wg])

  def _add(self, dq, j, q_head):
    """TMA reduce-add of a dQ tile into the fp32 accumulator in global memory."""
    smem, wg, block_q = self.stream.smem, self.wg, self.stream.block_q
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile was read
    smem["dq"].at[wg][...] = dq
    plgpu.commit_smem()
    cols = pl.ds(wg * self.cols if self.shared else 0, self.cols)
    plgpu.copy_smem_to_gmem(smem["dq"].at[wg],
                            self.dq_ref.at[self.stream.batch, pl.ds(j * block_q, block_q),
                                           q_head, cols],
                            reduction_op="add")

  def accumulate(self, dk, dv, p_lo, ds_lo, slot, g, j, q_head):
    buf = self._exchange(self.stream.position(g, j), ds_lo)
    smem = self.stream.smem

    def run(refs):
      dv_ref, dk_ref, dq_ref = refs
      plgpu.wgmma(dv_ref, p_lo, smem["do"].at[slot])
      plgpu.wgmma(dk_ref, ds_lo, smem["q"].at[slot])
      self._issue(dq_ref, buf)

    dv, dk, dq = pl.run_state(run)((plgpu.ACC.init(dv), plgpu.ACC.init(dk),
                                    plgpu.ACC.init(_zeros((self.stream.block_q, self.cols)))))
    self.stream.release(slot)
    self._add(dq, j, q_head)
    return dk, dv

  def skip(self, g, j, q_head, shape):
    """A block this consumer does not need: with ``shared`` the other one may, so a zero
    dS keeps the exchange in step (and this consumer's columns still get the other's)."""
    if not self.shared:
      return
    buf = self._exchange(self.stream.position(g, j),
                         plgpu.layout_cast(jnp.zeros(shape, self.dtype), plgpu.Layout.WGMMA))

    def dq_of_block(acc_ref):
      self._issue(acc_ref, buf)
      return acc_ref[...]

    self._add(pl.run_scoped(dq_of_block, plgpu.ACC((self.stream.block_q, self.cols),
                                                   jnp.float32)), j, q_head)

  def finish(self):
    if self.shared:  # the other consumer's last dQ wgmma reads this one's K tile
      plgpu.barrier_arrive(self.stream.smem["ds_ready"])
      plgpu.barrier_wait(self.stream.smem["ds_ready"])


# --- the dK/dV kernel ------------------------------------------------------------------------

def _dkv_kernel(*refs, spec: MaskSpec, positions: PositionInputs, scale: float, softcap,
                block_q: int, block_kv: int, stages: int, group: int, fuse_dq: bool,
                fold_stats: bool, self_fed: bool, q_layout: ContiguousQ,
                addressing: ContiguousKV, **smem):
  n_in = 6 + positions.n_refs + fuse_dq
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *extra), (dk_ref, dv_ref) = (
      refs[:n_in], refs[n_in:])
  row_refs, col_refs, scalar_refs, ranges_ref, bias_ref, rest = positions.split(extra)
  k_smem, v_smem, q_smem, do_smem = smem["k"], smem["v"], smem["q"], smem["do"]
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("heads")
  wg = lax.axis_index("wg")
  tile = lax.axis_index("kv_tiles")
  cta_k = tile * (mp.CONSUMERS * block_kv)
  c_lo, c_hi = _dkv_cta_blocks(spec, ranges_ref, batch, kv_head, tile, cta_k, group=group,
                               block_q=block_q, block_kv=block_kv,
                               n_q_blocks=q_ref.shape[1] // block_q)
  n_blocks = c_hi - c_lo  # per query head; the stream covers `group` heads
  stream = _QStream(refs=(q_ref, do_ref, lse_ref, delta_ref), q_layout=q_layout,
                    row_refs=row_refs, smem=smem,
                    positions=positions, batch=batch, kv_head=kv_head, group=group,
                    c_lo=c_lo, c_hi=c_hi, n_blocks=n_blocks, n_steps=group * n_blocks,
                    block_q=block_q, stages=stages, descending=spec.right is not None,
                    bias=bias_ref, key_start=cta_k, block_kv=block_kv)
  dtype = q_ref.dtype
  head_dim = q_ref.shape[-1]
  feed = (_SelfFeed if self_fed else _ProducerFeed)(stream, wg)
  stats = _FoldedStats(stream, scale) if fold_stats else _LoadedStats(stream, positions)
  dq_cols = fused_dq_columns(head_dim)
  grads = (_FusedDq(stream, rest[0], wg, dtype, dq_cols, shared=dq_cols < head_dim)
           if fuse_dq else _DkvOnly(stream))

  @pl.when(wg < mp.CONSUMERS)
  def _consumer():
    feed.start()
    k_start = cta_k + wg * block_kv
    keys = (batch, pl.ds(k_start, block_kv), kv_head)
    my = lambda ref: ref.at[wg]
    kv_ready = smem["kv_ready"].at[wg]
    plgpu.copy_gmem_to_smem(addressing.tile(k_ref, batch, kv_head, k_start, block_kv),
                            my(k_smem), kv_ready)
    plgpu.copy_gmem_to_smem(addressing.v_tile(v_ref, batch, kv_head, k_start, block_kv),
                            my(v_smem), kv_ready)
    mp.copy_vectors(col_refs, [my(b) for b in positions.buffers(smem, COL)], batch, k_start,
                    block_kv, kv_ready)
    plgpu.barrier_wait(kv_ready)
    # transposed scores: keys on rows, so the key vectors are per row here
    col_vectors = positions.load(smem, COL, my, mp.ROW)
    shape = (block_kv, block_q)
    static_own = q_block_range(spec, k_start, block_kv, block_q)

    def over_head(g, carry):
      q_head = kv_head * group + g
      scalars = positions.read_scalars(scalar_refs, batch, q_head)

      def step(j, carry, masked):
        dk, dv = carry
        feed.refill(stream.position(g, j))
        slot = stream.slot(stream.position(g, j))
        stream.wait(slot)
        s_init, dp_init = stats.inits(slot, shape)
        def tile_at():
          row_vectors = _slot_vectors(positions, smem, ROW, masked, slot)
          return Tile(shape, 1, j * block_q, k_start, batch, q_head, row_vectors, col_vectors,
                      scalars)

        at = None
        if bias_ref is not None:
          # Its [block_q, block_kv] tile, read transposed, starts Sᵀ (over the scale, so
          # that the logits are scale Sᵀ): no registers beside the accumulators for it.
          at = tile_at()
          bias = positions.bias_tile(at, mp.load(smem["bias"].at[slot, wg].transpose((1, 0)),
                                                 plgpu.Layout.WGMMA)).bias
          s_init = bias * (1.0 / scale)
        s_t, dp_t = _wgmma_pair(s_init, my(k_smem), q_smem.at[slot].transpose((1, 0)),
                                dp_init, my(v_smem), do_smem.at[slot].transpose((1, 0)))
        at = tile_at() if at is None else at
        s_t, c, g_t = _masked_logits(positions, spec, s_t, scale, softcap, at, masked)
        p_t, ds_t, kept = stats.weights(s_t, c, dp_t, g_t, slot, at)
        p_lo, ds_lo = p_t.astype(dtype), ds_t.astype(dtype)
        if positions.dropout:  # selected in 16 bits, as in the forward
          p_lo = jnp.where(kept, p_lo, jnp.zeros((), dtype))
        return grads.accumulate(dk, dv, p_lo, ds_lo, slot, g, j, q_head)

      def skip(j):
        feed.refill(stream.position(g, j))
        slot = stream.slot(stream.position(g, j))
        stream.wait(slot)
        stream.release(slot)
        grads.skip(g, j, q_head, shape)

      own, masked_runs = own_blocks(static_own, spec.masked_q_runs, ranges_ref, batch, q_head,
                                    tile, wg)
      return mp.visit_blocks((c_lo, c_hi), own, step, skip, carry, stream.descending,
                             masked_runs)

    dk, dv = lax.fori_loop(0, group, over_head, (_zeros((block_kv, head_dim)),
                                                 _zeros((block_kv, v_ref.shape[-1]))))
    grads.finish()
    my(k_smem)[...] = (dk * scale).astype(dtype)
    my(v_smem)[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(my(k_smem), dk_ref.at[keys], commit_group=False)
    plgpu.copy_smem_to_gmem(my(v_smem), dv_ref.at[keys], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  feed.run_producer()


@dataclasses.dataclass(frozen=True)
class BackwardLayout:
  """Where the backward kernels read their rows: Q and dO by ``q_layout``
  (``hopper.addressing``: ``ContiguousQ`` or ``DilatedQ``), K and V by
  ``kv_addressing`` (one without extra inputs), with ``group`` query heads per KV head
  of the kernels (None: Q's heads over K's). dQ, dK, dV and the row statistics are
  laid out plainly, per the kernels' heads."""

  q_layout: ContiguousQ = ContiguousQ()
  kv_addressing: ContiguousKV = ContiguousKV()
  group: int | None = None

  def group_of(self, q_heads: int, k) -> int:
    return q_heads // k.shape[2] if self.group is None else self.group

  @property
  def plain(self) -> bool:
    return self == BackwardLayout()


def _barrier(n, arrivals=1):
  return plgpu.Barrier(num_arrivals=arrivals, num_barriers=n)


def dq_scratch(dtype, d: int, dv: int, block_q: int, block_kv: int, stages: int,
               row_dtypes: tuple = (), col_dtypes: tuple = (), bias_dtype=None,
               writes_ds: bool = False) -> dict:
  """The dQ kernel's shared memory: each consumer's Q and dO tiles with their row
  statistics, ``stages`` K and V slots, the barriers, the per-position vectors
  (``PositionInputs.scratch``) and, with a ``bias_dtype``, a dense bias's tile per slot
  and consumer (and where it ``writes_ds``, each consumer's dS tile on its way out)."""
  smem = dict(
      q=mp.tile_smem((mp.CONSUMERS, block_q, d), dtype),
      do=mp.tile_smem((mp.CONSUMERS, block_q, dv), dtype),
      lse=plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
      delta=plgpu.SMEM((mp.CONSUMERS, block_q), jnp.float32),
      k=mp.tile_smem((stages, block_kv, d), dtype),
      v=mp.tile_smem((stages, block_kv, dv), dtype),
      rows_ready=_barrier(mp.CONSUMERS, 4 + len(row_dtypes)),
      k_ready=_barrier(stages, 1 + len(col_dtypes) + (bias_dtype is not None) * mp.CONSUMERS),
      v_ready=_barrier(stages),
      k_free=_barrier(stages, mp.CONSUMERS), v_free=_barrier(stages, mp.CONSUMERS))
  smem.update(PositionInputs.scratch(row_dtypes, col_dtypes, (mp.CONSUMERS, block_q),
                                     (stages, block_kv)))
  if bias_dtype is not None:
    smem["bias"] = mp.tile_smem((stages, mp.CONSUMERS, block_q, block_kv), bias_dtype)
    if writes_ds:
      smem["ds"] = mp.tile_smem((mp.CONSUMERS, block_q, block_kv), bias_dtype)
  return smem


def dkv_scratch(dtype, d: int, dv: int, block_q: int, block_kv: int, stages: int,
                row_dtypes: tuple = (), col_dtypes: tuple = (), fuse_dq: bool = False,
                bias_dtype=None) -> dict:
  """The dK/dV kernel's shared memory: each consumer's K and V tiles, ``stages`` Q and
  dO slots with their row statistics, the barriers, the per-position vectors, with
  ``fuse_dq`` the dS tiles and float32 dQ tile of the fused dQ, and with a
  ``bias_dtype`` a dense bias's ``[block_q, block_kv]`` tile per slot and consumer."""
  smem = dict(
      k=mp.tile_smem((mp.CONSUMERS, block_kv, d), dtype),
      v=mp.tile_smem((mp.CONSUMERS, block_kv, dv), dtype),
      q=mp.tile_smem((stages, block_q, d), dtype),
      do=mp.tile_smem((stages, block_q, dv), dtype),
      lse=plgpu.SMEM((stages, block_q), jnp.float32),
      delta=plgpu.SMEM((stages, block_q), jnp.float32),
      kv_ready=_barrier(mp.CONSUMERS, 2 + len(col_dtypes)),
      q_ready=_barrier(stages, 4 + len(row_dtypes) + (bias_dtype is not None) * mp.CONSUMERS),
      q_free=_barrier(stages, mp.CONSUMERS))
  smem.update(PositionInputs.scratch(row_dtypes, col_dtypes, (stages, block_q),
                                     (mp.CONSUMERS, block_kv)))
  if bias_dtype is not None:
    smem["bias"] = mp.tile_smem((stages, mp.CONSUMERS, block_q, block_kv), bias_dtype)
  if fuse_dq:
    smem.update(ds=mp.tile_smem((2, mp.CONSUMERS, block_kv, block_q), dtype),
                dq=mp.tile_smem((mp.CONSUMERS, block_q, fused_dq_columns(d)), jnp.float32),
                ds_ready=plgpu.Barrier(num_arrivals=mp.CONSUMERS))
  return smem


def mosaic_dq(q, k, v, do, lse2, delta, inputs=(), *, spec: MaskSpec, scale: float,
              block_q: int, block_kv: int, stages: int, softcap: float | None = None,
              positions: PositionInputs = PositionInputs(), layout: BackwardLayout = BackwardLayout(),
              writes_ds: bool = False):
  """dQ kernel on padded inputs (see :func:`mosaic_backward`); returns ``dq``
  ``[batch, q_len_p, heads, d]`` (``writes_ds``, with a dense bias: ``(dq, ds)``, dS
  ``[batch, heads, q_len_p, kv_len_p]`` in the bias's dtype). ``inputs``: the
  per-position arrays of ``positions``, ranges per ``block_q`` query block."""
  batch, q_len_p, _, d = q.shape
  q_heads = layout.q_layout.n_heads(q)
  stages = max(1, min(stages, k.shape[1] // block_kv))
  bias_dtype = positions.bias_dtype(inputs)
  writes_ds = writes_ds and bias_dtype is not None
  smem = dq_scratch(q.dtype, d, v.shape[-1], block_q, block_kv, stages,
                    *positions.vector_dtypes(inputs), bias_dtype, writes_ds)
  out_type = jax.ShapeDtypeStruct((batch, q_len_p, q_heads, d), q.dtype)
  if writes_ds:
    out_type = (out_type,
                jax.ShapeDtypeStruct((batch, q_heads, q_len_p, k.shape[1]), bias_dtype))
  return mp.kernel(
      functools.partial(_dq_kernel, spec=spec, positions=positions, scale=scale,
                        softcap=softcap, block_q=block_q, block_kv=block_kv, stages=stages,
                        group=layout.group_of(q_heads, k), q_layout=layout.q_layout,
                        addressing=layout.kv_addressing),
      out_type=out_type,
      scratch_types=smem,
      grid=(q_heads, q_len_p // (mp.CONSUMERS * block_q), batch),
      grid_names=("heads", "q_tiles", "batch"),
  )(q, k, v, do, lse2, delta, *inputs)


def mosaic_dkv(q, k, v, do, lse2, delta, inputs=(), dq_acc=None, *, spec: MaskSpec,
               scale: float, block_q: int, block_kv: int, stages: int,
               softcap: float | None = None, positions: PositionInputs = PositionInputs(),
               layout: BackwardLayout = BackwardLayout()):
  """dK/dV kernel on padded inputs (see :func:`mosaic_backward`); returns ``(dk, dv)``
  ``[batch, kv_len_p, heads / group, d]``. ``inputs``: the per-position arrays of
  ``positions``, ranges per ``block_kv`` key block over ``block_q`` query blocks.
  ``dq_acc``: a zeroed float32 ``Ref`` shaped like ``q``: the kernel also adds each
  block's ``dS K`` into it (TMA reduce-add, so the sum order varies run to run)."""
  batch, q_len_p, _, d = q.shape
  q_heads = layout.q_layout.n_heads(q)
  kv_len_p = k.shape[1]
  group = layout.group_of(q_heads, k)
  kv_heads = q_heads // group
  stages = max(1, min(stages, group * (q_len_p // block_q)))
  fuse_dq = dq_acc is not None
  smem = dkv_scratch(q.dtype, d, v.shape[-1], block_q, block_kv, stages,
                     *positions.vector_dtypes(inputs), fuse_dq, positions.bias_dtype(inputs))
  # Folding lse and delta into the accumulators' initial values frees their registers
  # (``_FoldedStats``); plain logits only, and not for wider heads, where it spills.
  wide = d + v.shape[-1] > MOSAIC_MODELLED_BWD_WIDTH
  fold_stats = (not positions.transforms and softcap is None and not positions.dropout
                and not wide)
  # Wider heads drop the producer warpgroup, for the consumers' registers (``_SelfFeed``);
  # up to dk + dv = 256 the kernel with a producer is at least as fast.
  self_fed = wide and not fuse_dq
  body = functools.partial(_dkv_kernel, spec=spec, positions=positions, scale=scale,
                           softcap=softcap, block_q=block_q, block_kv=block_kv, stages=stages,
                           group=group, fuse_dq=fuse_dq, fold_stats=fold_stats,
                           self_fed=self_fed, q_layout=layout.q_layout,
                           addressing=layout.kv_addressing)
  out_type = (jax.ShapeDtypeStruct((batch, kv_len_p, kv_heads, d), k.dtype),
              jax.ShapeDtypeStruct((batch, kv_len_p, kv_heads, v.shape[-1]), v.dtype))
  grid = dict(grid=(kv_heads, kv_len_p // (mp.CONSUMERS * block_kv), batch),
              grid_names=("heads", "kv_tiles", "batch"))
  args = (q, k, v, do, lse2, delta, *inputs)
  if fuse_dq:
    return mp.kernel_writing_ref(body, out_type=out_type, scratch_types=smem, **grid)(
        *args, dq_acc)
  return mp.kernel(body, out_type=out_type, scratch_types=smem, producer=not self_fed,
                   **grid)(*args)


# The dK/dV kernel reads a dense bias's tiles transposed from shared memory, which jax
# 0.10's Mosaic GPU lowering refuses ("Can't transpose the swizzled dimension").
BIAS_TILES_SUPPORTED = jax.__version_info__ >= (0, 11)

# The fused dQ writes a ``jax.Ref`` under ``custom_vmap``, which jax 0.10 cannot
# discharge ("no state discharge rule for custom_vmap_call", lowering on jax 0.10.2).
FUSED_DQ_SUPPORTED = jax.__version_info__ >= (0, 11)


def _fold_vmap_into_batch(fn):
  """``fn(*arrays)`` whose arrays all lead with the batch axis, made ``vmap``-able by
  folding the mapped axis into that batch axis (batch rows are independent). The
  fused kernel writes through a ``Ref``, which ``plgpu.kernel``'s own rule does not map."""
  fn = jax.custom_batching.custom_vmap(fn)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, mapped in zip(args, in_batched)]
    outs = fn(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
    return (tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs),
            (True,) * len(outs))

  return fn


def mosaic_backward(q, k, v, do, lse2, delta, dq_inputs=(), dkv_inputs=(), *, spec: MaskSpec,
                    scale: float, blocks: tuple[int, int, int, int], stages: int,
                    fused_dq: bool = False, softcap: float | None = None,
                    positions: PositionInputs = PositionInputs(),
                    layout: BackwardLayout = BackwardLayout(), writes_ds: bool = False):
  """Runs the Hopper backward kernels on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, d_p]``, do: ``[..., dv_p]``; k: ``[batch, kv_len_p,
      kv_heads, d_p]``, v: ``[..., dv_p]``.
    lse2: ``[batch, q_heads, q_len_p]`` float32 log-sum-exp in base-2 units.
    delta: ``[batch, q_heads, q_len_p]`` float32, ``rowsum(o * do) - dlse``.
      With dropout (``positions.dropout``) both carry ``1 / (1 - rate)``
      (``dropout.backward_rows``).
    blocks: ``(block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv)``; lengths are
      padded so that ``2 * block_q_dq`` and ``block_q_dkv`` divide ``q_len_p``, and
      ``block_kv_dq`` and ``2 * block_kv_dkv`` divide ``kv_len_p``.
    dq_inputs, dkv_inputs: the per-position arrays of ``positions``
      (``hopper.inputs``) of each kernel (their ranges differ).
    softcap: the forward's soft-cap of the scaled logits, or None.
    fused_dq: False: a dQ kernel and a dK/dV kernel, bitwise repeatable. True: the
      dK/dV kernel alone, adding each block's dQ into an fp32 buffer (5 matmuls per
      block pair instead of 7; the sum order varies run to run); every per-position
      array must then lead with the batch axis.
    layout: where the kernels read Q, dO, K and V (``BackwardLayout``): other than
      plain, a dilated pair's views, read in place; then no ``positions`` and no
      ``fused_dq``, and ``lse2``, ``delta`` and the gradients hold the kernels' heads
      (``layout.q_layout.n_heads(q)`` query heads, those over ``layout.group`` for dK
      and dV).

  Returns:
    ``(dq, dk, dv)``, shaped like ``q, k, v`` where the layout is plain; with
    ``writes_ds`` and a dense bias (``positions.bias``), also dS ``[batch, heads,
    q_len_p, kv_len_p]`` in the bias's dtype (the dQ kernel writes it).
  """
  if not layout.plain and (fused_dq or positions != PositionInputs()):
    raise ValueError("the backward kernels read a non-plain layout without per-position "
                     "inputs and without the fused dQ")
  if fused_dq and positions.bias is not None:
    raise ValueError("the fused dQ takes no dense bias (its dQ kernel writes dS)")
  if fused_dq and not FUSED_DQ_SUPPORTED:
    raise ValueError(f"the fused dQ (config.fused_dq) needs jax >= 0.11, got {jax.__version__}")
  bq_dq, bkv_dq, bq_dkv, bkv_dkv = blocks
  args = (q, k, v, do, lse2, delta)
  dkv = functools.partial(mosaic_dkv, spec=spec, scale=scale, block_q=bq_dkv,
                          block_kv=bkv_dkv, stages=stages, softcap=softcap, positions=positions,
                          layout=layout)
  if fused_dq:
    @_fold_vmap_into_batch
    def fused(*arrays):
      dq_acc = jax.new_ref(jnp.zeros(arrays[0].shape, jnp.float32))
      dk, dv = dkv(*arrays[:6], arrays[6:], dq_acc)
      return (dq_acc[...] * scale).astype(arrays[0].dtype), dk, dv

    return tuple(fused(*args, *dkv_inputs))
  dq = mosaic_dq(*args, dq_inputs, spec=spec, scale=scale, block_q=bq_dq, block_kv=bkv_dq,
                 stages=stages, softcap=softcap, positions=positions, layout=layout,
                 writes_ds=writes_ds)
  dk, dv = dkv(*args, dkv_inputs)
  if writes_ds and positions.bias is not None:
    dq, ds = dq
    return dq, dk, dv, ds
  return dq, dk, dv
