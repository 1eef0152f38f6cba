"""Parallel-form retention, flash style: ``O = (scale · Q Kᵀ ⊙ D) V`` tile by tile.

No ``[seq, seq]`` tensor is stored: each program keeps a query tile and walks the key
tiles at or before it (``masking.kv_block_range`` with a causal spec), building the
decay ``D[n, m] = γ^(n-m)`` from positions in registers. There is no softmax, so the
accumulation is a plain sum; with ``normalize="abs_sum"`` the row sums of ``|S|`` are
accumulated too and the row is divided at the end. The backward (dQ kernel and dK/dV
kernel, no atomics) treats that denominator as a constant, as torchscale does.

A non-finite value (inf, NaN) reaches exactly the rows that see it: those come out
NaN, the others exact, in the outputs and in the gradients those rows send back.

Packed sequences (``cu_seqlens``, ``packing.py``): a row sees the keys of its own
sequence only. The query-side kernels read each row's sequence start, the dK/dV kernel
each key's sequence end; key (query) blocks no row (key) of a tile reaches are skipped,
and those some rows reach only in part run masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.launch import (HEAD_SCALAR, row_stat_spec, tile_spec, triton_call,
                                         whole_sequence_spec)
from jattn.kernels.common.masking import MaskSpec, kv_block_range, q_block_range
from jattn.kernels.common.nonfinite import (clear, finite_or, guard_rows, nonfinite_rows,
                                            poison)
from jattn.kernels.common.softmax import dot
from jattn.kernels.common.tiling import pad_to, tile_axis
from jattn.kernels.retention.packing import padded_bound, sequence_bounds, sequence_ids


def abs_sum_denominator(abs_sum):
  """``normalize="abs_sum"``'s row denominator from the row's ``Σ_m |S[n, m]|``:
  ``max(Σ|S|, 1)``, or 1 where the sum is not finite. Such a row sees a non-finite
  value and is NaN already; a NaN denominator would also send NaN, through the
  backward's ``dO / den``, to every input the row sees, even under a zero cotangent."""
  return finite_or(jnp.maximum(abs_sum, 1.0), 1.0)


def _pow(exponent, log2_decay):
  """``γ^exponent`` for int exponents ``>= 0`` (``log2_decay`` = log2 γ)."""
  return jnp.exp2(exponent.astype(jnp.float32) * log2_decay)


def _decayed(s, q_pos, k_pos, log2_decay, same=None):
  """``s · γ^(n-m)`` where the query at ``n`` sees the key at ``m`` (``n >= m``, and
  ``same``: in its sequence), else 0: selected, not multiplied by a 0/1 mask, as a score
  past the diagonal (or in another sequence) may be non-finite."""
  dist = q_pos - k_pos
  visible = dist >= 0 if same is None else (dist >= 0) & same
  return jnp.where(visible, s * _pow(jnp.maximum(dist, 0), log2_decay), 0.0)


def _cdiv(x, d: int):
  return lax.div(x + (d - 1), jnp.int32(d))


