"""Scalar functions (FlexAttention's ``score_mod`` / ``mask_mod``) evaluated on tiles.

A function's scalar jaxpr is interpreted equation by equation on broadcastable tiles
(query indices ``[bq, 1]``, key indices ``[1, bk]``, program ids as scalars):

- elementwise primitives apply to their operands broadcast to the operands' joint
  shape only (a ``[bq, 1]`` sum stays ``[bq, 1]``);
- shape primitives on one-element values (squeeze, reshape, ``broadcast_in_dim`` to
  ``[1]``) are the identity;
- reads of the arrays the function closed over (its jaxpr constants: ``x[i]``,
  ``jnp.take``, ``x.at[i].get(mode=...)``) become loads with per-element indices,
  clamped or filled as XLA's ``dynamic_slice`` / ``gather`` would.

The arrays are anything indexable by integer arrays: kernel refs (an indexed load
in the Triton lowering, a gather in interpret mode) or jax arrays. So one evaluator
serves every kernel tile; what it cannot express (arithmetic on whole arrays mixed
with indices) is reported before any kernel is built.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jattn.kernels.common.index_bounds import eqn_bounds, literal_bound, within

# Arrays of this dtype are passed to kernels as int32 (then compared with 0).
_STORED_AS_INT32 = (np.dtype(np.bool_),)
_SHAPE_PRIMITIVES = {"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p"}
_SUB_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives whose inner jaxprs run several times or one of several: inlined once they
# would compute something else (a fori_loop, searchsorted's scan, a cond or switch).
_CONTROL_FLOW = ("scan", "while", "cond")


class UnsupportedFunction(NotImplementedError):
  """A score or mask function the tile evaluator cannot run."""


@dataclasses.dataclass(frozen=True)
class _IndexVector:
  """Several one-element indices concatenated (a multi-dimensional gather's index)."""

  parts: tuple


def kernel_array(x):
  """How an array a function reads is passed to a kernel: booleans as int32, a
  scalar as one element, every dimension zero-padded to a power of two (Triton's
  blocks are; reads index the logical shape, so the padding is never read)."""
  x = x.astype(jnp.int32) if np.dtype(x.dtype) in _STORED_AS_INT32 else x
  x = x.reshape(1) if x.ndim == 0 else x
  pads = [(0, allocated(n) - n) for n in x.shape]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


def allocated(n: int) -> int:
  """The length ``kernel_array`` gives a dimension of ``n``: the next power of two."""
  return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class TileFunction:
  """A scalar function applied to broadcastable tiles: its jaxpr, whose first
  ``num_arrays`` inputs are the arrays it reads, then its arguments. Compared by the
  jaxpr's text: it is static kernel configuration."""

  jaxpr: Jaxpr = dataclasses.field(compare=False, repr=False)
  num_arrays: int = 0
  key: str = ""
  # Of the arguments, as ``with_bounds`` sets them: where the result counts, where the
  # kernels evaluate it, which arguments are clamped into ``bounds`` first.
  bounds: tuple = ()
  reach: tuple = ()
  clamped: tuple = ()

  @classmethod
  def of(cls, jaxpr: Jaxpr, num_arrays: int) -> "TileFunction":
    return cls(jaxpr, num_arrays, str(jaxpr))

  @property
  def _array_vars(self):
    return self.jaxpr.invars[:self.num_arrays]

  def __call__(self, arrays, *args):
    """The function of ``args`` (broadcastable tiles) reading ``arrays`` (refs or
    arrays, as ``kernel_array`` passes them, one per jaxpr constant)."""
    if len(arrays) != self.num_arrays:
      raise ValueError(f"the function reads {self.num_arrays} arrays, got {len(arrays)}")
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    bounds = self.bounds or (None,) * len(args)
    clamped = self.clamped or (False,) * len(args)
    args = [jnp.clip(a, *b) if c else a for a, b, c in zip(args, bounds, clamped)]
    # A clamped argument reaches no further than its bounds.
    reach = [b if c else r for b, r, c in zip(bounds, self.reach or bounds, clamped)]
    values = [_Array(a, v.aval) for a, v in zip(arrays, self._array_vars)] + args
    pairs = [(None, None)] * self.num_arrays + list(zip(bounds, reach))
    (out,) = evaluate_jaxpr(self.jaxpr, [], values, pairs)
    # A function constant in some indices still gives a value per element.
    return jnp.broadcast_to(out, shape)

  def with_bounds(self, bounds, reach=None, clamped=None) -> "TileFunction":
    """This function told where its arguments lie (one inclusive ``(lo, hi)`` or None
    per argument): within ``bounds`` where its results count, within ``reach`` (default
    ``bounds``) wherever a kernel evaluates it (past the ends of the sequences, say);
    arguments ``clamped`` (one bool each) are clipped into ``bounds`` first. A read
    of an array proven in bounds where results count, and inside the array's memory
    (``allocated``) wherever evaluated, skips the clamp (``index_bounds``)."""
    n = len(bounds)
    return dataclasses.replace(self, bounds=tuple(bounds),
                               reach=tuple(reach) if reach is not None else (),
                               clamped=tuple(clamped) if clamped is not None else (False,) * n)

  def _kernel_arrays(self) -> list:
    """The arrays it reads, abstract, as ``kernel_array`` stores them."""
    return [jax.eval_shape(kernel_array, jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
            for v in self._array_vars]

  @functools.cached_property
  def unit_slope(self) -> bool:
    """Whether the derivative in the first argument (a score) is 1 everywhere, as for
    ``score + g(b, h, q_idx, kv_idx)`` (a bias, ALiBi): then kernels take it as 1 with
    no forward-mode pass. Found by tracing that derivative once: it must come out
    as the literal 1."""
    arrays = self._kernel_arrays()
    args = [jax.ShapeDtypeStruct((), v.aval.dtype) for v in self.jaxpr.invars[self.num_arrays:]]

    def slope(arrays, score, *rest):
      values = [_Array(a, v.aval) for a, v in zip(arrays, self._array_vars)]
      f = lambda s: evaluate_jaxpr(self.jaxpr, [], values + [s, *rest])[0].astype(jnp.float32)
      return jax.jvp(f, (score,), (jnp.ones_like(score),))[1]

    try:
      closed = jax.make_jaxpr(slope)(arrays, *args)
    except UnsupportedFunction:
      return False
    (out,) = closed.jaxpr.outvars
    # A slope of 1 comes out of the trace as the literal (symbolic zeros for the rest).
    # Not evaluated: this is first asked inside a kernel, where an eager computation
    # would take the sharding of a mesh the call runs under (and fail in its manual axes).
    return isinstance(out, Literal) and bool(np.asarray(out.val) == 1.0)

  def check(self) -> str | None:
    """Why the evaluator cannot run this function (None: it can), by evaluating it
    abstractly on small tiles."""
    arrays = self._kernel_arrays()
    args = [jax.ShapeDtypeStruct((2, 1) if i % 2 else (1, 2), v.aval.dtype)
            for i, v in enumerate(self.jaxpr.invars[self.num_arrays:])]
    try:
      jax.eval_shape(lambda arrays, args: self(arrays, *args), arrays, args)
    except UnsupportedFunction as e:
      return str(e)
    return None


def reaches_custom_rule(jaxpr: Jaxpr, tainted) -> bool:
  """Whether a value computed from the variables ``tainted`` goes through a custom
  derivative rule (``jax.custom_jvp`` / ``custom_vjp``), in ``jaxpr`` or its inner
  jaxprs: evaluated inline, its rule would be lost to ``jax.jvp``."""
  tainted = set(tainted)
  for eqn in jaxpr.eqns:
    hit = [not isinstance(v, Literal) and v in tainted for v in eqn.invars]
    if not any(hit):
      continue
    if "custom_jvp" in eqn.primitive.name or "custom_vjp" in eqn.primitive.name:
      return True
    inner = _sub_jaxpr(eqn.params)
    if inner is not None:
      n = len(eqn.invars) - len(inner.jaxpr.invars)
      if reaches_custom_rule(inner.jaxpr, [v for v, h in zip(inner.jaxpr.invars, hit[n:]) if h]):
        return True
    tainted.update(eqn.outvars)
  return False


@dataclasses.dataclass(frozen=True)
class _Array:
  """A closed-over array as the evaluator reads it: ``ref`` indexable by integer
  arrays, ``aval`` its logical shape and dtype."""

  ref: object
  aval: object

  def load(self, indices, in_bounds: bool = False):
    """The elements at integer tiles ``indices`` (one per dimension), clamped into the
    array as ``dynamic_slice`` does, unless ``in_bounds`` (proven: the clamp is the
    identity, and the loads stay vectorised)."""
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in indices))
    if not in_bounds:
      indices = tuple(_clamp(i, n) for i, n in zip(indices, self.aval.shape))
    indices = tuple(jnp.broadcast_to(jnp.asarray(_index(i), jnp.int32), shape) for i in indices)
    x = self.ref[indices] if indices else self.ref[0]  # a scalar is stored as [1]
    if np.dtype(self.aval.dtype) in _STORED_AS_INT32:
      x = x != 0
    return x.astype(self.aval.dtype)

  def scalar(self):
    if int(np.prod(self.aval.shape)) != 1:
      raise UnsupportedFunction(
          f"it computes with a whole closed-over array of shape {list(self.aval.shape)} "
          "next to the indices (read it by indexing, e.g. x[h] or table[kv_idx - q_idx])")
    return self.load((0,) * len(self.aval.shape))


