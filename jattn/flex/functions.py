"""User score and mask functions, traced once into a form every backend can call.

A ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)`` is
traced on scalars (as PyTorch's FlexAttention vmaps it), and every array it closes
over (ALiBi slopes, bias tables, document ids, concrete or traced) is hoisted out
as an explicit input. So:

- the arrays reach the op as arguments: they get gradients through its VJP, and a
  new value never hides behind a cached compilation;
- two calls with functions of the same trace share one compiled program, even when
  each call builds a fresh lambda;
- a backend evaluates the function on whatever broadcastable index arrays it has:
  a dense ``[B, H, Sq, Sk]`` grid elementwise through ``vmap``, or a kernel tile
  through ``tile_function``, which reads the arrays from the kernel's refs. What
  depends on the arrays alone (``slopes * 2``, a table's softplus) is computed once,
  outside the kernels, by ``kernel_arrays``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun

from jattn.kernels.common.elementwise import elementwise
from jattn.kernels.common.element_functions import (TileFunction, concrete_value,
                                                    kernel_array, reaches_custom_rule)
from jattn.kernels.common.factored_functions import FactoredFunction
from jattn.kernels.common.varying import as_varying, varying_axes

SCORE_ARGS = "(score, b, h, q_idx, kv_idx)"
MASK_ARGS = "(b, h, q_idx, kv_idx)"


@dataclasses.dataclass(frozen=True, eq=False)
class ElementFunction:
  """A traced score or mask function: its scalar jaxpr, whose first ``num_consts``
  inputs are the hoisted arrays (passed back in at each call), then the function's
  own arguments. Equal, and hashed alike, when the traces are equal: it is part of
  an op's static problem."""

  jaxpr: Jaxpr  # no constvars: [arrays..., arguments...] -> [value]
  num_consts: int
  kind: str  # "score_mod" or "mask_mod"
  _key: str = dataclasses.field(repr=False)
  dense_bias: bool = False  # ``score + bias[b, h, q_idx, kv_idx]`` (``mods.bias_score``)

  @classmethod
  def of(cls, jaxpr: Jaxpr, num_consts: int, kind: str, dense_bias: bool = False):
    """The function of a jaxpr of ``[arrays..., arguments...]``, keyed by its text."""
    return cls(jaxpr, num_consts, kind,
               f"{kind}:{dense_bias}:{jaxpr}:{_hidden_parts(jaxpr)}", dense_bias)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, ElementFunction) and self._key == other._key

  def bind(self, consts) -> Callable:
    """The scalar function with ``consts`` in place of the arrays it closed over."""
    return lambda *xs: _evaluate(self.jaxpr, (*consts, *xs))[0]

  def __call__(self, consts, *args):
    """The function on broadcastable ``args`` (score float32, indices int32),
    elementwise, with ``consts`` in place of the arrays it closed over."""
    return elementwise(self.bind(consts), *args)

  def with_array_shapes(self, shapes) -> "ElementFunction":
    """The same equations traced again for closed-over arrays of ``shapes`` (a shard's
    rows of them). Only arrays ``index_reads`` finds (read at an index alone) may
    change shape: the equations' other shapes stay as traced."""
    invars = self.jaxpr.invars
    avals = [jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype)
             for shape, v in zip(shapes, invars[:self.num_consts])]
    avals += [jax.ShapeDtypeStruct((), v.aval.dtype) for v in invars[self.num_consts:]]
    closed = jax.make_jaxpr(lambda *xs: _evaluate(self.jaxpr, xs))(*avals)
    jaxpr = _jaxpr(closed.jaxpr.invars, closed.jaxpr.outvars, closed.jaxpr.eqns)
    return ElementFunction.of(jaxpr, self.num_consts, self.kind, self.dense_bias)

  def _index_var(self, index: str):
    names = (("score",) if self.kind == "score_mod" else ()) + ("b", "h", "q_idx", "kv_idx")
    return self.jaxpr.invars[self.num_consts + names.index(index)]

  def uses(self, index: str) -> bool:
    """Whether the function reads the index argument ``index`` ("b", "h", "q_idx",
    "kv_idx")."""
    var = self._index_var(index)
    return any(var is v for eqn in self.jaxpr.eqns for v in eqn.invars) or any(
        var is v for v in self.jaxpr.outvars)

  def index_reads(self, index: str) -> dict[int, int] | None:
    """``{position of a closed-over array: axis}`` when all the function does with the
    index argument ``index`` ("b" or "h") is to read arrays at it, one element at a
    time along that axis (``x[b, ...]``), and those arrays are read nowhere else; None
    when it uses the index otherwise (``{}``: not at all). On a shard of the batch
    rows (heads), such arrays split along those axes read the shard's own rows with
    its own indices."""
    consts = {v: i for i, v in enumerate(self.jaxpr.invars[:self.num_consts])}
    is_var = lambda v: not isinstance(v, Literal)
    same = {self._index_var(index)}  # equal to the index: the kernels' are never negative
    below_zero, wrapped = {}, {}  # jnp indexing's `i < 0` and `i + size`, of such a var
    reads = {}
    for eqn in self.jaxpr.eqns:
      ins, name = eqn.invars, eqn.primitive.name
      touched = [v for v in ins if is_var(v) and (v in same or v in below_zero or v in wrapped)]
      if not touched:
        continue
      out, first = eqn.outvars[0], ins[0] if is_var(ins[0]) else None
      if name == "lt" and first in same and not is_var(ins[1]) and ins[1].val == 0:
        below_zero[out] = first
      elif name == "add" and first in same and not is_var(ins[1]):
        wrapped[out] = first
      elif (name == "select_n" and len(ins) == 3 and all(map(is_var, ins))
            and below_zero.get(ins[0]) is ins[1] and wrapped.get(ins[2]) is ins[1]):
        same.add(out)  # where(i < 0, i + size, i): i itself
      elif name == "dynamic_slice" and is_var(ins[0]) and ins[0] in consts:
        axes = [a for a, v in enumerate(ins[1:]) if is_var(v) and v in same]
        if len(axes) != 1 or len(touched) != 1 or eqn.params["slice_sizes"][axes[0]] != 1:
          return None
        if reads.setdefault(consts[ins[0]], axes[0]) != axes[0]:
          return None
      else:
        return None
    if any(is_var(v) and (v in same or v in below_zero or v in wrapped or v in consts
                          and consts[v] in reads) for v in self.jaxpr.outvars):
      return None
    for eqn in self.jaxpr.eqns:  # the arrays read at the index: read there alone
      for v in eqn.invars:
        if not (is_var(v) and v in consts and consts[v] in reads):
          continue
        at = (eqn.invars[1 + reads[consts[v]]] if eqn.primitive.name == "dynamic_slice"
              and v is eqn.invars[0] else None)
        if at is None or not is_var(at) or at not in same:
          return None
    return reads

  @functools.cached_property
  def _split(self) -> tuple[Jaxpr, TileFunction]:
    """``(jaxpr: the function's arrays -> the arrays the tiles read, the tile
    function)``: equations that do not depend on the arguments move out of the tiles."""
    consts, args = self.jaxpr.invars[:self.num_consts], self.jaxpr.invars[self.num_consts:]
    varying, arrays = set(args), set(consts)
    outer, inner = [], []
    for eqn in self.jaxpr.eqns:
      inputs = [v for v in eqn.invars if not isinstance(v, Literal)]
      if any(v in varying for v in inputs):
        inner.append(eqn)
        varying.update(eqn.outvars)
      elif any(v in arrays for v in inputs):
        outer.append(eqn)
        arrays.update(eqn.outvars)
      else:  # of literals only: wherever it is needed
        outer.append(eqn)
        inner.append(eqn)
    read = [v for eqn in inner for v in eqn.invars] + list(self.jaxpr.outvars)
    read = list({id(v): v for v in read if not isinstance(v, Literal) and v in arrays}.values())
    tiles = TileFunction.of(_jaxpr(read + list(args), self.jaxpr.outvars, inner), len(read))
    return _jaxpr(consts, read, outer), tiles

  @property
  def tile_function(self) -> TileFunction:
    """The function as kernels run it on tiles (see ``kernel_arrays``)."""
    return self._split[1]

  def tile_arrays(self, consts) -> tuple:
    """The arrays ``tile_function`` reads, from the closed-over ``consts``
    (differentiably), in their logical shapes and dtypes."""
    return tuple(jnp.asarray(a) for a in jaxpr_as_fun(ClosedJaxpr(self._split[0], []))(*consts))

  def kernel_arrays(self, consts) -> tuple:
    """``tile_arrays`` as the Triton kernels take them (``kernel_array``)."""
    return tuple(kernel_array(a) for a in self.tile_arrays(consts))

  @functools.cached_property
  def factored(self) -> FactoredFunction:
    """The function split for the Hopper kernels (``factored_functions``)."""
    return FactoredFunction.of(self.tile_function)

  @functools.cached_property
  def slope_gap(self) -> str | None:
    """Why the kernels' slope of the function in the score (forward-mode autodiff of
    the evaluated tiles) would be wrong (None: it is right)."""
    tiles = self.tile_function
    score = tiles.jaxpr.invars[tiles.num_arrays:][:1] if self.kind == "score_mod" else []
    if reaches_custom_rule(tiles.jaxpr, score):
      return ("a custom derivative rule (jax.custom_jvp or custom_vjp) on the score, which "
              "the kernels' forward-mode slope would not follow")
    return None

  @functools.cached_property
  def kernel_gap(self) -> str | None:
    """Why kernels cannot evaluate the function (None: they can)."""
    return self.slope_gap or self.tile_function.check()


