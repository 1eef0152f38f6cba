"""Ops that run per shard under ``jax.jit``: an op whose arrays are sharded over their
batch and/or head axes (KV heads with their query-head groups) runs its kernels on
each device's shard, forward and backward, with no gather of its inputs; the outputs
keep the inputs' sharding.

The op's forward (its outputs from its arrays) and backward (gradients from the
arrays, the outputs and the cotangents) are each one ``custom_partitioning``
function. An op says where each array keeps its batch and head axes (``ShardRule``);
that gives Shardy's factor rule and, when XLA partitions the program, each shard's
problem (``Problem.local``: the same call on fewer rows and heads). A sharded
sequence or feature axis is refused with an error that points to the ring. On one
device, or inside ``shard_map``, the functions are inlined: the call runs as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.custom_batching
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

SEQUENCE_SHARDING_HINT = ("shard it over batch or heads only, or use jattn.sharded_ring_attention "
                          "(context parallelism) to split sequences over devices")


@dataclasses.dataclass(frozen=True)
class Axes:
  """Where one array of an op keeps its batch and head axes (None: it has none, and
  every shard holds all of it)."""

  batch: int | None = None
  heads: int | None = None
  kv: bool = False  # the head axis counts KV heads (query heads come in groups per KV head)
  # Its other axes, if given split, are gathered (an array a flex function reads at b
  # or h) rather than refused as a split sequence.
  gather_rest: bool = False


REPLICATED = Axes()


@dataclasses.dataclass(frozen=True)
class ShardRule:
  """How an op's call splits: ``Axes`` of each of its arrays (``Op.arg_names``' order,
  absent ones included) and of each of its outputs (one: the forward returns it bare,
  not in a tuple); ``group`` query heads per KV head; ``refusals``: ``("batch" |
  "heads", why)`` pairs for axes this call cannot be split over."""

  inputs: tuple[Axes, ...]
  outputs: tuple[Axes, ...]
  group: int = 1
  refusals: tuple[tuple[str, str], ...] = ()


Q_HEADS = Axes(batch=0, heads=2)  # [batch, seq, q_heads, d]
KV_HEADS = Axes(batch=0, heads=2, kv=True)  # [batch, seq, kv_heads, d]
ROW_STATS = Axes(batch=0, heads=1)  # [batch, q_heads, seq]: lse
PER_ROW = Axes(batch=0)  # [batch, ...]: segment ids, lengths
PER_Q_HEAD = Axes(heads=0)  # [q_heads]: sinks
PER_KV_HEAD = Axes(heads=0, kv=True)  # [kv_heads]: FP8 descales


def _factors(axes: Axes, ndim: int, group: int, name: str, one_kv_head: bool) -> str:
  """One array's dimensions in Shardy's factor notation: ``b`` the batch, ``g`` the KV
  heads (query heads ``(g r)``), a factor of its own for every other dimension. With
  one KV head (MQA) the query heads are ``g`` and the KV head a factor of its own:
  Shardy takes no factor of size 1 in a compound one."""
  dims = []
  for d in range(ndim):
    if d == axes.batch:
      dims.append("b")
    elif d == axes.heads and not (axes.kv and one_kv_head):
      dims.append("g" if axes.kv or group == 1 or one_kv_head else "(g r)")
    else:
      dims.append(f"{name}{d}")
  return " ".join(dims)


def _rule_text(in_axes, out_axes, in_ndims, out_ndims, group: int, one_kv_head: bool):
  factors = lambda axes, ndims, prefix: ", ".join(
      _factors(a, n, group, f"{prefix}{i}x", one_kv_head)
      for i, (a, n) in enumerate(zip(axes, ndims)))
  sizes = {"r": group} if group > 1 and not one_kv_head else {}
  return f"{factors(in_axes, in_ndims, 'i')} -> {factors(out_axes, out_ndims, 'o')}", sizes


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def _mesh_size(mesh, names) -> int:
  if names is None:
    return 1
  names = (names,) if isinstance(names, str) else tuple(names)
  return math.prod(mesh.shape[n] for n in names)


def _pspec(axes: Axes, ndim: int, batch_mesh, head_mesh) -> PartitionSpec:
  return PartitionSpec(*(batch_mesh if d == axes.batch else head_mesh if d == axes.heads
                         else None for d in range(ndim)))


def _split(call, names, in_axes, mesh, arg_shapes):
  """``(local call, batch mesh axes, head mesh axes)`` of the shardings XLA proposes
  for the arrays, or a ``ValueError`` for a split the op cannot run."""
  rule = call.op.shard_rule(call.problem)
  q_axes, q_spec = in_axes[0], _spec(arg_shapes[0].sharding, len(arg_shapes[0].shape))
  batch_mesh = q_spec[q_axes.batch] if q_axes.batch is not None else None
  head_mesh = q_spec[q_axes.heads] if q_axes.heads is not None else None
  for name, axes, shape in zip(names, in_axes, arg_shapes):
    if axes.gather_rest or (axes.batch is None and axes.heads is None):
      continue  # read whole but for its batch or head axis (a flex function's): gathered
    spec = _spec(shape.sharding, len(shape.shape))
    for d, mesh_axes in enumerate(spec):
      if mesh_axes is not None and d not in (axes.batch, axes.heads):
        raise ValueError(f"{call.op.name}: {name} of shape {tuple(shape.shape)} is sharded over "
                         f"its axis {d} (mesh axes {mesh_axes!r}); the op runs per shard of "
                         f"batch and heads: {SEQUENCE_SHARDING_HINT}")
  batch_shards, head_shards = _mesh_size(mesh, batch_mesh), _mesh_size(mesh, head_mesh)
  for name, axes, shape in zip(names, in_axes, arg_shapes):
    for axis, shards in ((axes.batch, batch_shards), (axes.heads, head_shards)):
      if axis is not None and shape.shape[axis] % shards:
        raise ValueError(f"{call.op.name}: {name} of shape {tuple(shape.shape)} cannot be split "
                         f"evenly over {shards} shards along its axis {axis}")
  for axis, shards in (("batch", batch_shards), ("heads", head_shards)):
    why = dict(rule.refusals).get(axis)
    if shards > 1 and why:
      raise ValueError(f"{call.op.name} cannot run split over {axis} ({shards} shards): {why}")
  local = call.problem.local(batch_shards, head_shards)
  return dataclasses.replace(call, problem=local), batch_mesh, head_mesh


def _fill(present: tuple, arrays) -> list:
  """The op's arrays with None where ``present`` says one is absent."""
  it = iter(arrays)
  return [next(it) if p else None for p in present]


