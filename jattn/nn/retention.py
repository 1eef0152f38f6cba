"""RetNet's multi-scale retention layer (Flax NNX) on top of ``jattn.retention``.

Mirrors torchscale's ``MultiScaleRetention``: bias-free ``q_proj``, ``k_proj``,
``v_proj``, ``g_proj`` and ``out_proj``; keys scaled by ``key_dim ** -0.5``; the
rotary "theta shift" on queries and keys; per-head decay
``γ_h = 1 - 2**(-5 - h)``; a per-head RMS norm without affine weights; a swish gate.
torchscale also rescales each row of the retention scores (by the decay mask's and
the scores' row sums); a per-row positive factor cancels in the per-head RMS norm,
so this layer leaves it out and its three modes agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.reference import default_decay
from jattn.retention import retention, retention_step


def theta_angles(key_dim: int):
  """Rotary frequencies ``[key_dim]``: ``1 / 10000**linspace(0, 1, key_dim/2)``, each twice."""
  angle = 1.0 / (10000.0 ** jnp.linspace(0.0, 1.0, key_dim // 2, dtype=jnp.float32))
  return jnp.repeat(angle, 2)


def theta_shift(x, positions):
  """Rotates pairs ``(x[2i], x[2i+1])`` of ``x: [batch, seq, heads, key_dim]`` by
  ``positions[seq] * angle_i`` (torchscale's ``theta_shift``)."""
  angle = positions.astype(jnp.float32)[:, None] * theta_angles(x.shape[-1])[None, :]
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  pairs = x.reshape(*x.shape[:-1], -1, 2)
  rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
  return (x * cos + rotated * sin).astype(x.dtype)


class MultiScaleRetention(nnx.Module):
  """Multi-scale retention: ``x: [batch, seq, embed_dim] -> [batch, seq, embed_dim]``.

  Args:
    embed_dim: model width (also the total key width).
    num_heads: heads; ``embed_dim`` and ``value_dim`` must divide among them.
    value_dim: total value width (default ``2 * embed_dim``, as in RetNet).
    eps: RMS-norm epsilon.
    backend: ``jattn.retention`` backend.
    rngs: ``nnx.Rngs`` for initialisation.
  """

  def __init__(self, embed_dim: int, num_heads: int, *, value_dim: int | None = None,
               eps: float = 1e-6, backend: str = "auto", dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    value_dim = 2 * embed_dim if value_dim is None else value_dim
    for name, width in (("embed_dim", embed_dim), ("value_dim", value_dim)):
      if width % num_heads:
        raise ValueError(f"{name} ({width}) must be divisible by num_heads ({num_heads})")
    if (embed_dim // num_heads) % 2:
      raise ValueError(f"the key dim per head ({embed_dim // num_heads}) must be even for "
                       "the rotary theta shift")
    self.embed_dim, self.value_dim, self.num_heads = embed_dim, value_dim, num_heads
    self.key_dim, self.head_dim = embed_dim // num_heads, value_dim // num_heads
    self.eps, self.backend, self.dtype = eps, backend, dtype
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(embed_dim, embed_dim)
    self.k_proj = linear(embed_dim, embed_dim)
    self.v_proj = linear(embed_dim, value_dim)
    self.g_proj = linear(embed_dim, value_dim)
    self.out_proj = linear(value_dim, embed_dim)

  @property
  def decay(self):
    return default_decay(self.num_heads)

  def _qkvg(self, x, positions):
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.key_dim)
    k = self.k_proj(x).reshape(b, t, self.num_heads, self.key_dim) * self.key_dim ** -0.5
    v = self.v_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    return theta_shift(q, positions), theta_shift(k, positions), v, self.g_proj(x)

  def _finish(self, o, g):
    o = o.astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
    o = o.reshape(*o.shape[:-2], self.value_dim).astype(g.dtype)
    return self.out_proj(jax.nn.silu(g) * o)

  def __call__(self, x, *, mode: str = "parallel", chunk_size: int | None = None):
    """``mode``: ``"parallel"``, ``"chunkwise"`` or ``"recurrent"`` (all agree)."""
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"x must be [batch, seq, {self.embed_dim}], got shape {x.shape}")
    q, k, v, g = self._qkvg(x, jnp.arange(x.shape[1]))
    o = retention(q, k, v, decay=self.decay, scale=1.0, mode=mode, chunk_size=chunk_size,
                  backend=self.backend if mode != "recurrent" else "xla")
    return self._finish(o, g)

  def init_cache(self, batch: int):
    """Decoding cache: the retention state ``[batch, heads, key_dim, head_dim]`` and position."""
    return (jnp.zeros((batch, self.num_heads, self.key_dim, self.head_dim), jnp.float32),
            jnp.zeros((), jnp.int32))

  def step(self, x, cache):
    """One decoding position ``x: [batch, embed_dim]``; returns ``(y, new_cache)``."""
    state, position = cache
    q, k, v, g = self._qkvg(x[:, None], position[None])
    o, state = retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=self.decay, scale=1.0)
    return self._finish(o[:, None], g)[:, 0], (state, position + 1)


