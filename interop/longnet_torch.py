"""A PyTorch reference of LongNet's dilated attention with ``jattn.dilated_attention``'s
exact semantics, written independently of ``jattn.reference``, and the torch modules
that ``jattn.nn.DilatedAttention`` / ``jattn.nn.MultiheadDilatedAttention`` mirror.

The modules use the parameter names of the ``dilated-attention-pytorch`` package
(``q_proj``, ``k_proj``, ``v_proj``, ``norm``, ``out_proj``) and its MAGNETO init, so
their state dicts load into the Flax module by name (``jattn.interop.convert``). Tensors
are ``[batch, seq, heads, head_dim]``. This module imports torch; code that must run
without torch imports it only where it is needed (``jattn.interop.torch_import``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _check(q, k, v, segment_lengths, dilation_rates):
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim] with k and v of one shape, "
                     f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
  if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
    raise ValueError(f"k and v must share q's batch, seq and head_dim, got q {tuple(q.shape)}, "
                     f"k {tuple(k.shape)}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"q's {q.shape[2]} heads must be a multiple of k/v's {k.shape[2]} heads")
  _check_pairs(segment_lengths, dilation_rates)


def _check_pairs(segment_lengths, dilation_rates):
  if not segment_lengths or len(segment_lengths) != len(dilation_rates):
    raise ValueError(f"segment_lengths {list(segment_lengths)} and dilation_rates "
                     f"{list(dilation_rates)} must be non-empty and of the same length")
  for w, r in zip(segment_lengths, dilation_rates):
    if w < 1 or r < 1 or w % r:
      raise ValueError(f"each pair needs positive integers with the segment length a multiple "
                       f"of the dilation rate, got (w={w}, r={r})")


def _pair_attention(q, k, v, w: int, r: int, causal: bool, scale: float):
  """One pair ``(w, r)`` on ``q, k, v: [batch, seq, heads, D]`` (kv heads already
  repeated): ``(o [batch, seq, heads, D], lse [batch, seq, heads])``, zeros and
  ``-inf`` where the pair does not cover a position for a head."""
  batch, seq, heads, dim = q.shape
  segments, length = -(-seq // w), w // r
  padded = segments * w
  # Head h's dilated rows of a segment are its positions h % r, h % r + r, ...
  rows = ((torch.arange(heads, device=q.device) % r)[:, None]
          + r * torch.arange(length, device=q.device)[None, :])  # [heads, L]
  head = torch.arange(heads, device=q.device)[:, None]

  def dilate(x):  # [b, seq, heads, D] -> [b, segments, heads, L, D]
    x = F.pad(x, (0, 0, 0, 0, 0, padded - seq)).view(batch, segments, w, heads, dim)
    return x.transpose(2, 3)[:, :, head, rows]

  def undilate(x, fill):  # [b, segments, heads, L, ...] -> [b, seq, heads, ...]
    full = x.new_full((batch, segments, heads, w, *x.shape[4:]), fill)
    full[:, :, head, rows] = x
    return full.transpose(2, 3).reshape(batch, padded, heads, *x.shape[4:])[:, :seq]

  exists = (torch.arange(padded, device=q.device) < seq).view(segments, w)[:, rows]  # [n, H, L]
  allowed = exists[None, :, :, None, :]  # keys inside the sequence
  if causal:
    allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
  logits = (dilate(q) @ dilate(k).transpose(-1, -2)) * scale
  logits = logits.masked_fill(~allowed, float("-inf"))
  # The shift only keeps exp finite (its gradient cancels); rows past the sequence end
  # may see no key at all, so their shift is 0 and their sum 0 (they are dropped).
  top = logits.amax(-1, keepdim=True).detach()
  top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
  e = torch.exp(logits - top)
  total = e.sum(-1, keepdim=True)
  empty = total == 0
  total = torch.where(empty, torch.ones_like(total), total)
  o = (e / total) @ dilate(v)
  lse = (top + total.log()).masked_fill(empty, float("-inf"))
  return undilate(o, 0.0), undilate(lse[..., 0], float("-inf"))


def dilated_attention_torch(q, k, v, segment_lengths: Sequence[int],
                            dilation_rates: Sequence[int], *, causal: bool = False,
                            scale: float | None = None, detach_weights: bool = False):
  """LongNet dilated attention, ``jattn.dilated_attention``'s semantics, in torch.

  Args:
    q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``
      (head ``h`` reads kv head ``h // (heads // kv_heads)``).
    segment_lengths, dilation_rates: the pairs ``(w_i, r_i)``, ``w_i % r_i == 0``.
    causal: within a segment, each dilated row attends to itself and earlier ones.
    scale: default ``head_dim ** -0.5``.
    detach_weights: detach the mixing weights ``softmax_i(lse_i)`` as torchscale does
      (same output, different gradients).

  Returns:
    ``[batch, seq, heads, head_dim]`` in q's dtype, computed in float32 (float64 for
    float64 inputs); positions no pair covers for a head are zeros.
  """
  _check(q, k, v, segment_lengths, dilation_rates)
  dtype = q.dtype
  work = torch.float64 if dtype == torch.float64 else torch.float32
  group = q.shape[2] // k.shape[2]
  q = q.to(work)
  k, v = (x.to(work).repeat_interleave(group, dim=2) for x in (k, v))
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  outs, lses = zip(*(_pair_attention(q, k, v, w, r, causal, scale)
                     for w, r in zip(segment_lengths, dilation_rates)))
  lses = torch.stack(lses)  # [pairs, b, seq, heads]
  # Where no pair covers a position every lse is -inf; any finite stand-in gives
  # weights that multiply zeros.
  covered = torch.isfinite(lses).any(dim=0)
  weights = torch.softmax(lses.masked_fill(~covered, 0.0), dim=0)
  if detach_weights:
    weights = weights.detach()
  return (weights[..., None] * torch.stack(outs)).sum(dim=0).to(dtype)


class TorchDilatedAttention(nn.Module):
  """``dilated_attention_torch`` as a module (no parameters): ``forward(q, k, v)`` on
  ``[batch, seq, heads, head_dim]``; ``causal`` overrides the constructor's."""

  def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int], *,
               causal: bool = False, scale: float | None = None, detach_weights: bool = False):
    super().__init__()
    _check_pairs(segment_lengths, dilation_rates)
    self.segment_lengths, self.dilation_rates = tuple(segment_lengths), tuple(dilation_rates)
    self.causal, self.scale, self.detach_weights = causal, scale, detach_weights

  def forward(self, q, k, v, *, causal: bool | None = None):
    return dilated_attention_torch(q, k, v, self.segment_lengths, self.dilation_rates,
                                   causal=self.causal if causal is None else causal,
                                   scale=self.scale, detach_weights=self.detach_weights)


