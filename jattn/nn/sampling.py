"""``Sampling``: how generation picks the next token from a row of logits (greedy, or
temperature with top-k and top-p filtering), as a hashable value that ``jit`` can
take as a static argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """``temperature`` 0 is greedy (the first of equal maxima); above 0 the logits are
  divided by it, then filtered: ``top_k`` keeps the k largest (ties with the k-th
  kept; 0 or None: no filter), ``top_p`` keeps the smallest set of the most likely
  tokens whose probability reaches ``top_p`` (the token that crosses it included), as
  Hugging Face's warpers do, in that order; then one token is drawn."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if self.top_k is not None and not (type(self.top_k) is int and self.top_k >= 0):
      raise ValueError(f"top_k must be None or an integer >= 0 (0: no filter), got "
                       f"{self.top_k!r}")
    if self.top_p is not None and not (isinstance(self.top_p, (int, float))
                                       and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def __call__(self, logits, key):
    """``[batch, vocab]`` logits -> ``[batch]`` int32 tokens (``key`` unused when
    greedy)."""
    if self.greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / self.temperature
    if self.top_k and self.top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p is not None and self.top_p < 1:
      ordered = jnp.sort(logits, axis=-1)[..., ::-1]
      probs = jax.nn.softmax(ordered, axis=-1)
      before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
      kept = jnp.where(before < self.top_p, ordered, jnp.inf)
      logits = jnp.where(logits < kept.min(axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