def _inlined_arrays(jaxpr: Jaxpr) -> list:
  """The arrays newer JAX may inline into a jaxpr's equations as literals (concrete
  closed-over arrays), in order of use."""
  return [v for eqn in jaxpr.eqns for v in eqn.invars
          if isinstance(v, Literal) and jnp.ndim(v.val) > 0]


def _with_arrays_as_inputs(closed: ClosedJaxpr, args) -> tuple[Jaxpr, tuple]:
  """``(jaxpr of [arrays..., args...], the arrays)`` for a traced function: its
  constants, and any arrays inlined as literals, traced again as inputs. So, like any
  constant, they reach the op as arguments (a literal would be baked into a compiled
  program that calls with other values would reuse). Constants are leading inputs, as
  JAX versions without ``constvars`` keep them too."""
  literals = _inlined_arrays(closed.jaxpr)
  values = list({id(v.val): v.val for v in literals}.values())  # one input per array
  index = {id(x): i for i, x in enumerate(values)}
  position = {id(v): index[id(v.val)] for v in literals}
  constvars, invars = list(closed.jaxpr.constvars), list(closed.jaxpr.invars)
  if not constvars and closed.consts:  # JAX that passes constants as leading inputs
    constvars, invars = invars[:len(closed.consts)], invars[len(closed.consts):]

  def lifted(arrays, *xs):
    literal = lambda v: arrays[position[id(v)]] if id(v) in position else v.val
    return _evaluate(_jaxpr(constvars + invars, closed.jaxpr.outvars, closed.jaxpr.eqns),
                     list(arrays[len(values):]) + list(xs), literal)

  arrays = [jnp.asarray(x) for x in values] + [jnp.asarray(c) for c in closed.consts]
  if not literals:
    return _jaxpr(constvars + invars, closed.jaxpr.outvars, closed.jaxpr.eqns), tuple(arrays)
  retraced = jax.make_jaxpr(lifted)(arrays, *args)
  jaxpr = retraced.jaxpr
  return (_jaxpr(list(jaxpr.constvars) + list(jaxpr.invars), jaxpr.outvars, jaxpr.eqns),
          tuple(jnp.asarray(c) for c in retraced.consts) + tuple(arrays))


