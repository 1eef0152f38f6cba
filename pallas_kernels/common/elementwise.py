"""Scalar functions applied elementwise over broadcastable arrays (FlexAttention's
score and mask functions, in the reference and in every backend)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def elementwise(f: Callable, *args):
  """``f`` of scalars applied to broadcastable ``args``: the result has their
  broadcast shape. How every backend (and the reference) calls a user function."""
  args = [jnp.asarray(a) for a in args]
  shape = jnp.broadcast_shapes(*(a.shape for a in args))
  args = [a.reshape((1,) * (len(shape) - a.ndim) + a.shape) for a in args]
  return _elementwise(f, args, shape)


def _elementwise(f: Callable, args: list, shape: tuple):
  """``f`` of scalars over broadcastable ``args`` of rank ``len(shape)``: one ``vmap``
  per axis, mapping only the arguments that vary along it (no broadcast copies)."""
  if not shape:
    return f(*args)
  varies = [a.shape[0] != 1 for a in args]
  inner = lambda *xs: _elementwise(f, list(xs), shape[1:])
  heads = [a if v else a[0] for a, v in zip(args, varies)]
  if not any(varies):
    return inner(*heads)[None]
  return jax.vmap(inner, in_axes=[0 if v else None for v in varies])(*heads)


def dense_indices(batch: int, heads: int, q_len: int, kv_len: int) -> tuple[Any, ...]:
  """``(b, h, q_idx, kv_idx)`` int32, broadcastable to ``[batch, heads, q_len, kv_len]``."""
  shapes = ((batch, 1, 1, 1), (1, heads, 1, 1), (1, 1, q_len, 1), (1, 1, 1, kv_len))
  return tuple(jnp.arange(n, dtype=jnp.int32).reshape(s)
               for n, s in zip((batch, heads, q_len, kv_len), shapes))
