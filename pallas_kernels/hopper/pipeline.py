"""The warp-specialised pipeline every Hopper kernel shares: warpgroup roles, the TMA
ring of shared-memory slots and its barrier protocol, the block walk, the launch.

Every kernel runs three warpgroups per CTA: two consumers, each owning one tile
of rows and issuing wgmma, and one producer that streams the other operand's
tiles into a ring of shared-memory slots with TMA (the wide-head dK/dV kernel
drops the producer: its first consumer feeds the ring, ``feed_first_slots`` and
``refeed``). A slot has a ``ready``
barrier (the copy landed) and a ``free`` barrier (both consumers are done with
it). Consumers walk the CTA's block range in the same order; blocks outside a
consumer's own range are *skipped*: it still waits and arrives on the slot's
barriers, because barrier phases are tracked per thread and must stay in step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from jattn.kernels.hopper.addressing import ContiguousKV

CONSUMERS = 2  # consumer warpgroups per CTA; the producer is warpgroup 2
PRODUCER = CONSUMERS
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232

ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per accumulator row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per accumulator column


def operand_swizzle(cols: int, dtype) -> int:
  """The swizzle (bytes) of a wgmma operand tile with ``cols`` columns of ``dtype``:
  128 where a row holds at least 128 bytes (every 16-bit tile here; 8-bit ones of 128
  columns or more), else the row's bytes (64 for 8-bit tiles of 64 columns)."""
  return min(128, cols * jnp.dtype(dtype).itemsize)