def _evaluate(jaxpr: Jaxpr, args, literal=lambda v: v.val, consts=()) -> list:
  """The outputs of ``jaxpr`` on ``args`` (and ``consts`` for its constvars), equation
  by equation (``literal(v)``: a literal's value). Inside a ``shard_map`` that checks
  varying axes, each equation's inputs are first marked varying over every axis one of
  them varies over: a closed-over array, an index or a literal (varying over none)
  meets scores that vary over the mesh, which JAX's functions reconcile and a bare
  primitive does not. There, inner jaxprs (custom derivatives), traced as varying
  over nothing, run inlined, and the function's own casts to varying apply only to
  the axes an input does not vary over yet. Inner ``jit`` calls run inlined always."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: literal(v) if isinstance(v, Literal) else env[v]
  matching = bool(varying_axes(args) or varying_axes(list(consts)))
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    if matching:
      axes = varying_axes(inputs)
      inputs = [as_varying(x, axes) for x in inputs]
      outs = _matching_rule(eqn, inputs)
    elif eqn.primitive.name in ("pjit", "jit"):  # inlined: bound under a mesh of Explicit
      # axes, in the transpose of a shard_map, it leaves a constant JAX cannot close over
      outs = _inlined(eqn, inputs)
    else:
      outs = None
    if outs is None:
      params = eqn.primitive.get_bind_params(eqn.params)  # (older JAX: (subfuns, params))
      subfuns, params = ([], params) if isinstance(params, dict) else params
      outs = eqn.primitive.bind(*subfuns, *inputs, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _matching_rule(eqn, inputs) -> list | None:
  """``_evaluate``'s outputs of an equation inside a checking ``shard_map`` where
  binding it as traced would not do (None: bind it): a cast to varying, or a call
  of an inner jaxpr."""
  name = eqn.primitive.name
  if name in ("pvary", "pcast"):
    if name == "pcast" and eqn.params.get("to") != "varying":
      return None
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = frozenset(axes if isinstance(axes, (tuple, list)) else (axes,))
    return [as_varying(x, axes) for x in inputs]
  return _inlined(eqn, inputs)


def _inlined(eqn, inputs) -> list | None:
  """The outputs of an equation that calls an inner jaxpr, its equations evaluated in
  place (None: it calls none)."""
  inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                if k in eqn.params), None)
  if isinstance(inner, ClosedJaxpr):
    return _evaluate(inner.jaxpr, inputs, consts=inner.consts)
  if isinstance(inner, Jaxpr):
    return _evaluate(inner, inputs)
  return None


def _debug_info(invars, outvars) -> DebugInfo:
  return DebugInfo("flex_attention", "a score or mask function",
                   tuple(f"x{i}" for i in range(len(invars))),
                   tuple(f"y{i}" for i in range(len(outvars))))


def _jaxpr(invars, outvars, eqns) -> Jaxpr:
  """A jaxpr without constants (what it reads is among its inputs)."""
  return Jaxpr([], list(invars), list(outvars), list(eqns),
               debug_info=_debug_info(invars, outvars))


def _digest(x) -> str:
  """A constant's dtype, shape and contents (a traced one: its identity)."""
  host = concrete_value(x)
  if host is None:
    return f"traced@{id(x)}"
  return f"{host.dtype}{host.shape}:{hashlib.sha1(host.tobytes()).hexdigest()}"


