"""Flash attention's forward on Hopper: the online softmax as a row rule of the shared
forward kernel (``jattn.kernels.hopper.forward``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, LN2, LOG2E, log2_units
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import ContiguousKV, TransposedValuesKV
from jattn.kernels.hopper.forward import ConsumerRows, Rows, rows_forward
from jattn.kernels.hopper.inputs import PositionInputs


@dataclasses.dataclass(frozen=True)
class SoftmaxRows:
  """Flash attention's row rule: the online softmax (``softmax.online_softmax_step``'s:
  the running max in the logits' units, each weight ``exp2((s - m) * c)``), with the
  mask (segment ids, a mask function) and the score transform (soft-cap, a score
  function) of ``positions`` applied to the logits, and its dropout of the weights;
  saves the log-sum-exp (natural log; ``EMPTY_ROW_LSE`` for rows that see no key,
  whose output is zeros).

  ``descaled`` (FP8 inputs): the logits are ``q kᵀ`` times a per-head ``logit_scale``
  (the descales of q and k) besides ``scale``, and the output is times a per-head
  ``value_scale`` (V's descale); both positive, so the running max of the raw products
  stays the max of the logits. The weights multiplied with V are cast to the inputs'
  dtype as they stand (in ``(0, 1]``, where E4M3 needs no scale of its own)."""

  spec: MaskSpec
  scale: float
  softcap: float | None = None
  positions: PositionInputs = PositionInputs()
  sinks: bool = False  # reads ``[q_heads]`` float32 sink logits
  descaled: bool = False  # reads ``[q_heads]`` float32 logit_scale, then value_scale

  @property
  def n_inputs(self) -> int:  # kernel inputs the rule reads
    return int(self.sinks) + 2 * int(self.descaled)

  reduces = True  # the row max (``hopper.forward.forward_smem_bytes``)

  def mma_row_sums(self, dtype) -> bool:
    """Whether the denominator sums the weights V meets, on the tensor cores
    (``rows_forward``): for bfloat16 inputs without dropout (whose denominator counts
    the dropped weights too). Not in float16, whose range the weights' exponent may
    leave (below), nor in FP8, whose recipe sums the float32 weights."""
    return jnp.dtype(dtype) == jnp.bfloat16 and not self.positions.dropout

  def bind(self, inputs, t: ConsumerRows) -> Rows:
    # (a dense bias's logits are the scaled ones plus the bias: natural units)
    c = LOG2E if self.positions.bias is not None else log2_units(
        self.scale, self.positions.score is not None or self.softcap is not None)
    mma_sums = self.mma_row_sums(t.dtype)
    value_scale = None
    if self.descaled:
      logit_scale, value_scale = (x[t.head] for x in inputs[int(self.sinks):])
      c = c * logit_scale

    def update(s, stats, j, masked, tile):
      m, l = stats
      s, _, _ = self.positions.logits(s, self.scale, self.softcap, tile)
      if masked:
        s = self.positions.apply_mask(s, self.spec, tile)
      m_next = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2((m - m_next) * c)
      if self.descaled or mma_sums:
        # One FFMA per weight, FlashAttention-3's form. The top weight is 2^e, e the
        # rounding of m * c (|e| <= ulp(m * c) / 2): the row sums of the very bf16
        # weights V meets cancel it (a one-hot row's output is its value exactly) while
        # |m * c| < 2^31; past that, 2^e may leave bf16's range (NaN or zero rows, see
        # finish). FP8 sums float32 weights, so its top weight is e4m3(2^e) over 2^e:
        # under 0.3% off while |m * c| < 2^16, out of e4m3's range from 2^27.
        # float16's range ends at 2^16 (|m * c| >= 2^28 would do it): it subtracts first.
        # (m * c floored at float32's lowest: a row that has seen no key, m = -1e30,
        # under a scale past 3.4e8 would otherwise meet -inf - -inf.)
        mc = jnp.maximum(m_next * c, -3.4e38)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(mc, s.shape, [0]))
      else:  # the max subtracted first: a saturated row's top weight is exactly 1
        p = jnp.exp2((s - lax.broadcast_in_dim(m_next, s.shape, [0])) * c)

      def late(stats):
        m, l = stats
        return m, l * alpha + (0.0 if mma_sums else p.sum(axis=1))

      # Dropout: the denominator counts every weight, V meets the kept ones (selected
      # in 16 bits: half the registers of an fp32 copy of the tile).
      p_v = p.astype(t.dtype)
      if self.positions.dropout:
        p_v = jnp.where(self.positions.kept(tile), p_v, jnp.zeros((), t.dtype))
      return p_v, alpha, (m_next, l), late

    def finish(acc, stats, row_sums=None):
      m, l = stats
      if row_sums is None:
        empty = l == 0.0
      else:
        l = l + row_sums
        # A row that saw keys yet sums to 0 lost its weights to bf16's range (logits
        # past 2^31 / c): it keeps l = 0, so its output is NaN, not an empty row's zeros
        # (one whose sum overflows instead, or that a sink keeps above 0, gives zeros).
        empty = (l == 0.0) & (m == EMPTY_ROW_LSE)
      l_safe = jnp.where(empty, 1.0, l)
      # Dropout scales the kept weights by 1 / (1 - rate).
      l_out = l_safe * (1.0 - self.positions.dropout) if self.positions.dropout else l_safe
      row_scale = 1.0 / l_out if value_scale is None else value_scale / l_out
      o = acc * lax.broadcast_in_dim(row_scale, acc.shape, [0])
      return o, jnp.where(empty, EMPTY_ROW_LSE, m * (c * LN2) + jnp.log(l_safe))

    if self.sinks:  # every row's denominator starts at exp(sink)
      init = (mp.row_vector(inputs[0][t.head] * (LOG2E / c), t.block_q),
              mp.row_vector(1.0, t.block_q))
    else:
      init = (mp.row_vector(EMPTY_ROW_LSE, t.block_q), mp.row_vector(0.0, t.block_q))
    return Rows(init, update, finish)


def mosaic_forward(q, k, v, inputs=(), *, spec: MaskSpec, scale: float, block_q: int,
                   block_kv: int, stages: int, softcap: float | None = None,
                   persistent: bool | None = None,
                   positions: PositionInputs = PositionInputs(), sinks=None, descales=None,
                   out_dtype=None):
  """Flash attention's Hopper forward kernel on padded inputs (see ``rows_forward``):
  ``(o, lse)``, ``lse: [batch, q_heads, q_len_p]`` float32 in natural log.
  ``inputs``: the per-position arrays of ``positions``; ``sinks``: ``[q_heads]``
  float32 or None. FP8: ``descales = (logit_scale, value_scale)``, each ``[q_heads]``
  float32 (``SoftmaxRows``), with ``v: [batch, kv_heads, dv_p, kv_len_p]`` transposed;
  ``out_dtype``: the output's (default q's)."""
  rule = SoftmaxRows(spec, scale, softcap, positions, sinks is not None, descales is not None)
  inputs = (tuple(inputs) + (() if sinks is None else (sinks,))
            + (() if descales is None else tuple(descales)))
  addressing = ContiguousKV() if descales is None else TransposedValuesKV()
  return rows_forward(q, k, v, inputs, rule=rule,
                      spec=spec, block_q=block_q, block_kv=block_kv, stages=stages,
                      persistent=persistent, positions=positions, addressing=addressing,
                      out_dtype=out_dtype)
