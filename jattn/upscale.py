"""Super-resolving large images in overlapping tiles with one compiled function.

Tiles all have the same shape (the last row and column are moved inward to end at the
image edge, so nothing is padded), hence ``jax.jit`` compiles once per image size
class. Overlaps are blended with weights that ramp linearly across the overlap, so
seams fade instead of cutting.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def jit_model(model) -> Callable:
  """``model(x)`` as one jitted function taking the weights as arguments (not as
  constants baked into the program): compiled once per input shape."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, x):
    return nnx.merge(graphdef, state)(x)

  return lambda x: run(state, x)


def tile_starts(length: int, tile: int, overlap: int) -> list[int]:
  """Start offsets of tiles of ``tile`` covering ``[0, length)`` with at least
  ``overlap`` shared pixels; the last tile ends exactly at ``length``."""
  if tile >= length:
    return [0]
  step = tile - overlap
  if step <= 0:
    raise ValueError(f"overlap ({overlap}) must be smaller than the tile ({tile})")
  starts = list(range(0, length - tile, step))
  return starts + [length - tile]


def _ramp(length: int, overlap: int, at_start: bool, at_end: bool) -> np.ndarray:
  """1-D blend weights: rising over the first ``overlap`` pixels unless the tile
  starts at the image edge, falling over the last unless it ends there."""
  w = np.ones(length, np.float32)
  if overlap > 0:
    ramp = (np.arange(overlap, dtype=np.float32) + 1.0) / (overlap + 1.0)
    if not at_start:
      w[:overlap] = np.minimum(w[:overlap], ramp)
    if not at_end:
      w[-overlap:] = np.minimum(w[-overlap:], ramp[::-1])
  return w


def upscale_image(fn: Callable, image, *, scale: int, tile: int | None = None, overlap: int = 16,
                  progress: Callable[[int, int], None] | None = None) -> np.ndarray:
  """Applies ``fn`` (``[1, h, w, C] -> [1, h * scale, w * scale, C]``) to ``image``.

  Args:
    fn: the model; called on float32 batches of one tile (jit it once outside).
    image: ``[H, W, C]`` float32 in [0, 1].
    tile: tile side in input pixels (None: the whole image at once).
    overlap: input pixels shared by neighbouring tiles.
    progress: called as ``progress(done, total)`` after each tile.

  Returns:
    ``[H * scale, W * scale, C]`` float32, clipped to [0, 1].
  """
  image = np.asarray(image, np.float32)
  if image.ndim != 3:
    raise ValueError(f"image must be [H, W, C], got shape {image.shape}")
  h, w, c = image.shape
  tile_h, tile_w = (h, w) if tile is None else (min(tile, h), min(tile, w))
  ys, xs = tile_starts(h, tile_h, overlap), tile_starts(w, tile_w, overlap)
  out = np.zeros((h * scale, w * scale, c), np.float32)
  weight = np.zeros((h * scale, w * scale, 1), np.float32)
  total, done = len(ys) * len(xs), 0
  for y in ys:
    wy = _ramp(tile_h * scale, overlap * scale, y == 0, y + tile_h == h)
    for x in xs:
      wx = _ramp(tile_w * scale, overlap * scale, x == 0, x + tile_w == w)
      piece = np.asarray(jax.device_get(fn(jnp.asarray(image[None, y:y + tile_h, x:x + tile_w]))))
      blend = (wy[:, None] * wx[None, :])[:, :, None]
      rows = slice(y * scale, (y + tile_h) * scale)
      cols = slice(x * scale, (x + tile_w) * scale)
      out[rows, cols] += piece[0].astype(np.float32) * blend
      weight[rows, cols] += blend
      done += 1
      if progress is not None:
        progress(done, total)
  return np.clip(out / weight, 0.0, 1.0)