def _hidden_parts(jaxpr: Jaxpr) -> str:
  """What a jaxpr's text leaves out but its function depends on: the constants of its
  inner jaxprs (an inner ``jax.jit`` closing over an array) and custom derivative
  rules (by identity), for the cache key."""
  parts = []
  for eqn in jaxpr.eqns:
    for name, value in sorted(eqn.params.items()):
      if isinstance(value, ClosedJaxpr):
        parts += [_digest(c) for c in value.consts] + [_hidden_parts(value.jaxpr)]
      elif isinstance(value, Jaxpr):
        parts.append(_hidden_parts(value))
      elif callable(value) and ("custom" in eqn.primitive.name):
        parts.append(f"{name}@{id(value)}")
  return ";".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True, eq=False)
class _Built:
  """How one of jattn's helpers built a function: ``build(*arrays)`` is ``fn``;
  ``dense_bias``: it is ``bias_score``'s ``score + bias[b, h, q_idx, kv_idx]``."""

  arrays: tuple
  build: Callable
  fn: Callable
  dense_bias: bool


def built_function(build: Callable, arrays, dense_bias: bool = False) -> Callable:
  """``build(*arrays)``, marked so that ``trace`` traces it from the arrays (as its
  inputs: indexing a closed-over array sharded over a mesh of Explicit axes is
  refused while tracing). The mark holds for this function alone: a wrapper that
  copies its attributes (``functools.wraps``) is traced as it is."""
  fn = build(*arrays)
  fn._jattn_built = _Built(tuple(arrays), build, fn, dense_bias)
  return fn


def _built(fn) -> _Built | None:
  built = getattr(fn, "_jattn_built", None)
  return built if isinstance(built, _Built) and built.fn is fn else None


def trace(fn: Callable | None, kind: str) -> tuple[ElementFunction | None, tuple]:
  """``(traced fn, the arrays it closes over)`` for a ``score_mod`` or ``mask_mod``
  (``(None, ())`` for None). Raises TypeError naming ``kind`` when ``fn`` is not a
  function of the expected arguments returning one float score (``score_mod``) or one
  boolean (``mask_mod``) per element."""
  if fn is None:
    return None, ()
  signature = SCORE_ARGS if kind == "score_mod" else MASK_ARGS
  if not callable(fn):
    raise TypeError(f"{kind} must be a function {signature}, got {type(fn).__name__}")
  index = jax.ShapeDtypeStruct((), jnp.int32)
  args = ([jax.ShapeDtypeStruct((), jnp.float32)] if kind == "score_mod" else []) + [index] * 4
  built = _built(fn)  # (``built_function``'s: traced from its arrays)
  arrays = () if built is None else tuple(jnp.asarray(a) for a in built.arrays)
  n = len(arrays)
  traced = fn if built is None else lambda *xs: built.build(*xs[:n])(*xs[n:])
  inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=jax.typeof(a).weak_type)
            for a in arrays] + args
  try:
    closed = jax.make_jaxpr(traced)(*inputs)
  except TypeError as e:
    raise TypeError(f"{kind} must be a function {signature} of jnp operations, called "
                    f"elementwise; calling it raised: {e}") from e
  out = closed.out_avals
  want = "a float score" if kind == "score_mod" else "a boolean"
  ok = len(out) == 1 and out[0].shape == () and (
      jnp.issubdtype(out[0].dtype, jnp.floating) if kind == "score_mod"
      else out[0].dtype == jnp.bool_)
  if not ok:
    got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in out)
    raise TypeError(f"{kind} must return {want} per element (it is called on scalars), "
                    f"got {got}")
  jaxpr, consts = _with_arrays_as_inputs(closed, inputs)
  consts += arrays  # (the builder's arrays follow what it closes over)
  dense_bias = kind == "score_mod" and built is not None and built.dense_bias and len(
      consts) == 1
  return ElementFunction.of(jaxpr, len(consts), kind, dense_bias), consts
