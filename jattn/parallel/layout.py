"""How a sequence sits on the devices of a context-parallel mesh axis: contiguous
chunks, the zig-zag order that balances causal work (device ``i`` holds chunks ``i``
and ``2P - 1 - i`` of ``2P``), or that zig-zag applied to each segment of packed
sequences (``segment_zigzag``: every device holds two chunks of every document)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.validation import check_positive_int
from jattn.kernels.retention.packing import sequence_bounds

LAYOUTS = ("contiguous", "zigzag", "segment_zigzag")

# The segment zig-zag's steps mark halves as 2 id + 1 in int32.
ID_LIMIT = 2 ** 30


def _zigzag_chunks(x, devices: int, axis: int):
  """``x`` cut into ``2 * devices`` chunks along ``axis``, and the zig-zag order of
  their indices: device ``i`` holds chunks ``i`` and ``2 * devices - 1 - i``."""
  check_positive_int("devices", devices)
  if x.shape[axis] % (2 * devices):
    raise ValueError(f"x's length {x.shape[axis]} along axis {axis} must be a multiple of "
                     f"2 * devices = {2 * devices}; x has shape {tuple(x.shape)}")
  order = [c for i in range(devices) for c in (i, 2 * devices - 1 - i)]
  return jnp.split(x, 2 * devices, axis=axis), order


def zigzag_order(x, devices: int, axis: int = 1):
  """Reorders a full sequence so that sharding it evenly over ``devices`` gives device
  ``i`` the chunks ``i`` and ``2 * devices - 1 - i``. ``x.shape[axis]`` must be a
  multiple of ``2 * devices``."""
  chunks, order = _zigzag_chunks(x, devices, axis)
  return jnp.concatenate([chunks[c] for c in order], axis=axis)


def zigzag_restore(x, devices: int, axis: int = 1):
  """Inverse of ``zigzag_order``."""
  chunks, order = _zigzag_chunks(x, devices, axis)
  return jnp.concatenate([chunks[pos] for pos in np.argsort(order)], axis=axis)


# --- per-segment zig-zag (packed documents) -------------------------------------------

def _runs(segment_ids):
  """Per token of ``segment_ids [batch, seq]``: its run's start and length (a run:
  consecutive equal ids)."""
  start, end = jax.vmap(sequence_bounds)(jnp.asarray(segment_ids))
  return start, end - start


def check_segment_zigzag(segment_ids, devices: int, name: str = "segment_ids") -> None:
  """Raises a ValueError where concrete ``segment_ids [batch, seq]`` cannot take the
  per-segment zig-zag layout: a segment (a run of equal ids) whose length is not a
  multiple of ``2 * devices``, an id that comes back after another (each segment
  must be one run), or an id outside ``[-2**30, 2**30)``. Traced ids are not checked."""
  check_positive_int("devices", devices)
  if isinstance(segment_ids, jax.core.Tracer):
    return
  ids = np.asarray(segment_ids)
  if ids.ndim != 2:
    raise ValueError(f"{name} must be [batch, seq], got shape {ids.shape}")
  for b, row in enumerate(ids):
    cuts = np.flatnonzero(np.diff(row)) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, row.size]
    for s, e in zip(starts, ends):
      if (e - s) % (2 * devices):
        raise ValueError(
            f"{name}: row {b}'s segment {row[s]} (tokens {s}..{e - 1}) has length {e - s}, not "
            f"a multiple of 2 * devices = {2 * devices}; pad each segment to such a length")
    if len(set(row[starts].tolist())) != starts.size:
      raise ValueError(f"{name}: row {b} has a segment id in more than one run; in the "
                       "segment zig-zag layout each segment must be one run")
  if ids.size and (ids.min() < -ID_LIMIT or ids.max() >= ID_LIMIT):
    raise ValueError(f"{name} must lie in [-2**30, 2**30) for the segment zig-zag layout "
                     f"(its steps double them), got [{ids.min()}, {ids.max()}]")


def _segment_zigzag_targets(segment_ids, devices: int):
  """``[batch, seq]``: where each token of the natural order goes in the per-segment
  zig-zag order (see ``segment_zigzag_order``)."""
  start, length = _runs(segment_ids)
  seq = start.shape[1]
  chunk = length // (2 * devices)
  offset = jnp.arange(seq) - start
  part, within = offset // chunk, offset % chunk
  device = jnp.where(part < devices, part, 2 * devices - 1 - part)
  # Every earlier segment put 2 chunks (2 * length / (2P) = start / P tokens) on each device.
  return (device * (seq // devices) + start // devices + (part >= devices) * chunk + within)


def segment_zigzag_order(x, segment_ids, devices: int):
  """Reorders packed sequences so that sharding them evenly over ``devices`` gives
  device ``i``, of every segment, chunks ``i`` and ``2 * devices - 1 - i`` of the
  segment's ``2 * devices`` equal chunks, laid out segment by segment: the layout of
  ``ring_attention(..., layout="segment_zigzag")``, which balances causal work over the
  devices whatever the documents' lengths.

  ``x``: ``[batch, seq, ...]`` (the ids themselves too), or a tuple of such arrays,
  all reordered by one permutation; ``segment_ids [batch, seq]`` in the natural order;
  every segment (a run of equal ids) must have a length that is a multiple of
  ``2 * devices`` and be one run (checked where the ids are concrete, not under
  ``jit``). Pad documents to such lengths: with ``causal=True``, pad tokens at a
  document's end that take its id are seen by no token of it but the pads."""
  check_segment_zigzag(segment_ids, devices)
  order = jnp.argsort(_segment_zigzag_targets(segment_ids, devices), axis=1)
  return _take_rows(x, order)


def segment_zigzag_restore(x, segment_ids, devices: int):
  """Inverse of ``segment_zigzag_order`` (``x``: an array or a tuple of arrays);
  ``segment_ids [batch, seq]`` in the natural order (the ones given to
  ``segment_zigzag_order``)."""
  check_segment_zigzag(segment_ids, devices)
  return _take_rows(x, _segment_zigzag_targets(segment_ids, devices))


def _take_rows(x, index):
  """``x[b, index[b, t], ...]`` of an array, or of each array of a tuple."""
  if isinstance(x, tuple):
    return tuple(_take_rows(a, index) for a in x)
  x = jnp.asarray(x)
  # A permutation: in bounds and non-negative by construction, so the gather needs no
  # masks or index wrapping around it.
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1,
                             mode="promise_in_bounds", wrap_negative_indices=False)


def segment_zigzag_halves(local_ids):
  """``[batch, n]`` int32, 1 where a token of a local shard in the segment zig-zag
  layout lies in the second half of its run (the segment's later chunk), else 0."""
  start, length = _runs(local_ids)
  return ((jnp.arange(local_ids.shape[1]) - start) >= length // 2).astype(jnp.int32)