def _present(items, present):
  return tuple(x for x, p in zip(items, present) if p)


# --- the partitioned functions --------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)  # a static argument, hashed by identity
class _Piece:
  """One partitioned function of a call, its forward or its backward: ``body(call,
  *operands)`` gives its results on any call (the whole one or a shard's); ``jaxpr``
  is the body on the whole call traced once, with its constants (arrays the kernel
  wrappers build from numbers) among its operands, as the partitioner wants them."""

  call: Any
  body: Callable
  operand_axes: tuple
  result_axes: tuple
  names: tuple
  jaxpr: Any
  num_consts: int
  sum_missing: bool  # results are gradients: summed over the shards that do not split them


def _whole(piece: _Piece, *operands):
  consts, operands = operands[:piece.num_consts], operands[piece.num_consts:]
  return tuple(jaxpr_as_fun(ClosedJaxpr(piece.jaxpr, list(consts)))(*operands))


def _rule(piece: _Piece, mesh, arg_types, result_types):
  ndims = lambda types: [len(t.shape) for t in types]
  in_axes = (REPLICATED,) * piece.num_consts + piece.operand_axes
  kv_heads = {t.shape[a.heads] for a, t in zip(in_axes, arg_types)
              if a.kv and a.heads is not None}
  return _rule_text(in_axes, piece.result_axes, ndims(arg_types), ndims(result_types),
                    piece.call.op.shard_rule(piece.call.problem).group, kv_heads == {1})


