"""KV caches of jattn.nn.MultiHeadAttention (contiguous, and paged through
jattn.paged_attention / write_kv_pages), DecoderLM and greedy generation: decoding
through a cache gives what a full causal pass over the same tokens gives."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jattn.nn import DecoderLM, KVCache, MultiHeadAttention, greedy_generate

EMBED, HEADS, KV_HEADS = 32, 4, 2
TOL = dict(atol=2e-5, rtol=2e-5)
KINDS = ["contiguous", "paged"]


# --- helpers ----------------------------------------------------------------------------

def make_layer(**options):
  return MultiHeadAttention(EMBED, HEADS, num_kv_heads=KV_HEADS, causal=True, backend="xla",
                            rngs=nnx.Rngs(0), **options)


def init(layer, kind: str, batch: int, max_length: int):
  """An empty cache of ``kind``; the paged one in 4-token pages, dealt out of order."""
  if kind == "contiguous":
    layer.init_cache((batch, max_length, EMBED))
  else:
    pages_per_seq = -(-max_length // 4)
    tables = jax.random.permutation(jax.random.PRNGKey(7), batch * pages_per_seq + 3)
    layer.init_paged_cache(batch * pages_per_seq + 3, 4, batch, pages_per_seq,
                           block_tables=tables[:batch * pages_per_seq].reshape(batch, -1))


STEP = nnx.jit(lambda layer, x, lengths: layer(x, decode=True, lengths=lengths))


def cached_keys(cache):
  """The keys a cache holds, ``[batch, capacity, kv_heads, head_dim]`` in token order."""
  if isinstance(cache, KVCache):
    return cache.k[...]
  pages = cache.k_pages[...][cache.block_tables[...]]
  return pages.reshape(pages.shape[0], -1, *pages.shape[3:])


def decode_in_chunks(layer, x, sizes, lengths=None):
  """Feeds ``x`` to the cache in chunks of ``sizes`` tokens (jitted); the outputs,
  concatenated."""
  outs, start = [], 0
  for i, size in enumerate(sizes):
    outs.append(STEP(layer, x[:, start:start + size], lengths if i == 0 else None))
    start += size
  return jnp.concatenate(outs, axis=1)


# --- the layer --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [(5, 1, 1, 1), (3, 3, 2)], ids=["prefill+steps", "chunks"])
def test_decode_matches_full_causal_pass(kind, sizes):
  """Prefill then single steps, or a chunked prefill, under nnx.jit, with GQA: the full
  causal pass's outputs; the cache holds every token."""
  layer = make_layer()
  x = jax.random.normal(jax.random.PRNGKey(0), (2, sum(sizes), EMBED))
  full = layer(x)
  init(layer, kind, 2, 12)
  chex.assert_trees_all_close(decode_in_chunks(layer, x, sizes), full, **TOL)
  chex.assert_trees_all_equal(layer.cache.lengths[...], jnp.array([8, 8], jnp.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_with_prompts_of_their_own_length(kind):
  """Left-aligned prompts of lengths 6, 2, 4 (right-padded to 6), then 3 steps: each row
  gives what the full causal pass over its own prompt and steps gives."""
  layer = make_layer()
  lengths, steps = jnp.array([6, 2, 4]), 3
  prompts = jax.random.normal(jax.random.PRNGKey(1), (3, 6, EMBED))
  tokens = jax.random.normal(jax.random.PRNGKey(2), (3, steps, EMBED))
  init(layer, kind, 3, 10)
  out = decode_in_chunks(layer, jnp.concatenate([prompts, tokens], 1), (6, 1, 1, 1), lengths)
  chex.assert_trees_all_equal(layer.cache.lengths[...], (lengths + steps).astype(jnp.int32))
  # Each row's prompt and steps, left-aligned in one full pass: with causal attention the
  # padding after them changes nothing.
  pad = lambda a, n: jnp.pad(a, ((0, 6 - n), (0, 0)))
  full = layer(jnp.stack([pad(jnp.concatenate([prompts[r, :n], tokens[r]]), n)
                          for r, n in enumerate(lengths.tolist())]))
  for row, n in enumerate(lengths.tolist()):
    ours = jnp.concatenate([out[row, :n], out[row, 6:]])
    chex.assert_trees_all_close(ours, full[row, :n + steps], **TOL)


def test_paged_cache_equals_contiguous_cache():
  """Same layer, same tokens, pages out of order: the same outputs and the same cached
  keys (gathered through the block table)."""
  layer = make_layer()
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 7, EMBED))
  lengths = jnp.array([5, 3])
  outs = {}
  for kind in ("contiguous", "paged"):
    init(layer, kind, 2, 8)
    outs[kind] = decode_in_chunks(layer, x, (5, 1, 1), lengths)
    outs[kind, "cache"] = layer.cache
  chex.assert_trees_all_close(outs["paged"], outs["contiguous"], **TOL)
  paged, contiguous = cached_keys(outs["paged", "cache"]), cached_keys(outs["contiguous", "cache"])
  for row, n in enumerate([7, 5]):
    chex.assert_trees_all_equal(paged[row, :n], contiguous[row, :n])


