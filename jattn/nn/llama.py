"""``LlamaForCausalLM``: the Llama-family decoder (Llama 2/3, Qwen2, Mistral) in Flax NNX,
with Hugging Face's parameter names, attention through ``jattn.flash_attention`` and a
KV cache (``jattn.nn.kv_cache``) for generation.

Pre-norm blocks: RMSNorm, grouped-query attention with rotary embeddings (rotated
halves, as Hugging Face checkpoints are laid out), RMSNorm, a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``); a final RMSNorm and the head (``lm_head``, or the
token embedding when tied). Mistral's and Qwen2's sliding windows are flash attention's
``local_window``.

The NNX attribute paths are the checkpoints' keys (``model.layers[3].self_attn.q_proj``
is ``model.layers.3.self_attn.q_proj.weight``), so ``jattn.interop`` loads them by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.flash import flash_attention
from jattn.nn.loaders import checkpoint_loader
from jattn.nn.generate import generate
from jattn.nn.kv_cache import KVCache
from jattn.nn.llama_config import LlamaConfig, rope_frequencies
from jattn.nn.norms import RMSNorm


def rotary(positions, inv_freq):
  """``(cos, sin)``, each ``[batch, seq, 1, head_dim]`` float32, of the rotary angles at
  ``positions: [batch, seq]`` ints for the ``[head_dim // 2]`` ``inv_freq`` (both halves
  of a head share them). Computed once per forward, shared by every layer."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def rotate(x, cos_sin):
  """The rotary embedding of ``x: [batch, seq, heads, head_dim]`` by ``rotary``'s
  ``(cos, sin)``, cast to ``x``'s dtype: the two halves of each head rotated together."""
  cos, sin = (t.astype(x.dtype) for t in cos_sin)
  half = x.shape[-1] // 2
  turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + turned * sin


def _linear(i, o, bias, dtype, param_dtype, rngs):
  return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class LlamaAttention(nnx.Module):
  """Grouped-query causal self-attention with rotary embeddings; ``window`` (keys seen,
  itself included) makes it sliding."""

  def __init__(self, c: LlamaConfig, window, *, backend, dtype, param_dtype, rngs):
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    self.q_proj = _linear(c.hidden_size, heads * d, c.qkv_bias, dtype, param_dtype, rngs)
    self.k_proj = _linear(c.hidden_size, kv * d, c.qkv_bias, dtype, param_dtype, rngs)
    self.v_proj = _linear(c.hidden_size, kv * d, c.qkv_bias, dtype, param_dtype, rngs)
    self.o_proj = _linear(heads * d, c.hidden_size, c.o_bias, dtype, param_dtype, rngs)
    self.heads, self.kv_heads, self.head_dim = heads, kv, d
    self.local_window = None if window is None else (window - 1, 0)
    self.backend = backend
    self.cache: KVCache | None = nnx.data(None)

  def __call__(self, x, cos_sin, *, decode: bool, lengths):
    b, n, _ = x.shape
    q = self.q_proj(x).reshape(b, n, self.heads, self.head_dim)
    k = self.k_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
    q, k = rotate(q, cos_sin), rotate(k, cos_sin)
    if decode:
      o = self.cache.attend(q, k, v, lengths, local_window=self.local_window,
                            backend=self.backend).astype(q.dtype)
    else:
      o = flash_attention(q, k, v, causal=True, local_window=self.local_window,
                          q_lengths=lengths, kv_lengths=lengths, backend=self.backend)
    return self.o_proj(o.reshape(b, n, self.heads * self.head_dim))


class LlamaMLP(nnx.Module):
  """``down(silu(gate(x)) * up(x))``."""

  def __init__(self, c: LlamaConfig, *, dtype, param_dtype, rngs):
    w, h = c.hidden_size, c.intermediate_size
    self.gate_proj = _linear(w, h, c.mlp_bias, dtype, param_dtype, rngs)
    self.up_proj = _linear(w, h, c.mlp_bias, dtype, param_dtype, rngs)
    self.down_proj = _linear(h, w, c.mlp_bias, dtype, param_dtype, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
  """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``x: [batch, seq, hidden_size]``."""

  def __init__(self, c: LlamaConfig, index: int, *, backend, dtype, param_dtype, rngs):
    self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
    self.self_attn = LlamaAttention(c, c.sliding_windows[index], backend=backend, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps,
                                            param_dtype=param_dtype)
    self.mlp = LlamaMLP(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x, cos_sin, *, decode: bool, lengths):
    x = x + self.self_attn(self.input_layernorm(x), cos_sin, decode=decode, lengths=lengths)
    return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
  """The decoder stack: ``embed_tokens``, ``layers``, ``norm``."""

  def __init__(self, c: LlamaConfig, *, backend, dtype, param_dtype, rngs):
    self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layers = nnx.List([LlamaDecoderLayer(c, i, backend=backend, dtype=dtype,
                                              param_dtype=param_dtype, rngs=rngs)
                            for i in range(c.num_hidden_layers)])
    self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)


