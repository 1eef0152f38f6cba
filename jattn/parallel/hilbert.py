"""Hilbert-curve token order for images of any size: ``hilbert_flatten`` lists the
tokens of ``[batch, H, W, C]`` along a space-filling curve, so that cutting the
flattened sequence into ``P`` contiguous shards (ring attention's ``contiguous``
layout) gives each device a compact image region instead of a strip of rows.

The curve is a generalized Hilbert curve for rectangles (the "gilbert" idea): a
rectangle is traversed from one corner to the corner next to it along its
*travel* axis, by splitting it into smaller rectangles that are traversed the same
way and joined end to start. Such a traversal exists without diagonal steps iff the
travel side is even or the other side is odd (colour the grid like a chessboard);
every split here keeps that true for all parts, and the top level picks its travel
axis (and, for long odd-by-even images, peels off even-width pieces) so that it is
true there too, because the whole curve's end is free. Hence every step of the curve
moves to a 4-neighbour, for every ``H, W``; for ``2^k x 2^k`` images it is the
Hilbert curve.
"""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
import numpy as np


def _positive_int(value, name: str) -> int:
  if isinstance(value, bool):  # bool is an int subclass, but True is no image size
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  try:
    value = operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be a positive int, got {value!r}") from None
  if value < 1:
    raise ValueError(f"{name} must be a positive int, got {value}")
  return value


# --- the curve ------------------------------------------------------------------------
# A traversal is built in the rectangle's own coordinates: cell (i, j) is i steps along
# the travel axis and j across it. The recursion depends on (w, h) alone, so each
# distinct (w, h) (a few per level) is built once and its parts are placed by
# transposing / flipping / shifting whole arrays; no Python work per cell.

def _fill(w: int, h: int, memo: dict) -> np.ndarray:
  """int64 ``[w * h, 2]`` of ``(i, j)``: a traversal of the ``w x h`` rectangle from
  ``(0, 0)`` to ``(w - 1, 0)``. Needs ``w`` even or ``h`` odd, and ``w > 1`` unless
  ``h == 1``."""
  if (w, h) in memo:
    return memo[w, h]
  if h == 1:
    path = np.stack([np.arange(w), np.zeros(w, np.int64)], axis=1)
  elif 2 * w > 3 * h:
    # Long along the travel axis: two halves side by side, each traversed along it.
    # With ``h`` even both halves need an even width, else one of them would need a
    # diagonal step.
    w1 = w // 2
    if h % 2 == 0 and w1 % 2:
      w1 += 1
    path = np.concatenate([_fill(w1, h, memo), _fill(w - w1, h, memo) + (w1, 0)])
  else:
    # Near square: a U of three parts. Up the first ``w1`` columns of the bottom ``h1``
    # rows, along all of the top ``h - h1`` rows, down the other columns of the bottom.
    # An even ``h1`` makes the two legs traversable whatever their width, and leaves
    # the top the same parity problem as the whole; ``h == 2`` has only the 2 x 2 U
    # (w > 1 here, and w == 3 would break the precondition).
    h1 = h // 2
    if h1 % 2 and h > 2:
      h1 += 1
    w1 = w // 2
    up = _fill(h1, w1, memo)[:, ::-1]  # travels across: swap the roles of i and j
    top = _fill(w, h - h1, memo) + (0, h1)
    down = (w - 1, h1 - 1) - _fill(h1, w - w1, memo)[:, ::-1]  # from the far corner back
    path = np.concatenate([up, top, down])
  memo[w, h] = path
  return path


def _free(nu: int, nv: int, memo: dict) -> np.ndarray:
  """int64 ``[nu * nv, 2]`` of ``(i, j)``: a traversal of the ``nu x nv`` rectangle
  from ``(0, 0)`` to wherever suits it."""
  if nu < nv:  # travel along the longer side: parts stay near square
    return _free(nv, nu, memo)[:, ::-1]
  if nu % 2 == 0 or nv % 2 == 1:
    return _fill(nu, nv, memo)
  # Long side odd, short side even: ending next to the origin along the long side
  # would need a diagonal step. Long rectangles peel off an even-width half and go on
  # with the rest; near-square ones travel along the (even) short side instead.
  if 2 * nu > 3 * nv:
    w1 = nu // 2 + (nu // 2) % 2
    return np.concatenate([_fill(w1, nv, memo), _free(nu - w1, nv, memo) + (w1, 0)])
  return _fill(nv, nu, memo)[:, ::-1]


