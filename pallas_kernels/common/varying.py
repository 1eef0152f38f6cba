"""Which mesh axes arrays vary over inside a ``jax.shard_map`` that checks them
(``check_vma=True``, its default), and marking an array as varying over more. Outside
such a map, or on a JAX without manual axis types, none."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def as_varying(x, axes: frozenset):
  """``x`` (an array or a scalar) marked as varying over ``axes`` too: what JAX's own
  functions do before combining arrays that vary over different axes, and a primitive
  bound directly does not."""
  missing = tuple(sorted(axes - _varying(x)))
  if not missing:
    return x
  cast = getattr(jax.lax, "pcast", None)
  x = jnp.asarray(x)
  return cast(x, missing, to="varying") if cast else jax.lax.pvary(x, missing)
