"""PyTorch references of the jattn ops, computed independently of JAX.

Tensors use jattn's layout ``[batch, seq, heads, head_dim]``; the functions
transpose to torch's ``[batch, heads, seq, head_dim]`` internally. This module imports
torch; code that must run without torch imports it only where it is needed
(``jattn.interop.torch_import``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from jattn.flex.examples import CAP, WINDOW, example_arrays


def flash_attention_mask(q_len: int, kv_len: int, *, causal=False, local_window=None,
                         q_segment_ids=None, kv_segment_ids=None, lengths=None, device=None):
  """Boolean ``[batch or 1, 1, q_len, kv_len]`` mask, True where a query may attend.

  Same semantics as ``jattn.flash_attention``: queries aligned bottom-right
  (query ``i`` at key position ``i + kv_len - q_len``); with ``lengths`` (``[batch,
  2]``: each row's ``(q_len, kv_len)``) on the row's own, and queries and keys past
  them attend nothing.
  """
  q_idx = torch.arange(q_len, device=device)[:, None]
  k_pos = torch.arange(kv_len, device=device)[None, :]
  q_pos = q_idx + (kv_len - q_len)
  mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
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
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask = mask & same[:, None]
  return mask


def flash_attention_torch(q, k, v, *, causal=False, scale=None, q_segment_ids=None,
                          kv_segment_ids=None, local_window=None, softcap=None, sinks=None,
                          dropout_keep=None, dropout_rate: float = 0.0, lengths=None):
  """Attention through ``torch.nn.functional.scaled_dot_product_attention``.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``,
      v: ``[..., head_dim_v]`` torch tensors (GQA handled by repeating kv heads).
    sinks: ``[q_heads]`` sink logits in each row's denominator, or None.
    dropout_keep: a boolean ``[batch, q_heads, q_len, kv_len]`` keep-mask (jattn's,
      so that both sides drop the same weights) applied with ``dropout_rate``.
    lengths: ``[batch, 2]`` each row's ``(q_len, kv_len)`` (``q_lengths`` and
      ``kv_lengths`` together), or None.
    Other arguments as ``jattn.flash_attention``. A soft-cap, sinks or a given
    dropout mask cannot be expressed through SDPA, so those cases compute the softmax
    explicitly in torch.

  Returns:
    ``[batch, q_len, q_heads, head_dim_v]``; rows that see no key are zeros.
  """
  q_len, q_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
  kv_len, kv_heads = k.shape[1], k.shape[2]
  scale = head_dim ** -0.5 if scale is None else scale
  qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
  if kv_heads != q_heads:
    kt = kt.repeat_interleave(q_heads // kv_heads, dim=1)
    vt = vt.repeat_interleave(q_heads // kv_heads, dim=1)
  mask = flash_attention_mask(q_len, kv_len, causal=causal, local_window=local_window,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              lengths=lengths, device=q.device)
  # SDPA turns a row with no allowed key into NaN; open such rows up and zero
  # their output afterwards (the zeroing also stops their gradient).
  empty = ~mask.any(dim=-1, keepdim=True)
  mask = mask | empty
  if softcap is None and sinks is None and dropout_keep is None:
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
  else:
    logits = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * scale
    if softcap is not None:
      logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a column per head that attends to nothing
      sink = sinks.float()[None, :, None, None].expand(*logits.shape[:-1], 1)
      logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :kv_len]
    if dropout_keep is not None:
      probs = probs * dropout_keep / (1.0 - dropout_rate)
    out = torch.matmul(probs, vt.float()).to(q.dtype)
  out = out.masked_fill(empty, 0.0)
  return out.transpose(1, 2)


def fp8_attention_torch(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False,
                        scale=None, local_window=None, q_segment_ids=None,
                        kv_segment_ids=None, out_dtype=torch.bfloat16):
  """The FP8 recipe (``jattn.fp8``) in torch: ``float8_e4m3fn`` q, k, v with ``[kv_heads]``
  float32 descales; scores from the FP8 values times the descales, the softmax in
  float32 with its probabilities rounded to ``float8_e4m3fn`` for ``p v`` and the
  float32 row sums dividing after. ``[batch, q_len, q_heads, head_dim_v]`` in
  ``out_dtype``; rows that see no key are zeros."""
  q_len, q_heads, head_dim = q8.shape[1], q8.shape[2], q8.shape[3]
  kv_len, kv_heads = k8.shape[1], k8.shape[2]
  group = q_heads // kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  per_q_head = lambda d: d.float().reshape(-1).expand(kv_heads).repeat_interleave(group)
  qt, kt, vt = (x.float().transpose(1, 2) for x in (q8, k8, v8))
  kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
  logits = torch.matmul(qt, kt.transpose(-1, -2))
  logits = logits * (per_q_head(q_descale) * per_q_head(k_descale) * scale)[None, :, None, None]
  # a key with a non-finite value row: NaN for the rows that see it, none for the others
  bad = ~torch.isfinite(vt).all(-1)  # [batch, q_heads, kv_len]
  vt = vt.masked_fill(bad[..., None], 0.0)
  logits = logits.masked_fill(bad[:, :, None, :], float("nan"))
  mask = flash_attention_mask(q_len, kv_len, causal=causal, local_window=local_window,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              device=q8.device)
  row_max = logits.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
  row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
  probs = torch.exp(logits - row_max).masked_fill(~mask, 0.0)
  total = probs.sum(-1, keepdim=True)
  probs = probs.to(torch.float8_e4m3fn).float()
  out = torch.matmul(probs, vt) * per_q_head(v_descale)[None, :, None, None]
  out = out / torch.where(total > 0, total, torch.ones_like(total))
  return out.to(out_dtype).transpose(1, 2)


def retention_torch(q, k, v, *, decay=None, scale=None, normalize=None, mode=None,
                    chunk_size=None):
  """RetNet retention in torch (parallel form, float32), following the paper.

  ``q, k: [batch, q_len, heads, dk]`` / ``[batch, kv_len, heads, dk]``, ``v:
  [batch, kv_len, heads, dv]``; queries are the last ``q_len`` positions. ``mode``
  and ``chunk_size`` are accepted and ignored: every form computes this function.
  With ``normalize="abs_sum"`` rows are divided by ``max(Σ|S|, 1)``, detached.
  """
  del mode, chunk_size
  dtype = q.dtype
  q, k, v = q.float(), k.float(), v.float()
  heads, dk = q.shape[2], q.shape[3]
  q_len, kv_len = q.shape[1], k.shape[1]
  if decay is None:
    decay = 1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float32, device=q.device))
  decay = torch.as_tensor(decay, dtype=torch.float32, device=q.device)
  scale = dk ** -0.5 if scale is None else scale
  dist = (torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
          - torch.arange(kv_len, device=q.device)[None, :])
  weights = decay[:, None, None] ** dist.clamp(min=0).float()
  weights = torch.where(dist >= 0, weights, torch.zeros_like(weights))
  scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale * weights
  if normalize == "abs_sum":
    scores = scores / scores.detach().abs().sum(-1, keepdim=True).clamp(min=1.0)
  return torch.einsum("bhqk,bkhd->bqhd", scores, v).to(dtype)


def retention_step_torch(q, k, v, state, *, decay=None, scale=None):
  """One recurrent retention step in torch (float32): ``S' = γ S + kᵀ v``,
  ``o = scale · q S'``; ``q, k: [batch, heads, dk]``, ``v: [batch, heads, dv]``,
  ``state: [batch, heads, dk, dv]``. Returns ``(o, S')``."""
  heads, dk = q.shape[1], q.shape[2]
  if decay is None:
    decay = 1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float32, device=q.device))
  decay = torch.as_tensor(decay, dtype=torch.float32, device=q.device)
  scale = dk ** -0.5 if scale is None else scale
  state = decay[None, :, None, None] * state.float() + torch.einsum(
      "bhk,bhv->bhkv", k.float(), v.float())
  return (scale * torch.einsum("bhk,bhkv->bhv", q.float(), state)).to(q.dtype), state