class LlamaForCausalLM(nnx.Module):
  """A Llama-family causal LM: ``input_ids: [batch, seq]`` ints -> logits ``[batch, seq,
  vocab_size]`` (float32).

  Args:
    config: a ``LlamaConfig`` (``LlamaConfig.from_hf(config_dict)`` reads a Hugging
      Face ``config.json``).
    backend: the ``flash_attention`` backend of every layer.
    dtype: the computation dtype (default ``param_dtype``); RMSNorm statistics, rotary
      angles and the softmax run in float32 whatever it is.
    param_dtype: the parameters' dtype (``from_pretrained`` takes the checkpoint's).
    rngs: ``nnx.Rngs`` for a random initialisation.

  ``from_pretrained(folder)`` loads a Hugging Face folder (or ``jattn-convert``'s);
  ``from_torch(module_or_state_dict, config)`` a live torch model; ``generate(...)``
  decodes with a KV cache in one jitted loop.
  """

  def __init__(self, config: LlamaConfig, *, backend: str = "auto", dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    dtype = param_dtype if dtype is None else dtype
    self.config, self.dtype = config, dtype
    self.model = LlamaModel(config, backend=backend, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs)
    self.lm_head = None if config.tie_word_embeddings else _linear(
        config.hidden_size, config.vocab_size, False, dtype, param_dtype, rngs)

  @classmethod
  def from_pretrained(cls, folder, **kwargs) -> "LlamaForCausalLM":
    """The model of a Hugging Face folder (``config.json`` and ``model.safetensors`` or
    shards with ``model.safetensors.index.json``) or of a folder ``jattn-convert llama``
    wrote; read with numpy (no torch). ``kwargs``: ``dtype``, ``param_dtype`` (default the
    checkpoint's), ``backend`` (``jattn.interop.load_llama``)."""
    return checkpoint_loader("llama")(folder, **kwargs)

  @classmethod
  def from_torch(cls, module_or_state_dict, config=None, **kwargs) -> "LlamaForCausalLM":
    """The model of a live transformers model (its ``config`` is used unless given) or
    of a state dict with Hugging Face's keys and a ``config`` (a ``LlamaConfig``, a
    config dict or a transformers config); ``kwargs`` as ``from_pretrained``'s."""
    return checkpoint_loader("llama_torch")(module_or_state_dict, config, **kwargs)

  def init_cache(self, batch: int, max_length: int, dtype=None) -> None:
    """A contiguous KV cache in every layer: ``batch`` rows of up to ``max_length``
    tokens (default dtype: the computation dtype)."""
    shape = (batch, max_length, self.config.hidden_size)
    for layer in self.model.layers:
      attn = layer.self_attn
      attn.cache = KVCache(shape, attn.kv_heads, attn.head_dim, attn.head_dim,
                           self.dtype if dtype is None else dtype)

  def drop_cache(self) -> None:
    """Removes the KV caches (``init_cache`` makes new ones)."""
    for layer in self.model.layers:
      layer.self_attn.cache = None

  def cached_lengths(self):
    """``[batch]`` int32: the tokens cached per row."""
    cache = self.model.layers[0].self_attn.cache
    if cache is None:
      raise ValueError("no KV cache: call model.init_cache(batch, max_length) first")
    return cache.lengths[...]

  def __call__(self, input_ids, *, decode: bool = False, lengths=None):
    """Logits ``[batch, seq, vocab_size]`` float32 of ``input_ids: [batch, seq]``.

    ``lengths: [batch]`` ints: each row's real tokens (left-aligned, the rest padding,
    whose logits are meaningless; default all). ``decode=True`` (after ``init_cache``):
    the tokens continue each row's cached ones, at positions from its cached length on.
    """
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
      raise ValueError(f"input_ids must be [batch, seq] integers, got shape "
                       f"{input_ids.shape} {input_ids.dtype}")
    b, n = input_ids.shape
    if lengths is not None:
      lengths = jnp.asarray(lengths)
      if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be [batch] = ({b},) integers, got shape "
                         f"{lengths.shape} {lengths.dtype}")
      lengths = jnp.clip(lengths, 0, n).astype(jnp.int32)
    steps = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    positions = self.cached_lengths()[:, None] + steps if decode else steps
    cos_sin = rotary(positions, rope_frequencies(self.config))
    x = self.model.embed_tokens(input_ids)
    for layer in self.model.layers:
      x = layer(x, cos_sin, decode=decode, lengths=lengths)
    x = self.model.norm(x)
    logits = self.model.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32)

  def generate(self, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
               key=None, lengths=None):
    """``[batch, max_new_tokens]`` int32 new tokens after each row's prompt
    (``jattn.nn.generate.generate``: greedy by default, one jitted loop with a KV cache,
    ``lengths`` for right-padded prompts of different lengths, rows ending at
    ``eos_token_id``)."""
    return generate(self, input_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, eos_token_id=eos_token_id, key=key, lengths=lengths)
