"""A PyTorch twin of ``jattn.nn.DecoderLM`` for ``bench/generate.py``: the same
architecture, loaded with the same weights (``from_nnx``), decoding through a static KV
cache in the gpt-fast pattern.

- ``TorchDecoderLM(tokens, positions)``: pre-norm blocks (LayerNorm eps as the NNX
  model's, causal attention, LayerNorm, a tanh-GELU MLP), learned position embeddings
  (positions clipped to the table), a final LayerNorm and the head tied to the token
  embedding (or a ``head`` of its own). Logits ``[batch, seq, vocab]`` in the weights'
  dtype.
- The static cache (``setup_caches``): per layer ``k, v: [batch, kv_heads, max_length,
  head_dim]`` buffers written in place with ``index_copy_`` at ``positions`` (a ``[seq]``
  int64 tensor, the same for every row), and the attention mask ``key position <=
  query position`` built from it, so every call has static shapes and one compiled
  decode step (and one CUDA graph) serves every position.
- Attention is ``F.scaled_dot_product_attention`` over the whole cache with that mask.
  Grouped-query attention folds each KV head's query heads into its query rows
  (``[batch, kv_heads, group * seq, head_dim]``), so the cache is never repeated.
- ``from_nnx(model)`` copies a ``DecoderLM``'s parameters (Linear kernels transposed).

``STEPS`` maps an SDPA backend choice to a decode step ``(model, token [batch, 1],
position [1]) -> greedy token [batch, 1]``; each is its own function (its own
``torch.compile`` cache), the choice made inside it with ``sdpa_kernel``. gpt-fast
decodes with the math backend (inductor generates the attention) and prefills with
torch's default choice.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  num_layers: int
  mlp_dim: int
  max_positions: int
  tie_embeddings: bool = True
  eps: float = 1e-6

  @property
  def head_dim(self) -> int:
    return self.embed_dim // self.num_heads


class StaticKVCache(nn.Module):
  """``k, v: [batch, kv_heads, max_length, head_dim]``, written at given positions."""

  def __init__(self, batch, kv_heads, max_length, head_dim, dtype, device):
    super().__init__()
    shape = (batch, kv_heads, max_length, head_dim)
    self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
    self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

  def update(self, positions, k, v):
    """Writes ``k, v: [batch, kv_heads, seq, head_dim]`` at ``positions: [seq]``."""
    self.k.index_copy_(2, positions, k)
    self.v.index_copy_(2, positions, v)
    return self.k, self.v


class Attention(nn.Module):

  def __init__(self, c: Config):
    super().__init__()
    self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    self.q_proj = nn.Linear(c.embed_dim, c.num_heads * c.head_dim)
    self.k_proj = nn.Linear(c.embed_dim, c.num_kv_heads * c.head_dim)
    self.v_proj = nn.Linear(c.embed_dim, c.num_kv_heads * c.head_dim)
    self.out_proj = nn.Linear(c.num_heads * c.head_dim, c.embed_dim)
    self.cache: StaticKVCache | None = None

  def forward(self, x, positions, mask):
    """``x: [batch, seq, embed_dim]`` at ``positions``; ``mask: [seq, max_length]``."""
    b, n, _ = x.shape
    split = lambda t, heads: t.view(b, n, heads, self.head_dim).transpose(1, 2)
    q = split(self.q_proj(x), self.heads)
    k, v = self.cache.update(positions, split(self.k_proj(x), self.kv_heads),
                             split(self.v_proj(x), self.kv_heads))
    group = self.heads // self.kv_heads
    # Query head h reads KV head h // group (as jattn): fold the group into query rows.
    q = q.reshape(b, self.kv_heads, group * n, self.head_dim)
    mask = mask.repeat(group, 1) if group > 1 else mask
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    o = o.reshape(b, self.heads, n, self.head_dim).transpose(1, 2)
    return self.out_proj(o.reshape(b, n, self.heads * self.head_dim))


class Block(nn.Module):

  def __init__(self, c: Config):
    super().__init__()
    self.norm1 = nn.LayerNorm(c.embed_dim, eps=c.eps)
    self.attn = Attention(c)
    self.norm2 = nn.LayerNorm(c.embed_dim, eps=c.eps)
    self.mlp_in = nn.Linear(c.embed_dim, c.mlp_dim)
    self.mlp_out = nn.Linear(c.mlp_dim, c.embed_dim)

  def forward(self, x, positions, mask):
    x = x + self.attn(self.norm1(x), positions, mask)
    return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x)), approximate="tanh"))


class TorchDecoderLM(nn.Module):

  def __init__(self, c: Config):
    super().__init__()
    self.config = c
    self.embed = nn.Embedding(c.vocab_size, c.embed_dim)
    self.positions = nn.Embedding(c.max_positions, c.embed_dim)
    self.blocks = nn.ModuleList([Block(c) for _ in range(c.num_layers)])
    self.norm = nn.LayerNorm(c.embed_dim, eps=c.eps)
    self.head = None if c.tie_embeddings else nn.Linear(c.embed_dim, c.vocab_size, bias=False)
    self.register_buffer("key_positions", torch.zeros(0, dtype=torch.long), persistent=False)

  def setup_caches(self, batch: int, max_length: int, mark_static: bool = False):
    """A static KV cache in every layer, in the weights' dtype and device (zeros).
    ``mark_static``: tell dynamo the buffers keep their addresses (CUDA graphs)."""
    weight = self.embed.weight
    c = self.config
    for block in self.blocks:
      block.attn.cache = StaticKVCache(batch, c.num_kv_heads, max_length, c.head_dim,
                                       weight.dtype, weight.device)
      if mark_static:
        torch._dynamo.mark_static_address(block.attn.cache.k)
        torch._dynamo.mark_static_address(block.attn.cache.v)
    self.key_positions = torch.arange(max_length, device=weight.device)

  def forward(self, tokens, positions):
    """Logits ``[batch, seq, vocab]`` of ``tokens: [batch, seq]`` at ``positions: [seq]``
    (int64), appended to the caches."""
    mask = self.key_positions[None, :] <= positions[:, None]
    x = self.embed(tokens) + self.positions(positions.clamp(max=self.config.max_positions - 1))
    for block in self.blocks:
      x = block(x, positions, mask)
    x = self.norm(x)
    return F.linear(x, self.embed.weight if self.head is None else self.head.weight)


# ---------------------------------------------------------------- from the NNX model

def config_of(model) -> Config:
  """The ``Config`` of a ``jattn.nn.DecoderLM``."""
  block = model.blocks[0]
  attn = block.attn
  for name in ("local_window", "softcap", "sinks"):
    if getattr(attn, name, None) is not None:
      raise ValueError(f"the torch twin has no {name}")
  if attn.value_head_dim != attn.head_dim or attn.head_dim * attn.num_heads != attn.embed_dim:
    raise ValueError("the torch twin needs head_dim = value_head_dim = embed_dim / num_heads")
  return Config(vocab_size=model.embed.num_embeddings, embed_dim=model.embed.features,
                num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                num_layers=len(model.blocks), mlp_dim=block.mlp_in.out_features,
                max_positions=model.max_positions, tie_embeddings=model.head is None,
                eps=model.norm.epsilon)


def _tensor(param, transpose=False):
  array = np.array(param[...], dtype=np.float32)  # a writable copy; bfloat16 params too
  return torch.from_numpy(np.ascontiguousarray(array.T if transpose else array))


def nnx_state_dict(model) -> dict:
  """The torch state dict of a ``DecoderLM``'s parameters (float32)."""
  linear = lambda prefix, m: {f"{prefix}.weight": _tensor(m.kernel, transpose=True),
                              f"{prefix}.bias": _tensor(m.bias)}
  norm = lambda prefix, m: {f"{prefix}.weight": _tensor(m.scale), f"{prefix}.bias": _tensor(m.bias)}
  state = {"embed.weight": _tensor(model.embed.embedding),
           "positions.weight": _tensor(model.positions.embedding)}
  for i, block in enumerate(model.blocks):
    p = f"blocks.{i}"
    state |= norm(f"{p}.norm1", block.norm1) | norm(f"{p}.norm2", block.norm2)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
      state |= linear(f"{p}.attn.{name}", getattr(block.attn, name))
    state |= linear(f"{p}.mlp_in", block.mlp_in) | linear(f"{p}.mlp_out", block.mlp_out)
  state |= norm("norm", model.norm)
  if model.head is not None:
    state["head.weight"] = _tensor(model.head.kernel, transpose=True)
  return state