def _key_runs(spec: MaskSpec, start_ref, q_start, block_q: int, block_k: int):
  """A query tile's key blocks as ``(unmasked run, masked runs)``, each ``(lo, hi)``.

  Packed (``start_ref``: the tile's rows' sequence starts, non-decreasing): the blocks
  wholly before the first row's start are skipped, those before the last row's run
  masked."""
  lo, full_lo, full_hi, hi = kv_block_range(spec, q_start, block_q, block_k)
  if start_ref is None:
    return (lo, full_hi), ((full_hi, hi),)
  lo = jnp.minimum(jnp.maximum(lo, start_ref[0] // block_k), hi)
  full_lo = jnp.maximum(jnp.maximum(full_lo, _cdiv(start_ref[block_q - 1], block_k)), lo)
  full_lo = jnp.minimum(full_lo, full_hi)
  return (full_lo, full_hi), ((lo, full_lo), (full_hi, hi))


def _query_runs(spec: MaskSpec, end_ref, k_start, block_k: int, block_q: int):
  """A key tile's query blocks as ``(unmasked run, masked runs)`` (``_key_runs``
  transposed). Packed (``end_ref``: the tile's keys' sequence ends): the blocks wholly
  after the last key's sequence are skipped, those after the first key's run masked."""
  lo, full_lo, _, hi = q_block_range(spec, k_start, block_k, block_q)
  if end_ref is None:
    return (full_lo, hi), ((lo, full_lo),)
  hi = jnp.maximum(jnp.minimum(hi, _cdiv(end_ref[block_k - 1], block_q)), lo)
  full_lo = jnp.minimum(full_lo, hi)
  full_hi = jnp.minimum(jnp.maximum(end_ref[0] // block_q, full_lo), hi)
  return (full_lo, full_hi), ((lo, full_lo), (full_hi, hi))


def _times(carry: tuple, factor) -> tuple:
  return tuple(x * factor for x in carry)


def _run_loops(unmasked, masked_runs, step, carry, between):
  """``step`` over the unmasked run, then ``between`` (the factored decay's remaining
  factor) on the carry, then the masked runs."""
  carry = lax.fori_loop(*unmasked, functools.partial(step, masked=False), carry)
  carry = between(carry)
  for lo, hi in masked_runs:
    carry = lax.fori_loop(lo, hi, functools.partial(step, masked=True), carry)
  return carry


# Key blocks wholly at or before a query tile's first row take the decay as a product:
# γ^(n-m) = γ^(n-n0) · γ^(n0-m) with n0 the tile's first query. Both factors are <= 1,
# the per-key one is a [1, block] vector per step, and the per-query one scales the
# accumulator once, after those blocks: one multiply per score instead of an exp2.
# Blocks on the diagonal (and, packed, those that reach before some row's sequence
# start) build the exact masked decay, and guard their rows (nonfinite.py): there a
# masked weight meets the rows of keys (or, in the dK/dV pass, queries) the row does
# not see, and 0 · inf would carry a non-finite value into it.


def _fwd_kernel(q_ref, k_ref, v_ref, log2_decay_ref, start_ref, o_ref, den_ref, *,
                spec: MaskSpec, scale: float, normalize: bool, block_q: int, block_k: int):
  q_first = pl.program_id(0) * block_q + spec.offset
  q = q_ref[...]
  log2_decay = log2_decay_ref[...]
  rows = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  start = None if start_ref is None else start_ref[...][:, None]

  def step(j, carry, masked):
    acc, den = carry
    k_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]
    k_pos = j * block_k + cols
    if masked:
      k, v = guard_rows(k, v)
      same = None if start is None else k_pos >= start
      s = scale * _decayed(dot(q, k, 1, 1), q_first + rows, k_pos, log2_decay, same)
    else:
      s = dot(q, k, 1, 1) * (scale * _pow(q_first - k_pos, log2_decay))
    if normalize:
      den = den + jnp.sum(jnp.abs(s), axis=1, keepdims=True)
    return acc + dot(s.astype(v.dtype), v, 1, 0), den

  runs = _key_runs(spec, start_ref, q_first - spec.offset, block_q, block_k)
  carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
           jnp.zeros((block_q, 1), jnp.float32))
  acc, den = _run_loops(*runs, step, carry, lambda c: _times(c, _pow(rows, log2_decay)))
  den = abs_sum_denominator(den) if normalize else jnp.ones_like(den)
  o_ref[...] = (acc / den).astype(o_ref.dtype)
  den_ref[...] = den[:, 0]


def _dq_kernel(k_ref, v_ref, do_ref, log2_decay_ref, start_ref, dq_ref, *, spec: MaskSpec,
               scale: float, block_q: int, block_k: int):
  q_first = pl.program_id(0) * block_q + spec.offset
  do = do_ref[...]
  log2_decay = log2_decay_ref[...]
  rows = lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  start = None if start_ref is None else start_ref[...][:, None]

  def step(j, dq, masked):
    k_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]
    k_pos = j * block_k + cols
    if masked:
      v, k = guard_rows(v, k)  # the weights dO·vᵀ multiply k
      same = None if start is None else k_pos >= start
      ds = _decayed(dot(do, v, 1, 1), q_first + rows, k_pos, log2_decay, same)
    else:
      ds = dot(do, v, 1, 1) * _pow(q_first - k_pos, log2_decay)
    return dq + dot(ds.astype(k.dtype), k, 1, 0)

  runs = _key_runs(spec, start_ref, q_first - spec.offset, block_q, block_k)
  dq = jnp.zeros((block_q, k_ref.shape[-1]), jnp.float32)
  dq = _run_loops(*runs, step, dq, lambda dq: dq * _pow(rows, log2_decay))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, log2_decay_ref, end_ref, dk_ref, dv_ref, *,
                spec: MaskSpec, scale: float, block_q: int, block_k: int):
  k_start = pl.program_id(0) * block_k
  k_last = k_start + block_k - 1
  k, v = k_ref[...], v_ref[...]
  log2_decay = log2_decay_ref[...]
  # Tiles are kept transposed ([keys, queries]) so no operand needs a transpose.
  keys = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
  cols = lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
  end = None if end_ref is None else end_ref[...][:, None]

  def step(i, carry, masked):
    dk, dv = carry
    q_slice = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q, do = q_ref[q_slice, :], do_ref[q_slice, :]
    q_pos = i * block_q + spec.offset + cols
    if masked:
      # A query row or cotangent that is not finite: NaN weights for the keys it sees,
      # and a zero row where the weights of later keys (masked) multiply it.
      bad = nonfinite_rows(q, do)
      same = None if end is None else q_pos < end
      weigh = lambda x, y: scale * _decayed(dot(x, poison(y, bad), 1, 1), q_pos,
                                            k_start + keys, log2_decay, same)
      s_t, ds_t = weigh(k, q), weigh(v, do)
      q, do = clear(q, bad), clear(do, bad)
    else:
      decay_t = scale * _pow(q_pos - k_last, log2_decay)
      s_t, ds_t = dot(k, q, 1, 1) * decay_t, dot(v, do, 1, 1) * decay_t
    dv = dv + dot(s_t.astype(do.dtype), do, 1, 0)
    return dk + dot(ds_t.astype(q.dtype), q, 1, 0), dv

  runs = _query_runs(spec, end_ref, k_start, block_k, block_q)
  carry = (jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32),
           jnp.zeros((block_k, v_ref.shape[-1]), jnp.float32))
  # Query blocks wholly at or after the key tile's last row: γ^(n-m) = γ^(n-m1)·γ^(m1-m).
  dk, dv = _run_loops(*runs, step, carry, lambda c: _times(c, _pow(block_k - 1 - keys,
                                                                   log2_decay)))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _tiles(config: BlockConfig, q_len: int, kv_len: int):
  """``(q tiles (fwd, dkv, dq), k tiles, q_len_p, kv_len_p, spec)``."""
  c = config
  bq, q_len_p = tile_axis(q_len, (c.block_q, c.block_q_dkv, c.block_q_dq))
  bk, kv_len_p = tile_axis(kv_len, (c.block_k, c.block_k_dkv, c.block_k_dq))
  # Zero-padded keys add nothing, so only causality restricts the blocks.
  spec = MaskSpec.build(q_len, kv_len, causal=True, local_window=None, kv_padded=False,
                        segments=False)
  return bq, bk, q_len_p, kv_len_p, spec


