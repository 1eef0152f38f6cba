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

from jattn.nn.sampling import Sampling


@nnx.jit
def prefill(model, prompt, lengths=None):
  """Appends ``prompt: [batch, prompt_len]`` ints to the caches and returns each row's
  greedy next token ``[batch]`` int32, from the logits at its last real position.

  ``lengths: [batch]`` (default ``prompt_len``): each row's prompt length, prompts
  left-aligned and right-padded. A row of length 0 caches nothing (its token is
  meaningless)."""
  return jnp.argmax(_prompt_logits(model, prompt, lengths), axis=-1).astype(jnp.int32)


def _prompt_logits(model, prompt, lengths):
  """Appends ``prompt: [batch, prompt_len]`` to the caches; ``[batch, vocab]``: each
  row's logits at its last real position (``lengths``; None: all of them)."""
  logits = model(prompt, decode=True, lengths=lengths)
  batch, n = prompt.shape
  last = jnp.full((batch,), n) if lengths is None else jnp.asarray(lengths)
  return logits[jnp.arange(batch), jnp.clip(last - 1, 0, n - 1)]


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


def generate(model, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
             key=None, lengths=None):
  """``max_new_tokens`` new tokens after each row's prompt: ``[batch, max_new_tokens]``
  int32, by a prefill and one jitted ``lax.while_loop`` of single-token decode steps.

  Args:
    model: a module with ``init_cache(batch, max_length)`` and ``model(tokens,
      decode=True, lengths=None) -> logits [batch, seq, vocab]`` (``LlamaForCausalLM``);
      its caches are made anew for the call (``max(prompt) + max_new_tokens`` tokens).
    input_ids: ``[batch, prompt_len]`` ints, prompts left-aligned (right-padded).
    temperature, top_k, top_p: ``jattn.nn.sampling.Sampling`` (0: greedy).
    eos_token_id: an int or a list of ints; a row that emits one is done, and its
      later tokens are the first of them. The loop stops when every row is done.
    key: a ``jax.random`` key, required when sampling (``temperature > 0``).
    lengths: ``[batch]`` ints, each prompt's length (default ``prompt_len``; at least 1).
  """
  sampling = Sampling(temperature, top_k, top_p)
  if type(max_new_tokens) is not int or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if input_ids.ndim != 2:
    raise ValueError(f"input_ids must be [batch, prompt_len], got shape {input_ids.shape}")
  if not sampling.greedy and key is None:
    raise ValueError("sampling (temperature > 0) needs key=jax.random.key(...)")
  eos = () if eos_token_id is None else tuple(
      int(t) for t in (eos_token_id if isinstance(eos_token_id, (list, tuple))
                       else [eos_token_id]))
  batch, prompt_len = input_ids.shape
  if lengths is None:
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
  else:
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"lengths must be [batch] = ({batch},) integers, got shape "
                       f"{lengths.shape} {lengths.dtype}")
    try:  # known values are checked; traced ones cannot be
      low, high = int(jnp.min(lengths)), int(jnp.max(lengths))
    except jax.errors.ConcretizationTypeError:
      low, high = 1, prompt_len
    if low < 1 or high > prompt_len:
      raise ValueError(f"lengths must be in [1, prompt_len = {prompt_len}] (each row's "
                       f"prompt), got values from {low} to {high}")
    lengths = lengths.astype(jnp.int32)
  model.init_cache(batch, prompt_len + max_new_tokens)
  key = jax.random.key(0) if key is None else key
  return _sample(model, jnp.asarray(input_ids, jnp.int32), lengths, key,
                 steps=max_new_tokens, sampling=sampling, eos=eos)


@nnx.jit(static_argnames=("steps", "sampling", "eos"))
def _sample(model, prompt, lengths, key, *, steps, sampling, eos):
  batch = prompt.shape[0]
  key, now = jax.random.split(key)
  token = sampling(_prompt_logits(model, prompt, lengths), now)
  fill = eos[0] if eos else 0
  is_eos = lambda t: jnp.isin(t, jnp.asarray(eos, jnp.int32)) if eos else jnp.zeros_like(t, bool)
  out = jnp.full((batch, steps), fill, jnp.int32).at[:, 0].set(token)
  graphdef, caches, rest = nnx.split(model, nnx.Cache, ...)

  def more(carry):
    i, done = carry[0], carry[-1]
    return (i < steps) & ~jnp.all(done)

  def step(carry):
    i, caches, token, key, out, done = carry
    model = nnx.merge(graphdef, caches, rest)
    key, now = jax.random.split(key)
    token = jnp.where(done, fill, sampling(model(token[:, None], decode=True)[:, -1], now))
    return (i + 1, nnx.state(model, nnx.Cache), token, key, out.at[:, i].set(token),
            done | is_eos(token))

  carry = (jnp.int32(1), caches, token, key, out, is_eos(token))
  _, caches, _, _, out, _ = jax.lax.while_loop(more, step, carry)
  nnx.update(model, caches)
  return out