def _partition(piece: _Piece, mesh, arg_shapes, result_shape):
  n = piece.num_consts
  local, batch_mesh, head_mesh = _split(piece.call, piece.names, piece.operand_axes, mesh,
                                        arg_shapes[n:])
  shard = lambda axes, shape: NamedSharding(mesh, _pspec(axes, len(shape.shape), batch_mesh,
                                                         head_mesh))

  def lower(*operands):
    results = piece.body(local, *operands[n:])
    if not piece.sum_missing:
      return results
    # An array without a batch (head) axis gets, on each shard, its gradient from that
    # shard's rows (heads) only: the sum over the shards is its gradient.
    return tuple(_sum_over(g, _missing(axes, batch_mesh, head_mesh))
                 for g, axes in zip(results, piece.result_axes))

  operand_axes = (REPLICATED,) * n + piece.operand_axes
  return (mesh, lower, tuple(shard(a, s) for a, s in zip(piece.result_axes, result_shape)),
          tuple(shard(a, s) for a, s in zip(operand_axes, arg_shapes)))


def _infer(piece: _Piece, mesh, arg_shapes, result_shape):
  return _partition(piece, mesh, arg_shapes, result_shape)[2]


_partitioned = custom_partitioning(_whole, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)


def _missing(axes: Axes, batch_mesh, head_mesh) -> tuple:
  """The mesh axes that split the call but not this array."""
  names = lambda m: () if m is None else (m,) if isinstance(m, str) else tuple(m)
  return ((names(batch_mesh) if axes.batch is None else ())
          + (names(head_mesh) if axes.heads is None else ()))


def _sum_over(x, mesh_axes: tuple):
  return jax.lax.psum(x, mesh_axes) if mesh_axes else x


def _run_piece(call, body, operand_axes, result_axes, names, operands, sum_missing=False):
  """``body(call, *operands)``, partitioned; under ``vmap`` (the partitioner has no
  batching rule) the body runs vmapped instead: the kernels' own batching."""
  closed = jax.make_jaxpr(functools.partial(body, call))(*operands)
  piece = _Piece(call, body, operand_axes, result_axes, names, closed.jaxpr, len(closed.consts),
                 sum_missing)

  @jax.custom_batching.custom_vmap
  def run(*operands):
    return _partitioned(piece, *closed.consts, *operands)

  @run.def_vmap
  def _(axis_size, in_batched, *operands):
    in_axes = tuple(0 if batched else None for batched in in_batched)
    results = jax.vmap(functools.partial(body, call), in_axes=in_axes,
                       axis_size=axis_size)(*operands)
    return results, tuple(True for _ in results)

  return run(*operands)


# --- the forward and the backward ------------------------------------------------------


def _forward_body(present, call, *arrays):
  outputs = call.impl.forward(call, *_fill(present, arrays))[0]
  return tuple(outputs) if isinstance(outputs, tuple) else (outputs,)


def _backward_body(present, wanted, n_outputs, call, *operands):
  """Gradients of the arrays at ``wanted`` (positions among the present ones) from
  ``(arrays..., outputs..., cotangents...)``; zeros where the op gives none."""
  n = len(operands) - 2 * n_outputs
  arrays = _fill(present, operands[:n])
  outputs, cotangents = operands[n:n + n_outputs], operands[n + n_outputs:]
  residuals = call.impl.residuals_of(call, arrays, outputs)
  cotangents = tuple(cotangents) if n_outputs > 1 else cotangents[0]
  grads = call.impl.backward(call, residuals, cotangents)
  flat = _present(grads, present)
  kept = _present(arrays, present)
  return tuple(jnp.zeros(kept[i].shape, jnp.float32) if flat[i] is None else flat[i]
               for i in wanted)


def _names(call, present) -> tuple:
  rule = call.op.shard_rule(call.problem)
  names = tuple(call.op.arg_names)
  names += tuple(f"array {i}" for i in range(len(names), len(rule.inputs)))
  return _present(names, present)


def partitions(call) -> bool:
  """Whether ``call``'s op splits over batch and heads (it has a ``ShardRule``)."""
  return call.op.shard_rule(call.problem) is not None


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def forward(call, arrays: tuple):
  """The outputs of ``call`` on ``arrays`` (None for absent ones), run per shard."""
  rule = call.op.shard_rule(call.problem)
  present = tuple(x is not None for x in arrays)
  outputs = _run_piece(call, functools.partial(_forward_body, present),
                       _present(rule.inputs, present), rule.outputs, _names(call, present),
                       _present(arrays, present))
  return outputs if len(rule.outputs) > 1 else outputs[0]


