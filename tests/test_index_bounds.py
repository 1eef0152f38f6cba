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
    (lambda i, j: (i.astype(jnp.float32) * 0.5).astype(jnp.int32), (0, 3)),
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
  (values,), (bound,) = ef.evaluate_with_bounds(closed.jaxpr, closed.consts, [i, j],
                                                [I_RANGE, J_RANGE])
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


TABLE = jax.random.normal(jax.random.PRNGKey(0), (3, 6, 6))
REL = jax.random.normal(jax.random.PRNGKey(1), (3, 11))


@pytest.mark.parametrize("fn, q_bound, proven", [
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 5, True),           # a dense bias
    (lambda s, b, h, i, j: s + TABLE[h, i, j], 7, False),          # positions past the table
    (lambda s, b, h, i, j: s + REL[h, i - j + 5], 5, True),         # relative, always inside
    (lambda s, b, h, i, j: s + REL[h, i - j], 5, False),            # wraps negative offsets
    (lambda s, b, h, i, j: s + REL[h, jnp.clip(i - j, -5, 5) + 5], 7, True),
], ids=["bias", "bias-past-end", "relative", "relative-wraps", "relative-clipped"])
def test_reads_go_unclamped_where_the_bounds_prove_them_in_bounds(monkeypatch, fn, q_bound,
                                                                 proven):
  import jattn
  traced, consts = jattn.flex.functions.trace(fn, "score_mod")
  fn = traced.tile_function.with_bounds([None, (0, 0), (0, 2), (0, q_bound), (0, 5)])
  reads, load = [], ef._Array.load
  monkeypatch.setattr(ef._Array, "load",
                      lambda self, idx, in_bounds=False: reads.append(in_bounds) or load(
                          self, idx, in_bounds))
  i = jnp.arange(q_bound + 1, dtype=jnp.int32)[:, None]
  j = jnp.arange(6, dtype=jnp.int32)[None, :]
  out = fn(traced.tile_arrays(consts), jnp.zeros((q_bound + 1, 6)), 0, 1, i, j)
  assert reads == [proven]
  expected = jax.vmap(jax.vmap(lambda i, j: traced(consts, 0.0, 0, 1, i, j), (None, 0)),
                      (0, None))(i[:, 0], j[0])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
