"""Greedy generation with a KV cache, jitted: ``prefill`` the prompts, then a
``lax.fori_loop`` of single-token ``decode_steps``.

Works with any module ``model(tokens, decode=True, lengths=None) -> logits [batch, seq,
vocab]`` whose caches are ``nnx.Cache`` state (``DecoderLM`` after ``init_cache`` or
``init_paged_cache``). Each function updates the model's caches in place (``nnx.jit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


@nnx.jit
def prefill(model, prompt, lengths=None):
  """Appends ``prompt: [batch, prompt_len]`` ints to the caches and returns each row's
  greedy next token ``[batch]`` int32, from the logits at its last real position.

  ``lengths: [batch]`` (default ``prompt_len``): each row's prompt length, prompts
  left-aligned and right-padded. A row of length 0 caches nothing (its token is
  meaningless)."""
  logits = model(prompt, decode=True, lengths=lengths)
  batch, n = prompt.shape
  last = jnp.full((batch,), n) if lengths is None else jnp.asarray(lengths)
  last = jnp.clip(last - 1, 0, n - 1)
  return jnp.argmax(logits[jnp.arange(batch), last], axis=-1).astype(jnp.int32)


@nnx.jit(static_argnames="steps")
def decode_steps(model, tokens, steps: int):
  """Feeds ``tokens: [batch]`` and then each greedy pick for ``steps`` single-token
  decode steps, in one ``lax.fori_loop``; returns the picks ``[batch, steps]`` int32."""
  # Only the caches change from step to step: they are the loop's carry, the parameters
  # stay outside it.
  graphdef, caches, rest = nnx.split(model, nnx.Cache, ...)

  def step(i, carry):
    caches, token, out = carry
    model = nnx.merge(graphdef, caches, rest)
    logits = model(token[:, None], decode=True)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return nnx.state(model, nnx.Cache), token, out.at[:, i].set(token)

  out = jnp.zeros((tokens.shape[0], steps), jnp.int32)
  caches, _, out = jax.lax.fori_loop(0, steps, step, (caches, tokens.astype(jnp.int32), out))
  nnx.update(model, caches)
  return out


def greedy_generate(model, prompt, new_tokens: int, lengths=None):
  """``new_tokens`` greedy tokens after each row's prompt: ``[batch, new_tokens]`` int32.

  ``prefill`` gives the first, ``decode_steps`` the rest, so the caches must hold
  ``max(lengths) + new_tokens - 1`` tokens per row (the last pick is not fed back)."""
  first = prefill(model, prompt, lengths)
  if new_tokens <= 1:
    return first[:, None][:, :new_tokens]
  rest = decode_steps(model, first, new_tokens - 1)
  return jnp.concatenate([first[:, None], rest], axis=1)
