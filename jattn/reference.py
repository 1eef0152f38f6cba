"""Pure-jnp references: the oracle for tests and the ``"xla"`` backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn.kernels.common.elementwise import dense_indices, elementwise
from jattn.core.validation import scale_of
from jattn.kernels.common.dropout import keep_mask
from jattn.kernels.common.nonfinite import clear, nonfinite_rows
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, floor_sinks
from jattn.kernels.common.tiling import packed_positions


def compute_dtype(*arrays):
  """float32, or float64 where an input is (under ``jax_enable_x64``): the references
  then serve as a float64 oracle."""
  return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def attention_mask(q_len: int, kv_len: int, *, causal=False, local_window=None,
                   q_segment_ids=None, kv_segment_ids=None, lengths=None):
  """Boolean mask ``[batch or 1, 1, q_len, kv_len]``: True where a query may attend.

  Queries are aligned to the bottom-right: query ``i`` sits at key position
  ``i + kv_len - q_len``. With ``lengths`` (``[batch, 2]`` ints: each row's ``(q_len,
  kv_len)``) those are the row's own, and queries and keys past them attend nothing.
  """
  q_idx, k_pos = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]
  q_pos = q_idx + (kv_len - q_len)
  mask = jnp.ones((q_len, kv_len), bool)
  if lengths is not None:
    q_n, kv_n = lengths[:, 0, None, None], lengths[:, 1, None, None]
    q_pos = q_idx + (kv_n - q_n)
    mask = (q_idx < q_n) & (k_pos < kv_n)
  left, right = local_window if local_window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  if right is not None:
    mask &= k_pos <= q_pos + right
  if left is not None:
    mask &= k_pos >= q_pos - left
  mask = mask[:, None] if lengths is not None else mask[None, None]
  if q_segment_ids is not None:
    mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  return mask


def masked_softmax(logits, mask):
  """Softmax over the last axis where ``mask`` holds, and its log-sum-exp.

  Returns ``(p, lse)`` with ``lse`` keeping the reduced axis (size 1). Rows with no
  allowed entry give ``p = 0`` and ``lse = EMPTY_ROW_LSE``, and finite gradients. A
  NaN or +inf among a row's allowed logits makes the row NaN (as the dense formula);
  refused entries never reach it, whatever they hold.
  """
  row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  # Refused logits may be huge (a bias that grows toward masked keys): exp of them
  # would overflow, and where's gradient would be 0 * inf = NaN.
  p = jnp.where(mask, jnp.exp(jnp.where(mask, logits, row_max) - row_max), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  empty = denom == 0.0
  safe = jnp.where(empty, 1.0, denom)
  return p / safe, jnp.where(empty, EMPTY_ROW_LSE, jnp.log(safe) + row_max)


def guarded_values(v):
  """For ``guard_values=True``: ``(bad keys, v)``, the keys of ``v [..., keys, heads,
  d]`` whose value row is not finite (bool ``[..., keys, heads]``) and ``v`` with those
  rows zeroed. The caller makes such a key's logits NaN, so the rows that see it are NaN
  and the others meet a 0 value: what the kernels do in the tiles that straddle a mask
  (``nonfinite.guard_values``)."""
  bad = nonfinite_rows(v)
  return bad[..., 0], clear(v, bad)


def idle_cleared(x, active):
  """``x [..., rows, heads, d]`` with its rows that are not ``active`` (``[..., rows]``,
  broadcastable) zeroed: queries that see no key and keys no query sees (padding, a
  cache's unused tail) take no part, and what they hold then reaches no gradient
  through ``0 * NaN``, as the kernels skip them."""
  return jnp.where(active[..., None, None], x, jnp.zeros((), x.dtype))


def flash_attention_reference(q, k, v, *, causal=False, scale=None, q_segment_ids=None,
                              kv_segment_ids=None, local_window=None, softcap=None, sinks=None,
                              dropout_rate: float = 0.0, dropout_seed=None,
                              guard_values: bool = False, lengths=None):
  """Dense attention with every flash_attention feature, differentiable by autodiff.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, head_dim_v]``.
    lengths: ``[batch, 2]`` ints, each row's ``(q_len, kv_len)`` (``attention_mask``),
      or None.
    sinks: ``[q_heads]``: a logit per head in every row's softmax denominator, or None;
      floored at ``EMPTY_ROW_LSE`` (``softmax.floor_sinks``: -inf is no sink).
    dropout_rate, dropout_seed: weights dropped where ``dropout.keep_mask(dropout_seed,
      ...)`` says (the kernels' mask), the kept ones scaled by ``1 / (1 - rate)``.
    guard_values: a key whose value row is not finite makes every row that sees it NaN
      and no other (``guarded_values``); without, ``0 * inf`` carries it into rows that
      do not see it, as in the plain dense formula.

  Returns:
    ``(o, lse)``: ``o: [batch, q_len, q_heads, head_dim_v]`` in q's dtype and
    ``lse: [batch, q_heads, q_len]`` float32 (float64 for float64 inputs; the sink
    included, dropout not). Rows that see no key give zeros and ``lse = EMPTY_ROW_LSE``
    (the sink's logit with sinks).
  """
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  scale = scale_of(scale, head_dim)
  dtype = compute_dtype(q)
  mask = attention_mask(q_len, kv_len, causal=causal, local_window=local_window,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                        lengths=lengths)
  q = idle_cleared(q, jnp.any(mask, axis=-1)[:, 0])
  k = idle_cleared(k, jnp.any(mask, axis=-2)[:, 0])
  qg = q.reshape(batch, q_len, kv_heads, group, head_dim)
  precision = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=dtype,
                      precision=precision) * scale
  if guard_values:
    bad, v = guarded_values(v)
    logits = jnp.where(jnp.moveaxis(bad, 1, 2)[:, :, None, None, :], jnp.nan, logits)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = mask[:, :, None]  # [b, 1, 1, q, k] against logits [b, h, g, q, k]
  if sinks is not None:  # one more logit per row, always allowed, attending to nothing
    sink = floor_sinks(sinks).astype(dtype).reshape(1, kv_heads, group, 1, 1)
    logits = jnp.concatenate([logits, jnp.broadcast_to(sink, logits.shape[:-1] + (1,))], -1)
    mask = jnp.concatenate([jnp.broadcast_to(mask, logits.shape[:-1] + (kv_len,)),
                            jnp.ones(logits.shape[:-1] + (1,), bool)], -1)
  p, lse = masked_softmax(logits, mask)
  p = p[..., :kv_len]
  if dropout_rate:
    heads = (jnp.arange(kv_heads)[:, None] * group + jnp.arange(group)[None, :])
    kept = keep_mask(dropout_seed, dropout_rate, jnp.arange(batch)[:, None, None, None, None],
                     heads[None, :, :, None, None], jnp.arange(q_len)[:, None],
                     jnp.arange(kv_len)[None, :])
    p = jnp.where(kept, p / (1.0 - dropout_rate), 0.0)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                 preferred_element_type=dtype, precision=precision)
  lse = lse[..., 0]
  return (o.reshape(batch, q_len, q_heads, v.shape[-1]).astype(q.dtype),
          lse.reshape(batch, q_heads, q_len))


def flash_attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                                     max_seqlen_k: int, causal=False, scale=None,
                                     local_window=None, softcap=None, sinks=None):
  """Dense attention over packed sequences, differentiable by autodiff: row ``t`` of
  ``q`` ``[total_q, q_heads, head_dim]`` attends to the keys of its own sequence in k, v
  ``[total_k, kv_heads, head_dim(_v)]`` (sequence ``s``: rows ``[cu[s], cu[s + 1])``),
  with the mask of ``flash_attention_reference`` on the sequence's own lengths, each
  clipped to ``max_seqlen_q`` / ``max_seqlen_k``. Returns ``(o [total_q, q_heads,
  head_dim_v], lse [q_heads, total_q])``; rows no sequence holds see no key: zeros and
  ``EMPTY_ROW_LSE`` (the sink's logit with sinks)."""
  total_q, q_heads, head_dim = q.shape
  total_k, kv_heads = k.shape[:2]
  group = q_heads // kv_heads
  scale = scale_of(scale, head_dim)
  dtype = compute_dtype(q)
  seq_q, pos_q, valid_q = packed_positions(cu_seqlens_q, total_q, max_seqlen_q)
  seq_k, pos_k, valid_k = packed_positions(cu_seqlens_k, total_k, max_seqlen_k)
  cu_q, cu_k = (jnp.asarray(c).astype(jnp.int32) for c in (cu_seqlens_q, cu_seqlens_k))
  len_q = jnp.minimum(jnp.diff(cu_q), max_seqlen_q)[seq_q]
  len_k = jnp.minimum(jnp.diff(cu_k), max_seqlen_k)[seq_q]
  q_abs = (pos_q + len_k - len_q)[:, None]
  mask = (seq_q[:, None] == seq_k[None]) & valid_q[:, None] & valid_k[None]
  mask &= pos_k[None] < len_k[:, None]
  left, right = local_window if local_window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  if right is not None:
    mask &= pos_k[None] <= q_abs + right
  if left is not None:
    mask &= pos_k[None] >= q_abs - left
  q = idle_cleared(q, jnp.any(mask, axis=1))
  k = idle_cleared(k, jnp.any(mask, axis=0))
  qg = q.reshape(total_q, kv_heads, group, head_dim)
  precision = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("qhgd,khd->hgqk", qg, k, preferred_element_type=dtype,
                      precision=precision) * scale
  bad, v = guarded_values(v)
  logits = jnp.where(jnp.swapaxes(bad, 0, 1)[:, None, None, :], jnp.nan, logits)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = jnp.broadcast_to(mask, logits.shape)
  if sinks is not None:
    sink = floor_sinks(sinks).astype(dtype).reshape(kv_heads, group, 1, 1)
    logits = jnp.concatenate([logits, jnp.broadcast_to(sink, logits.shape[:-1] + (1,))], -1)
    mask = jnp.concatenate([mask, jnp.ones(mask.shape[:-1] + (1,), bool)], -1)
  p, lse = masked_softmax(logits, mask)
  o = jnp.einsum("hgqk,khd->qhgd", p[..., :total_k].astype(v.dtype), v,
                 preferred_element_type=dtype, precision=precision)
  return (o.reshape(total_q, q_heads, v.shape[-1]).astype(q.dtype),
          lse[..., 0].reshape(q_heads, total_q))


def flex_attention_reference(q, k, v, *, score_mod=None, mask_mod=None, scale=None,
                             guard_values: bool = False):
  """Dense FlexAttention in float32, differentiable by autodiff (also through the
  arrays the functions close over).

  ``softmax(where(mask_mod, score_mod(scale · q kᵀ, b, h, q_idx, kv_idx), -inf)) v``,
  each function called elementwise on int32 indices (``h`` the query head).

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``.
    guard_values: as ``flash_attention_reference``'s.

  Returns:
    ``(o, lse)``: ``o`` like q in q's dtype, ``lse: [batch, q_heads, q_len]``
    float32 (float64 for float64 inputs). Rows that see no key (masked out, or every
    score ``-inf``) give zeros and ``EMPTY_ROW_LSE``.
  """
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  precision = jax.lax.Precision.HIGHEST
  dtype = compute_dtype(q)
  bad = None
  if guard_values:
    bad, v = guarded_values(v)
    bad = jnp.moveaxis(jnp.repeat(bad, group, axis=2), 1, 2)[:, :, None, :]  # [b, h, 1, k]
  kg = jnp.repeat(k, group, axis=2)
  vg = jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, kg, preferred_element_type=dtype,
                      precision=precision) * scale_of(scale, head_dim)
  if bad is not None:
    scores = jnp.where(bad, jnp.nan, scores)
  index = dense_indices(batch, q_heads, q_len, kv_len)
  if score_mod is not None:
    scores = elementwise(score_mod, scores, *index).astype(dtype)
  allowed = jnp.logical_not(jnp.isneginf(scores))  # NaN stays in: its row is NaN
  if mask_mod is not None:
    allowed = allowed & elementwise(mask_mod, *index)
  p, lse = masked_softmax(scores, allowed)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, vg.astype(dtype), precision=precision)
  return o.astype(q.dtype), lse[..., 0]


# Additive mask values at or below this mean "masked" (torch code writes -1e9 or the
# dtype's lowest) and become -inf: a row masked everywhere then gives zeros on every
# backend. Left finite, such a row's log-sum-exp (near the mask value) cannot hold the
# log of its weights' sum in float32, and a backward that recomputes exp(s - lse) would
# miss the forward's softmax by up to that sum.
MASKED_LOGIT = -1e5


def additive_window_mask(mask):
  """A window mask as float32 logit offsets: boolean (True = may attend) becomes
  0 / -inf, a float mask (e.g. Swin's 0 / -100) is taken as it is, but for values at
  or below ``MASKED_LOGIT`` (-1e5), which become -inf."""
  mask = jnp.asarray(mask)
  if mask.dtype == jnp.bool_:
    return jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)
  mask = mask.astype(jnp.float32)
  return jnp.where(mask <= MASKED_LOGIT, -jnp.inf, mask)


