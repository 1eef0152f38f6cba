"""Image files for the super-resolution tools: what the model sees (RGB floats in
[0, 1]) and what is written back (the input's own kind of image).

- RGB images go through the model as they are.
- Grey images (``L``, 16-bit ``I;16``, ``I``, ``F`` and 1-bit) go through it as three
  equal channels, and come back grey (the mean of the output's channels).
- An alpha channel (``RGBA``, ``LA``, transparent palette images) is not something the
  model was trained on: the colours go through the model, the alpha channel is
  upscaled bicubically, and the output keeps it (so it must be PNG, WebP or TIFF).
- Palette and other colour modes (``P``, ``CMYK``, ``YCbCr``, ...) come back RGB.

Outputs are 8 bits per channel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from jattn.command_line import first_line

# Suffixes the tools read, and those they can write (with the PIL format for each).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
WRITE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP",
                 ".webp": "WEBP", ".tif": "TIFF", ".tiff": "TIFF"}
ALPHA_FORMATS = ("PNG", "WEBP", "TIFF")
GREY_MODES = ("1", "L", "I;16", "I;16B", "I;16L", "I", "F")
GREY_ALPHA_MODES = ("LA", "La", "PA")


class ImageError(ValueError):
  """A file that is not an image the tools can read, or cannot be written as asked."""


@dataclasses.dataclass
class Picture:
  """An image as the model takes it: ``rgb [H, W, 3]`` float32 in [0, 1]; ``alpha
  [H, W]`` uint8 or None; ``grey``: whether to write it back grey."""

  rgb: np.ndarray
  alpha: np.ndarray | None
  grey: bool

  @property
  def size(self) -> tuple[int, int]:
    """``(width, height)``."""
    return self.rgb.shape[1], self.rgb.shape[0]


def _pil():
  from PIL import Image  # the image extra: only the tools need it

  return Image


@contextlib.contextmanager
def _opened(path: str, max_pixels: int):
  """The image ``path``, opened (its header read, no pixel decoded) and no larger than
  ``max_pixels``; PIL's errors while reading it become one ``ImageError`` naming it.
  That limit replaces PIL's own (a warning at 89 million pixels, an error at twice
  that): one limit, said in one line, that the tools' --max-pixels sets."""
  Image = _pil()
  pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
  try:
    with Image.open(path) as img:
      width, height = img.size
      if width * height > max_pixels:
        raise ImageError(f"{path!r} is {width}x{height} = {width * height:,} pixels, more than "
                         f"the limit of {max_pixels:,} (--max-pixels raises it)")
      yield img
  except ImageError:
    raise
  except (OSError, SyntaxError, ValueError) as e:
    raise ImageError(f"{path!r} is not an image that can be read ({first_line(e, 120)})"
                     ) from None
  finally:
    Image.MAX_IMAGE_PIXELS = pil_limit


def inspect_image(path: str, max_pixels: int) -> tuple[int, int, bool]:
  """``(width, height, has_alpha)`` of an image file, decoded once so that a file
  whose pixels cannot be read is found before any slow work; an ``ImageError`` naming
  the file if it is not an image or has more than ``max_pixels`` pixels (checked
  before any pixel is decoded)."""
  with _opened(path, max_pixels) as img:
    img.verify()  # the header and, for PNG, the chunks' checksums
  with _opened(path, max_pixels) as img:  # verify() leaves the file unusable: open it again
    img.load()
    mode, size, info = img.mode, img.size, dict(img.info)
  has_alpha = mode in ("RGBA", "RGBa") + GREY_ALPHA_MODES or (
      mode == "P" and "transparency" in info)
  return size[0], size[1], has_alpha


def read_image(path: str, max_pixels: int) -> Picture:
  """Decodes ``path`` into a ``Picture`` (see the module docstring for the modes); an
  ``ImageError`` as ``inspect_image``'s."""
  with _opened(path, max_pixels) as img:
    img.load()
    mode = img.mode
    if mode == "P":
      img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode in GREY_MODES:
      grey = np.asarray(img, np.float32)
      peak = {"1": 1.0, "L": 255.0, "F": 1.0}.get(mode, 65535.0)
      grey = np.clip(grey / peak, 0.0, 1.0)
      return Picture(np.repeat(grey[:, :, None], 3, axis=2), None, grey=True)
    elif mode in GREY_ALPHA_MODES:
      la = np.asarray(img.convert("LA"))
      grey = la[:, :, 0].astype(np.float32) / 255.0
      return Picture(np.repeat(grey[:, :, None], 3, axis=2), la[:, :, 1].copy(), grey=True)
    elif img.mode not in ("RGB", "RGBA"):
      img = img.convert("RGB")
    pixels = np.asarray(img)
  rgb = pixels[:, :, :3].astype(np.float32) / 255.0
  alpha = pixels[:, :, 3].copy() if pixels.shape[2] == 4 else None
  return Picture(rgb, alpha, grey=False)


def output_format(path: str, has_alpha: bool = False) -> str:
  """The PIL format for writing ``path`` (from its suffix); an ``ImageError`` if the
  suffix is unknown or the format cannot store an alpha channel the image has."""
  suffix = os.path.splitext(path)[1].lower()
  fmt = WRITE_FORMATS.get(suffix)
  if fmt is None:
    raise ImageError(f"cannot write {path!r}: unknown image suffix {suffix or '(none)'!r}; "
                     f"use one of {', '.join(WRITE_FORMATS)}")
  if has_alpha and fmt not in ALPHA_FORMATS:
    raise ImageError(f"cannot write {path!r}: {fmt} stores no alpha channel and the input has "
                     "one; use .png, .webp or .tif")
  return fmt


def write_image(path: str, picture: Picture, fmt: str) -> None:
  """Writes ``picture`` (``rgb`` upscaled, ``alpha`` and ``grey`` from its input) to
  ``path`` in PIL format ``fmt``, 8 bits per channel; the alpha channel is resized
  bicubically to the colours' size."""
  Image = _pil()
  to8 = lambda x: np.round(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)
  if picture.grey:
    img = Image.fromarray(to8(picture.rgb.mean(axis=2)), "L")
  else:
    img = Image.fromarray(to8(picture.rgb), "RGB")
  if picture.alpha is not None:
    alpha = Image.fromarray(picture.alpha, "L").resize(img.size, Image.Resampling.BICUBIC)
    img.putalpha(alpha)
  img.save(path, format=fmt)


__all__ = ["IMAGE_SUFFIXES", "ImageError", "Picture", "inspect_image", "output_format",
           "read_image", "write_image"]
