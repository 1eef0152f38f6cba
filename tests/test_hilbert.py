"""jattn.parallel.hilbert: the generalized Hilbert curve visits every cell once with
4-neighbour steps for any image size, is the Hilbert curve on 2^k squares, gives
compact shards, and hilbert_flatten / hilbert_unflatten are exact inverse gathers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jattn.parallel.hilbert import (hilbert_curve, hilbert_flatten, hilbert_permutation,
                                    hilbert_unflatten, inverse_permutation)

SHAPES = [(1, 1), (1, 2), (2, 1), (1, 17), (17, 1), (2, 2), (2, 3), (3, 2), (3, 3), (5, 2),
          (2, 5), (5, 5), (7, 13), (13, 7), (11, 11), (6, 9), (9, 6), (4, 7), (8, 8), (16, 16),
          (32, 32), (8, 32), (48, 48), (30, 50), (37, 41), (41, 36), (2, 101), (10, 101),
          (64, 3)]


def _check_curve(height, width):
  cells = hilbert_curve(height, width)
  assert cells.shape == (height * width, 2) and np.issubdtype(cells.dtype, np.integer)
  assert tuple(cells[0]) == (0, 0)
  perm = hilbert_permutation(height, width)
  np.testing.assert_array_equal(perm, cells[:, 0] * width + cells[:, 1])
  np.testing.assert_array_equal(np.sort(perm), np.arange(height * width))
  # The guarantee: no diagonal (or longer) step, whatever the parities of the sides.
  steps = np.abs(np.diff(cells, axis=0)).sum(axis=1)
  np.testing.assert_array_equal(steps, 1)


@pytest.mark.parametrize("height,width", SHAPES)
def test_curve_is_a_path_through_every_cell(height, width):
  _check_curve(height, width)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 48), st.integers(1, 48))
def test_curve_any_shape(height, width):
  _check_curve(height, width)


def test_curve_every_small_shape():
  for height in range(1, 25):
    for width in range(1, 25):
      _check_curve(height, width)


@pytest.mark.parametrize("k", range(1, 7))
def test_power_of_two_square_is_hilbert(k):
  n = 2 ** k
  cells = hilbert_curve(n, n)
  # At every scale, each run of 4^j consecutive cells fills an aligned 2^j square, so
  # in particular the four quarters of the curve are the four quadrants.
  for j in range(1, k + 1):
    side = 2 ** j
    for block in cells.reshape(-1, side * side, 2):
      lo = block.min(axis=0)
      assert (lo % side == 0).all() and (block.max(axis=0) - lo == side - 1).all()
  quadrants = {tuple(q[0] // (n // 2)) for q in cells.reshape(4, -1, 2)}
  assert quadrants == {(0, 0), (0, 1), (1, 0), (1, 1)}


def _shard_perimeters(cells, shards):
  """Bounding-box perimeter of each of ``shards`` contiguous pieces of the order."""
  return np.array([2 * (c.max(axis=0) - c.min(axis=0) + 1).sum()
                   for c in np.array_split(cells, shards)])


@pytest.mark.parametrize("height,width", [(48, 48), (30, 50), (37, 41), (41, 36), (7, 13),
                                          (64, 64)])
def test_shards_are_compact(height, width):
  cells = hilbert_curve(height, width)
  row_major = np.stack(np.unravel_index(np.arange(height * width), (height, width)), axis=1)
  for shards in (2, 4, 8):
    ours = _shard_perimeters(cells, shards)
    theirs = _shard_perimeters(row_major, shards)
    if shards == 2:
      # Halves of a near-square image are strips either way.
      assert ours.sum() <= 1.05 * theirs.sum()
    else:
      assert ours.sum() < 0.9 * theirs.sum()
    # Each shard is near square: perimeter close to that of a square of its area.
    sizes = np.array([len(c) for c in np.array_split(cells, shards)])
    assert (ours <= 1.5 * 4 * np.sqrt(sizes)).all()


def test_inverse_permutation():
  perm = hilbert_permutation(7, 13)
  inv = inverse_permutation(perm)
  np.testing.assert_array_equal(inv[perm], np.arange(perm.size))
  np.testing.assert_array_equal(perm[inv], np.arange(perm.size))
  np.testing.assert_array_equal(inverse_permutation([2, 0, 1]), [1, 2, 0])


def test_cache_cannot_be_corrupted():
  cells, perm = hilbert_curve(6, 9), hilbert_permutation(6, 9)
  expected = cells.copy(), perm.copy()
  cells[:] = -1
  perm[:] = -1
  np.testing.assert_array_equal(hilbert_curve(6, 9), expected[0])
  np.testing.assert_array_equal(hilbert_permutation(6, 9), expected[1])


@pytest.mark.parametrize("height,width", [(1, 1), (9, 1), (7, 13)])
def test_flatten_is_the_curve_gather_and_unflatten_inverts_it(height, width):
  x = jax.random.normal(jax.random.PRNGKey(height * 100 + width), (2, height, width, 3))
  y = hilbert_flatten(x)
  assert y.shape == (2, height * width, 3)
  cells = hilbert_curve(height, width)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x)[:, cells[:, 0], cells[:, 1], :])
  np.testing.assert_array_equal(np.asarray(hilbert_unflatten(y, height, width)), np.asarray(x))
  # numpy input too, and integers come back bit for bit
  xi = np.random.default_rng(0).integers(-1000, 1000, (1, height, width, 2), dtype=np.int32)
  np.testing.assert_array_equal(np.asarray(hilbert_unflatten(hilbert_flatten(xi), height,
                                                             width)), xi)


def test_under_jit_and_grad():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 13, 4))
  w = jax.random.normal(jax.random.PRNGKey(2), (2, 7 * 13, 4))
  y = jax.jit(hilbert_flatten)(x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(hilbert_flatten(x)))
  back = jax.jit(hilbert_unflatten, static_argnums=(1, 2))(y, 7, 13)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
  # The gradient of a gather by a permutation is the inverse gather.
  grad = jax.grad(lambda x: jnp.sum(hilbert_flatten(x) * w))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(hilbert_unflatten(w, 7, 13)))


@pytest.mark.parametrize("bad", [0, -3, 2.0, "4", True, None])
def test_bad_sizes(bad):
  with pytest.raises(ValueError, match="height must be a positive int"):
    hilbert_curve(bad, 4)
  with pytest.raises(ValueError, match="width must be a positive int"):
    hilbert_permutation(4, bad)
  with pytest.raises(ValueError, match="width must be a positive int"):
    hilbert_unflatten(jnp.ones((1, 4, 1)), 4, bad)


def test_bad_arrays():
  with pytest.raises(ValueError,
                     match=r"x must be \[batch, height, width, channels\].*\(2, 3, 4\)"):
    hilbert_flatten(jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match=r"x\.shape\[1\] \(height\) must be a positive int"):
    hilbert_flatten(jnp.ones((2, 0, 4, 1)))
  with pytest.raises(ValueError, match=r"y must be \[batch, height \* width, channels\]"):
    hilbert_unflatten(jnp.ones((2, 3, 4, 1)), 3, 4)
  with pytest.raises(ValueError, match=r"y's length .* = 12, got 11"):
    hilbert_unflatten(jnp.ones((2, 11, 1)), 3, 4)
  with pytest.raises(ValueError, match=r"perm must be a permutation of range\(3\)"):
    inverse_permutation([0, 0, 2])
  with pytest.raises(ValueError, match=r"perm must be a permutation of range\(3\)"):
    inverse_permutation([1, 2, 3])
  with pytest.raises(ValueError, match="perm must be a 1-D integer array"):
    inverse_permutation(np.zeros((2, 2), np.int64))
  with pytest.raises(ValueError, match="perm must be a 1-D integer array"):
    inverse_permutation([0.0, 1.0])
