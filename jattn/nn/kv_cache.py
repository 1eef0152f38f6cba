"""The KV caches of ``MultiHeadAttention`` for autoregressive decoding.

Two layouts of the same state, each with one method, ``attend(q, k, v, counts)``: write
this call's new keys and values at each batch row's current length, advance the lengths,
and attend from the new queries to everything the row has cached.

- ``KVCache``: one contiguous ``[batch, max_length, ...]`` buffer per K and V (dense
  batches, one compile for every length), attended by ``flash_attention``.
- ``PagedKVCache``: K and V in a pool of fixed-size pages that a block table maps each
  row's positions to (many sequences of very different lengths share one pool),
  written by ``write_kv_pages`` and attended by ``paged_attention`` (``jattn.paged``).

Everything they hold is ``AttentionCache`` state: a step under ``nnx.jit`` writes the new
values back into the module, and ``nnx.state(model, nnx.Cache)`` selects them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.flash import flash_attention
from jattn.paged import paged_attention, write_kv_pages


class AttentionCache(nnx.Cache):
  """The state of a KV cache (keys, values, lengths, block tables). A subclass of
  ``nnx.Cache``: filters on either select it, and ``nnx.Param`` filters leave it out."""


def new_token_counts(counts, batch: int, new: int):
  """``[batch]`` int32: how many of a call's ``new`` tokens each row really has (the rest
  are right padding). ``None`` means all of them; values are clipped to ``[0, new]``."""
  if counts is None:
    return jnp.full((batch,), new, jnp.int32)
  counts = jnp.asarray(counts)
  if counts.shape != (batch,) or not jnp.issubdtype(counts.dtype, jnp.integer):
    raise ValueError(f"lengths must be [batch] = ({batch},) integers, got shape "
                     f"{counts.shape} {counts.dtype}")
  return jnp.clip(counts, 0, new).astype(jnp.int32)


def check_room(lengths, needed, capacity: int, what: str) -> None:
  """Raises if some row would pass ``capacity`` cached tokens, when the values are known.

  Under ``jit`` they are traced and nothing can raise: the caches document what happens
  to tokens past the end instead (they never corrupt the tokens before it)."""
  try:
    worst = int(jnp.max(lengths + needed))
  except jax.errors.ConcretizationTypeError:  # traced: no check possible
    return
  if worst > capacity:
    raise ValueError(f"the {what} holds {capacity} tokens per row; this call would take a "
                     f"row to {worst} (cached lengths {lengths.tolist()})")


def _mismatch(x_shape: tuple, batch: int, cache_shape: tuple, new: int, capacity: int):
  if x_shape[0] != batch:
    raise ValueError(f"x has shape {tuple(x_shape)} but the cache was made for batch "
                     f"{batch} (init shape {cache_shape})")
  if new > capacity:
    raise ValueError(f"x has shape {tuple(x_shape)}: {new} tokens at once are more than "
                     f"the cache holds per row (init shape {cache_shape})")


class KVCache(nnx.Module):
  """A contiguous KV cache.

  State (``AttentionCache``): ``k: [batch, max_length, kv_heads, head_dim]``,
  ``v: [batch, max_length, kv_heads, value_head_dim]``, ``lengths: [batch]`` int32
  (tokens cached per row, starting at 0). ``input_shape`` is the ``(batch, max_length,
  embed_dim)`` it was made for.

  A row never holds more than ``max_length`` tokens: eagerly a call that would pass it
  raises; under ``jit`` the tokens past the end are dropped (not written, the length
  stops at ``max_length``) and their outputs are meaningless.
  """

  def __init__(self, input_shape: tuple, kv_heads: int, head_dim: int, value_head_dim: int,
               dtype):
    batch, max_length, _ = input_shape
    self.input_shape = tuple(input_shape)
    self.k = AttentionCache(jnp.zeros((batch, max_length, kv_heads, head_dim), dtype))
    self.v = AttentionCache(jnp.zeros((batch, max_length, kv_heads, value_head_dim), dtype))
    self.lengths = AttentionCache(jnp.zeros((batch,), jnp.int32))

  def check_input(self, x_shape: tuple) -> None:
    """Raises (naming both shapes) if ``x: [batch, new, embed_dim]`` does not fit."""
    batch, capacity, _ = self.input_shape
    _mismatch(x_shape, batch, self.input_shape, x_shape[1], capacity)

  def attend(self, q, k, v, counts=None, **options):
    """Appends ``k, v: [batch, new, kv_heads, *]`` at each row's length and attends
    causally from ``q: [batch, new, q_heads, head_dim]`` to the row's whole cache.

    ``counts: [batch]`` (default ``new``): the row's real tokens; its later ones are
    padding, neither cached nor attended, and give zero outputs. Query ``i`` of row
    ``b`` sits at position ``lengths[b] + i``. ``options`` go to ``flash_attention``.
    Returns ``[batch, new, q_heads, value_head_dim]`` in the cache's dtype.
    """
    batch, new = q.shape[:2]
    capacity = self.k.shape[1]
    counts = new_token_counts(counts, batch, new)
    old = self.lengths[...]
    check_room(old, counts, capacity, "KV cache")
    # One scatter writes every row at its own offset. Padding tokens and tokens past the
    # end get an out-of-range index and mode="drop" skips them (dynamic_update_slice
    # would clamp the start instead, overwriting a full row's last tokens).
    steps = jnp.arange(new)[None, :]
    positions = jnp.where(steps < counts[:, None], old[:, None] + steps, capacity)
    rows = jnp.arange(batch)[:, None]
    dtype = self.k.dtype
    self.k[...] = self.k[...].at[rows, positions].set(k.astype(dtype), mode="drop")
    self.v[...] = self.v[...].at[rows, positions].set(v.astype(dtype), mode="drop")
    lengths = jnp.minimum(old + counts, capacity)
    self.lengths[...] = lengths
    # Bottom-right alignment on each row's own lengths puts query i at old + i; the
    # tokens that found room are the queries (the rest are padding, dropped).
    return flash_attention(q.astype(dtype), self.k[...], self.v[...], causal=True,
                           q_lengths=lengths - old, kv_lengths=lengths, **options)


def contiguous_block_tables(batch: int, pages_per_seq: int):
  """``[batch, pages_per_seq]`` int32: row ``b`` owns pages ``[b * pages_per_seq,
  (b + 1) * pages_per_seq)``, the trivial allocation."""
  return jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)


class PagedKVCache(nnx.Module):
  """A paged KV cache: token ``t`` of row ``b`` sits in page ``block_tables[b, t //
  page_size]``, slot ``t % page_size``.

  State (``AttentionCache``): ``k_pages: [num_pages, page_size, kv_heads, head_dim]``,
  ``v_pages: [num_pages, page_size, kv_heads, value_head_dim]``, ``block_tables:
  [batch, pages_per_seq]`` int32 and ``lengths: [batch]`` int32. Block tables and
  lengths are plain state: a server may rewrite them between calls (give a row other
  pages, set a finished row's length to 0 to start a new sequence in it).

  A row holds at most ``pages_per_seq * page_size`` tokens: eagerly a call that would
  pass that raises; under ``jit`` the tokens past the row's pages are dropped, as in
  ``KVCache``.
  """

  def __init__(self, num_pages: int, page_size: int, block_tables, kv_heads: int,
               head_dim: int, value_head_dim: int, dtype):
    batch = block_tables.shape[0]
    self.k_pages = AttentionCache(jnp.zeros((num_pages, page_size, kv_heads, head_dim), dtype))
    self.v_pages = AttentionCache(
        jnp.zeros((num_pages, page_size, kv_heads, value_head_dim), dtype))
    self.block_tables = AttentionCache(jnp.asarray(block_tables, jnp.int32))
    self.lengths = AttentionCache(jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    """Tokens one row can hold."""
    return self.block_tables.shape[1] * self.k_pages.shape[1]

  def check_input(self, x_shape: tuple) -> None:
    """Raises (naming both shapes) if ``x: [batch, new, embed_dim]`` does not fit."""
    shape = (f"{self.k_pages.shape[0]} pages of {self.k_pages.shape[1]}, block tables "
             f"{tuple(self.block_tables.shape)}")
    _mismatch(x_shape, self.block_tables.shape[0], shape, x_shape[1], self.capacity)

  def attend(self, q, k, v, counts=None, **options):
    """As ``KVCache.attend``, through the pages. ``options`` go to ``paged_attention``."""
    batch, new = q.shape[:2]
    counts = new_token_counts(counts, batch, new)
    old = self.lengths[...]
    check_room(old, counts, self.capacity, "paged KV cache")
    dtype, tables = self.k_pages.dtype, self.block_tables[...]
    # Padding (past counts) and tokens past a row's pages are not written.
    k_pages, v_pages = write_kv_pages(self.k_pages[...], self.v_pages[...], k.astype(dtype),
                                      v.astype(dtype), tables, old, counts)
    self.k_pages[...], self.v_pages[...] = k_pages, v_pages
    lengths = jnp.minimum(old + counts, self.capacity)
    self.lengths[...] = lengths
    return paged_attention(q.astype(dtype), k_pages, v_pages, tables, lengths,
                           q_lengths=lengths - old, causal=True, **options)