def _bound_input(cu_seqlens, length: int, length_p: int, block: int, side: int):
  """The ``(array, block spec)`` of the sequence starts (``side`` 0) or ends (1) per
  position, in tiles of ``block``; ``(None, None)`` unpacked."""
  if cu_seqlens is None:
    return None, None
  bound = sequence_bounds(sequence_ids(cu_seqlens, length))[side]
  return padded_bound(bound, length_p), pl.BlockSpec((None, block), lambda i, b, h: (0, i))


def retention_parallel_forward(q, k, v, log2_decay, *, scale: float, normalize: bool,
                               config: BlockConfig, interpret: bool, cu_seqlens=None):
  """Parallel retention ``O = (scale · Q Kᵀ ⊙ D) V``, flash style.

  Args:
    q, k: ``[batch, q_len, heads, dk]`` / ``[batch, kv_len, heads, dk]``; v:
      ``[batch, kv_len, heads, dv]``; log2_decay ``[heads]`` float32 (log2 γ).
    normalize: divide rows by ``max(Σ|S|, 1)``.
    cu_seqlens: ``[num_seqs + 1]`` int, or None: packed sequences (batch 1,
      ``q_len == kv_len``; ``packing.py``), each row seeing its own only.

  Returns:
    ``(o, den)``: ``o: [batch, q_len, heads, dv]`` in q's dtype and the row
    denominators ``[batch, heads, q_len]`` float32 (ones without ``normalize``).
  """
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  bq, bk, q_len_p, kv_len_p, spec = _tiles(config, q_len, kv_len)
  dk_p, dv_p = padded_head_dim(q.shape[-1]), padded_head_dim(v.shape[-1])
  c = config
  start, start_spec = _bound_input(cu_seqlens, q_len, q_len_p, bq[0], 0)
  o, den = triton_call(
      functools.partial(_fwd_kernel, spec=spec, scale=scale, normalize=normalize,
                        block_q=bq[0], block_k=bk[0]),
      grid=(q_len_p // bq[0], batch, heads),
      in_specs=[tile_spec(bq[0], dk_p), whole_sequence_spec(kv_len_p, dk_p),
                whole_sequence_spec(kv_len_p, dv_p), HEAD_SCALAR, start_spec],
      out_specs=[tile_spec(bq[0], dv_p), row_stat_spec(bq[0])],
      out_shape=[jax.ShapeDtypeStruct((batch, q_len_p, heads, dv_p), q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, q_len_p), jnp.float32)],
      name="jattn_retention_fwd", interpret=interpret, num_warps=c.num_warps,
      num_stages=c.num_stages,
  )(pad_to(q, q_len_p, dk_p), pad_to(k, kv_len_p, dk_p), pad_to(v, kv_len_p, dv_p), log2_decay,
    start)
  return o[:, :q_len, :, :v.shape[-1]], den[:, :, :q_len]