def window_attention_reference(q, k, v, bias, *, mask=None, scale=None, return_lse=False):
  """Dense window attention in float32, differentiable by autodiff.

  ``softmax(scale · q kᵀ + bias[h] + mask[w % mask_windows]) v`` per window ``w`` and
  head ``h``.

  Args:
    q, k, v: ``[windows, tokens, heads, head_dim]``; bias ``[heads, tokens, tokens]``;
      mask ``[mask_windows, tokens, tokens]`` (boolean or additive float) or None.
    return_lse: also return the log-sum-exp of each row, ``[windows, heads, tokens]``.

  Returns:
    ``[windows, tokens, heads, head_dim]`` in q's dtype (and the lse); rows that see
    no key (every logit ``-inf``) give zeros (and ``EMPTY_ROW_LSE``). A key whose value
    row is not finite makes every row that sees it NaN (``guarded_values``).
  """
  windows, _, _, head_dim = q.shape
  scale = scale_of(scale, head_dim)
  dtype = compute_dtype(q)
  precision = jax.lax.Precision.HIGHEST
  bad, v = guarded_values(v)  # as the kernels do in every tile
  terms = bias.astype(dtype)[None]
  if mask is not None:
    mask = additive_window_mask(mask).astype(dtype)
    terms = terms + mask[jnp.arange(windows) % mask.shape[0]][:, None]
  logits = jnp.einsum("wqhd,wkhd->whqk", q, k, preferred_element_type=dtype,
                      precision=precision) * scale
  logits = jnp.where(jnp.moveaxis(bad, 1, 2)[:, :, None, :], jnp.nan, logits) + terms
  # Masked: a -inf bias or mask term (a NaN logit there does not reach the row), or a
  # -inf logit (a weight of 0, as in the dense formula).
  p, lse = masked_softmax(logits, ~(jnp.isneginf(terms) | jnp.isneginf(logits)))
  o = jnp.einsum("whqk,wkhd->wqhd", p, v.astype(dtype), precision=precision)
  return (o.astype(q.dtype), lse[..., 0]) if return_lse else o.astype(q.dtype)


