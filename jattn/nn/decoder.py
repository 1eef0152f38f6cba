"""``DecoderLM``: a small GPT-style decoder language model on ``MultiHeadAttention``, with
the KV caches of ``jattn.nn.kv_cache`` for generation (``jattn.nn.generate``).

Pre-norm blocks (LayerNorm, causal attention, LayerNorm, a GELU MLP), learned absolute
position embeddings, a final LayerNorm and a head tied to the token embedding or not.
It is the model of docs/serving.md and of the serving benchmark, not a checkpoint
format: the names are plain (``embed``, ``positions``, ``blocks[i].attn`` / ``.mlp_in`` /
``.mlp_out``, ``norm``, ``head``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.nn.attention import MultiHeadAttention


class DecoderBlock(nnx.Module):
  """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; ``x: [batch, seq, embed_dim]``."""

  def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None,
               mlp_dim: int, backend: str, dtype, param_dtype, rngs: nnx.Rngs):
    norm = lambda: nnx.LayerNorm(embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    linear = lambda i, o: nnx.Linear(i, o, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm1, self.norm2 = norm(), norm()
    self.attn = MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads,
                                   causal=True, backend=backend, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
    self.mlp_in, self.mlp_out = linear(embed_dim, mlp_dim), linear(mlp_dim, embed_dim)

  def __call__(self, x, *, decode: bool = False, lengths=None):
    x = x + self.attn(self.norm1(x), decode=decode, lengths=lengths)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class DecoderLM(nnx.Module):
  """A decoder-only language model: ``tokens: [batch, seq]`` ints -> logits
  ``[batch, seq, vocab_size]`` (float32).

  Args:
    vocab_size, embed_dim, num_heads, num_layers: the sizes.
    num_kv_heads: key/value heads of every attention layer (default ``num_heads``;
      fewer gives grouped-query attention, a smaller KV cache).
    mlp_dim: hidden width of the MLPs (default ``4 * embed_dim``).
    max_positions: rows of the position embedding: the longest prompt plus generated
      tokens (positions past it reuse the last row).
    tie_embeddings: the output head is the token embedding (``embed.attend``);
      ``False`` gives a ``head`` of its own.
    backend: ``flash_attention`` / ``paged_attention`` backend of every layer.
    dtype, param_dtype: computation and parameter dtypes.
    rngs: ``nnx.Rngs`` for initialisation.

  The benchmark's model, for one: ``DecoderLM(32000, 1024, 16, 12, max_positions=2304,
  dtype=jnp.bfloat16, rngs=nnx.Rngs(0))`` with ``init_cache(8, 2304, jnp.bfloat16)``
  serves 8 rows of a 2048-token prompt and 256 new tokens.
  """

  def __init__(self, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, *,
               num_kv_heads: int | None = None, mlp_dim: int | None = None,
               max_positions: int = 2048, tie_embeddings: bool = True, backend: str = "auto",
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.vocab_size, self.max_positions = vocab_size, max_positions
    embed = lambda n: nnx.Embed(n, embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.embed, self.positions = embed(vocab_size), embed(max_positions)
    self.blocks = nnx.List([
        DecoderBlock(embed_dim, num_heads, num_kv_heads=num_kv_heads,
                     mlp_dim=mlp_dim or 4 * embed_dim, backend=backend, dtype=dtype,
                     param_dtype=param_dtype, rngs=rngs)
        for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(embed_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.head = None if tie_embeddings else nnx.Linear(
        embed_dim, vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> None:
    """A contiguous KV cache in every layer: ``batch`` rows of up to ``max_length``
    tokens (prompt and generated)."""
    for block in self.blocks:
      block.attn.init_cache((batch, max_length, block.attn.embed_dim), dtype)

  def init_paged_cache(self, num_pages: int, page_size: int, batch: int, pages_per_seq: int,
                       dtype=jnp.float32, block_tables=None) -> None:
    """A paged KV cache in every layer (``MultiHeadAttention.init_paged_cache``); the
    layers share the block tables, each has its own pages."""
    for block in self.blocks:
      block.attn.init_paged_cache(num_pages, page_size, batch, pages_per_seq, dtype,
                                  block_tables)

  def cached_lengths(self):
    """``[batch]`` int32: tokens cached per row (the first layer's count; they agree)."""
    cache = self.blocks[0].attn.cache
    if cache is None:
      raise ValueError("no KV cache: call model.init_cache(batch, max_length, dtype) or "
                       "model.init_paged_cache(...) first")
    return cache.lengths[...]

  def __call__(self, tokens, *, decode: bool = False, lengths=None):
    """Logits ``[batch, seq, vocab_size]`` float32 of ``tokens: [batch, seq]``.

    ``decode=True``: ``tokens`` continue each row's cached sequence (a prompt, a chunk
    of one, or one token per row), at positions from the row's cached length on.
    ``lengths: [batch]``: each row's real tokens in ``tokens`` (left-aligned; default
    all); the logits at padding positions are meaningless.
    """
    steps = jnp.arange(tokens.shape[1])[None, :]
    positions = self.cached_lengths()[:, None] + steps if decode else steps
    x = self.embed(tokens) + self.positions(jnp.minimum(positions, self.max_positions - 1))
    for block in self.blocks:
      x = block(x, decode=decode, lengths=lengths)
    x = self.norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x)
    return logits.astype(jnp.float32)