def tile_smem(shape, dtype):
  """Shared memory for wgmma operands (and tiles stored for TMA): swizzled tiles of
  8 rows by one swizzle width (``operand_swizzle``: 128 bytes, or a narrow 8-bit
  row's width)."""
  swizzle = operand_swizzle(shape[-1], dtype)
  tiling = (8, swizzle // jnp.dtype(dtype).itemsize)
  return plgpu.SMEM(shape, dtype,
                    transforms=(plgpu.TilingTransform(tiling), plgpu.SwizzleTransform(swizzle)))


# An 8-bit wgmma takes its A operand from registers as 4 consecutive columns per thread
# and 16-column group; an accumulator-shaped tile gives a thread columns (2i, 2i + 1, 8 +
# 2i, 9 + 2i) of each group (i = lane % 4). Read as they lie, those registers are the
# operand of the tile's columns reordered by ``EIGHT_BIT_KEY_ORDER``: a B operand whose
# rows (keys) come in that order within each group of 16 gives the product unchanged.
EIGHT_BIT_KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


def eight_bit_values(v):
  """``v: [batch, keys, heads, d]`` (keys a multiple of 16) as the 8-bit PV takes it:
  ``[batch, heads, d, keys]``, keys fastest (an 8-bit wgmma reads B only so), in
  ``EIGHT_BIT_KEY_ORDER`` within each group of 16. One transpose: the reorder is a
  reshape of the key axis into ``(group, a, i, b)`` read as ``(group, i, a, b)``, key
  ``8a + 2i + b`` going to place ``4i + 2a + b``."""
  batch, keys, heads, d = v.shape
  v = v.reshape(batch, keys // 16, 2, 4, 2, heads, d)
  return v.transpose(0, 5, 6, 1, 3, 2, 4).reshape(batch, heads, d, keys)


def eight_bit_operand(p):
  """An accumulator-shaped 8-bit tile ``p`` (``[64 * m, cols]``, the WGMMA layout) as an
  8-bit wgmma's A operand from registers, without moving a value: its columns come
  reordered by ``EIGHT_BIT_KEY_ORDER`` within each group of 16 (B's rows must be too)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  def reinterpret(ctx, tile):
    del ctx
    old = tile.registers
    shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape(tile.shape)
    if old.shape != (shape[0], 2 * shape[1], *shape[2:]):
      raise NotImplementedError(f"unexpected register shapes {old.shape} -> {shape}")
    new = np.empty(shape, dtype=object)
    for idx in np.ndindex(shape):
      pair = [old[(idx[0], 2 * idx[1] + h, *idx[2:])] for h in (0, 1)]
      new[idx] = mgpu_utils.vector_concat(pair)
    return mgpu.FragmentedArray(_registers=new, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return reinterpret(p)


def row_vector(value, rows: int):
  """A float32 value (a constant or a traced scalar) per accumulator row, in the
  ``ROW`` layout (a bare constant would take a layout the kernel cannot store)."""
  return plgpu.layout_cast(jnp.full((rows,), value, jnp.float32), ROW)


def iota(shape, dim, offset):
  """int32 positions along ``dim`` of a wgmma-accumulator-shaped tile."""
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA) + offset


def produce(n_steps, stages: int, streams, first_slot_use=0):
  """Producer warpgroup: issues step ``i``'s copies into slot ``(first_slot_use + i) %
  stages``.

  ``streams`` is a list of ``(copy, ready, free)``: ``copy(i, slot, barrier)``
  issues the TMA copies of step ``i`` (0-based) completing on ``barrier``; a slot
  is refilled only after the consumers arrived on its ``free`` barrier.
  ``first_slot_use``: how many steps the ring already carried (a persistent kernel's
  earlier work items), so that slots and barrier phases run on.
  """

  def fill(i, carry):
    use = first_slot_use + i
    slot = lax.rem(use, jnp.int32(stages))
    for copy, ready, free in streams:
      @pl.when(use >= stages)  # the slot's earlier contents were consumed
      def _():
        plgpu.barrier_wait(free.at[slot])
      copy(i, slot, ready.at[slot])
    return carry

  lax.fori_loop(jnp.int32(0), n_steps, fill, None)


def feed_first_slots(n_steps, stages: int, copy, ready, feeder):
  """A ring without a producer, fed by one of its consumers (where ``feeder`` is true):
  before the consumers' loop, the copies of steps ``0 .. stages - 1`` (those below
  ``n_steps``); ``copy`` and ``ready`` as in ``produce``'s streams. ``refeed`` goes on."""
  @pl.when(feeder)
  def _():
    for slot in range(stages):
      @pl.when(slot < n_steps)
      def _():
        copy(jnp.int32(slot), slot, ready.at[slot])


def refeed(pos, n_steps, stages: int, copy, ready, free, feeder):
  """A ring without a producer, at stream position ``pos`` of every consumer (before
  it waits for that step): where ``feeder`` (true in the one consumer that feeds the
  ring), refills the slot of step ``pos - 1`` with step ``pos - 1 + stages`` once every
  consumer arrived on its ``free`` barrier. Refilling one step behind keeps the
  consumers at most a step apart."""
  @pl.when(feeder & (pos >= 1) & (pos - 1 + stages < n_steps))
  def _():
    slot = lax.rem(pos - 1, jnp.int32(stages))
    plgpu.barrier_wait(free.at[slot])
    copy(pos - 1 + stages, slot, ready.at[slot])


def shared_index(ref, axis: int, index):
  """``index`` into ``ref``'s ``axis``, or 0 where that axis is 1 (values shared, e.g.
  by every batch row or head)."""
  return index if ref.shape[axis] > 1 else 0


def copy_vectors(refs, smems, b, start, size: int, barrier, h=None):
  """TMA copies of ``ref[b, start:start + size]`` of each ``[B', length]`` per-position
  array in ``refs`` (``ref[b, h, start:start + size]`` of a ``[B', H', length]`` one)
  into the matching one of ``smems``, completing on ``barrier``."""
  for ref, smem in zip(refs, smems):
    head = (shared_index(ref, 1, h),) if ref.ndim == 3 else ()
    plgpu.copy_gmem_to_smem(ref.at[shared_index(ref, 0, b), *head, pl.ds(start, size)], smem,
                            barrier)


def produce_kv(k_ref, v_ref, k_smem, v_smem, barriers, *, batch, head, group: int,
               first_block, n_steps, block_kv: int, stages: int, cols=((), ()),
               first_slot_use=0, addressing=ContiguousKV(), tiles=None):
  """Producer of the forward and dQ kernels: K and V tiles of KV head ``head // group``,
  blocks ``first_block + i``; ``barriers = (k_ready, v_ready, k_free, v_free)``.
  ``cols = (refs, smems)``: the key-position inputs ``[B', kv_len_p]``
  (``hopper.inputs``) and their ``[stages, block_kv]`` buffers, copied with each K tile
  (its ready barrier counts those copies too); ``tiles(key_start, slot, barrier)``
  issues more copies with each K tile (a dense bias's), or None. ``first_slot_use`` as ``produce``;
  ``addressing``: a bound K/V addressing (``addressing``), where the tiles lie. The
  caller lowers the warpgroup's registers."""
  kv_head = lax.div(head, jnp.int32(group))
  k_ready, v_ready, k_free, v_free = barriers

  def copy_from(ref, smem, tile, with_cols=False):
    def copy(i, slot, barrier):
      start = (first_block + i) * block_kv
      plgpu.copy_gmem_to_smem(tile(ref, batch, kv_head, start, block_kv), smem.at[slot],
                              barrier)
      if with_cols:
        copy_vectors(cols[0], [smem.at[slot] for smem in cols[1]], batch, start, block_kv,
                     barrier)
        if tiles is not None:
          tiles(start, slot, barrier)
    return copy

  produce(n_steps, stages,
          [(copy_from(k_ref, k_smem, addressing.tile, True), k_ready, k_free),
           (copy_from(v_ref, v_smem, addressing.v_tile), v_ready, v_free)], first_slot_use)


def visit_blocks(cta_range, own_range, step, skip, carry, descending: bool = False,
                 masked_runs: tuple[bool, bool] = (True, True)):
  """Consumer loop over blocks ``[c_lo, c_hi)`` of the CTA, in order (from ``c_hi - 1``
  down with ``descending``; the producer must stream the blocks in the same order).

  ``own_range = (lo, full_lo, full_hi, hi)`` (from ``masking.kv_block_range`` or
  ``q_block_range``) says which blocks this consumer needs, and which of those
  need the element mask. ``step(j, carry, masked)`` computes block ``j``;
  ``skip(j)`` keeps the barriers in step for a block this consumer does not need.
  ``masked_runs``: whether masked blocks can come before / after the unmasked ones
  (``MaskSpec.masked_kv_runs``); a side that cannot has no loop, so no copy of the
  masked step's code.
  """
  c_lo, c_hi = cta_range
  lo, full_lo, full_hi, hi = clamp_own(own_range, c_lo, c_hi)

  def skipped(j, carry):
    skip(j)
    return carry

  masked = lambda j, c: step(j, c, True)
  runs = [(c_lo, lo, skipped), (lo, full_lo, masked if masked_runs[0] else None),
          (full_lo, full_hi, lambda j, c: step(j, c, False)),
          (full_hi, hi, masked if masked_runs[1] else None), (hi, c_hi, skipped)]
  runs = [run for run in runs if run[2] is not None]
  for start, stop, body in reversed(runs) if descending else runs:
    if descending:
      carry = lax.fori_loop(0, stop - start, lambda i, c, stop=stop, body=body:
                            body(stop - 1 - i, c), carry)
    else:
      carry = lax.fori_loop(start, stop, body, carry)
  return carry


def clamp_own(own_range, c_lo, c_hi):
  """A consumer's ``(lo, full_lo, full_hi, hi)`` restricted to the CTA's blocks
  ``[c_lo, c_hi)``: the blocks ``visit_blocks`` computes, and which of them masked."""
  return tuple(jnp.minimum(jnp.maximum(x, c_lo), c_hi) for x in own_range)


def clamp_range(lo, hi, n_blocks: int):
  """Restricts a block range to the ``n_blocks`` blocks that exist in memory."""
  hi = jnp.minimum(hi, jnp.int32(n_blocks))
  return jnp.minimum(lo, hi), hi


# Every Hopper kernel's warpgroups: the consumers, then the producer, named "wg".
_WARPGROUPS = dict(num_threads=CONSUMERS + 1, thread_name="wg")


def kernel(body, *, out_type, scratch_types, grid, grid_names, producer: bool = True):
  """``plgpu.kernel`` with the consumer/producer warpgroups and compiler parameters
  every Hopper kernel here uses (``producer=False``: the consumers alone, a body that
  issues its own copies)."""
  warpgroups = dict(_WARPGROUPS, num_threads=CONSUMERS + producer)
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch_types, grid=grid,
                      grid_names=grid_names, compiler_params=compiler_params(), **warpgroups)


