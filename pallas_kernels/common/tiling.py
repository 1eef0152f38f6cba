"""Host-side tiling: which tiles a kernel runs along an axis, how far that axis is
padded, the zero padding of inputs and per-row statistics, and where packed
sequences' rows lie."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jattn.kernels.common.config import clamp_block


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def tile_axis(length: int, blocks, *, unit: int = 1, clamp: bool = True):
  """The tiles a kernel family runs along one axis of ``length`` positions, and the
  padded length that every tile divides.

  ``blocks``: the config's block sizes along this axis (all the kernels' of one
  family). With ``clamp`` each is lowered to the next power of two of
  ``ceil(length / unit)`` (at least 16), so a short axis pays for no larger tile.
  ``unit``: the axis is read in rows of ``unit`` positions (a dilation rate).
  Returns ``(blocks_used, padded_length)``, ``padded_length`` a multiple of ``unit``
  times every block.
  """
  rows = -(-length // unit)
  used = tuple(clamp_block(b, rows) for b in blocks) if clamp else tuple(blocks)
  return used, round_up(length, unit * math.lcm(*used))


def pad_to(x, length: int, width: int | None = None):
  """Zero-pads axis 1 to ``length`` and (if given) the last axis to ``width``."""
  pads = [(0, 0)] * x.ndim
  pads[1] = (0, length - x.shape[1])
  if width is not None:
    pads[-1] = (0, width - x.shape[-1])
  if all(p == (0, 0) for p in pads):
    return x
  return jnp.pad(x, pads)


def pad_rows(x, length: int):
  """Zero-pads the last axis of a ``[batch, heads, seq]`` row statistic to ``length``."""
  if x.shape[-1] == length:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])])


def pad_last(x, width: int):
  """Zero-pads the last axis to ``width``."""
  if x.shape[-1] == width:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def sequence_of_rows(cu_seqlens, rows: int):
  """``[rows]`` int32: for each row ``r``, how many of ``cu_seqlens[1:]`` are ``<= r``
  (``searchsorted(cu_seqlens[1:], r, side="right")`` of sorted lengths): the index of
  the sequence holding it. A scatter of ones and a running sum: no loop, which on a GPU
  would wait on the host once per step of a binary search."""
  ends = jnp.asarray(cu_seqlens).astype(jnp.int32)[1:]
  ends = jnp.where(ends >= 0, ends, rows)  # (negative ends would wrap around)
  marks = jnp.zeros((rows,), jnp.int32).at[ends].add(1, mode="drop")
  return jnp.cumsum(marks, dtype=jnp.int32)


def packed_positions(cu_seqlens, total: int, max_len: int | None = None):
  """Each of ``total`` packed rows' ``(sequence, position in it, valid)`` (``[total]``
  each) from the cumulative lengths ``[seqs + 1]``: a row is valid when a sequence holds
  it (at or after ``cu_seqlens[0]``, before ``cu_seqlens[-1]``) at a position below
  ``max_len``."""
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  t = jnp.arange(total, dtype=jnp.int32)
  seq = sequence_of_rows(cu, total)
  inside = (seq < cu.shape[0] - 1) & (t >= cu[0])
  seq = jnp.minimum(seq, cu.shape[0] - 2)
  local = t - cu[seq]
  valid = inside if max_len is None else inside & (local < max_len)
  return seq, local, valid
