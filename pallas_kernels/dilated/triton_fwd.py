"""Dilated attention forward kernel for one (w, r) pair (Triton-lowered Pallas), and
the pair's geometry, loops and block specs that the gradient kernels (``triton_bwd``)
share.

The inputs are viewed, without a copy, as ``[batch, S / r, r, heads, D]``: row ``m``
of slot ``o`` is sequence position ``m * r + o``. Head ``h`` takes slot ``h mod r``
(LongNet's head offsets), so its dilated rows are contiguous rows ``m`` of that slot,
and a segment of ``w`` positions is ``L = w / r`` consecutive rows. Every kernel
therefore works on plain row tiles of that view; a row ``m`` may attend to rows of
its own segment (``m // L``), that exist (``m * r + o < seq``) and, if causal, that
are not later.

Forward: grid (query tiles, batch, heads); online softmax over the key tiles of the
tile's segments, then merged into the running ``(o, lse)`` of the pairs before
(aliased in and out), so the pairs' mixing ``Σ softmax_i(lse_i) O_i`` is built pair by
pair with no per-pair output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.launch import triton_call
from jattn.kernels.common.nonfinite import guard_values
from jattn.kernels.common.softmax import (LOG2E, dot, merge_weights, online_softmax_finish,
                                          online_softmax_init, online_softmax_step)


@dataclasses.dataclass(frozen=True)
class PairGeometry:
  """One pair on the ``[batch, rows, r, heads, D]`` view of a padded sequence."""
  seq: int        # true sequence length (positions >= seq are padding)
  rows: int       # padded length / r
  seg_rows: int   # L = w / r rows per segment
  rate: int       # r
  group: int      # query heads per kv head
  causal: bool
  scale: float

  def valid_rows(self, head):
    """Rows of slot ``head mod r`` that are real positions (traced int32)."""
    offset = _rem(head, self.rate)
    return (self.seq - offset + self.rate - 1) // self.rate

  def mask(self, q_idx, k_idx, head):
    """Which logits of a ``[rows, keys]`` tile may count."""
    keep = (q_idx // self.seg_rows == k_idx // self.seg_rows) & (k_idx < self.valid_rows(head))
    if self.causal:
      keep &= k_idx <= q_idx
    return keep

  def key_range(self, q_start: int, block_q: int):
    """Key rows ``[lo, hi)`` any row of the tile may see."""
    lo = (q_start // self.seg_rows) * self.seg_rows
    hi = ((q_start + block_q - 1) // self.seg_rows + 1) * self.seg_rows
    hi = jnp.minimum(hi, self.rows)
    if self.causal:
      hi = jnp.minimum(hi, q_start + block_q)
    return lo, hi

  def full_key_tiles(self, q_start, block_q: int, block_k: int, head):
    """Key tiles ``[lo, hi)`` that need no mask for any row of the query tile: inside
    its segment, real positions, and (causal) not after its first row. Empty when
    the query tile straddles two segments."""
    seg_lo = (q_start // self.seg_rows) * self.seg_rows
    top = jnp.minimum(jnp.minimum(seg_lo + self.seg_rows, self.rows), self.valid_rows(head))
    if self.causal:
      top = jnp.minimum(top, q_start + 1)
    lo = cdiv(seg_lo, block_k)
    one_segment = (q_start + block_q - 1) // self.seg_rows == q_start // self.seg_rows
    return lo, jnp.where(one_segment, jnp.maximum(lo, top // block_k), lo)

  def full_query_tiles(self, k_start, block_k: int, block_q: int, head):
    """Query tiles ``[lo, hi)`` that need no mask against the key tile (see
    ``full_key_tiles``)."""
    seg_lo = (k_start // self.seg_rows) * self.seg_rows
    bottom = jnp.maximum(seg_lo, k_start + block_k - 1) if self.causal else seg_lo
    lo = cdiv(bottom, block_q)
    hi = jnp.minimum(seg_lo + self.seg_rows, self.rows) // block_q
    ok = (((k_start + block_k - 1) // self.seg_rows == k_start // self.seg_rows)
          & (k_start + block_k <= self.valid_rows(head)))
    return lo, jnp.where(ok, jnp.maximum(lo, hi), lo)

  def query_range(self, k_start: int, block_k: int):
    """Query rows ``[lo, hi)`` that may see any key of the tile."""
    lo = (k_start // self.seg_rows) * self.seg_rows
    if self.causal:
      lo = jnp.maximum(lo, k_start)
    hi = jnp.minimum(((k_start + block_k - 1) // self.seg_rows + 1) * self.seg_rows, self.rows)
    return lo, hi


# Index math on non-negative ints: one hardware divide each, where ``//`` and ``%``
# add sign fix-ups; the divisor takes x's dtype (lax wants equal dtypes, also under x64).
def _rem(x, n: int):
  return lax.rem(x, jnp.asarray(n, x.dtype))


def cdiv(x, n: int):
  """``ceil(x / n)`` of a non-negative traced int."""
  return lax.div(x + (n - 1), jnp.asarray(n, x.dtype))


def iota(n: int, axis: int, shape):
  return lax.broadcasted_iota(jnp.int32, shape, axis) + n


def split_loop(lo, hi, full, body, carry):
  """``body(masked, i, carry)`` over tiles ``[lo, hi)``: tiles in ``full = (f_lo, f_hi)``
  skip the mask (the interior of a segment costs no compares)."""
  f_lo = jnp.clip(full[0], lo, hi)
  f_hi = jnp.clip(full[1], f_lo, hi)
  carry = lax.fori_loop(lo, f_lo, functools.partial(body, True), carry)
  carry = lax.fori_loop(f_lo, f_hi, functools.partial(body, False), carry)
  return lax.fori_loop(f_hi, hi, functools.partial(body, True), carry)


def _forward_kernel(q_ref, k_ref, v_ref, o_in_ref, lse_in_ref, o_ref, lse_ref, *,
                    geo: PairGeometry, block_q: int, block_k: int, fast: bool):
  del o_in_ref, lse_in_ref  # aliased to o_ref / lse_ref
  head = pl.program_id(2)
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  q_idx = iota(q_start, 0, (block_q, 1))

  def body(masked, j, carry):
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = k_ref[cols, :], v_ref[cols, :]
    if masked:  # masked weights must not meet a non-finite value (nonfinite.py)
      k, v = guard_values(k, v)
    s = dot(q, k, 1, 1, fast) * (geo.scale * LOG2E)
    if masked:
      s = jnp.where(geo.mask(q_idx, iota(j * block_k, 1, (1, block_k)), head), s, -jnp.inf)
    return online_softmax_step(carry, s, 1.0, v, fast)

  lo, hi = geo.key_range(q_start, block_q)
  carry = split_loop(lo // block_k, cdiv(hi, block_k),
                      geo.full_key_tiles(q_start, block_q, block_k, head), body,
                      online_softmax_init(block_q, q.shape[-1]))
  o_pair, lse_pair = online_softmax_finish(carry)
  # Merge with the pairs before: weights exp(lse_i - lse) of the running log-sum-exp.
  # The running output is loaded only once its weight is known, so the 128x128 float32
  # tile is not live across the weights' math.
  w_prev, w_pair, lse = merge_weights(lse_ref[...], lse_pair)
  o_ref[...] = o_ref[...] * w_prev[:, None] + o_pair * w_pair[:, None]
  lse_ref[...] = lse


def row_tile(block: int, d: int, rate: int):
  """Rows of slot ``h mod r`` of head ``h`` in a ``[batch, rows, r, heads, d]`` view."""
  return pl.BlockSpec((None, block, None, None, d), lambda i, b, h: (b, i, h % rate, h, 0))


def kv_rows(rows: int, d: int, rate: int, group: int):
  return pl.BlockSpec((None, rows, None, None, d),
                      lambda i, b, h: (b, 0, h % rate, h // group, 0))


def stat_tile(block: int, rate: int):
  """Rows of a ``[batch, heads, rows, r]`` view of a ``[batch, heads, seq]`` statistic."""
  return pl.BlockSpec((None, None, block, None), lambda i, b, h: (b, h, i, h % rate))


def pair_forward(q5, k5, v5, o_acc, lse_acc, *, geo: PairGeometry, block_q: int, block_k: int,
                 num_warps: int, num_stages: int, interpret: bool):
  """Folds one pair into the running mixture.

  Args:
    q5: ``[batch, rows, r, heads, d]``; k5, v5: ``[batch, rows, r, kv_heads, d]``
      (``rows`` a multiple of both tiles); o_acc: ``[batch, rows, r, heads, d]`` float32;
      lse_acc: ``[batch, heads, rows, r]`` float32 (``EMPTY_ROW_LSE`` before any pair).

  Returns:
    the updated ``(o_acc, lse_acc)``.
  """
  batch, rows, rate, heads, d = q5.shape
  kernel = functools.partial(_forward_kernel, geo=geo, block_q=block_q, block_k=block_k,
                             fast=not interpret)
  return triton_call(
      kernel, grid=(rows // block_q, batch, heads),
      in_specs=[row_tile(block_q, d, rate), kv_rows(rows, d, rate, geo.group),
                kv_rows(rows, d, rate, geo.group), row_tile(block_q, d, rate),
                stat_tile(block_q, rate)],
      out_specs=[row_tile(block_q, d, rate), stat_tile(block_q, rate)],
      out_shape=[jax.ShapeDtypeStruct(o_acc.shape, jnp.float32),
                 jax.ShapeDtypeStruct(lse_acc.shape, jnp.float32)],
      input_output_aliases={3: 0, 4: 1}, interpret=interpret, name="jattn_dilated_fwd",
      num_warps=num_warps, num_stages=num_stages,
  )(q5, k5, v5, o_acc, lse_acc)
