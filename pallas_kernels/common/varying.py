"""Which mesh axes arrays vary over inside a ``jax.shard_map`` that checks them
(``check_vma=True``, its default). Outside such a map, or on a JAX without manual axis
types, none."""

from __future__ import annotations

import jax


def _varying(x) -> frozenset:
  try:
    mat = jax.typeof(x).manual_axis_type
  except (AttributeError, TypeError):  # not an array, or a JAX without the types
    return frozenset()
  return frozenset(getattr(mat, "varying", None) or ())


def varying_axes(arrays) -> frozenset:
  """The mesh axes any of ``arrays`` (a pytree; None leaves skipped) varies over."""
  axes = frozenset()
  for x in jax.tree.leaves(arrays):
    axes |= _varying(x)
  return axes