def backward(call, arrays: tuple, outputs, cotangents) -> tuple:
  """The gradients of ``arrays`` (None for absent and integer ones), run per shard."""
  rule = call.op.shard_rule(call.problem)
  present = tuple(x is not None for x in arrays)
  kept = _present(arrays, present)
  outputs, cotangents = _as_tuple(outputs), _as_tuple(cotangents)
  wanted = tuple(i for i, x in enumerate(kept) if jnp.issubdtype(x.dtype, jnp.inexact))
  in_axes = _present(rule.inputs, present)
  outs = tuple(f"output {i}" for i in range(len(outputs)))
  names = _names(call, present) + outs + tuple(f"cotangent of {o}" for o in outs)
  grads = _run_piece(call, functools.partial(_backward_body, present, wanted, len(outputs)),
                     in_axes + rule.outputs + rule.outputs, tuple(in_axes[i] for i in wanted),
                     names, kept + outputs + cotangents, sum_missing=True)
  flat = [None] * len(kept)
  for i, g in zip(wanted, grads):
    flat[i] = g
  return tuple(_fill(present, flat))


# --- meshes of explicit axes (the shardings are in the types) -------------------------


def _typed_sharding(x):
  try:
    sharding = jax.typeof(x).sharding
  except (AttributeError, TypeError):  # JAX without sharding in types, or not an array
    return None
  return sharding if isinstance(sharding, NamedSharding) else None


def typed_split(x) -> NamedSharding | None:
  """``x``'s sharding where its type splits an axis of it (a mesh of ``Explicit``
  axes), else None."""
  typed = _typed_sharding(x)
  return None if typed is None or all(a is None for a in typed.spec) else typed


def explicit_split(call, arrays: tuple):
  """``(call on a shard, mesh, which arrays are present, in_specs, out_specs)`` when
  ``call``'s arrays carry their shardings in their types (a mesh of ``Explicit`` axes)
  and split its batch or heads; None otherwise (the shardings, if any, are XLA's to
  propose: ``forward``)."""
  rule = call.op.shard_rule(call.problem)
  if rule is None:
    return None
  # q unsplit and another array split (sinks by head, say): that one is gathered
  typed = next((t for t in map(typed_split, arrays) if t is not None), None)
  if typed is None:
    return None
  present = tuple(x is not None for x in arrays)
  shapes = [_Typed(x.shape, _typed_sharding(x)) for x in _present(arrays, present)]
  in_axes = _present(rule.inputs, present)
  local, batch_mesh, head_mesh = _split(call, _names(call, present), in_axes, typed.mesh, shapes)
  in_specs = tuple(_pspec(a, len(s.shape), batch_mesh, head_mesh) for a, s in zip(in_axes, shapes))
  rank = lambda a: 1 + max((d for d in (a.batch, a.heads) if d is not None), default=-1)
  out_specs = tuple(_pspec(a, rank(a), batch_mesh, head_mesh) for a in rule.outputs)
  return local, typed.mesh, present, in_specs, out_specs


def run_explicit(run, split, arrays: tuple):
  """``run(call, arrays)`` per shard with ``shard_map``, for ``explicit_split``'s split."""
  local, mesh, present, in_specs, out_specs = split

  def per_shard(*kept):
    outputs = run(local, tuple(_fill(present, kept)))
    return _as_tuple(outputs)

  # Arrays the op builds itself (a default decay, zero states) come unsplit: each
  # device keeps its own slice of them (a reshard from replicated gathers nothing).
  kept = tuple(jax.reshard(x, NamedSharding(mesh, spec))
               for x, spec in zip(_present(arrays, present), in_specs))
  # check_vma off: the kernels' pallas_calls do not say how their outputs vary.
  outputs = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)(*kept)
  return outputs if len(out_specs) > 1 else outputs[0]


@dataclasses.dataclass(frozen=True)
class _Typed:
  """An array's shape and sharding, as the partitioner's callbacks see them."""

  shape: tuple
  sharding: object
