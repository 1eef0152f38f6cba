"""Parallel retention's forward on Hopper: the shared forward kernel of
``jattn.kernels.hopper.forward`` (producer warpgroup, two ping-ponging consumers,
wgmma from shared memory) with retention's row rule instead of the softmax.

Each score tile is weighed by the decay ``scale · γ^(n-m)``. Key blocks wholly at or
before a consumer's first row ``n0`` take it as ``γ^(n0-m)``, a per-key vector, and
the per-row ``γ^(n-n0)`` joins the accumulator once, at the first block on the
diagonal; diagonal blocks build the exact masked decay (as the Triton kernel,
``triton_parallel.py``, does). The saved row statistic is the denominator
(``abs_sum_denominator``; ones without ``normalize``), what the Triton backward
kernels take.

Non-finite values: the masked decay is selected, not multiplied, so a non-finite
score past the diagonal stays out. A masked weight still meets, in the P·V wgmma, the
V rows of keys its row does not see (0 · inf = NaN), and those V tiles sit in shared
memory that rows on both sides of the key read: a non-finite value reaches the earlier
rows of its diagonal block, the one exception to the rule (as in the Hopper flash
kernels; docs/flash_attention.md). A guard on the host costs more than it is worth
(docs/retention.md has the measurements).

Packed sequences (``cu_seqlens``) ride on the per-position inputs flash attention's
segment ids use (``hopper.inputs``): the sequence ids as row and col vectors, and the
key blocks each query block's sequences reach as block ranges; every visited block
then builds the exact decay, 0 across sequences.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.tiling import pad_to, tile_axis
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.budget import mosaic_head_dim
from jattn.kernels.hopper.forward import ConsumerRows, Rows, rows_forward
from jattn.kernels.hopper.inputs import PositionInputs, position_arrays, segment_ranges
from jattn.kernels.retention.packing import sequence_ids
from jattn.kernels.retention.triton_parallel import abs_sum_denominator


@dataclasses.dataclass(frozen=True)
class DecayRows:
  """Retention's row rule (causal ``spec`` without a window; with ``spec.segments``,
  the tiles' first row and col vectors are sequence ids); reads ``log2 γ`` per head
  (``[heads]`` float32)."""

  spec: MaskSpec
  scale: float
  normalize: bool
  n_inputs = 1

  def mma_row_sums(self, dtype) -> bool:
    del dtype
    return False  # its denominator sums |s|, not the weights

  @property
  def reduces(self) -> bool:  # rows reduce for the abs-sum denominator only
    return self.normalize

  def bind(self, inputs, t: ConsumerRows) -> Rows:
    (log2_decay_ref,) = inputs
    lg = log2_decay_ref[t.head]
    log2_scale = math.log2(self.scale)
    q_first = t.q_start + self.spec.offset  # the first row's absolute position
    _, _, first_masked, hi = t.own
    rows = plgpu.broadcasted_iota(jnp.int32, (t.block_q,), 0, layout=mp.ROW)
    row_decay = jnp.exp2(rows.astype(jnp.float32) * lg)  # γ^(n - n0), <= 1
    cols = plgpu.broadcasted_iota(jnp.int32, (t.block_kv,), 0, layout=mp.COL)

    def joins(flag):
      """The rows' own factor where the scalar ``flag`` holds, else ones."""
      return 1.0 + (row_decay - 1.0) * flag.astype(jnp.float32)

    def update(s, stats, j, masked, tile):
      (den,) = stats
      k_first = j * t.block_kv
      acc_scale = None
      if masked:
        dist = mp.iota(s.shape, 0, q_first) - mp.iota(s.shape, 1, k_first)
        visible = dist >= 0
        if self.spec.segments:
          visible = visible & (tile.row(0) == tile.col(0))
        # Above the diagonal (or across sequences) the weight may overflow to inf and
        # the score be non-finite: selected away, never multiplied.
        s = jnp.where(visible, s * jnp.exp2(dist.astype(jnp.float32) * lg + log2_scale),
                      0.0)
        acc_scale = joins(j == first_masked)
        den = den * acc_scale
      else:
        w = jnp.exp2((q_first - k_first - cols).astype(jnp.float32) * lg + log2_scale)
        s = s * lax.broadcast_in_dim(w, s.shape, [1])
      if self.normalize:
        den = den + jnp.abs(s).sum(axis=1)
      return s.astype(t.dtype), acc_scale, (den,), None

    def finish(acc, stats):
      (den,) = stats
      row_scale = joins(hi == first_masked)  # no diagonal block: the factor joins here
      den = den * row_scale
      den = abs_sum_denominator(den) if self.normalize else mp.row_vector(1.0, t.block_q)
      return acc * lax.broadcast_in_dim(row_scale / den, acc.shape, [0]), den

    return Rows((mp.row_vector(0.0, t.block_q),), update, finish)


