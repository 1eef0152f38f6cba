"""Attention dropout without a stored mask: whether weight ``(b, h, q, k)`` is kept is
a hash of the position and a seed, so the forward pass, the backward pass and the
reference draw the same mask tile by tile (FlashAttention-2's scheme, with a hash in
place of Philox). Pure jnp on uint32: it runs inside kernels and on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Keep-decisions resolve rates in steps of 2^-24.
_RATE_BITS = 24


def _mix(x):
  """MurmurHash3's 32-bit finalizer: every input bit flips each output bit with
  probability near 1/2."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _u32(x):
  return lax.bitcast_convert_type(jnp.asarray(x, jnp.int32), jnp.uint32)


def seed_of(key):
  """``[2]`` int32 seed words from a ``jax.random`` key (typed or raw)."""
  bits = jax.random.bits(key, (2,), jnp.uint32)
  return lax.bitcast_convert_type(bits, jnp.int32)


def row_hash(seed, b, h, q_idx):
  """The per-row half of the hash: broadcastable int32 ``b``, ``h``, ``q_idx`` and the
  ``[2]`` seed's first word (scalars or tiles)."""
  x = _mix(_u32(seed) ^ (_u32(b) * jnp.uint32(0x27D4EB2F)) ^ (_u32(h) * jnp.uint32(0x165667B1)))
  return _mix(x ^ (_u32(q_idx) * jnp.uint32(0x9E3779B1)))


def col_hash(seed, k_idx):
  """The per-column half: int32 key positions ``k_idx`` and the seed's second word."""
  return _mix((_u32(k_idx) * jnp.uint32(0x85EBCA77)) ^ _u32(seed))


def keep(row, col, rate: float):
  """Boolean keep-mask of a tile from its rows' and columns' hashes (broadcast against
  each other), each weight kept with probability ``1 - rate``. Per weight only one
  multiply and xor-shift mixes the two well-mixed halves: the kernels pay it on every
  weight of every tile, three times (the forward and both backward kernels)."""
  x = (row ^ col) * jnp.uint32(0x9E3779B1)
  x = x ^ (x >> 16)
  threshold = round(rate * (1 << _RATE_BITS))
  return lax.bitcast_convert_type(x >> (32 - _RATE_BITS), jnp.int32) >= threshold


def keep_mask(seed, rate: float, b, h, q_idx, k_idx):
  """The keep-mask at broadcastable int32 positions (the reference's dense call)."""
  return keep(row_hash(seed[0], b, h, q_idx), col_hash(seed[1], k_idx), rate)