@functools.lru_cache(maxsize=64)
def _cached_curve(height: int, width: int) -> np.ndarray:
  # Travel along the width first: i is the column, j the row.
  out = np.ascontiguousarray(_free(width, height, {})[:, ::-1], dtype=np.int64)
  out.setflags(write=False)
  return out


@functools.lru_cache(maxsize=64)
def _cached_permutations(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
  cells = _cached_curve(height, width)
  perm = cells[:, 0] * width + cells[:, 1]
  inv = np.empty_like(perm)
  inv[perm] = np.arange(perm.size)
  for x in (perm, inv):
    x.setflags(write=False)
  return perm, inv


def hilbert_curve(height: int, width: int) -> np.ndarray:
  """The cells of a ``height x width`` grid in curve order: int64 ``[height * width,
  2]`` of ``(row, col)``, starting at ``(0, 0)``, every cell once. Consecutive cells
  are always 4-neighbours (no diagonal step, for any ``height, width``); for
  ``2^k x 2^k`` grids it is the Hilbert curve, whose quarters are the 4 quadrants.
  Computed once per shape; the result is a fresh copy."""
  return _cached_curve(_positive_int(height, "height"), _positive_int(width, "width")).copy()


def hilbert_permutation(height: int, width: int) -> np.ndarray:
  """int64 ``[height * width]``: ``perm[i] = row_i * width + col_i`` for the ``i``-th
  cell of ``hilbert_curve``, so ``x_flat[..., perm, :]`` lists row-major tokens in
  curve order. A fresh copy."""
  return _cached_permutations(_positive_int(height, "height"),
                              _positive_int(width, "width"))[0].copy()


def inverse_permutation(perm) -> np.ndarray:
  """int64 ``[n]`` with ``inv[perm[i]] = i`` for a permutation ``perm`` of
  ``range(n)``."""
  perm = np.asarray(perm)
  if perm.ndim != 1 or not np.issubdtype(perm.dtype, np.integer):
    raise ValueError(f"perm must be a 1-D integer array, got dtype {perm.dtype} and shape "
                     f"{perm.shape}")
  n = perm.size
  if n and (perm.min() < 0 or perm.max() >= n or np.unique(perm).size != n):
    raise ValueError(f"perm must be a permutation of range({n}) (each value once)")
  inv = np.empty(n, np.int64)
  inv[perm] = np.arange(n)
  return inv


def hilbert_flatten(x):
  """``[batch, H, W, C]`` -> ``[batch, H * W, C]`` with the tokens in
  ``hilbert_curve(H, W)`` order. A gather with a static index, so it works under
  ``jax.jit`` and is differentiable; ``hilbert_unflatten`` inverts it."""
  if getattr(x, "ndim", None) != 4:
    raise ValueError(f"x must be [batch, height, width, channels] (rank 4), got shape "
                     f"{getattr(x, 'shape', type(x).__name__)}")
  batch, height, width, channels = x.shape
  perm, _ = _cached_permutations(_positive_int(height, "x.shape[1] (height)"),
                                 _positive_int(width, "x.shape[2] (width)"))
  flat = jnp.reshape(x, (batch, height * width, channels))
  return jnp.take(flat, perm.astype(np.int32), axis=1, unique_indices=True)


def hilbert_unflatten(y, height: int, width: int):
  """``[batch, height * width, C]`` in Hilbert order (``hilbert_flatten``'s output) ->
  ``[batch, height, width, C]``."""
  height, width = _positive_int(height, "height"), _positive_int(width, "width")
  if getattr(y, "ndim", None) != 3:
    raise ValueError(f"y must be [batch, height * width, channels] (rank 3), got shape "
                     f"{getattr(y, 'shape', type(y).__name__)}")
  if y.shape[1] != height * width:
    raise ValueError(f"y's length y.shape[1] must be height * width = {height} * {width} = "
                     f"{height * width}, got {y.shape[1]}")
  _, inv = _cached_permutations(height, width)
  rows = jnp.take(y, inv.astype(np.int32), axis=1, unique_indices=True)
  return jnp.reshape(rows, (y.shape[0], height, width, y.shape[2]))