def retention_mosaic_forward(q, k, v, log2_decay, *, scale: float, normalize: bool,
                             block_q: int, block_kv: int, stages: int,
                             persistent: bool | None = None, cu_seqlens=None):
  """Parallel retention ``O = (scale · Q Kᵀ ⊙ D) V`` on Hopper.

  Args:
    q, k: ``[batch, q_len, heads, dk]`` / ``[batch, kv_len, heads, dk]``; v:
      ``[batch, kv_len, heads, dv]``; float16 or bfloat16, head dims up to 256;
      log2_decay ``[heads]`` float32 (log2 γ, <= 0).
    normalize: divide rows by ``max(Σ|S|, 1)``.
    block_q, block_kv, stages, persistent: the forward kernel's tiles (``block_q`` per
      consumer warpgroup), ring depth and schedule (``hopper.forward.rows_forward``).
    cu_seqlens: ``[num_seqs + 1]`` int, or None: packed sequences (batch 1,
      ``q_len == kv_len``), each row seeing its own only.

  Returns:
    ``(o, den)`` as ``retention_parallel_forward``: ``o: [batch, q_len, heads, dv]``
    in q's dtype, ``den: [batch, heads, q_len]`` float32.
  """
  q_len, kv_len = q.shape[1], k.shape[1]
  dk, dv = q.shape[-1], v.shape[-1]
  _, q_len_p = tile_axis(q_len, (mp.CONSUMERS * block_q,), clamp=False)
  _, kv_len_p = tile_axis(kv_len, (block_kv,), clamp=False)
  # Zero-padded keys add nothing, so only causality (and the sequences) restrict the blocks.
  packed = cu_seqlens is not None
  spec = MaskSpec.build(q_len, kv_len, causal=True, local_window=None, kv_padded=False,
                        segments=packed)
  positions = PositionInputs(segments=packed, ranges=packed)
  inputs = ()
  if packed:
    ids = sequence_ids(cu_seqlens, q_len)[None]
    segments = (pad_to(ids, q_len_p), pad_to(ids, kv_len_p))
    # Every visited block masked: the decay rule joins its per-row factor at the first
    # masked block (DecayRows), which must be the first block visited.
    inputs = position_arrays(positions, segments, ranges=segment_ranges(
        *segments, q_len, kv_len, block_q, block_kv, uniform=False),
        padded=(q_len_p, kv_len_p))
  dk_p, dv_p = mosaic_head_dim(dk), mosaic_head_dim(dv)
  o, den = rows_forward(pad_to(q, q_len_p, dk_p), pad_to(k, kv_len_p, dk_p),
                        pad_to(v, kv_len_p, dv_p), inputs + (log2_decay.astype(jnp.float32),),
                        rule=DecayRows(spec, scale, normalize), spec=spec, block_q=block_q,
                        block_kv=block_kv, stages=stages, persistent=persistent,
                        positions=positions)
  return o[:, :q_len, :, :dv], den[:, :, :q_len]
