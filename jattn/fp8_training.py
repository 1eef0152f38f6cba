"""``fp8_attention``: attention with an FP8 forward and a 16-bit backward, for training
with FP8 attention (``MultiHeadAttention(fp8=True)``). Apart from ``jattn.fp8``, which
``jattn.flash`` builds on: this one builds on both."""

from __future__ import annotations

import jax

from jattn.flash import flash_attention
from jattn.fp8 import quantize_attention_inputs


def fp8_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                  local_window=None, q_segment_ids=None, kv_segment_ids=None, rotation=None,
                  backend: str = "auto"):
  """Attention of 16/32-bit ``q [batch, q_len, q_heads, d]``, ``k, v [batch, kv_len,
  kv_heads, d(_v)]`` with an FP8 forward and a 16-bit backward: the forward quantises
  them (``quantize_attention_inputs``, descales per KV head, ``rotation`` if given) and
  runs ``flash_attention`` on the FP8 values; the gradients are those of the unquantised
  ``flash_attention`` at the same inputs (the inputs are the 16-bit master copy).
  Segment ids (``[batch, q_len]`` / ``[batch, kv_len]``) as ``flash_attention``'s.
  Returns ``[batch, q_len, q_heads, d_v]`` in q's dtype."""
  options = dict(causal=causal, scale=scale, local_window=local_window)

  @jax.custom_vjp
  def attend(q, k, v, segments):
    q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v, rotation=rotation)
    return flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                           out_dtype=q.dtype, backend=backend, **segments, **options)

  def forward(q, k, v, segments):
    return attend(q, k, v, segments), (q, k, v, segments)

  def backward(residuals, cotangent):
    *qkv, segments = residuals
    _, pull = jax.vjp(lambda *x: flash_attention(*x, **segments, **options), *qkv)
    return (*pull(cotangent.astype(qkv[0].dtype)), None)

  attend.defvjp(forward, backward)
  segments = {}
  if q_segment_ids is not None or kv_segment_ids is not None:
    segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  return attend(q, k, v, segments)