def retention_parallel_backward(q, k, v, log2_decay, den, do, *, scale: float,
                                config: BlockConfig, interpret: bool, cu_seqlens=None):
  """Gradients ``(dq, dk, dv)`` given the forward's row denominators ``den`` (held
  constant, as torchscale does) and the output's cotangent ``do``; ``cu_seqlens`` as
  the forward's."""
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  bq, bk, q_len_p, kv_len_p, spec = _tiles(config, q_len, kv_len)
  dk_p, dv_p = padded_head_dim(q.shape[-1]), padded_head_dim(v.shape[-1])
  c = config
  # The denominator is a constant: dividing dO by it is the whole of its backward.
  do = (do.astype(jnp.float32) / jnp.swapaxes(den, 1, 2)[..., None]).astype(q.dtype)
  q_p, k_p, v_p = pad_to(q, q_len_p, dk_p), pad_to(k, kv_len_p, dk_p), pad_to(v, kv_len_p, dv_p)
  do_p = pad_to(do, q_len_p, dv_p)
  bwd = dict(interpret=interpret, num_warps=c.bwd_num_warps, num_stages=c.bwd_num_stages)
  start, start_spec = _bound_input(cu_seqlens, q_len, q_len_p, bq[2], 0)
  dq = triton_call(
      functools.partial(_dq_kernel, spec=spec, scale=scale, block_q=bq[2], block_k=bk[2]),
      grid=(q_len_p // bq[2], batch, heads),
      in_specs=[whole_sequence_spec(kv_len_p, dk_p), whole_sequence_spec(kv_len_p, dv_p),
                tile_spec(bq[2], dv_p), HEAD_SCALAR, start_spec],
      out_specs=tile_spec(bq[2], dk_p), out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
      name="jattn_retention_dq", **bwd,
  )(k_p, v_p, do_p, log2_decay, start)
  end, end_spec = _bound_input(cu_seqlens, kv_len, kv_len_p, bk[1], 1)
  dk, dv = triton_call(
      functools.partial(_dkv_kernel, spec=spec, scale=scale, block_q=bq[1], block_k=bk[1]),
      grid=(kv_len_p // bk[1], batch, heads),
      in_specs=[whole_sequence_spec(q_len_p, dk_p), tile_spec(bk[1], dk_p),
                tile_spec(bk[1], dv_p), whole_sequence_spec(q_len_p, dv_p), HEAD_SCALAR,
                end_spec],
      out_specs=[tile_spec(bk[1], dk_p), tile_spec(bk[1], dv_p)],
      out_shape=[jax.ShapeDtypeStruct(k_p.shape, k.dtype),
                 jax.ShapeDtypeStruct(v_p.shape, v.dtype)],
      name="jattn_retention_dkv", **bwd,
  )(q_p, k_p, v_p, do_p, log2_decay, end)
  return (dq[:, :q_len, :, :q.shape[-1]], dk[:, :kv_len, :, :k.shape[-1]],
          dv[:, :kv_len, :, :v.shape[-1]])