def window_attention_torch(q, k, v, bias, *, mask=None, scale=None):
  """Window attention as Swin / DAT compute it, in float32: ``softmax(scale · q kᵀ +
  bias + mask) v``.

  ``q, k, v: [windows, tokens, heads, head_dim]``, ``bias: [heads, tokens, tokens]``,
  ``mask: [mask_windows, tokens, tokens]`` (additive float, or boolean with True =
  may attend); window ``w`` adds ``mask[w % mask_windows]``. Rows with no allowed key
  give zeros.
  """
  dtype = q.dtype
  windows, _, _, head_dim = q.shape
  scale = head_dim ** -0.5 if scale is None else scale
  qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))  # [windows, heads, tokens, d]
  logits = (qt * scale) @ kt.transpose(-1, -2) + bias.float().unsqueeze(0)
  if mask is not None:
    mask = torch.as_tensor(mask, device=q.device)
    if mask.dtype == torch.bool:
      mask = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
    index = torch.arange(windows, device=q.device) % mask.shape[0]
    logits = logits + mask.float()[index].unsqueeze(1)
  empty = torch.isneginf(logits).all(dim=-1, keepdim=True)
  probs = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
  return (probs @ vt).transpose(1, 2).to(dtype)


class MultiScaleRetentionTorch(torch.nn.Module):
  """torchscale-style multi-scale retention (parallel form), written from its formulas.

  Parameter names match ``jattn.nn.MultiScaleRetention``: bias-free ``q_proj``,
  ``k_proj``, ``v_proj``, ``g_proj``, ``out_proj``. As in torchscale, the decay mask's
  rows are divided by the square root of their sums and the scores' rows by
  ``max(Σ|S|, 1)`` (detached) before the per-head RMS norm.
  """

  def __init__(self, embed_dim: int, num_heads: int, value_dim: int | None = None,
               eps: float = 1e-6):
    super().__init__()
    value_dim = 2 * embed_dim if value_dim is None else value_dim
    self.num_heads, self.eps = num_heads, eps
    self.key_dim, self.head_dim = embed_dim // num_heads, value_dim // num_heads
    linear = lambda i, o: torch.nn.Linear(i, o, bias=False)
    self.q_proj, self.k_proj = linear(embed_dim, embed_dim), linear(embed_dim, embed_dim)
    self.v_proj, self.g_proj = linear(embed_dim, value_dim), linear(embed_dim, value_dim)
    self.out_proj = linear(value_dim, embed_dim)

  def _theta_shift(self, x):
    t, d = x.shape[1], x.shape[-1]
    angle = 1.0 / (10000.0 ** torch.linspace(0, 1, d // 2, device=x.device))
    angle = angle.repeat_interleave(2)
    phase = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * angle[None]
    sin, cos = phase.sin()[None, :, None], phase.cos()[None, :, None]
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin

  def forward(self, x):
    b, t, _ = x.shape
    h = self.num_heads
    q = self.q_proj(x).view(b, t, h, self.key_dim)
    k = self.k_proj(x).view(b, t, h, self.key_dim) * self.key_dim ** -0.5
    v = self.v_proj(x).view(b, t, h, self.head_dim)
    g = self.g_proj(x)
    q, k = self._theta_shift(q), self._theta_shift(k)
    log_decay = torch.log(1 - 2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32,
                                                            device=x.device)))
    dist = torch.arange(t, device=x.device)[:, None] - torch.arange(t, device=x.device)[None]
    mask = torch.exp(dist.clamp(min=0)[None].float() * log_decay[:, None, None])
    mask = torch.where(dist[None] >= 0, mask, torch.zeros_like(mask))
    mask = mask / mask.sum(-1, keepdim=True).sqrt()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * mask
    scores = scores / scores.detach().abs().sum(-1, keepdim=True).clamp(min=1.0)
    o = torch.einsum("bhqk,bkhd->bqhd", scores, v)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.out_proj(F.silu(g) * o.reshape(b, t, -1))


