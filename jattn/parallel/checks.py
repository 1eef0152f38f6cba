"""The argument checks the rings share (``ring``, ``dilated_ring``, and the Flax layer
over them): mesh axes, by name, inside ``shard_map`` and on a ``Mesh``; an even split of
the sequence over an axis. Each error names the argument and what was expected."""

from __future__ import annotations

import jax
from jax import lax


def mesh_axis_size(mesh, axis_name) -> int:
  """The size of ``mesh``'s axis ``axis_name`` (a ``jax.sharding.Mesh`` or
  ``AbstractMesh``)."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; its axes are "
                     f"{mesh.axis_names}")
  return mesh.shape[axis_name]


def bound_axis_size(axis_name, fn: str) -> int:
  """The size of mesh axis ``axis_name`` where ``fn`` runs: inside ``shard_map``, one of
  the axes it maps (JAX itself only says "unbound axis name")."""
  try:
    return lax.axis_size(axis_name)
  except NameError:
    mesh = jax.sharding.get_abstract_mesh()
    raise ValueError(
        f"axis_name {axis_name!r} is not a mesh axis that shard_map maps here (mapped: "
        f"{tuple(mesh.manual_axes)}; the mesh's axes: {mesh.axis_names}); call {fn} inside "
        f"jax.shard_map over a mesh with that axis, or sharded_{fn} with the mesh") from None


def check_split(arrays: dict, *, devices: int, axis_name, chunks: int = 1) -> None:
  """Each of ``arrays`` (name -> ``[batch, seq, ...]``) has a sequence length that
  splits into ``chunks`` equal pieces per device of axis ``axis_name``."""
  multiple = devices * chunks
  for name, x in arrays.items():
    if x.shape[1] % multiple:
      pieces = f", {chunks} chunks each" if chunks > 1 else ""
      raise ValueError(f"{name}'s sequence length {x.shape[1]} must be a multiple of {multiple} "
                       f"({devices} devices on axis {axis_name!r}{pieces}); {name} has shape "
                       f"{tuple(x.shape)}")