def default_decay(heads: int):
  """RetNet's per-head decay ``γ_h = 1 - 2**(-5 - h)``, shape ``[heads]`` float32."""
  return 1.0 - 2.0 ** (-5.0 - jnp.arange(heads, dtype=jnp.float32))


def packed_sequence_ids(cu_seqlens, length: int):
  """The packed sequence of each of ``length`` positions, ``[length]`` int32: how many of
  the sequence starts ``cu_seqlens[1:-1]`` lie at or before it.

  For ``cu_seqlens`` from 0 to ``length``, non-decreasing, that is the index of the
  sequence holding the position (an empty sequence holds none). Whatever the values,
  the ids never decrease along the positions: positions before ``cu_seqlens[0]`` join
  the first sequence, those from ``cu_seqlens[-1]`` on the last. (A broadcast
  comparison, ``O(length · sequences)``: the oracle; the kernels count another way.)
  """
  starts = jnp.asarray(cu_seqlens)[1:-1]
  return jnp.sum(starts[None, :] <= jnp.arange(length)[:, None], axis=1, dtype=jnp.int32)


def _retention_visible(q_len: int, kv_len: int, segment_ids=None):
  """``[q_len, kv_len]`` bool: query ``i`` (at position ``i + kv_len - q_len``) sees key
  ``m`` at or before it, in its own sequence where ``segment_ids`` (``[kv_len]``) is given."""
  diff = (jnp.arange(q_len)[:, None] + (kv_len - q_len)) - jnp.arange(kv_len)[None, :]
  visible = diff >= 0
  if segment_ids is not None:
    visible &= segment_ids[kv_len - q_len:, None] == segment_ids[None, :]
  return visible


