"""Split-KV decoding's packed rows, which both decode kernels (Triton and Hopper) take:
the query heads of one KV head packed into one tile (row ``r``: query position ``r //
group`` of head ``r % group`` of the group), and the merge of the splits' partials."""

from __future__ import annotations

import jax.numpy as jnp

from jattn.kernels.common.softmax import combine_partials, floor_sinks


def full_lengths(lengths, batch: int, q_len: int, kv_len: int):
  """``lengths`` (``[batch, 2]`` int32 per-row ``(q_len, kv_len)``), or where None, every
  row's full ``(q_len, kv_len)``: the decode kernels always bind per-row lengths."""
  if lengths is not None:
    return lengths
  return jnp.tile(jnp.array([[q_len, kv_len]], jnp.int32), (batch, 1))


def pack_rows(q, kv_heads: int, rows_p: int, d_p: int):
  """``[batch, q_len, q_heads, d]`` -> ``[batch, kv_heads, rows_p, d_p]``: each KV head's
  ``q_len * group`` query rows, position-major, zero-padded to ``rows_p`` rows and
  ``d_p`` columns."""
  batch, q_len, q_heads, d = q.shape
  group = q_heads // kv_heads
  q = q.reshape(batch, q_len, kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  q = q.reshape(batch, kv_heads, q_len * group, d)
  return jnp.pad(q, [(0, 0), (0, 0), (0, rows_p - q_len * group), (0, d_p - d)])


def _unpack(x, q_len: int, group: int):
  """``[batch, kv_heads, rows_p(, d)]`` -> ``[batch, q_len, q_heads, d]`` (with ``d``) or
  ``[batch, q_heads, q_len]`` (a row statistic)."""
  batch, kv_heads = x.shape[:2]
  x = x[:, :, :q_len * group].reshape(batch, kv_heads, q_len, group, *x.shape[3:])
  if x.ndim == 5:
    return x.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, kv_heads * group, x.shape[-1])
  return x.transpose(0, 1, 3, 2).reshape(batch, kv_heads * group, q_len)


def merge_splits(o, lse, sinks, *, q_len: int, group: int, dv: int, dtype):
  """The attention output from the splits' partials ``o: [batch, kv_heads, splits,
  rows_p, dv_p]`` and ``lse: [batch, kv_heads, splits, rows_p]`` (``EMPTY_ROW_LSE``
  where a split saw no key), the ``[q_heads]`` ``sinks`` (or None) counted once per
  row (``group`` query heads per KV head): ``(o [batch, q_len, q_heads, dv] in dtype,
  lse [batch, q_heads, q_len])``."""
  kv_heads, rows_p = o.shape[1], o.shape[3]
  sink = None
  if sinks is not None:  # row r of KV head h is query head h * group + r % group
    sink = floor_sinks(sinks).reshape(kv_heads, group)[:, jnp.arange(rows_p) % group][None]
  o, lse = combine_partials(o.astype(jnp.float32), lse, axis=2, sink=sink)
  return _unpack(o[..., :dv], q_len, group).astype(dtype), _unpack(lse, q_len, group)
