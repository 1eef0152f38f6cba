"""Packed sequences (``cu_seqlens``) as the retention kernels read them.

Positions ``[cu_seqlens[i], cu_seqlens[i + 1])`` hold sequence ``i``; a query sees
only the keys of its own sequence. Sequence ids never decrease along the positions, so
"key ``m`` lies in the sequence of query ``n >= m``" is ``m >= start[n]``, and also
``n < end[m]``, with ``start`` / ``end`` the first position of a position's sequence
and one past its last. The query-side kernels (forward, dQ, chunk outputs) read
``start`` per row, the key-side one (dK/dV) ``end`` per key: one int per position, and
a tile's first and last entries bound the blocks it visits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def sequence_ids(cu_seqlens, length: int):
  """``[length]`` int32: how many of the starts ``cu_seqlens[1:-1]`` lie at or before
  each position (a scatter and a prefix sum). For ``cu_seqlens`` from 0 to ``length``,
  non-decreasing, the index of the position's sequence; whatever the values, the ids
  never decrease (positions before ``cu_seqlens[0]`` join the first sequence, those
  from ``cu_seqlens[-1]`` on the last), which is all the kernels rely on."""
  starts = jnp.clip(jnp.asarray(cu_seqlens)[1:-1].astype(jnp.int32), 0, length)
  return jnp.cumsum(jnp.zeros(length + 1, jnp.int32).at[starts].add(1)[:length])


def sequence_bounds(ids):
  """``(start, end)``, ``[length]`` int32 each: the first position of each position's
  run of equal ``ids`` and one past its last (for non-decreasing sequence ids, its
  sequence's)."""
  length = ids.shape[0]
  pos = jnp.arange(length, dtype=jnp.int32)
  change = ids[1:] != ids[:-1]
  first = jnp.concatenate([jnp.ones(1, bool), change])
  last = jnp.concatenate([change, jnp.ones(1, bool)])
  start = lax.cummax(jnp.where(first, pos, 0))
  end = lax.cummin(jnp.where(last, pos + 1, length), reverse=True)
  return start, end


def padded_bound(bound, length: int):
  """A ``[length']`` start or end array as a ``[1, length]`` kernel input, the padding
  repeating the last entry: padded positions then join the last sequence, so a tile's
  last entry still bounds its rows (they hold zeros and are dropped)."""
  return jnp.pad(bound, (0, length - bound.shape[0]), mode="edge")[None]


def final_states(k, v, log2_decay, states, cu_seqlens, chunk: int):
  """Each packed sequence's state after its last position, ``[num_seqs, heads, dk, dv]``
  float32 (zeros for an empty sequence), from the states before every chunk.

  Args:
    k: ``[1, length, heads, dk]``; v: ``[1, length, heads, dv]``; log2_decay ``[heads]``.
    states: ``[chunks, heads, dk, dv]`` float32: ``states[c]`` is the state after
      position ``c * chunk - 1``, of the sequence holding it (zeros for ``c = 0``).

  The state after position ``p`` of a sequence that starts at ``b``, in the chunk
  starting at ``c0``: ``γ^(p-c0+1) states[c]`` where ``b < c0``, plus
  ``Σ_{max(b, c0) <= m <= p} γ^(p-m) k_mᵀ v_m``: one chunk's keys per sequence.
  """
  length = k.shape[1]
  ids = sequence_ids(cu_seqlens, length)
  seqs = jnp.arange(jnp.shape(cu_seqlens)[0] - 1, dtype=jnp.int32)
  begin = jnp.searchsorted(ids, seqs, side="left").astype(jnp.int32)
  end = jnp.searchsorted(ids, seqs, side="right").astype(jnp.int32)
  last = jnp.maximum(end - 1, 0)
  c0 = last // chunk * chunk
  pos = c0[:, None] + jnp.arange(chunk, dtype=jnp.int32)  # [seqs, chunk]
  inside = ((pos >= begin[:, None]) & (pos <= last[:, None]))[..., None, None]
  weights = jnp.exp2(jnp.where(inside[..., 0], last[:, None, None] - pos[..., None], 0)
                     * log2_decay)  # [seqs, chunk, heads]
  rows = jnp.minimum(pos, length - 1)
  # Selected, not multiplied: keys of other sequences may hold an inf.
  k_w = jnp.where(inside, k[0, rows].astype(jnp.float32) * weights[..., None], 0.0)
  v_in = jnp.where(inside, v[0, rows].astype(jnp.float32), 0.0)
  carried = jnp.exp2((last - c0 + 1)[:, None] * log2_decay)[..., None, None] * states[last // chunk]
  carried = jnp.where((begin < c0)[:, None, None, None], carried, 0.0)
  out = carried + jnp.einsum("nchk,nchv->nhkv", k_w, v_in, precision="highest")
  return jnp.where((end > begin)[:, None, None, None], out, 0.0)