@pytest.mark.kernel
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_decode_as_the_reference_does(kind):
  """backend="auto" (here the Pallas kernels, in interpret mode on CPU): a prefill of rows
  of their own lengths (contiguous: the flash forward kernel), then single steps through
  the split-KV decode kernel (paged: reading K/V through the block table), as the xla
  backend does."""
  x = jax.random.normal(jax.random.PRNGKey(8), (3, 9, EMBED))
  lengths = jnp.array([6, 2, 4])
  outs = []
  for backend in ("auto", "xla"):
    layer = make_layer()
    layer.backend = backend
    init(layer, kind, 3, 40)
    outs.append(decode_in_chunks(layer, x, (6, 1, 1, 1), lengths))
  chex.assert_trees_all_close(*outs, atol=1e-5, rtol=1e-5)


def test_window_softcap_sinks_and_a_low_precision_cache():
  """The layer's local window, soft-cap and sinks apply in decoding too; a bfloat16
  cache decodes a float32 layer within bfloat16's precision."""
  layer = make_layer(local_window=(3, 0), softcap=5.0, sinks=True)
  layer.sinks[...] = jnp.linspace(-1.0, 1.0, HEADS)
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 8, EMBED))
  full = layer(x)
  init(layer, "contiguous", 2, 8)
  chex.assert_trees_all_close(decode_in_chunks(layer, x, (5, 1, 1, 1)), full, **TOL)
  layer.init_cache((2, 8, EMBED), jnp.bfloat16)
  chex.assert_trees_all_close(decode_in_chunks(layer, x, (5, 1, 1, 1)), full,
                              atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_writes_past_the_end_raise_eagerly_and_are_dropped_under_jit(kind):
  layer = make_layer()
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 4, EMBED))
  init(layer, kind, 2, 4)
  layer(x[:, :3], decode=True, lengths=jnp.array([3, 1]))
  with pytest.raises(ValueError, match="KV cache holds 4 tokens per row; this call would "
                     "take a row to 5 \\(cached lengths \\[3, 1\\]\\)"):
    layer(x[:, :2], decode=True)
  keys = cached_keys(layer.cache)
  new = x[:, 1:3][::-1]  # rows' next two tokens
  out = STEP(layer, new, None)  # row 0 has room for one
  chex.assert_trees_all_equal(layer.cache.lengths[...], jnp.array([4, 3], jnp.int32))
  # Nothing written over the cached tokens (a clamped start would have moved the write).
  chex.assert_trees_all_equal(cached_keys(layer.cache)[0, :3], keys[0, :3])
  # The token that found room sits at its position (the full pass's last output).
  full = make_layer()(jnp.concatenate([x[:1, :3], new[:1, :1]], axis=1))
  chex.assert_trees_all_close(out[0, 0], full[0, 3], **TOL)