def retention_decay_mask(q_len: int, kv_len: int, decay, segment_ids=None):
  """``D[h, n, m] = γ_h^(n - m)`` for ``n >= m`` else 0, shape ``[heads, q_len, kv_len]``,
  in decay's dtype promoted to at least float32.

  Queries are the last ``q_len`` positions: query ``i`` sits at position
  ``i + kv_len - q_len``. γ = 0 gives ``γ^0 = 1`` and 0 beyond; a NaN γ gives NaN.
  ``segment_ids`` (``[kv_len]`` ints, e.g. ``packed_sequence_ids``): also 0 where ``n``
  and ``m`` lie in different sequences.
  """
  dtype = jnp.promote_types(jnp.result_type(decay), jnp.float32)
  diff = (jnp.arange(q_len)[:, None] + (kv_len - q_len)) - jnp.arange(kv_len)[None, :]
  visible = _retention_visible(q_len, kv_len, segment_ids)
  # where() before exp: a negative distance would overflow γ^(n - m). log 0 is taken
  # as the most negative finite float: exp(0 · -inf) would make γ^0 NaN for γ = 0.
  power = jnp.where(visible, diff, 0).astype(dtype)
  log_decay = jnp.maximum(jnp.log(jnp.asarray(decay, dtype)), -jnp.finfo(dtype).max)
  return jnp.where(visible[None], jnp.exp(power[None] * log_decay[:, None, None]), 0.0)


