"""Multi-head attention layer (Flax NNX) on top of ``jattn.flash_attention``, with a
contiguous or paged KV cache for decoding (``jattn.nn.kv_cache``)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jattn.flash import flash_attention
from jattn.fp8 import hadamard_rotation
from jattn.fp8_training import fp8_attention
from jattn.nn.kv_cache import KVCache, PagedKVCache, contiguous_block_tables


class MultiHeadAttention(nnx.Module):
  """Multi-head (or grouped-query) attention with flash attention inside.

  Projections are named ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``, as
  in most PyTorch attention modules, so torch checkpoints map over by name.

  Args:
    embed_dim: model width; ``x: [batch, seq, embed_dim]``.
    num_heads: query heads; ``embed_dim`` must divide evenly among them unless
      ``head_dim`` is given.
    num_kv_heads: key/value heads (default ``num_heads``); fewer gives GQA/MQA.
    head_dim: per-head width of queries and keys (default ``embed_dim // num_heads``).
    value_head_dim: per-head width of values (default ``head_dim``).
    causal, local_window, softcap: passed to ``flash_attention``.
    sinks: a learned sink logit per query head (``self.sinks``, zeros at start) in
      every row's softmax denominator.
    dropout_rate: dropout of the attention weights while training, drawn from the
      ``"dropout"`` stream of ``rngs``; ``deterministic=True`` (or ``model.eval()``)
      turns it off.
    use_bias: biases on the four projections.
    fp8: run the attention's forward in FP8 (``jattn.fp8_training.fp8_attention``: q, k, v
      quantised per KV head each call, FlashAttention-3's recipe) with the 16-bit
      backward of the unquantised attention; without softcap, sinks, dropout or segment
      ids. Decoding through a cache stays 16-bit.
    fp8_rotation: with ``fp8``, rotate q and k by a random-sign Hadamard matrix (fixed
      per layer) before quantising, which cuts the error of outliers; head_dim a power
      of two.
    backend: ``flash_attention`` backend.
    dtype: computation dtype (params stay in ``param_dtype``).
    rngs: ``nnx.Rngs`` for initialisation (and dropout).

  Decoding: ``init_cache`` (contiguous) or ``init_paged_cache`` (pages) creates
  ``self.cache``, and ``layer(x, decode=True)`` appends ``x``'s tokens to it and
  attends causally to everything cached (docs/serving.md).
  """

  def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, value_head_dim: int | None = None,
               causal: bool = False, local_window=None, softcap: float | None = None,
               sinks: bool = False, dropout_rate: float = 0.0, deterministic: bool = False,
               use_bias: bool = True, fp8: bool = False, fp8_rotation: bool = False,
               backend: str = "auto", dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    if head_dim is None:
      if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                         "or pass head_dim")
      head_dim = embed_dim // num_heads
    if not (0 <= dropout_rate < 1):
      raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    dropout_rate = float(dropout_rate)
    if fp8 and (softcap is not None or sinks or dropout_rate):
      raise ValueError("fp8=True runs the attention without softcap, sinks or dropout")
    if fp8_rotation and not fp8:
      raise ValueError("fp8_rotation applies with fp8=True")
    # A fixed rotation per layer (data: it rides through jit as an array).
    self.fp8 = fp8
    self.fp8_rotation = nnx.data(hadamard_rotation(head_dim, rngs.params())
                                 if fp8_rotation else None)
    self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
    self.head_dim = head_dim
    self.value_head_dim = head_dim if value_head_dim is None else value_head_dim
    self.causal, self.local_window, self.softcap = causal, local_window, softcap
    self.backend, self.dtype = backend, dtype
    self.dropout_rate, self.deterministic = dropout_rate, deterministic
    # As nnx.Dropout: a fork of the "dropout" stream, so each call draws a new mask.
    self.dropout_rngs = rngs["dropout"].fork() if dropout_rate else None
    linear = lambda i, o: nnx.Linear(i, o, use_bias=use_bias, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(embed_dim, num_heads * head_dim)
    self.k_proj = linear(embed_dim, num_kv_heads * head_dim)
    self.v_proj = linear(embed_dim, num_kv_heads * self.value_head_dim)
    self.out_proj = linear(num_heads * self.value_head_dim, embed_dim)
    self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if sinks else None
    # Data, not static: init_cache puts a module holding state here.
    self.cache: KVCache | PagedKVCache | None = nnx.data(None)

  def init_cache(self, input_shape: tuple, dtype=jnp.float32) -> None:
    """Creates an empty contiguous KV cache (``self.cache``, a ``KVCache``) for
    ``x: input_shape = (batch, max_length, embed_dim)``: every row holds up to
    ``max_length`` tokens, at lengths of its own. Replaces any cache there was."""
    if len(input_shape) != 3 or input_shape[-1] != self.embed_dim:
      raise ValueError(f"init_cache takes (batch, max_length, embed_dim) with embed_dim "
                       f"{self.embed_dim} (the layer's), got {tuple(input_shape)}")
    self.cache = KVCache(input_shape, self.num_kv_heads, self.head_dim, self.value_head_dim,
                         dtype)

  def init_paged_cache(self, num_pages: int, page_size: int, batch: int, pages_per_seq: int,
                       dtype=jnp.float32, block_tables=None) -> None:
    """Creates an empty paged KV cache (``self.cache``, a ``PagedKVCache``): a pool of
    ``num_pages`` pages of ``page_size`` tokens; row ``b``'s token ``t`` sits in page
    ``block_tables[b, t // page_size]``. ``block_tables: [batch, pages_per_seq]`` ints
    (default: row ``b`` owns pages ``[b * pages_per_seq, (b + 1) * pages_per_seq)``,
    which needs ``num_pages >= batch * pages_per_seq``). Replaces any cache there was.
    Decoding through it runs ``jattn.paged_attention`` on the layer's ``backend``, which
    must be one that op takes (any but ``"cudnn"``)."""
    if block_tables is None:
      if num_pages < batch * pages_per_seq:
        raise ValueError(f"the default block tables give each of {batch} rows "
                         f"{pages_per_seq} pages of their own: num_pages must be at least "
                         f"{batch * pages_per_seq}, got {num_pages} (or pass block_tables)")
      block_tables = contiguous_block_tables(batch, pages_per_seq)
    block_tables = jnp.asarray(block_tables)
    if block_tables.shape != (batch, pages_per_seq):
      raise ValueError(f"block_tables must be [batch, pages_per_seq] = {(batch, pages_per_seq)}"
                       f", got shape {block_tables.shape}")
    self.cache = PagedKVCache(num_pages, page_size, block_tables, self.num_kv_heads,
                              self.head_dim, self.value_head_dim, dtype)

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               deterministic: bool | None = None, decode: bool = False, lengths=None):
    """Attends from ``x: [batch, q_len, embed_dim]`` to ``context`` (default ``x``).

    ``segment_ids: [batch, q_len]`` / ``context_segment_ids: [batch, kv_len]``
    restrict attention to equal ids (packed sequences); for self-attention the
    context ids default to ``segment_ids``. ``deterministic`` overrides the module's
    (no dropout). Returns ``[batch, q_len, embed_dim]``.

    ``decode=True`` (after ``init_cache`` or ``init_paged_cache``): self-attention
    through the cache. ``x``'s tokens (a prompt, a chunk of one, or one new token per
    row) are appended at each row's cached length, and each attends causally to the
    row's cached tokens and those before it in ``x`` (always causal, whatever
    ``causal`` says; no dropout). ``lengths: [batch]`` ints: how many of ``x``'s tokens
    each row really has (default all; left-aligned, the rest padding, not cached; their
    attention is zero, so the layer gives ``out_proj``'s bias there).
    """
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"x must be [batch, seq, {self.embed_dim}], got shape {x.shape}")
    if decode:
      if context is not None or segment_ids is not None or context_segment_ids is not None:
        raise ValueError("decode=True is self-attention through the cache: no context or "
                         "segment ids")
      return self._decode(x, lengths)
    if lengths is not None:
      raise ValueError("lengths counts the new tokens of decode=True calls; without decode "
                       "use segment_ids")
    context = x if context is None else context
    if context.ndim != 3 or context.shape[-1] != self.embed_dim:
      raise ValueError(f"context must be [batch, seq, {self.embed_dim}], got {context.shape}")
    if segment_ids is not None and context_segment_ids is None:
      if context is not x:
        raise ValueError("cross-attention with segment_ids needs context_segment_ids too")
      context_segment_ids = segment_ids
    b, q_len, kv_len = x.shape[0], x.shape[1], context.shape[1]
    q = self.q_proj(x).reshape(b, q_len, self.num_heads, self.head_dim)
    k = self.k_proj(context).reshape(b, kv_len, self.num_kv_heads, self.head_dim)
    v = self.v_proj(context).reshape(b, kv_len, self.num_kv_heads, self.value_head_dim)
    deterministic = self.deterministic if deterministic is None else deterministic
    dropout = {}
    if self.dropout_rate and not deterministic:
      dropout = dict(dropout_rate=self.dropout_rate, dropout_key=self.dropout_rngs())
    if self.fp8:
      o = fp8_attention(q, k, v, causal=self.causal, local_window=self.local_window,
                        q_segment_ids=segment_ids, kv_segment_ids=context_segment_ids,
                        rotation=self.fp8_rotation, backend=self.backend)
    else:
      o = flash_attention(q, k, v, causal=self.causal, local_window=self.local_window,
                          softcap=self.softcap, q_segment_ids=segment_ids,
                          kv_segment_ids=context_segment_ids, backend=self.backend,
                          sinks=None if self.sinks is None else self.sinks[...], **dropout)
    return self.out_proj(o.reshape(b, q_len, self.num_heads * self.value_head_dim))

  def _decode(self, x, lengths):
    """``decode=True``: project ``x``, append its keys and values to ``self.cache``,
    attend through it."""
    if self.cache is None:
      raise ValueError("decode=True needs a KV cache: call layer.init_cache((batch, "
                       "max_length, embed_dim), dtype) or layer.init_paged_cache(...) first")
    self.cache.check_input(x.shape)
    b, n = x.shape[:2]
    q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, n, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, n, self.num_kv_heads, self.value_head_dim)
    sinks = None if self.sinks is None else self.sinks[...]
    o = self.cache.attend(q, k, v, lengths, local_window=self.local_window,
                          softcap=self.softcap, sinks=sinks, backend=self.backend)
    o = o.astype(q.dtype)
    return self.out_proj(o.reshape(b, n, self.num_heads * self.value_head_dim))