def test_misuse_errors():
  layer = make_layer()
  x = jnp.ones((2, 3, EMBED))
  with pytest.raises(ValueError, match="decode=True needs a KV cache: call "
                     "layer.init_cache\\(\\(batch, max_length, embed_dim\\), dtype\\)"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="embed_dim 32 \\(the layer's\\), got \\(2, 8, 16\\)"):
    layer.init_cache((2, 8, 16))
  layer.init_cache((4, 8, EMBED))
  with pytest.raises(ValueError, match="x has shape \\(2, 3, 32\\) but the cache was made "
                     "for batch 4 \\(init shape \\(4, 8, 32\\)\\)"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="x must be \\[batch, seq, 32\\], got shape \\(4, 1, 8\\)"):
    layer(jnp.ones((4, 1, 8)), decode=True)
  with pytest.raises(ValueError, match="x has shape \\(4, 9, 32\\): 9 tokens at once"):
    layer(jnp.ones((4, 9, EMBED)), decode=True)
  with pytest.raises(ValueError, match="lengths must be \\[batch\\] = \\(4,\\) integers"):
    layer(jnp.ones((4, 1, EMBED)), decode=True, lengths=jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="no context or segment ids"):
    layer(x, x, decode=True)
  with pytest.raises(ValueError, match="lengths counts the new tokens of decode=True calls"):
    layer(x, lengths=jnp.array([1, 2]))
  with pytest.raises(ValueError, match="num_pages must be at least 6, got 5"):
    layer.init_paged_cache(5, 4, 2, 3)
  with pytest.raises(ValueError, match="block_tables must be \\[batch, pages_per_seq\\] = "
                     "\\(2, 3\\), got shape \\(3, 2\\)"):
    layer.init_paged_cache(8, 4, 2, 3, block_tables=jnp.zeros((3, 2), jnp.int32))
  layer.init_paged_cache(6, 4, 2, 3)
  with pytest.raises(ValueError, match="x has shape \\(3, 1, 32\\) but the cache was made for "
                     "batch 2 \\(init shape 6 pages of 4, block tables \\(2, 3\\)\\)"):
    layer(jnp.ones((3, 1, EMBED)), decode=True)
  layer(jnp.ones((2, 10, EMBED)), decode=True, lengths=jnp.array([10, 1]))
  with pytest.raises(ValueError, match="the paged KV cache holds 12 tokens per row"):
    layer(x, decode=True)


# --- the model and generation -----------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_full_recompute(kind):
  """Greedy tokens from prefill + fori_loop decoding are the argmax of one full pass over
  each row's prompt and generated tokens, for prompts of different lengths."""
  model = DecoderLM(61, EMBED, HEADS, 2, num_kv_heads=KV_HEADS, max_positions=16,
                    tie_embeddings=kind == "paged", backend="xla", rngs=nnx.Rngs(1))
  lengths, new = jnp.array([6, 3]), 5
  prompt = jax.random.randint(jax.random.PRNGKey(6), (2, 6), 0, 61)
  if kind == "paged":
    model.init_paged_cache(8, 4, 2, 4)
  else:
    model.init_cache(2, 10)
  out = greedy_generate(model, prompt, new, lengths)
  chex.assert_shape(out, (2, new))
  chex.assert_trees_all_equal(model.cached_lengths(), (lengths + new - 1).astype(jnp.int32))
  # Each row's prompt and picks, left-aligned: with causal attention the padding after
  # them changes nothing.
  rows = [jnp.concatenate([prompt[r, :n], out[r], jnp.zeros(6 - n, jnp.int32)])
          for r, n in enumerate(lengths.tolist())]
  logits = model(jnp.stack(rows))
  for r, n in enumerate(lengths.tolist()):
    chex.assert_trees_all_equal(jnp.argmax(logits[r, n - 1:n - 1 + new], -1), out[r])