def retention_reference(q, k, v, *, decay=None, scale=None, normalize=None, cu_seqlens=None):
  """Parallel-form retention: ``O = (scale · Q Kᵀ ⊙ D) V``.

  Computed in the inputs' dtype promoted to at least float32 (float64 inputs under
  ``jax_enable_x64`` give a float64 oracle). Non-finite values stay in the rows that
  see them: row ``n`` (at position ``n'``) sees ``q_n`` and the keys and values at
  positions ``<= n'`` (of its own sequence, with ``cu_seqlens``); it comes out NaN
  where one of them holds an inf or NaN, and exact where none does (also in the
  gradients of the inputs it sees).

  Args:
    q: ``[batch, q_len, heads, dk]``; k: ``[batch, kv_len, heads, dk]``;
      v: ``[batch, kv_len, heads, dv]``; decay: ``[heads]`` (default RetNet's).
    normalize: None or ``"abs_sum"``: each row of ``S = scale · Q Kᵀ ⊙ D`` is divided
      by ``max(Σ_m |S[n, m]|, 1)``, a constant for the gradient (as torchscale); a row
      whose sum is not finite (it sees a non-finite value) is divided by 1.
    cu_seqlens: ``[num_seqs + 1]`` ints or None: the key positions hold packed
      sequences ``[cu_seqlens[i], cu_seqlens[i + 1])`` (every batch row alike), and
      ``D[n, m] = 0`` where ``n`` and ``m`` lie in different ones
      (``packed_sequence_ids``).

  Returns:
    ``[batch, q_len, heads, dv]``.
  """
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  heads, dk = q.shape[2], q.shape[3]
  decay = default_decay(heads) if decay is None else decay
  scale = scale_of(scale, dk)
  segment_ids = None if cu_seqlens is None else packed_sequence_ids(cu_seqlens, k.shape[1])
  # A non-finite query row, or key or value row, is zeroed for the products and comes
  # back as NaN scores where it is seen: in a product with masked (zero) scores, or in
  # its transpose in the backward, 0 · inf = NaN would reach rows that do not see it.
  bad_q = ~jnp.isfinite(q).all(-1, keepdims=True)
  bad_kv = ~(jnp.isfinite(k).all(-1, keepdims=True) & jnp.isfinite(v).all(-1, keepdims=True))
  q, k, v = jnp.where(bad_q, 0.0, q), jnp.where(bad_kv, 0.0, k), jnp.where(bad_kv, 0.0, v)
  bad = jnp.moveaxis(bad_q, 2, 1) | jnp.moveaxis(bad_kv, 2, 1).swapaxes(2, 3)  # [b, h, q, kv]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  visible = _retention_visible(q.shape[1], k.shape[1], segment_ids)
  s = jnp.where(visible, jnp.where(bad, jnp.nan, s * retention_decay_mask(
      q.shape[1], k.shape[1], decay.astype(dtype), segment_ids)[None]), 0.0)
  if normalize == "abs_sum":
    den = jnp.maximum(jnp.abs(s).sum(-1, keepdims=True), 1.0)
    s = s / jax.lax.stop_gradient(jnp.where(jnp.isfinite(den), den, 1.0))
  return jnp.einsum("bhqk,bkhd->bqhd", s, v, precision="highest")


