"""Index bounds (``jattn.kernels.common.index_bounds``): sound on every index function
below (each value it computes over the whole argument grid lies within the bound it
proves), tight where index arithmetic needs it, and the evaluator reads an array
unclamped exactly where the bounds prove the read in bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.kernels.common import element_functions as ef

I_RANGE, J_RANGE = (0, 7), (-2, 5)

# (function of the int32 indices i and j, the bound expected: exact, "any" (sound,
# not checked for tightness) or None)
INDEX_FUNCTIONS = [
    (lambda i, j: i - j + 3, (-2, 12)),
    (lambda i, j: (2 * i - j) // 3, "any"),
    (lambda i, j: jnp.clip(i - j, 0, 4), (0, 4)),
    (lambda i, j: jnp.where(i > j, i, -j), "any"),
    (lambda i, j: jnp.where(i >= 0, i, 100), (0, 7)),  # the predicate is decided
    (lambda i, j: i % 3, "any"),
    (lambda i, j: (i - j) % 4, "any"),
    (lambda i, j: jnp.abs(i - j), (0, 9)),
    (lambda i, j: jnp.maximum(i, j) - jnp.minimum(i, j), "any"),
    (lambda i, j: -i, (-7, 0)),
    # Through floats: none (float32 rounding could carry an index past a bound).
    (lambda i, j: (i.astype(jnp.float32) * 0.5).astype(jnp.int32), None),
    (lambda i, j: ((i < 3) & (j > 0)).astype(jnp.int32), (0, 1)),
    (lambda i, j: jnp.sign(j) * i, "any"),
    (lambda i, j: i * j, (-14, 35)),
    (lambda i, j: i // (j - 1), None),  # the divisor can be 0
]


@pytest.mark.parametrize("fn, expected", INDEX_FUNCTIONS,
                         ids=[f"f{n}" for n in range(len(INDEX_FUNCTIONS))])
def test_bounds_hold_every_value_on_the_grid(fn, expected):
  closed = jax.make_jaxpr(fn)(jnp.int32(0), jnp.int32(0))
  i = jnp.arange(I_RANGE[0], I_RANGE[1] + 1, dtype=jnp.int32)[:, None]
  j = jnp.arange(J_RANGE[0], J_RANGE[1] + 1, dtype=jnp.int32)[None, :]
  (values,), ((bound, same),) = ef.evaluate_with_bounds(
      closed.jaxpr, closed.consts, [i, j], [(I_RANGE, I_RANGE), (J_RANGE, J_RANGE)])
  assert bound == same
  values = np.broadcast_to(np.asarray(values), (i.shape[0], j.shape[1]))  # (tiles broadcast)
  np.testing.assert_array_equal(values, np.asarray(jax.vmap(jax.vmap(
      fn, (None, 0)), (0, None))(i[:, 0], j[0])))
  if expected is None:
    assert bound is None
    return
  assert bound is not None
  assert bound[0] <= values.min() and values.max() <= bound[1], (bound, values.min(),
                                                                 values.max())
  if expected != "any":
    assert tuple(bound) == expected


def test_integer_division_bounds_are_exact_past_float_precision():
  """64-bit integers past 2^53: the bounds of a division come out exact."""
  big = 2 ** 62
  with jax.enable_x64(True):
    fn = lambda j: jax.lax.div(j.astype(jnp.int64) + (big + 3), jnp.int64(1)) - big
    closed = jax.make_jaxpr(fn)(jnp.int32(0))
    _, ((bound, _),) = ef.evaluate_with_bounds(closed.jaxpr, closed.consts,
                                               [jnp.arange(6, dtype=jnp.int32)], [((0, 5),) * 2])
  assert tuple(bound) == (3, 8)


TABLE = jax.random.normal(jax.random.PRNGKey(0), (3, 6, 6))
REL = jax.random.normal(jax.random.PRNGKey(1), (3, 11))


@pytest.mark.parametrize("fn, q_reach, kv_reach, clamp_q, proven", [
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 5, 5, False, True),        # a dense bias
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 8, 5, False, False),       # rows past its memory
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 8, 5, True, True),         # ... clamped first
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 5, 7, False, True),        # keys in its padding
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 5, 8, False, False),       # keys past its memory
    (lambda s, b, h, i, j: s + REL[h, i - j + 5], 5, 5, False, True),     # relative, inside
    (lambda s, b, h, i, j: s + REL[h, i - j + 5], 5, 7, False, False),    # ... wraps past keys
    (lambda s, b, h, i, j: s + REL[h, i - j], 5, 5, False, False),        # wraps negative offsets
    (lambda s, b, h, i, j: s + REL[h, jnp.clip(i - j, -5, 5) + 5], 7, 7, False, True),
], ids=["bias", "bias-rows-past-memory", "bias-rows-clamped", "bias-keys-padded",
        "bias-keys-past-memory", "relative", "relative-keys-past", "relative-wraps",
        "relative-clipped"])
def test_reads_go_unclamped_where_the_bounds_prove_them_in_bounds(monkeypatch, fn, q_reach,
                                                                 kv_reach, clamp_q, proven):
  """Results count at 6 query and 6 key positions (the arrays have 6 there, stored as
  8: ``allocated``); the kernels evaluate to ``q_reach`` and ``kv_reach``."""
  import jattn
  traced, consts = jattn.flex.functions.trace(fn, "score_mod")
  bounds = [None, (0, 0), (0, 2), (0, 5), (0, 5)]
  reach = [None, (0, 0), (0, 2), (0, q_reach), (0, kv_reach)]
  fn = traced.tile_function.with_bounds(bounds, reach, [False, False, False, clamp_q, False])
  reads, load = [], ef._Array.load
  monkeypatch.setattr(ef._Array, "load",
                      lambda self, idx, in_bounds=False: reads.append(in_bounds) or load(
                          self, idx, in_bounds))
  i = jnp.arange(q_reach + 1, dtype=jnp.int32)[:, None]
  j = jnp.arange(kv_reach + 1, dtype=jnp.int32)[None, :]
  arrays = tuple(ef.kernel_array(x) for x in traced.tile_arrays(consts))  # as kernels get them
  out = fn(arrays, jnp.zeros((q_reach + 1, kv_reach + 1)), 0, 1, i, j)
  assert reads == [proven]
  rows = jnp.minimum(i[:, 0], 5) if clamp_q else i[:, 0]
  expected = jax.vmap(jax.vmap(lambda i, j: traced(consts, 0.0, 0, 1, i, j), (None, 0)),
                      (0, None))(rows, j[0])
  # Where results count (keys past 5 are the kernels' padding, masked there).
  np.testing.assert_array_equal(np.asarray(out)[:, :6], np.asarray(expected)[:, :6])
