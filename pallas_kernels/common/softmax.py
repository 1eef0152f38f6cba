"""The softmax arithmetic every attention kernel shares: matmuls in the precision
each dtype needs, the online softmax (init, step, finish), the merge of two partial
results of the same rows, the logit transform (scale, soft-cap, base-2 exponent)
and the backward's row term. Pure jnp: it runs inside kernels and on the host."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.element_functions import TileFunction
from jattn.kernels.common.tiling import pad_rows

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Stand-in for -inf in the saved log-sum-exp of rows that see no key: finite, so
# that merging or subtracting it never produces NaN.
EMPTY_ROW_LSE = -1e30
# The log-sum-exp the backward gives padded query rows when a score function runs:
# their probabilities are then 0 whatever the function makes of their (zero) logits.
PADDED_ROW_LSE = 1e30


def dot(a, b, contract_a: int, contract_b: int, fast_fp32: bool = False):
  """2-D matmul contracting ``a``'s and ``b``'s given axes, accumulating in fp32.

  fp32 operands use IEEE fp32 products (not TF32), so fp32 calls are as exact as
  the reference; ``fast_fp32`` uses three TF32 products instead (Triton's tf32x3:
  relative error near 1e-7, on the tensor cores; compiled GPU kernels only, as
  XLA on the CPU has no such dot).
  """
  precision = None
  if a.dtype == jnp.float32:
    precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if fast_fp32 else lax.Precision.HIGHEST
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)


def online_softmax_init(rows: int, width: int, sink=None, c: float = 1.0):
  """Carry ``(acc, m, l)`` of the online softmax before the first key tile; ``sink``
  (a scalar logit, natural units) starts every row's denominator at ``exp(sink)``. The
  running max ``m`` is in the units of the logits the steps take (``s``, with ``s * c``
  in base 2)."""
  acc = jnp.zeros((rows, width), jnp.float32)
  if sink is None:
    return acc, jnp.full((rows,), EMPTY_ROW_LSE, jnp.float32), jnp.zeros((rows,), jnp.float32)
  m = jnp.full((rows,), 1.0, jnp.float32) * (sink.astype(jnp.float32) * (LOG2E / c))
  return acc, m, jnp.ones((rows,), jnp.float32)


def floor_sinks(sinks):
  """Sink logits as every backend takes them: float32, at least ``EMPTY_ROW_LSE``. A sink
  at or below it (-inf included) is no sink: its weight is 0 and empty rows take the
  usual ``EMPTY_ROW_LSE`` (in the kernels a -inf running max would make the first
  rescale ``exp2(-inf - -inf)``). A sink of +inf or NaN becomes NaN: as in the dense
  formula (``exp(inf) / exp(inf)``), every row of its head is NaN."""
  sinks = sinks.astype(jnp.float32)
  # (a select, not a maximum: autodiff gives a maximum's tie at the floor half a gradient)
  floored = jnp.where(sinks <= EMPTY_ROW_LSE, EMPTY_ROW_LSE, sinks)
  return jnp.where(jnp.isposinf(sinks), jnp.nan, floored)


# A row whose log-sum-exp (or largest bias) is beyond this many nats from 0 loses
# gradient precision in float32: the backward's weights exp(s - lse) carry the lse's
# rounding, half an ulp (2e-6 at 64, 3e-5 at 1e3), amplified by dS's cancellation.
LARGE_ROW = 64.0


def shared_row_shift(peaks, axes: tuple = ()):
  """What is taken off rows of a dense bias (``flex.bias_score``'s, window attention's),
  float32, no gradient. ``peaks``: each row's largest logit (its log-sum-exp will do)
  over the keys it sees, not finite for a row that sees none; rows along ``axes`` share
  one bias row, and so one shift (``axes`` are kept, of size 1).

  A constant shift of a row changes neither the softmax nor any gradient, but keeps the
  row's log-sum-exp small: the kernels keep it in float32 and the backward recomputes
  the weights from it, so a row of ``-1e9`` (an additive padding mask) would lose its
  ``log(sum)`` and get gradients off by up to ``kv_len``-fold. A shift must lie between
  0 and the row's peak: past the peak the logits the row sees lose their digits to it
  (a row's largest bias value at a key its mask hides is no shift for it). So rows
  that share a shift take the peak nearest 0 where all their peaks have one sign, else
  0; and a shift within ``LARGE_ROW`` of 0 is 0."""
  peaks = jax.lax.stop_gradient(peaks).astype(jnp.float32)
  seen = jnp.isfinite(peaks)
  lo = jnp.min(jnp.where(seen, peaks, jnp.inf), axis=axes, keepdims=True)
  hi = jnp.max(jnp.where(seen, peaks, -jnp.inf), axis=axes, keepdims=True)
  shift = jnp.where(jnp.isfinite(lo) & (lo > 0), lo,
                    jnp.where(jnp.isfinite(hi) & (hi < 0), hi, 0.0))
  return jnp.where(jnp.abs(shift) > LARGE_ROW, shift, 0.0)


def unshifted_lse(lse, shift):
  """The log-sum-exp of logits from that of the logits less ``shift`` (float32, shaped
  as ``lse``: one per row); rows that saw no key keep ``EMPTY_ROW_LSE``."""
  return jnp.where(lse == EMPTY_ROW_LSE, lse, lse + shift)


def exact_empty_rows(lse):
  """``lse`` with the rows that saw no key at exactly ``EMPTY_ROW_LSE``: a sink at the
  floor (no sink) passes through the kernels' base-2 units, which round it by an ulp."""
  near = jnp.abs(lse - EMPTY_ROW_LSE) <= 1e-6 * -EMPTY_ROW_LSE
  return jnp.where(near, jnp.asarray(EMPTY_ROW_LSE, lse.dtype), lse)


def online_softmax_step(carry, s, c, v, fast_fp32: bool = False, kept=None):
  """Folds one key tile into ``(acc, m, l)``: logits ``s`` (``[rows, keys]``, -inf where
  masked) with ``s * c`` in base-2 units, and values ``v: [keys, width]`` (``fast_fp32``
  as in ``dot``); ``kept``: dropout's keep-mask of the tile (the denominator counts every
  weight, the output only the kept ones).

  A saturated row (one weight 1, the rest 0) gives its key's value exactly: the
  backward's ``rowsum(o * dO)`` must cancel that key's ``dP``, or dQ is off by an ulp of
  ``o`` times ``|k|``. Two things see to it. Each weight is ``exp2((s - m) * c)``, the
  running max ``m`` in the units of ``s``: the subtraction comes first, so the largest
  logit weighs exactly 1 (``s * c - m * c`` fused into one FMA leaves it off by the
  rounding of ``m * c``: 2^e with ``|e|`` up to half an ulp of ``m * c``, which passes
  1 at ``|m * c| >= 2^24``). And the denominator sums the weights as the PV matmul
  takes them (in v's dtype), so the output is a convex combination of v whatever the
  weights are (a compiler may also compute ``s`` twice, once for the max and once for
  the weights, rounded differently: XLA on the CPU does, in interpret mode)."""
  acc, m_prev, l_prev = carry
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
  alpha = jnp.exp2((m_prev - m_next) * c)
  p = jnp.exp2((s - m_next[:, None]) * c).astype(v.dtype)
  l_next = l_prev * alpha + jnp.sum(p.astype(jnp.float32), axis=1)
  if kept is not None:
    p = jnp.where(kept, p, jnp.zeros((), p.dtype))
  acc = acc * alpha[:, None] + dot(p, v, 1, 0, fast_fp32)
  return acc, m_next, l_next


def online_softmax_finish(carry, c: float = 1.0):
  """``(o, lse)`` from the final carry (``c`` as the steps took it): o float32, lse in
  natural log; rows that saw no key give zeros and ``EMPTY_ROW_LSE``."""
  acc, m, l = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  return acc / l_safe[:, None], jnp.where(empty, EMPTY_ROW_LSE,
                                          m * (c * LN2) + jnp.log(l_safe))


def merge_weights(lse1, lse2):
  """Weights of two partial results of the same rows in their online-softmax merge,
  and the merged ``lse`` (``EMPTY_ROW_LSE`` where a part saw no key): ``(w1, w2, lse)``,
  all shaped like ``lse1``."""
  top = jnp.maximum(lse1, lse2)
  w1, w2 = jnp.exp(lse1 - top), jnp.exp(lse2 - top)
  total = w1 + w2
  return w1 / total, w2 / total, top + jnp.log(total)


def merge_partials(o1, lse1, o2, lse2, expand=lambda w: w[:, None]):
  """Online-softmax merge of two partial results of the same rows: ``o`` float32 and
  ``lse`` (see ``merge_weights``). ``expand`` lays a per-row weight (shaped like
  ``lse``) out against ``o`` (default: rows first, ``[rows, d]``). Returns the merged
  ``(o, lse)``."""
  w1, w2, lse = merge_weights(lse1, lse2)
  return o1 * expand(w1) + o2 * expand(w2), lse


def combine_partials(o, lse, axis: int, sink=None):
  """Merges partial results of the same rows along ``axis`` (split-KV decoding): ``o``
  float32 ``[..., parts, rows, d]`` and ``lse`` ``[..., parts, rows]`` (``axis``
  indexing the parts in both; ``EMPTY_ROW_LSE`` for a part that saw no key), and
  optionally ``sink`` logits (broadcastable to ``lse`` without its parts axis)
  counted once in each row's denominator. Returns ``(o, lse)`` without the parts
  axis; rows no part saw give zeros and ``EMPTY_ROW_LSE`` (the sink's logit with one)."""
  top = jnp.max(lse, axis=axis)
  if sink is not None:
    top = jnp.maximum(top, sink)
  weights = jnp.exp(lse - jnp.expand_dims(top, axis))
  total = jnp.sum(weights, axis=axis) + (0.0 if sink is None else jnp.exp(sink - top))
  o = jnp.sum(o * jnp.expand_dims(weights / jnp.expand_dims(total, axis), -1), axis=axis)
  lse = jnp.where(top > EMPTY_ROW_LSE, top + jnp.log(total), top)
  return o, lse


@dataclasses.dataclass(frozen=True)
class Softcap:
  """The soft-cap score transform ``cap * tanh(x / cap)`` (Gemma 2)."""

  cap: float

  @classmethod
  def of(cls, cap: float | None) -> "Softcap | None":
    """The transform of a cap, or None for no cap."""
    return None if cap is None else cls(cap)

  def apply(self, x, index, with_grad: bool):
    # tanh through exp2: the Hopper kernels' approximate tanh (2^-11 relative) would
    # put errors of |logit| * 5e-4 into the logits; exp2 and the division are exact
    # to ~2^-22 there. Overflow of the exp2 gives t = 1, as it should.
    t = 1.0 - 2.0 / (1.0 + jnp.exp2(x * (2.0 * LOG2E / self.cap)))
    return self.cap * t, (1.0 - t * t) if with_grad else None


@dataclasses.dataclass(frozen=True)
class ScoreFunction:
  """A user score function ``f(score, b, h, q_idx, kv_idx)`` evaluated on a tile
  (``index``: broadcastable ``(b, h, q_idx, kv_idx)``), reading ``arrays`` (refs
  inside a kernel); its derivative in the score by forward-mode autodiff."""

  fn: TileFunction
  arrays: tuple = ()

  def apply(self, x, index, with_grad: bool):
    f = lambda x: self.fn(self.arrays, x, *index).astype(jnp.float32)
    if not with_grad or getattr(self.fn, "unit_slope", False):  # slope 1: g is None
      return f(x), None
    return jax.jvp(f, (x,), (jnp.ones_like(x),))


def log2_units(scale: float, transformed: bool) -> float:
  """The ``c`` of ``log2_logits``: what its logits are multiplied by into base 2
  (``transformed``: a score transform is applied, and its logits are base 2 already)."""
  return 1.0 if transformed else scale * LOG2E


def log2_logits(qk, scale: float, score=None, index=None, with_grad: bool = False):
  """Raw q.k products -> ``(s, c, g)`` with ``s * c`` the logits in base-2 units.

  Without a score transform ``s`` is ``qk`` itself and the multiply by ``c`` is left
  to the caller, where it fuses with the max subtraction. With one (``Softcap``,
  ``ScoreFunction``) applied to the scaled logits ``x = qk * scale`` (at ``index``),
  ``c = 1`` and ``g = d score / d x`` where ``with_grad`` (the backward's chain rule).
  """
  if score is None:
    return qk, log2_units(scale, False), None
  y, g = score.apply(qk * scale, index, with_grad)
  return y * LOG2E, log2_units(scale, True), g


def logit_grad(ds, g):
  """d(loss)/d(scaled logit) from d(loss)/d(transformed score)."""
  return ds if g is None else ds * g


# How far below the saved log-sum-exp the backward places it, relative to its size: a
# few float32 ulps. The backward recomputes each logit in other tiles (another summation
# order; the Hopper dK/dV kernel starts its accumulators at -lse) and reads the lse
# through a change of base, each off by an ulp or two; at logits of 1e6 and beyond an
# ulp is worth more than 1 in the exponent, and a saturated row's weight of 1 would come
# back as 2^-64 (or 2^64). Lowered by the allowance and clamped (``backward_probs``),
# the top weights come back as exactly 1 for one add on the host and one min per weight
# (cheaper in the kernels than a compare-and-select); the others grow by at most
# 2^(2^-21 |lse|): 1 + 2e-6 at |lse| = 5, a few percent past 1e5, where float32
# resolves the logits no better.
LSE_ALLOWANCE = 2.0 ** -21


def backward_lse(lse, length: int, score_function: bool):
  """The saved natural-log ``lse`` ``[batch, heads, q_len]`` as the backward kernels read
  it: in base-2 units, lowered by ``LSE_ALLOWANCE`` of itself, padded to ``length`` rows;
  with a score function, padded rows get ``PADDED_ROW_LSE`` (their probabilities are
  then 0 whatever the function makes of their logits)."""
  q_len = lse.shape[-1]
  lse2 = lse * LOG2E
  lse2 = pad_rows(lse2 - jnp.abs(lse2) * LSE_ALLOWANCE, length)
  return lse2.at[..., q_len:].set(PADDED_ROW_LSE) if score_function and length != q_len else lse2


def backward_probs(x, dropout_rate: float = 0.0):
  """The backward's recomputed weights ``exp2(x)`` from ``x = logits - lse2`` in base-2
  units (``lse2`` as ``backward_lse`` gives it), clamped to the largest weight a softmax
  gives: 1, or ``1 / (1 - rate)`` where dropout's factor is folded into the lse
  (``dropout.backward_rows``)."""
  cap = -math.log2(1.0 - dropout_rate) if dropout_rate else 0.0
  return jnp.exp2(jnp.minimum(x, cap))


def backward_delta(o, do, dlse):
  """``rowsum(o * do) - dlse`` as ``[batch, heads, q_len]`` float32.

  d(lse)/d(logits) is the softmax itself, so a cotangent on the returned lse
  folds into the row term that dS subtracts.
  """
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
  return delta - dlse.astype(jnp.float32)