def retention_recurrent_reference(q, k, v, *, decay=None, scale=None, initial_state=None,
                                  cu_seqlens=None):
  """Recurrent-form retention, one position at a time.

  ``S_t = γ S_{t-1} + k_tᵀ v_t`` (``S_{-1}`` = ``initial_state`` or 0) and
  ``o_t = scale · q_t S_t``. Shapes as :func:`retention_reference` (``q_len <= kv_len``,
  queries the last ``q_len`` positions); the state is ``[batch, heads, dk, dv]``.
  Computed in the inputs' dtype promoted to at least float32.

  With ``cu_seqlens`` (``[num_seqs + 1]`` ints, batch 1, no ``initial_state``) the
  state restarts from 0 at the first position of each packed sequence
  (``packed_sequence_ids``), and the final states are each sequence's last,
  ``[num_seqs, heads, dk, dv]`` (zeros for an empty sequence).

  Returns:
    ``(o, final_state)``.
  """
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  prefix = k.shape[1] - q.shape[1]  # keys before the first query only feed the state
  q = jnp.pad(q, ((0, 0), (prefix, 0), (0, 0), (0, 0)))
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  batch, length, heads, dk = q.shape
  decay = (default_decay(heads) if decay is None else decay).astype(dtype)
  scale = scale_of(scale, dk)
  shape = (batch, heads, dk, v.shape[-1])
  state = jnp.zeros(shape, dtype) if initial_state is None else initial_state.astype(dtype)
  ids = finals = None
  if cu_seqlens is not None:
    if batch != 1 or initial_state is not None:
      raise ValueError("cu_seqlens takes batch 1 and no initial_state")
    ids = packed_sequence_ids(cu_seqlens, length)
    finals = jnp.zeros((jnp.shape(cu_seqlens)[0] - 1,) + shape, dtype)

  def step(carry, qkv):
    state, finals, previous = carry
    q_t, k_t, v_t, id_t = qkv  # [batch, heads, d], the sequence (or None)
    state = decay[None, :, None, None] * state
    if finals is not None:  # a new sequence starts from 0; each sequence's last state kept
      state = jnp.where(id_t == previous, state, 0.0)
    state = state + jnp.einsum("bhk,bhv->bhkv", k_t, v_t, precision="highest")
    if finals is not None:
      finals = jax.lax.dynamic_update_index_in_dim(finals, state, id_t, 0)
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, state, precision="highest")
    return (state, finals, id_t), o_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v)) + (ids,)
  first = None if ids is None else ids[0]
  (state, finals, _), o = jax.lax.scan(step, (state, finals, first), xs)
  o = jnp.moveaxis(o, 0, 1)[:, prefix:]
  return (o, state) if finals is None else (o, finals[:, 0])


