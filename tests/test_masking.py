"""The element mask every flash kernel applies (``masking.element_mask``), against its
definition: a window (causal is ``right = 0``) on bottom-right aligned positions, key
padding, per-row lengths and segment ids, each one condition of its own."""

import itertools

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jattn.kernels.common.masking import MaskSpec, element_mask, kv_block_range, q_block_range

bounds = st.one_of(st.none(), st.integers(-3, 6))


def _definition(spec: MaskSpec, q_idx, k_idx, q_seg, k_seg):
  allowed = np.ones(np.broadcast_shapes(q_idx.shape, k_idx.shape), bool)
  q_abs = q_idx + (spec.kv_len - spec.q_len)
  if spec.lengths:
    allowed &= q_idx < spec.q_len
  if spec.kv_padded:
    allowed &= k_idx < spec.kv_len
  if spec.right is not None:
    allowed &= k_idx <= q_abs + spec.right
  if spec.left is not None:
    allowed &= k_idx >= q_abs - spec.left
  if spec.segments:
    allowed &= q_seg == k_seg
  return allowed


@settings(max_examples=100, deadline=None)
@given(q_len=st.integers(1, 12), kv_len=st.integers(1, 12), left=bounds, right=bounds,
       kv_padded=st.booleans(), segments=st.booleans(), lengths=st.booleans(),
       keys_on_rows=st.booleans(), data=st.data())
def test_element_mask_is_its_definition(q_len, kv_len, left, right, kv_padded, segments,
                                        lengths, keys_on_rows, data):
  spec = MaskSpec(q_len, kv_len, left, right, kv_padded, segments, lengths=lengths)
  if lengths:  # bound as a kernel binds them: traced scalars within the arrays' lengths
    spec = spec.with_lengths(jnp.int32(data.draw(st.integers(0, q_len))),
                             jnp.int32(data.draw(st.integers(0, kv_len))))
  rows, cols = 16, 20  # padded tiles, one shape for all examples (eager ops compile once)
  # The Triton dK/dV kernel lays keys along rows: the mask only needs broadcasting.
  q_shape, k_shape = ((1, rows), (cols, 1)) if keys_on_rows else ((rows, 1), (1, cols))
  q_idx, k_idx = np.arange(rows).reshape(q_shape), np.arange(cols).reshape(k_shape)
  ids = lambda n, shape: np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=n,
                                                       max_size=n))).reshape(shape)
  q_seg, k_seg = (ids(rows, q_shape), ids(cols, k_shape)) if segments else (None, None)
  mask = element_mask(spec, jnp.asarray(q_idx), jnp.asarray(k_idx), q_seg, k_seg)
  expected = _definition(spec, q_idx, k_idx, q_seg, k_seg)
  got = np.ones_like(expected) if mask is None else np.broadcast_to(np.asarray(mask),
                                                                    expected.shape)
  np.testing.assert_array_equal(got, expected)


def test_masked_runs_say_where_the_block_ranges_can_mask():
  """A kernel's block loop leaves out the masked run on a side ``MaskSpec.masked_kv_runs``
  (``masked_q_runs``) rules out: ``kv_block_range`` (``q_block_range``) must then give no
  masked block on that side, at any tile of the padded grid. Every combination of the
  fields those functions read (a grid, not a sample: a rare field must not go unseen)."""
  masks = [dict(), dict(segments=True), dict(segments=True, segment_tiles=True),
           dict(element_fn=lambda *a: True)]
  starts = np.arange(0, 48, 4)  # past the lengths too (padding tiles)
  for (q_len, kv_len), left, right, kv_padded, mask, lengths, (block_q, block_k) in (
      itertools.product([(7, 13), (16, 16), (13, 5)], [None, 0, 2, 5], [None, 0, 3],
                        [False, True], masks, [None, "unbound", "bound"], [(4, 2), (8, 4)])):
    spec = MaskSpec(q_len, kv_len, left, right, kv_padded, lengths=lengths is not None, **mask)
    if lengths == "bound":
      spec = spec.with_lengths(q_len - 2, kv_len - 1)
    for ranges, (before, after) in [
        (kv_block_range(spec, starts, block_q, block_k), spec.masked_kv_runs),
        (q_block_range(spec, starts, block_k, block_q), spec.masked_q_runs)]:
      lo, full_lo, full_hi, hi = (np.broadcast_to(np.asarray(x), starts.shape) for x in ranges)
      case = (spec, block_q, block_k)
      assert (lo <= full_lo).all() and (full_lo <= full_hi).all() and (full_hi <= hi).all(), case
      assert before or (lo == full_lo).all(), case
      assert after or (full_hi == hi).all(), case