def _index(i):
  """An index tile (a closed-over scalar index read as one)."""
  return i.scalar() if isinstance(i, _Array) else i


def _clamp(i, size: int):
  return jnp.clip(_index(i), 0, size - 1)


def _proven(array: _Array, bounds) -> bool:
  """Whether indices of ``bounds`` (``(where results count, where evaluated)`` pairs,
  one per dimension) read ``array`` in bounds, and inside its memory."""
  return all(within(b, n) and within(r, allocated(n))
             for (b, r), n in zip(bounds, array.aval.shape))


def _dynamic_slice(array: _Array, starts, slice_sizes, bounds):
  if any(s != 1 for s in slice_sizes):
    raise UnsupportedFunction("it slices more than one element out of a closed-over array")
  return array.load(tuple(starts), _proven(array, bounds))


def _gather_fill(dtype, fill_value):
  if fill_value is not None:
    return fill_value
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return True
  if jnp.issubdtype(dtype, jnp.inexact):
    return np.nan
  return np.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger) else np.iinfo(dtype).max


def _gather(array: _Array, indices, index_bounds, *, dimension_numbers, slice_sizes, mode,
            fill_value, **unused):
  dn = dimension_numbers
  if any(s != 1 for s in slice_sizes) or dn.operand_batching_dims:
    raise UnsupportedFunction("it gathers more than one element of a closed-over array")
  parts = indices.parts if isinstance(indices, _IndexVector) else (indices,)
  parts = tuple(_index(i) for i in parts)
  if len(parts) != len(dn.start_index_map):
    raise UnsupportedFunction("it gathers with an index of unexpected shape")
  shape = array.aval.shape
  part_bounds = _parts(index_bounds, len(parts))
  starts, bounds = [0] * len(shape), [((0, 0), (0, 0))] * len(shape)
  for dim, i, b in zip(dn.start_index_map, parts, part_bounds):
    starts[dim], bounds[dim] = i, b
  x = array.load(tuple(starts), _proven(array, bounds))
  if mode == lax.GatherScatterMode.FILL_OR_DROP:
    outside = None
    for dim, i in zip(dn.start_index_map, parts):
      bad = (i < 0) | (i > shape[dim] - 1)
      outside = bad if outside is None else outside | bad
    x = jnp.where(outside, jnp.asarray(_gather_fill(x.dtype, fill_value), x.dtype), x)
  return x


