"""Attention dropout without a stored mask: whether weight ``(b, h, q, k)`` is kept is
a hash of the position and a seed, so the forward pass, the backward pass and the
reference draw the same mask tile by tile (FlashAttention-2's scheme, with a hash in
place of Philox). Pure jnp on uint32: it runs inside kernels and on the host.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

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


def _bits(x):
  """A hash as uint32 (kernels read stored hashes as int32 bit patterns)."""
  return x if x.dtype == jnp.uint32 else lax.bitcast_convert_type(x, jnp.uint32)


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
  each other), each weight kept with probability ``1 - rate``. Per weight only a xor,
  a multiply and an unsigned compare join the two well-mixed halves: the kernels pay
  them on every weight of every tile, three times (the forward and both backward
  kernels). The multiply carries every bit of ``row ^ col`` into the top bits the
  compare reads, so that no 2x2 block of keep-bits is linearly dependent."""
  x = (_bits(row) ^ _bits(col)) * jnp.uint32(0x9E3779B1)
  return x >= jnp.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def keep_mask(seed, rate: float, b, h, q_idx, k_idx):
  """The keep-mask at broadcastable int32 positions (the reference's dense call)."""
  return keep(row_hash(seed[0], b, h, q_idx), col_hash(seed[1], k_idx), rate)


def hash_arrays(seed, batch: int, heads: int, q_len: int, kv_len: int):
  """The hashes as kernels that cannot compute them cheaply read them: ``(rows
  [batch, heads, q_len], cols [batch, kv_len])``, int32 bit patterns. The cols are the
  same for every batch row, but lead with the batch axis as every per-position array
  of the fused-dQ Hopper backward must (its vmap rule folds a mapped axis into it)."""
  as_i32 = lambda x: lax.bitcast_convert_type(x, jnp.int32)
  rows = row_hash(seed[0], jnp.arange(batch, dtype=jnp.int32)[:, None, None],
                  jnp.arange(heads, dtype=jnp.int32)[None, :, None],
                  jnp.arange(q_len, dtype=jnp.int32)[None, None, :])
  cols = col_hash(seed[1], jnp.arange(kv_len, dtype=jnp.int32))
  return as_i32(rows), as_i32(jnp.broadcast_to(cols, (batch, kv_len)))


def backward_rows(lse, delta, rate: float):
  """The backward's row terms with dropout's ``1 / (1 - rate)`` folded in, so that the
  kernels only select by the keep-mask: ``p' = exp(s - lse')`` is ``P / (1 - rate)``
  (the weight that multiplied V where kept) and ``p' * (kept * dP - delta')`` is
  ``P * (kept * dP / (1 - rate) - delta)``. ``lse`` natural log, any shape."""
  if not rate:
    return lse, delta
  return lse + math.log1p(-rate), delta * (1.0 - rate)