def multi_scale_retention_torch(embed_dim: int, num_heads: int, **kwargs):
  """A torch ``MultiScaleRetentionTorch`` module."""
  return MultiScaleRetentionTorch(embed_dim, num_heads, **kwargs)


def flex_attention_torch(q, k, v, *, example: str, scale=None):
  """PyTorch's FlexAttention on a named example of ``jattn.flex.examples``, with the
  functions spelled for torch. q: ``[batch, q_len, q_heads, d]``, k, v: ``[batch,
  kv_len, kv_heads, d]``. Differentiable on CUDA; on the CPU, where torch's
  FlexAttention has no backward, the output carries no gradient."""
  # torch.nn.attention.flex_attention is public from torch 2.5 (jattn takes 2.4):
  # imported here, so that the other references work without it.
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention

  batch, q_len, q_heads, _ = q.shape
  kv_len = k.shape[1]
  arrays = {name: torch.tensor(a, device=q.device)  # a copy: the numpy arrays are read-only
            for name, a in example_arrays(example, batch, q_heads, q_len, kv_len).items()}
  offset = kv_len - q_len
  score_mod = mask_mod = None
  if example == "alibi_causal":
    slopes = arrays["slopes"]
    score_mod = lambda s, b, h, i, j: s + slopes[h] * (j - i)
    mask_mod = lambda b, h, i, j: j <= i + offset
  elif example == "documents":
    ids = arrays["ids"]
    mask_mod = lambda b, h, i, j: ids[b, i + offset] == ids[b, j]
  elif example == "sliding_window":
    mask_mod = lambda b, h, i, j: (j <= i + offset) & (j >= i + offset - WINDOW)
  else:
    # CAP is read as a module global: dynamo then keeps it a constant (a closed-over
    # float would become a symbolic input FlexAttention rejects).
    score_mod = lambda s, b, h, i, j: CAP * torch.tanh(s / CAP)
  block_mask = None if mask_mod is None else create_block_mask(
      mask_mod, batch, None, q_len, kv_len, device=q.device)
  on_cpu = q.device.type == "cpu"
  heads_first = lambda x: (x.detach() if on_cpu else x).permute(0, 2, 1, 3)
  with warnings.catch_warnings():  # eager FlexAttention warns it is unfused: fine for a reference
    warnings.simplefilter("ignore")
    o = flex_attention(heads_first(q), heads_first(k), heads_first(v), score_mod=score_mod,
                       block_mask=block_mask, scale=scale, enable_gqa=True)
  return o.permute(0, 2, 1, 3)