def _sub_jaxpr(params):
  for name in _SUB_JAXPR_PARAMS:
    inner = params.get(name)
    if isinstance(inner, ClosedJaxpr):
      return inner
    if isinstance(inner, Jaxpr):
      return ClosedJaxpr(inner, [])
  return None


def _elementwise(eqn, values):
  values = [v.scalar() if isinstance(v, _Array) else v for v in values]
  if any(isinstance(v, _IndexVector) for v in values):
    raise UnsupportedFunction(f"it computes {eqn.primitive.name} on an index vector")
  shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in values))
  values = [jnp.broadcast_to(v, shape) if jnp.shape(v) != shape else v for v in values]
  out = eqn.primitive.bind(*values, **eqn.params)
  return out if eqn.primitive.multiple_results else [out]


def evaluate_jaxpr(jaxpr: Jaxpr, consts: list, args: list, bounds: list | None = None) -> list:
  """``jaxpr``'s outputs with its primitives applied to broadcastable tiles (``args``:
  tiles, scalars, or ``_Array`` reads of closed-over arrays; ``bounds``: per argument,
  ``(where results count, where evaluated)`` bounds or Nones, as ``index_bounds``
  propagates them)."""
  outs = evaluate_with_bounds(jaxpr, consts, args, bounds or [(None, None)] * len(args))[0]
  # A function may return a closed-over one-element array as it is (a constant mask).
  return [x.scalar() if isinstance(x, _Array) else x for x in outs]


