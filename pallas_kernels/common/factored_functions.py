"""Score and mask functions split for kernels that cannot gather (the Hopper ones).

A Mosaic GPU kernel holds a score tile in the wgmma register layout; it can load a
vector per tile row or column from shared memory and scalars from global memory,
but not an element per position from an array indexed by that position (a gather).
So a ``TileFunction`` is split into *parts* computed outside the kernel and an inner
function the kernel evaluates on its tiles:

- a part is a value of the function that reads closed-over arrays and depends on
  one sequence axis at most: per ``(b, h)`` (a *scalar* part: ``slopes[h]``), per
  query position (a *row* part: ``documents[b, q_idx]``) or per key position (a
  *col* part); row and col parts may depend on ``b`` but not on ``h``;
- the inner function gets the parts as inputs (a scalar, or a row or column vector
  broadcast over the tile) beside the score and the index tiles, and computes the
  rest elementwise: index arithmetic (``q_idx >= kv_idx``), comparisons, the score.

What cannot be split so (an array read at positions that depend on both axes, as a
relative-position table or a full bias; or per-head rows) is the Hopper kernels'
gap, reported before any kernel is built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun

from jattn.kernels.common.elementwise import elementwise
from jattn.kernels.common.element_functions import (TileFunction, UnsupportedFunction,
                                                    evaluate_jaxpr)

SCALAR, ROW, COL = "scalar", "row", "col"


def _jaxpr(invars, outvars, eqns) -> Jaxpr:
  debug = DebugInfo("flex_attention", "a part of a score or mask function",
                    tuple(f"x{i}" for i in range(len(invars))),
                    tuple(f"y{i}" for i in range(len(outvars))))
  return Jaxpr([], list(invars), list(outvars), list(eqns), debug_info=debug)


@dataclasses.dataclass(frozen=True)
class Part:
  """One value computed outside the kernels: its kind (``SCALAR``, ``ROW``, ``COL``)
  and whether it varies with the batch row and the head."""

  kind: str
  batch: bool
  head: bool


@dataclasses.dataclass(frozen=True)
class FactoredFunction:
  """A ``TileFunction`` as parts (``outer``: ``[arrays..., args...] -> [parts...]``) and
  an ``inner`` jaxpr ``[parts..., args...] -> [value]``; ``gap`` says why it cannot
  be split (then the rest is unset). Compared by the function's text."""

  inner: Jaxpr | None = dataclasses.field(compare=False, repr=False)
  outer: Jaxpr | None = dataclasses.field(compare=False, repr=False)
  parts: tuple[Part, ...] = ()
  gap: str | None = None
  key: str = ""

  @classmethod
  def of(cls, fn: TileFunction) -> "FactoredFunction":
    try:
      split = cls(*_split(fn), key=fn.key)
      split._check()
      return split
    except UnsupportedFunction as e:
      return cls(None, None, gap=str(e), key=fn.key)

  def _check(self) -> None:
    """Evaluates the inner function abstractly on small tiles: raises
    ``UnsupportedFunction`` where the tiles cannot run it."""
    n_args = len(self.inner.invars) - len(self.parts)
    tile = lambda dtype: jax.ShapeDtypeStruct((2, 2), dtype)
    parts = [jax.ShapeDtypeStruct(() if p.kind == SCALAR else (2, 2), v.aval.dtype)
             for p, v in zip(self.parts, self.inner.invars)]
    args = [tile(v.aval.dtype) for v in self.inner.invars[-n_args:]]
    jax.eval_shape(lambda parts, args: self(parts, *args), parts, args)

  def of_kind(self, kind: str) -> tuple[int, ...]:
    """Positions (among ``parts``) of the parts of ``kind``."""
    return tuple(i for i, p in enumerate(self.parts) if p.kind == kind)

  def part_arrays(self, arrays, batch: int, heads: int, q_len: int, kv_len: int) -> list:
    """The parts from the function's ``arrays`` (as ``ElementFunction.kernel_arrays``
    gives them, unpadded logical shapes are read): scalar parts ``[B', H']``, row parts
    ``[B', q_len]``, col parts ``[B', kv_len]``, with ``B'`` = ``batch`` where the part
    varies with the batch row, else 1 (``H'`` likewise)."""
    fn = jaxpr_as_fun(ClosedJaxpr(self.outer, []))
    n_args = len(self.outer.invars) - len(arrays)
    out = []
    for i, part in enumerate(self.parts):
      b = jnp.arange(batch if part.batch else 1, dtype=jnp.int32)[:, None]
      h = jnp.arange(heads if part.head else 1, dtype=jnp.int32)[None, :]
      zero = jnp.zeros((1, 1), jnp.int32)
      q = jnp.arange(q_len, dtype=jnp.int32)[None, :] if part.kind == ROW else zero
      k = jnp.arange(kv_len, dtype=jnp.int32)[None, :] if part.kind == COL else zero
      args = ([jnp.zeros((1, 1), jnp.float32)] if n_args == 5 else []) + [b, h, q, k]
      out.append(elementwise(lambda *xs, i=i: jnp.reshape(fn(*arrays, *xs)[i], ()), *args))
    return out

  def __call__(self, parts, *args):
    """The function on broadcastable tiles ``args`` given its ``parts`` (scalars, or
    tiles broadcast from the part's vector), in any dtype they were passed as (a
    kernel's int32 or float32)."""
    dtypes = [v.aval.dtype for v in self.inner.invars[:len(parts)]]
    parts = [p != 0 if t == jnp.bool_ else p.astype(t) for p, t in zip(parts, dtypes)]
    (out,) = evaluate_jaxpr(self.inner, [], parts + list(args))
    return jnp.broadcast_to(out, jnp.broadcast_shapes(*(jnp.shape(a) for a in args)))