def kernel_writing_ref(body, *, out_type, scratch_types: dict, grid, grid_names):
  """A consumer/producer kernel like ``kernel``'s, for a body that also writes
  into a mutable ``jax.Ref`` operand: ``plgpu.kernel`` wraps its launch in a vmap
  rule that loses a Ref's write effect, so this launches through ``pl.kernel``. Not
  ``vmap``-able itself."""
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, **_WARPGROUPS)

  def with_scratch(*refs):
    pl.run_scoped(functools.partial(body, *refs), collective_axes="wg", **scratch_types)

  return pl.kernel(with_scratch, out_type=out_type, mesh=mesh,
                   compiler_params=compiler_params())


# jax before 0.11 requires ``plgpu.load``'s index; later ones deprecate passing it.
_LOAD_INDEX = ((),) if jax.__version_info__ < (0, 11) else ()


def load(ref, layout):
  """The whole of ``ref`` in registers, in ``layout``."""
  return plgpu.load(ref, *_LOAD_INDEX, layout=layout)


# What Mosaic GPU allocates per CTA beside the buffers' own bytes (jax's Mosaic GPU
# lowering): each buffer starts on a 1 KiB boundary, a kernel that reduces across a
# warpgroup reserves ``CompilerParams.reduction_scratch_bytes`` (the default, 2 KiB)
# and every barrier takes 8 bytes.
SMEM_ALIGNMENT = 1024
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4
BARRIER_BYTES = 8


