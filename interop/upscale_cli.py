"""``jattn-upscale``: super-resolve images with a DAT checkpoint under ``jax.jit``.

    jattn-upscale --model 4xModel_dat2.pth input.png output.png
    jattn-upscale --model converted_dir/ --precision bf16 --tile 256 inputs/ outputs/

The model is a PyTorch checkpoint (``.pth`` / ``.safetensors``) or a folder written by
``jattn-convert dat``. Images larger than ``--tile`` run in overlapping tiles, blended
at the seams; all tiles share one shape, so one compiled function serves them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def load_model(path: str, precision: str):
  import jax.numpy as jnp

  from jattn.interop.checkpoints import load_converted, load_dat

  dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[precision]
  if os.path.isdir(path):
    return load_converted(path, dtype=dtype)
  return load_dat(path, dtype=dtype)


def read_image(path: str) -> np.ndarray:
  from PIL import Image

  with Image.open(path) as img:
    return np.asarray(img.convert("RGB"), np.float32) / 255.0


def write_image(path: str, image: np.ndarray) -> None:
  from PIL import Image

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  Image.fromarray(np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)).save(path)


def _progress_bar(name: str, stream=sys.stderr):
  def show(done: int, total: int):
    filled = int(30 * done / total)
    stream.write(f"\r{name} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tiles")
    if done == total:
      stream.write("\n")
    stream.flush()
  return show


def _pairs(src: str, dst: str) -> list[tuple[str, str]]:
  if not os.path.isdir(src):
    return [(src, dst)]
  names = sorted(n for n in os.listdir(src) if n.lower().endswith(IMAGE_SUFFIXES))
  if not names:
    raise SystemExit(f"jattn-upscale: no images ({', '.join(IMAGE_SUFFIXES)}) in {src}")
  return [(os.path.join(src, n), os.path.join(dst, os.path.splitext(n)[0] + ".png"))
          for n in names]


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jattn-upscale", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", required=True,
                      help="DAT checkpoint (.pth / .safetensors) or a jattn-convert folder")
  parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
  parser.add_argument("--tile", type=int, default=256, help="tile side in input pixels")
  parser.add_argument("--overlap", type=int, default=16, help="pixels shared by adjacent tiles")
  parser.add_argument("input", help="an image, or a folder of images")
  parser.add_argument("output", help="the output image, or a folder")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  from jattn.upscale import jit_model, upscale_image

  model = load_model(args.model, args.precision)
  fn = jit_model(model)
  scale = model.config.upscale
  for src, dst in _pairs(args.input, args.output):
    start = time.perf_counter()
    image = read_image(src)
    out = upscale_image(fn, image, scale=scale, tile=args.tile, overlap=args.overlap,
                        progress=_progress_bar(os.path.basename(src)))
    write_image(dst, out)
    print(f"{src} {image.shape[1]}x{image.shape[0]} -> {dst} {out.shape[1]}x{out.shape[0]} "
          f"({time.perf_counter() - start:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