def from_nnx(model, dtype=torch.float32, device="cpu") -> TorchDecoderLM:
  """A ``TorchDecoderLM`` computing what ``model`` (a ``jattn.nn.DecoderLM``) computes,
  its weights cast to ``dtype``; inference only (no gradients)."""
  twin = TorchDecoderLM(config_of(model))
  twin.load_state_dict(nnx_state_dict(model), strict=True)
  return twin.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ---------------------------------------------------------------- greedy generation

def prefill(model, prompt, positions):
  """Caches ``prompt: [batch, seq]`` at ``positions = arange(seq)``; the greedy next token
  ``[batch, 1]`` (logits of every position computed, as the NNX model does)."""
  return model(prompt, positions)[:, -1:].argmax(-1)


def decode_step(model, token, position):
  """One token per row: ``token: [batch, 1]`` at ``position: [1]`` -> the greedy next."""
  return model(token, position)[:, -1:].argmax(-1)


def _decode_step_math(model, token, position):
  with sdpa_kernel([SDPBackend.MATH]):
    return decode_step(model, token, position)


def _decode_step_efficient(model, token, position):
  with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
    return decode_step(model, token, position)


def _decode_step_cudnn(model, token, position):
  with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    return decode_step(model, token, position)


# SDPA backend of the decode step -> the step ("default": torch's own choice).
STEPS = {"math": _decode_step_math, "default": decode_step,
         "efficient": _decode_step_efficient, "cudnn": _decode_step_cudnn}


def compiled(fn, compile_: bool, **options):
  """``torch.compile(fn, fullgraph=True, **options)``, or ``fn`` itself."""
  return torch.compile(fn, fullgraph=True, **options) if compile_ else fn


def configure_inductor(coordinate_descent: bool = True) -> None:
  """gpt-fast's inductor setting: coordinate-descent tuning of the generated kernels."""
  import torch._inductor.config as inductor_config
  inductor_config.coordinate_descent_tuning = coordinate_descent


def generate(prefill_fn, step_fn, model, prompt, steps: int, sync=lambda: None):
  """Greedy: the prefill's token then ``steps`` decode steps, ``[batch, 1 + steps]``
  int64; also the seconds of the prefill and of the decode loop (``sync`` waits for the
  device)."""
  n = prompt.shape[1]
  positions = torch.arange(n, device=prompt.device)
  position = torch.tensor([n], device=prompt.device)
  sync()
  start = time.perf_counter()
  token = prefill_fn(model, prompt, positions).clone()
  sync()
  middle = time.perf_counter()
  out = [token]
  for _ in range(steps):
    token = step_fn(model, token, position).clone()  # a CUDA graph's output is reused
    out.append(token)
    position += 1
  tokens = torch.cat(out, dim=1)
  sync()
  return tokens, middle - start, time.perf_counter() - middle
