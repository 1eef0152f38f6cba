"""Pure-jnp references: the oracle for tests and the ``"xla"`` backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.flash.common import EMPTY_ROW_LSE


def attention_mask(q_len: int, kv_len: int, *, causal=False, local_window=None,
                   q_segment_ids=None, kv_segment_ids=None):
  """Boolean mask ``[batch or 1, 1, q_len, kv_len]``: True where a query may attend.

  Queries are aligned to the bottom-right: query ``i`` sits at key position
  ``i + kv_len - q_len``.
  """
  q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
  k_pos = jnp.arange(kv_len)[None, :]
  mask = jnp.ones((q_len, kv_len), bool)
  left, right = local_window if local_window is not None else (None, None)
  if causal:
    right = 0 if right is None else min(right, 0)
  if right is not None:
    mask &= k_pos <= q_pos + right
  if left is not None:
    mask &= k_pos >= q_pos - left
  mask = mask[None, None]
  if q_segment_ids is not None:
    mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  return mask


def flash_attention_reference(q, k, v, *, causal=False, scale=None, q_segment_ids=None,
                              kv_segment_ids=None, local_window=None, softcap=None):
  """Dense attention with every flash_attention feature, differentiable by autodiff.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``.

  Returns:
    ``(o, lse)``: ``o: [batch, q_len, q_heads, head_dim]`` in q's dtype and
    ``lse: [batch, q_heads, q_len]`` float32. Rows that see no key give zeros
    and ``lse = EMPTY_ROW_LSE``.
  """
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  if scale is None:
    scale = head_dim ** -0.5
  qg = q.reshape(batch, q_len, kv_heads, group, head_dim)
  precision = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32,
                      precision=precision) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask = attention_mask(q_len, kv_len, causal=causal, local_window=local_window,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  mask = mask[:, :, None]  # [b, 1, 1, q, k] against logits [b, h, g, q, k]
  row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  empty = denom == 0.0
  safe = jnp.where(empty, 1.0, denom)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", (p / safe).astype(v.dtype), v,
                 preferred_element_type=jnp.float32, precision=precision)
  lse = jnp.where(empty, EMPTY_ROW_LSE, jnp.log(safe) + row_max)[..., 0]
  return (o.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype),
          lse.reshape(batch, q_heads, q_len))