def dilated_positions(seq_len: int, heads: int, segment_length: int, dilation_rate: int):
  """Where one (w, r) pair's dilated rows sit: ``pos[n, j, h]`` is the sequence position
  of row ``j`` of segment ``n`` for head ``h`` (offset ``h mod r``), shape
  ``[ceil(S / w), w / r, heads]``; positions ``>= seq_len`` are padding."""
  w, r = segment_length, dilation_rate
  segments = -(-seq_len // w)
  return (jnp.arange(segments)[:, None, None] * w + jnp.arange(w // r)[None, :, None] * r
          + (jnp.arange(heads) % r)[None, None, :])


def dilated_pair_reference(q, k, v, segment_length: int, dilation_rate: int, *, causal=False,
                           scale=None, guard_values: bool = False):
  """One (w, r) pair of dilated attention in float32: head ``h`` attends within each
  segment of ``w`` positions among those ``≡ h (mod r)`` (causal: earlier ones only).

  Returns ``(o, lse)``: ``o: [batch, seq, heads, head_dim]`` float32, zero where the
  pair does not cover a position for that head; ``lse: [batch, heads, seq]`` with
  ``EMPTY_ROW_LSE`` there.
  """
  batch, seq, heads, head_dim = q.shape
  w, r = segment_length, dilation_rate
  scale = scale_of(scale, head_dim)
  dtype = compute_dtype(q)
  pos = dilated_positions(seq, heads, w, r)  # [n, L, H]
  valid = pos < seq
  heads_idx = jnp.arange(heads)
  rows = jnp.minimum(pos, seq - 1)

  def gather(x):  # [b, S, heads or kv_heads, D] -> [b, n, L, heads, D]
    x = x.astype(dtype)[:, :, heads_idx // (heads // x.shape[2])]
    return x[:, rows, heads_idx]

  qs, ks, vs = gather(q), gather(k), gather(v)
  logits = jnp.einsum("bnqhd,bnkhd->bnhqk", qs, ks, precision=jax.lax.Precision.HIGHEST) * scale
  if guard_values:  # (flash_attention_reference's)
    bad, vs = guarded_values(vs)  # [b, n, L, h]
    logits = jnp.where(jnp.moveaxis(bad, 2, 3)[:, :, :, None, :], jnp.nan, logits)
  mask = jnp.moveaxis(valid, -1, 1)[:, :, None, :]  # [n, H, 1, L]: keys that exist
  if causal:
    rows = jnp.arange(w // r)
    mask = mask & (rows[None, None, None, :] <= rows[None, None, :, None])
  p, lse = masked_softmax(logits, jnp.broadcast_to(mask[None], logits.shape))
  o = jnp.einsum("bnhqk,bnkhd->bnqhd", p, vs, precision=jax.lax.Precision.HIGHEST)
  lse = jnp.moveaxis(lse[..., 0], 2, 3)
  # Scatter back; rows past the sequence end go to a spare slot that is dropped.
  flat = jnp.where(valid, pos, seq).reshape(-1, heads)  # [n * L, H]
  o_full = jnp.zeros((batch, seq + 1, heads, head_dim), dtype)
  o_full = o_full.at[:, flat, heads_idx[None, :]].set(o.reshape(batch, -1, heads, head_dim))
  lse_full = jnp.full((batch, seq + 1, heads), EMPTY_ROW_LSE, dtype)
  lse_full = lse_full.at[:, flat, heads_idx[None, :]].set(lse.reshape(batch, -1, heads))
  return o_full[:, :seq], jnp.moveaxis(lse_full[:, :seq], 1, 2)


def mix_dilated_pairs(outs, lses):
  """LongNet's mixing: ``O = Σ_i softmax_i(lse_i) · O_i`` per position and head, from
  per-pair ``outs [pairs, batch, seq, heads, D]`` and ``lses [pairs, batch, heads, seq]``.
  Returns ``(o, lse)``; positions no pair covers give zeros and ``EMPTY_ROW_LSE``.

  The weights are normalised by their own sum after subtracting the largest lse, as
  the kernels merge: ``exp(lse_i - logsumexp)`` would not sum to 1 once the lse
  values are large (1e8: float32 keeps them to within 8, and e^8 is no rounding)."""
  top = jnp.max(lses, axis=0)
  weights = jnp.exp(lses - top[None])  # [pairs, b, h, s]
  total = jnp.sum(weights, axis=0)
  o = jnp.einsum("pbhs,pbshd->bshd", weights / total[None], outs,
                 precision=jax.lax.Precision.HIGHEST)
  # A NaN lse (a row that saw a NaN) counts as covering its row.
  covered = jnp.logical_not(top <= EMPTY_ROW_LSE / 2)
  return jnp.where(jnp.moveaxis(covered, 1, 2)[..., None], o, 0.0), jnp.where(
      covered, top + jnp.log(total), EMPTY_ROW_LSE)


def dilated_attention_reference(q, k, v, *, segment_lengths, dilation_rates, causal=False,
                                scale=None, guard_values: bool = False):
  """LongNet dilated attention in float32 (gather, dense attention per pair, mix),
  differentiable by autodiff, mixing weights included.

  Args:
    q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``.
    segment_lengths, dilation_rates: the (w_i, r_i) pairs (``w_i % r_i == 0``).
    guard_values: as ``flash_attention_reference``'s.

  Returns:
    ``(o, lse)``: ``o`` in q's dtype, ``lse: [batch, heads, seq]`` float32 (float64
    for float64 inputs).
  """
  pairs = [dilated_pair_reference(q, k, v, w, r, causal=causal, scale=scale,
                                  guard_values=guard_values)
           for w, r in zip(segment_lengths, dilation_rates)]
  o, lse = mix_dilated_pairs(jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs]))
  return o.astype(q.dtype), lse