def _parts(pair, n: int) -> list:
  """The per-part bound pairs of an index vector's (or ``n`` copies of one pair)."""
  if isinstance(pair[0], _IndexVector):
    return list(zip(pair[0].parts, pair[1].parts))
  return [pair] * n


def _eqn_pairs(eqn, pairs: list) -> list:
  plain = lambda k: [None if isinstance(p[k], _IndexVector) else p[k] for p in pairs]
  return list(zip(eqn_bounds(eqn, plain(0)), eqn_bounds(eqn, plain(1))))


def evaluate_with_bounds(jaxpr: Jaxpr, consts: list, args: list,
                         bounds: list) -> tuple[list, list]:
  """``evaluate_jaxpr``'s outputs and their bound pairs: ``(outputs, bounds)``."""
  env, env_bounds = {}, {}

  def read(v):
    if isinstance(v, Literal):
      return jnp.asarray(v.val, v.aval.dtype)
    return env[v]

  def bound(v):
    if isinstance(v, Literal):
      return (literal_bound(v.val),) * 2
    return env_bounds.get(v, (None, None))

  for var, value in zip(jaxpr.constvars, consts):
    env[var], env_bounds[var] = value, (_concrete_bound(value),) * 2
  for var, value, b in zip(jaxpr.invars, args, bounds):
    env[var], env_bounds[var] = value, b
  for eqn in jaxpr.eqns:
    values, in_bounds = [read(v) for v in eqn.invars], [bound(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CONTROL_FLOW:
      raise UnsupportedFunction(f"it runs a {name} (a loop or a branch) on the tiles")
    inner = _sub_jaxpr(eqn.params)
    out_bounds = None
    if inner is not None:
      if any(np.size(np.shape(c)) and np.prod(np.shape(c)) > 1 for c in inner.consts):
        raise UnsupportedFunction(f"its inner {name} closes over arrays")
      # Concrete constants go in as host values: a kernel takes them as literals (a
      # device array would be a captured constant).
      consts = [c if (h := concrete_value(c)) is None else h for c in inner.consts]
      if not inner.jaxpr.constvars:  # JAX that passes constants as leading inputs
        values, consts = consts + values, []
        in_bounds = [(_concrete_bound(c),) * 2 for c in inner.consts] + in_bounds
      n = len(values) - len(inner.jaxpr.invars)  # leading operands bound to constants
      outs, out_bounds = evaluate_with_bounds(inner.jaxpr, consts, values[n:], in_bounds[n:])
    elif values and isinstance(values[0], _Array) and name == "dynamic_slice":
      outs = [_dynamic_slice(values[0], values[1:], eqn.params["slice_sizes"], in_bounds[1:])]
    elif values and isinstance(values[0], _Array) and name == "gather":
      outs = [_gather(values[0], values[1], in_bounds[1], **eqn.params)]
    elif name in _SHAPE_PRIMITIVES and all(np.prod(v.aval.shape) == 1 for v in eqn.outvars):
      outs = [values[0].scalar() if isinstance(values[0], _Array) else values[0]]
      out_bounds = in_bounds[:1]
    elif name == "concatenate" and all(np.prod(v.aval.shape) == 1 for v in eqn.invars):
      parts, part_bounds = [], []
      for v, b in zip(values, in_bounds):
        parts.extend(v.parts if isinstance(v, _IndexVector) else (v,))
        part_bounds.extend(_parts(b, 1))
      outs = [_IndexVector(tuple(parts))]
      out_bounds = [tuple(_IndexVector(tuple(p[k] for p in part_bounds)) for k in (0, 1))]
    elif any(np.prod(v.aval.shape) != 1 for v in eqn.outvars):
      raise UnsupportedFunction(f"it computes {name} on whole arrays next to the indices")
    else:
      outs = _elementwise(eqn, values)
    if out_bounds is None:
      out_bounds = _eqn_pairs(eqn, in_bounds)
    for var, value, b in zip(eqn.outvars, outs, out_bounds):
      env[var], env_bounds[var] = value, b
  return [read(v) for v in jaxpr.outvars], [bound(v) for v in jaxpr.outvars]


def concrete_value(value):
  """A constant as a host array, or None where it is traced."""
  try:
    return np.asarray(value)
  except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _concrete_bound(value):
  """The bound of a constant value (None for a tracer or an array)."""
  host = concrete_value(value)
  return None if host is None else literal_bound(host)
