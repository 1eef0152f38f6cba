"""LongNet's dilated attention layers (Flax NNX) on top of ``jattn.dilated_attention``.

``MultiheadDilatedAttention`` follows the ``dilated-attention-pytorch`` package's
layer: ``q_proj``, ``k_proj``, ``v_proj``, dilated attention, MAGNETO's sub-LayerNorm
``norm`` on the attention output, ``out_proj``, with MAGNETO's init; so its torch
checkpoints load by name (``jattn.interop.convert.load_torch_state_dict``). Unlike that
package, every head takes part in every ``(w, r)`` pair (head ``h`` reading the
positions ``≡ h (mod r)``), and the pairs are mixed by their softmax denominators.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from jattn.dilated import dilated_attention


def _xavier_normal(gain: float):
  """Xavier-normal (untruncated, as ``torch.nn.init.xavier_normal_``) with ``gain``."""
  return nnx.initializers.variance_scaling(gain ** 2, "fan_avg", "normal")


class DilatedAttention(nnx.Module):
  """``jattn.dilated_attention`` as a layer without parameters.

  ``__call__(q, k, v)``: ``q: [batch, seq, heads, head_dim]``, ``k, v: [batch, seq,
  kv_heads, head_dim]`` -> ``[batch, seq, heads, head_dim]``. ``causal`` given to the
  call overrides the constructor's. Bad pairs or shapes raise on the call, from the op.

  Args:
    segment_lengths, dilation_rates: the pairs ``(w_i, r_i)``, each ``w_i`` a multiple
      of ``r_i``.
    causal, scale, backend: as ``jattn.dilated_attention``.
  """

  def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *,
               causal: bool = False, scale: float | None = None, backend: str = "auto"):
    self.segment_lengths, self.dilation_rates = tuple(segment_lengths), tuple(dilation_rates)
    self.causal, self.scale, self.backend = causal, scale, backend

  def __call__(self, q, k, v, *, causal: bool | None = None):
    return dilated_attention(q, k, v, segment_lengths=self.segment_lengths,
                             dilation_rates=self.dilation_rates,
                             causal=self.causal if causal is None else causal,
                             scale=self.scale, backend=self.backend)


class MultiheadDilatedAttention(nnx.Module):
  """LongNet multi-head dilated attention: ``[batch, seq, embed_dim]`` in and out.

  Projections ``q_proj``, ``k_proj``, ``v_proj`` (``num_kv_heads * head_dim`` wide:
  grouped-query attention), the dilated attention ``attention``, the optional
  LayerNorm ``norm`` over the heads' concatenated outputs (MAGNETO's sub-LayerNorm;
  MAGNETO's cross-attention goes without it) and ``out_proj``. Init as MAGNETO:
  xavier-normal weights, gain ``gamma_init`` on ``v_proj`` and ``out_proj``, zero
  biases.

  Args:
    embed_dim: model width; divisible by ``num_heads`` (``head_dim = embed_dim //
      num_heads``).
    num_heads: query heads; a multiple of ``num_kv_heads`` (default ``num_heads``).
    segment_lengths, dilation_rates: the ``(w_i, r_i)`` pairs.
    use_bias: biases on the four projections.
    layer_norm, layer_norm_eps: the sub-LayerNorm and its epsilon (torch's default).
    gamma_init: MAGNETO's gain for ``v_proj`` and ``out_proj``.
    causal, backend: as ``jattn.dilated_attention``.
    dtype: computation dtype (params stay in ``param_dtype``).
    rngs: ``nnx.Rngs`` for initialisation.

  Subclasses change how the heads attend (e.g. a sharded ring) by overriding
  ``_attend`` alone.
  """

  def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
               dilation_rates: Sequence[int], *, num_kv_heads: int | None = None,
               use_bias: bool = True, layer_norm: bool = True, layer_norm_eps: float = 1e-5,
               gamma_init: float = 1.0, causal: bool = False, backend: str = "auto",
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if embed_dim % num_heads:
      raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
    self.head_dim = embed_dim // num_heads
    kv_dim = num_kv_heads * self.head_dim
    linear = lambda i, o, gain: nnx.Linear(i, o, use_bias=use_bias,
                                           kernel_init=_xavier_normal(gain), dtype=dtype,
                                           param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(embed_dim, embed_dim, 1.0)
    self.k_proj = linear(embed_dim, kv_dim, 1.0)
    self.v_proj = linear(embed_dim, kv_dim, gamma_init)
    self.attention = DilatedAttention(segment_lengths, dilation_rates, causal=causal,
                                      backend=backend)
    self.norm = (nnx.LayerNorm(embed_dim, epsilon=layer_norm_eps, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs) if layer_norm else None)
    self.out_proj = linear(embed_dim, embed_dim, gamma_init)

  def _attend(self, q, k, v, causal: bool):
    """The heads' attention: ``q: [batch, seq, heads, head_dim]``, ``k, v: [batch, seq,
    kv_heads, head_dim]`` -> ``[batch, seq, heads, head_dim]``."""
    return self.attention(q, k, v, causal=causal)

  def __call__(self, query, key=None, value=None, *, causal: bool | None = None):
    """``query: [batch, seq, embed_dim]``; ``key`` defaults to ``query`` and ``value``
    to ``key`` (same shape as ``query``); ``causal`` overrides the constructor's.
    Returns ``[batch, seq, embed_dim]``."""
    if query.ndim != 3 or query.shape[-1] != self.embed_dim:
      raise ValueError(f"query must be [batch, seq, {self.embed_dim}], got shape {query.shape}")
    key = query if key is None else key
    value = key if value is None else value
    for name, x in (("key", key), ("value", value)):
      if x.shape != query.shape:
        raise ValueError(f"{name} must have query's shape {query.shape} (dilated attention "
                         f"pairs equal positions), got {x.shape}")
    b, s, _ = query.shape
    q = self.q_proj(query).reshape(b, s, self.num_heads, self.head_dim)
    k = self.k_proj(key).reshape(b, s, self.num_kv_heads, self.head_dim)
    v = self.v_proj(value).reshape(b, s, self.num_kv_heads, self.head_dim)
    o = self._attend(q, k, v, self.attention.causal if causal is None else causal)
    o = o.reshape(b, s, self.embed_dim)
    if self.norm is not None:
      o = self.norm(o)
    return self.out_proj(o)