def _split(fn: TileFunction):
  jaxpr, n = fn.jaxpr, fn.num_arrays
  arrays, args = jaxpr.invars[:n], jaxpr.invars[n:]
  names = ("s", "b", "h", "q", "k")[-len(args):]
  depends = {v: frozenset((name,)) for v, name in zip(args, names)}
  reads = {v: True for v in arrays}
  depends.update({v: frozenset() for v in arrays})
  dep = lambda v: frozenset() if isinstance(v, Literal) else depends[v]
  red = lambda v: False if isinstance(v, Literal) else reads.get(v, False)
  inner_eqns, computed_outside = [], set()

  def outside(v) -> bool:
    d = dep(v)
    return red(v) and "s" not in d and not {"q", "k"} <= d

  for eqn in jaxpr.eqns:
    d = frozenset().union(*(dep(v) for v in eqn.invars))
    r = any(red(v) for v in eqn.invars)
    for v in eqn.outvars:
      depends[v], reads[v] = d, r
    if all(outside(v) for v in eqn.outvars):
      computed_outside.update(eqn.outvars)
    else:
      for v in eqn.invars:
        if v in arrays and np.prod(v.aval.shape) != 1:
          raise UnsupportedFunction(
              "it reads a closed-over array at positions that depend on both q_idx and "
              "kv_idx, or on the score (the Hopper kernels read arrays per row, per "
              "column or per head only)")
      inner_eqns.append(eqn)
  used_inside = [v for e in inner_eqns for v in e.invars] + list(jaxpr.outvars)
  boundary = list({id(v): v for v in used_inside if not isinstance(v, Literal)
                   and (v in computed_outside or v in arrays)}.values())
  parts = []
  for v in boundary:
    if np.prod(v.aval.shape) != 1:  # a slice of an array, indexed on the tiles
      raise UnsupportedFunction(
          "it indexes, next to the indices, a slice of a closed-over array (the Hopper "
          "kernels read arrays per row, per column or per head only)")
    if np.dtype(v.aval.dtype).itemsize > 4:
      raise UnsupportedFunction(f"it reads {v.aval.dtype} values (the Hopper kernels take "
                                "32-bit ones)")
    d = dep(v)
    kind = ROW if "q" in d else COL if "k" in d else SCALAR
    if kind != SCALAR and "h" in d:
      raise UnsupportedFunction(
          "it reads a closed-over array per head and per sequence position (the Hopper "
          "kernels take per-position arrays shared by the heads)")
    parts.append(Part(kind, "b" in d, "h" in d))
  outer = _jaxpr(list(arrays) + list(args), boundary, _cone(jaxpr.eqns, boundary))
  inner = _jaxpr(boundary + list(args), jaxpr.outvars, inner_eqns)
  return inner, outer, tuple(parts)


def _cone(eqns, outputs) -> list:
  """The equations ``outputs`` are computed from, in order."""
  needed, cone = {id(v) for v in outputs}, []
  for eqn in reversed(eqns):
    if any(id(v) in needed for v in eqn.outvars):
      cone.append(eqn)
      needed.update(id(v) for v in eqn.invars if not isinstance(v, Literal))
  return cone[::-1]
