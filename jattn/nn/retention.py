"""RetNet's multi-scale retention layer (Flax NNX) on top of ``jattn.retention``.

Mirrors torchscale's ``MultiScaleRetention``: bias-free ``q_proj``, ``k_proj``,
``v_proj``, ``g_proj`` and ``out_proj``; keys scaled by ``key_dim ** -0.5``; the
rotary "theta shift" on queries and keys; per-head decay
``γ_h = 1 - 2**(-5 - h)``; a per-head RMS norm without affine weights; a swish gate.

torchscale's parallel form also scales row ``n`` of the scores ``S = (Q Kᵀ) ⊙ D``:
by ``1 / sqrt(Σ_m D[n, m])`` and by ``1 / max(|Σ_m S[n, m]| / sqrt(Σ_m D[n, m]), 1)``
(held constant in the backward). A per-row factor would cancel in the RMS norm but
for its epsilon, which weighs the more the smaller the outputs (at initialisation,
noticeably). So this layer applies the same factors, computed on the side (``Σ_m D``
in closed form, ``Σ_m S[n, m] = q_n · Σ_m γ^(n-m) k_m`` by a scan), in every mode and
in decoding: all of them give torchscale's parallel form. (torchscale's chunkwise
and recurrent forms scale rows their own ways, so they differ from its parallel
form by as much.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.nn.loaders import checkpoint_loader
from jattn.nn.norms import RMSNorm, rms_normalize
from jattn.reference import default_decay
from jattn.retention import retention, retention_step


ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "swish": jax.nn.silu}


class GLU(nnx.Module):
  """torchscale's gated FFN: ``fc2(act(fc1(x)) * gate(x))``, bias-free;
  ``[..., embed_dim] -> [..., embed_dim]``."""

  def __init__(self, embed_dim: int, ffn_dim: int, activation: str = "gelu", *, dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)
    self.activation = activation
    self.fc1, self.gate, self.fc2 = (linear(embed_dim, ffn_dim), linear(embed_dim, ffn_dim),
                                     linear(ffn_dim, embed_dim))

  def __call__(self, x):
    h = self.fc1(x)
    h = ACTIVATIONS[self.activation](h.astype(jnp.float32)).astype(h.dtype)
    return self.fc2(h * self.gate(x))


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


def check_heads(embed_dim: int, value_dim: int, num_heads: int) -> None:
  """A ``ValueError`` unless the key and value widths divide among ``num_heads`` heads,
  each with an even key dim (the rotary theta shift rotates pairs)."""
  for name, width in (("embed_dim", embed_dim), ("value_dim", value_dim)):
    if width % num_heads:
      raise ValueError(f"{name} ({width}) must be divisible by num_heads ({num_heads})")
  if (embed_dim // num_heads) % 2:
    raise ValueError(f"the key dim per head ({embed_dim // num_heads}) must be even for "
                     "the rotary theta shift")


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
    check_heads(embed_dim, value_dim, num_heads)
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
    o = rms_normalize(o.astype(jnp.float32), self.eps)
    o = o.reshape(*o.shape[:-2], self.value_dim).astype(g.dtype)
    return self.out_proj(jax.nn.silu(g) * o)

  def _row_factors(self, q, key_sums, positions):
    """torchscale's parallel-form row scale ``[batch, seq, heads, 1]`` (module doc), from
    ``key_sums[n] = Σ_m γ^(n-m) k_m`` ``[batch, seq, heads, key_dim]``."""
    gamma = self.decay
    decay_sums = (1.0 - gamma[None, :] ** (positions[:, None] + 1.0)) / (1.0 - gamma[None, :])
    root = jnp.sqrt(decay_sums)[None, :, :, None]  # [1, seq, heads, 1]
    score_sums = jnp.einsum("bthd,bthd->bth", q.astype(jnp.float32), key_sums)[..., None]
    return jax.lax.stop_gradient(1.0 / (root * jnp.maximum(jnp.abs(score_sums) / root, 1.0)))

  def _key_sums(self, k):
    """``Σ_m γ^(n-m) k_m`` for every ``n``: ``[batch, seq, heads, key_dim]`` float32."""
    gamma = jnp.broadcast_to(self.decay[None, None, :, None], k.shape)
    combine = lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1])
    return jax.lax.associative_scan(combine, (gamma, k.astype(jnp.float32)), axis=1)[1]

  def __call__(self, x, *, mode: str = "parallel", chunk_size: int | None = None):
    """``mode``: ``"parallel"``, ``"chunkwise"`` or ``"recurrent"`` (all agree)."""
    if x.ndim != 3 or x.shape[-1] != self.embed_dim:
      raise ValueError(f"x must be [batch, seq, {self.embed_dim}], got shape {x.shape}")
    positions = jnp.arange(x.shape[1])
    q, k, v, g = self._qkvg(x, positions)
    o = retention(q, k, v, decay=self.decay, scale=1.0, mode=mode, chunk_size=chunk_size,
                  backend=self.backend if mode != "recurrent" else "xla")
    factors = self._row_factors(q, self._key_sums(k), positions.astype(jnp.float32))
    return self._finish(o.astype(jnp.float32) * factors, g)

  def init_cache(self, batch: int):
    """Decoding cache: the retention state ``[batch, heads, key_dim, head_dim]``, the
    decayed key sum ``[batch, heads, key_dim]`` (for the row scale) and the position."""
    return (jnp.zeros((batch, self.num_heads, self.key_dim, self.head_dim), jnp.float32),
            jnp.zeros((batch, self.num_heads, self.key_dim), jnp.float32),
            jnp.zeros((), jnp.int32))

  def step(self, x, cache):
    """One decoding position ``x: [batch, embed_dim]``; returns ``(y, new_cache)``."""
    state, key_sum, position = cache
    q, k, v, g = self._qkvg(x[:, None], position[None])
    o, state = retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=self.decay, scale=1.0)
    key_sum = self.decay[None, :, None] * key_sum + k[:, 0].astype(jnp.float32)
    factors = self._row_factors(q, key_sum[:, None], position[None].astype(jnp.float32))
    y = self._finish(o[:, None].astype(jnp.float32) * factors, g)[:, 0]
    return y, (state, key_sum, position + 1)


@dataclasses.dataclass(frozen=True)
class RetNetConfig:
  """The hyper-parameters of torchscale's ``RetNetDecoder`` that shape a ``RetNet``
  (the names are torchscale's where they exist: ``decoder_value_embed_dim`` is
  ``value_dim``, ``decoder_ffn_embed_dim`` ``ffn_dim``, ``activation_fn``
  ``activation``, ``layernorm_eps`` ``eps``; ``embed_scale`` is 1 unless torchscale's
  ``no_scale_embedding`` was off, then ``sqrt(embed_dim)``; ``tie_embeddings`` is
  ``share_decoder_input_output_embed``)."""

  vocab_size: int
  embed_dim: int
  num_heads: int
  num_layers: int
  value_dim: int | None = None  # default 2 * embed_dim
  ffn_dim: int | None = None  # default 2 * embed_dim
  activation: str = "gelu"
  eps: float = 1e-6
  layernorm_embedding: bool = False
  embed_scale: float = 1.0
  tie_embeddings: bool = False

  def __post_init__(self):
    fill = lambda name, value: object.__setattr__(self, name, value)
    fill("value_dim", 2 * self.embed_dim if self.value_dim is None else self.value_dim)
    fill("ffn_dim", 2 * self.embed_dim if self.ffn_dim is None else self.ffn_dim)
    for name in ("vocab_size", "embed_dim", "num_heads", "num_layers", "value_dim", "ffn_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_heads(self.embed_dim, self.value_dim, self.num_heads)
    if not (isinstance(self.activation, str) and self.activation in ACTIVATIONS):
      raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got "
                       f"{self.activation!r}")
    for name, low in (("eps", 0.0), ("embed_scale", None)):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (low is None or value > low)):
        raise ValueError(f"{name} must be a finite number{'' if low is None else ' > 0'}, "
                         f"got {value!r}")
    for name in ("layernorm_embedding", "tie_embeddings"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


class RetNetLayer(nnx.Module):
  """torchscale's pre-norm ``DecoderLayer``: ``x + retention(RMSNorm(x))``, then
  ``x + GLU(RMSNorm(x))``; ``[batch, seq, embed_dim] -> [batch, seq, embed_dim]``."""

  def __init__(self, config: RetNetConfig, *, backend: str = "auto", dtype=None,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    c = config
    self.retention_layer_norm = RMSNorm(c.embed_dim, eps=c.eps, param_dtype=param_dtype)
    self.retention = MultiScaleRetention(c.embed_dim, c.num_heads, value_dim=c.value_dim,
                                         eps=c.eps, backend=backend, dtype=dtype,
                                         param_dtype=param_dtype, rngs=rngs)
    self.final_layer_norm = RMSNorm(c.embed_dim, eps=c.eps, param_dtype=param_dtype)
    self.ffn = GLU(c.embed_dim, c.ffn_dim, c.activation, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)

  def _ffn(self, x):
    return x + self.ffn(self.final_layer_norm(x))

  def __call__(self, x, *, mode: str = "parallel", chunk_size: int | None = None):
    x = x + self.retention(self.retention_layer_norm(x), mode=mode, chunk_size=chunk_size)
    return self._ffn(x)

  def step(self, x, cache):
    y, cache = self.retention.step(self.retention_layer_norm(x), cache)
    return self._ffn(x + y), cache


class RetNet(nnx.Module):
  """A RetNet language model with the layout of torchscale's ``RetNetDecoder``: token
  embedding (times ``embed_scale``, then an optional RMS norm), ``num_layers``
  ``RetNetLayer``, a final RMS norm and the output projection (or the embedding,
  tied). ``tokens: [batch, seq]`` int -> logits ``[batch, seq, vocab_size]``; ``step``
  decodes one token from a cache. ``RetNet.from_torch`` loads a torchscale checkpoint.

  Args: the fields of ``RetNetConfig`` (``vocab_size``, ``embed_dim``, ``num_heads``,
  ``num_layers`` and the keyword options), ``backend`` of the retention op, ``rngs``.
  """

  def __init__(self, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, *,
               backend: str = "auto", dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs,
               **options):
    c = self.config = RetNetConfig(vocab_size, embed_dim, num_heads, num_layers, **options)
    self.embed_tokens = nnx.Embed(c.vocab_size, c.embed_dim, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layernorm_embedding = (RMSNorm(c.embed_dim, eps=c.eps, param_dtype=param_dtype)
                                if c.layernorm_embedding else None)
    self.layers = nnx.List([RetNetLayer(c, backend=backend, dtype=dtype,
                                        param_dtype=param_dtype, rngs=rngs)
                            for _ in range(c.num_layers)])
    self.layer_norm = RMSNorm(c.embed_dim, eps=c.eps, param_dtype=param_dtype)
    self.output_projection = None if c.tie_embeddings else nnx.Linear(
        c.embed_dim, c.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)

  @classmethod
  def from_config(cls, config: RetNetConfig, **kwargs):
    """A model of ``config`` (``kwargs``: ``backend``, ``dtype``, ``rngs``, ...)."""
    return cls(**dataclasses.asdict(config), **kwargs)

  @classmethod
  def from_torch(cls, source, **kwargs):
    """Loads a torchscale ``RetNetDecoder`` checkpoint (a ``.pth`` / ``.safetensors``
    path or a state dict), through the loader the torch side offers
    (``jattn.interop.load_retnet``; ``kwargs`` are its own)."""
    return checkpoint_loader("retnet")(source, **kwargs)

  def _embed(self, tokens):
    x = self.embed_tokens(tokens)
    if self.config.embed_scale != 1.0:
      x = x * self.config.embed_scale
    return x if self.layernorm_embedding is None else self.layernorm_embedding(x)

  def _logits(self, x):
    x = self.layer_norm(x)
    if self.output_projection is None:
      return self.embed_tokens.attend(x)
    return self.output_projection(x)

  def __call__(self, tokens, *, mode: str = "parallel", chunk_size: int | None = None):
    """``mode``: ``"parallel"``, ``"chunkwise"`` or ``"recurrent"`` (all agree)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be [batch, seq] integers, got {tokens.dtype} "
                       f"{tuple(tokens.shape)}")
    x = self._embed(tokens)
    for layer in self.layers:
      x = layer(x, mode=mode, chunk_size=chunk_size)
    return self._logits(x)

  def init_cache(self, batch: int):
    """One ``MultiScaleRetention`` cache per layer."""
    return [layer.retention.init_cache(batch) for layer in self.layers]

  def step(self, token, cache):
    """``token: [batch]`` int -> ``(logits [batch, vocab_size], new_cache)``."""
    x = self._embed(token)
    new_cache = []
    for layer, c in zip(self.layers, cache):
      x, c = layer.step(x, c)
      new_cache.append(c)
    return self._logits(x), new_cache