def stand_in_dtype(nbytes: int):
  """A dtype of ``nbytes`` bytes per value, for counting buffers before inputs exist."""
  return jnp.dtype({1: jnp.float8_e4m3fn, 2: jnp.bfloat16, 4: jnp.float32}[nbytes])


def smem_bytes(scratch: dict, reduces: bool = True) -> int:
  """The shared memory Mosaic GPU allocates for a kernel's ``scratch_types`` (its
  ``plgpu.SMEM`` buffers, ``RefUnion`` s and ``Barrier`` s), as its own check counts
  them: ``reduces`` where the kernel body reduces across a warpgroup (a row max or
  sum), which reserves the reduction scratch."""
  align = lambda n: -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
  size = lambda ref: int(np.prod(ref.shape)) * jnp.dtype(ref.dtype).itemsize
  total = REDUCTION_SCRATCH_BYTES if reduces else 0
  for x in scratch.values():
    if isinstance(x, plgpu.Barrier):
      total += BARRIER_BYTES * int(np.prod(x.num_barriers))
    elif isinstance(x, plgpu.RefUnion):
      total += align(max(size(member) for member in x.refs))
    else:
      total += align(size(x))
  return total


def num_sms() -> int:
  """Streaming multiprocessors of the GPU kernels run on: a persistent kernel's CTAs
  (132, an H100's, where no GPU is attached: tracing only)."""
  try:
    return jax.local_devices(backend="gpu")[0].core_count
  except RuntimeError:
    return 132


def compiler_params():
  # approx_math: exp2 and reciprocals on the MUFU fast path, as the softmax needs.
  return plgpu.CompilerParams(approx_math=True)