class RetNetLayer(nnx.Module):
  """Pre-norm RetNet decoder layer: ``x + retention(LN(x))``, then ``x + FFN(LN(x))``."""

  def __init__(self, embed_dim: int, num_heads: int, *, ffn_dim: int | None = None,
               backend: str = "auto", rngs: nnx.Rngs):
    ffn_dim = 2 * embed_dim if ffn_dim is None else ffn_dim
    self.retention_layer_norm = nnx.LayerNorm(embed_dim, rngs=rngs)
    self.retention = MultiScaleRetention(embed_dim, num_heads, backend=backend, rngs=rngs)
    self.final_layer_norm = nnx.LayerNorm(embed_dim, rngs=rngs)
    self.fc1 = nnx.Linear(embed_dim, ffn_dim, rngs=rngs)
    self.fc2 = nnx.Linear(ffn_dim, embed_dim, rngs=rngs)

  def _ffn(self, x):
    return x + self.fc2(jax.nn.gelu(self.fc1(self.final_layer_norm(x))))

  def __call__(self, x, *, mode: str = "parallel", chunk_size: int | None = None):
    x = x + self.retention(self.retention_layer_norm(x), mode=mode, chunk_size=chunk_size)
    return self._ffn(x)

  def step(self, x, cache):
    y, cache = self.retention.step(self.retention_layer_norm(x), cache)
    return self._ffn(x + y), cache


class RetNet(nnx.Module):
  """A small RetNet language model: token embedding, ``num_layers`` RetNet layers,
  a final LayerNorm and an output projection. ``tokens: [batch, seq]`` int ->
  logits ``[batch, seq, vocab_size]``; ``step`` decodes one token from a cache."""

  def __init__(self, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, *,
               backend: str = "auto", rngs: nnx.Rngs):
    self.embed_tokens = nnx.Embed(vocab_size, embed_dim, rngs=rngs)
    self.layers = nnx.List([RetNetLayer(embed_dim, num_heads, backend=backend, rngs=rngs)
                            for _ in range(num_layers)])
    self.layer_norm = nnx.LayerNorm(embed_dim, rngs=rngs)
    self.output_projection = nnx.Linear(embed_dim, vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens, *, mode: str = "parallel", chunk_size: int | None = None):
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x, mode=mode, chunk_size=chunk_size)
    return self.output_projection(self.layer_norm(x))

  def init_cache(self, batch: int):
    return [layer.retention.init_cache(batch) for layer in self.layers]

  def step(self, token, cache):
    """``token: [batch]`` int -> ``(logits [batch, vocab_size], new_cache)``."""
    x = self.embed_tokens(token)
    new_cache = []
    for layer, c in zip(self.layers, cache):
      x, c = layer.step(x, c)
      new_cache.append(c)
    return self.output_projection(self.layer_norm(x)), new_cache