class TorchMultiheadDilatedAttention(nn.Module):
  """LongNet's multi-head dilated attention (MAGNETO sub-LayerNorm), the reference of
  ``jattn.nn.MultiheadDilatedAttention``: ``[batch, seq, embed_dim]`` in and out.

  ``q_proj``, ``k_proj``, ``v_proj`` (``num_kv_heads * head_dim`` wide: GQA),
  ``TorchDilatedAttention``, the optional LayerNorm ``norm`` on its output, ``out_proj``.
  MAGNETO init: xavier-normal weights (gain ``gamma_init`` on ``v_proj`` and
  ``out_proj``), zero biases.
  """

  def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
               dilation_rates: Sequence[int], *, num_kv_heads: int | None = None,
               bias: bool = True, layer_norm: bool = True, layer_norm_eps: float = 1e-5,
               gamma_init: float = 1.0, causal: bool = False, detach_weights: bool = False,
               device=None, dtype=None):
    super().__init__()
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if embed_dim % num_heads or num_heads % num_kv_heads:
      raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                       f"a multiple of num_kv_heads ({num_kv_heads})")
    self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
    self.head_dim = embed_dim // num_heads
    kv_dim = num_kv_heads * self.head_dim
    linear = lambda i, o: nn.Linear(i, o, bias=bias, device=device, dtype=dtype)
    self.q_proj, self.k_proj = linear(embed_dim, embed_dim), linear(embed_dim, kv_dim)
    self.v_proj = linear(embed_dim, kv_dim)
    self.attention = TorchDilatedAttention(segment_lengths, dilation_rates, causal=causal,
                                           detach_weights=detach_weights)
    self.norm = (nn.LayerNorm(embed_dim, eps=layer_norm_eps, device=device, dtype=dtype)
                 if layer_norm else None)
    self.out_proj = linear(embed_dim, embed_dim)
    for proj, gain in ((self.q_proj, 1.0), (self.k_proj, 1.0), (self.v_proj, gamma_init),
                       (self.out_proj, gamma_init)):
      nn.init.xavier_normal_(proj.weight, gain=gain)
      if proj.bias is not None:
        nn.init.zeros_(proj.bias)

  def forward(self, query, key=None, value=None, *, causal: bool | None = None):
    """``query: [batch, seq, embed_dim]``; ``key`` defaults to ``query``, ``value`` to
    ``key``. Returns ``[batch, seq, embed_dim]``."""
    key = query if key is None else key
    value = key if value is None else value
    b, s, _ = query.shape
    q = self.q_proj(query).view(b, s, self.num_heads, self.head_dim)
    k = self.k_proj(key).view(b, s, self.num_kv_heads, self.head_dim)
    v = self.v_proj(value).view(b, s, self.num_kv_heads, self.head_dim)
    x = self.attention(q, k, v, causal=causal).reshape(b, s, self.embed_dim)
    if self.norm is not None:
      x = self.norm(x)
    return self.out_proj(x)
