"""How a sequence sits on the devices of a context-parallel mesh axis: contiguous
chunks, or the zig-zag order that balances causal work (device ``i`` holds chunks ``i``
and ``2P - 1 - i`` of ``2P``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jattn.core.validation import check_positive_int

LAYOUTS = ("contiguous", "zigzag")


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
