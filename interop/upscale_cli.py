"""``jattn-upscale`` (also ``jattn upscale``): super-resolve images with a DAT model.

Everything the command is given is checked before the model loads: the options, the
model file's format, every input image, and that each output can be written. Each
output is written to a temporary file and renamed when complete, so a failed run
leaves no partial image (with a folder of inputs, the images finished before a
failure stay).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jattn.command_line import (Parser, UsageError, about, add_verbose, atomic_output,
                                existing_file, non_negative_int, positive_int, run_tool,
                                writable_destination, writable_folder)
from jattn.interop.checkpoint_files import checkpoint_format, read_checkpoint
from jattn.interop.converted import CONVERTED_FILES, read_converted_config
from jattn.interop.images import (IMAGE_SUFFIXES, ImageError, inspect_image, output_format,
                                  read_image, write_image)

PROG = "jattn-upscale"
DESCRIPTION = """\
Super-resolve images with a DAT model under jax.jit.

examples:
  jattn-upscale --model 4xModel_dat2.pth photo.png photo_x4.png
  jattn-upscale --model converted/ --precision bf16 --tile 256 photos/ upscaled/

The model is a PyTorch DAT checkpoint (.pth as torch.save writes it, read without
running pickled code, or .safetensors) or a folder written by `jattn convert dat`.
Images larger than --tile run in overlapping tiles blended at the seams; all tiles
share one shape, so one compiled function serves them. Grey images come out grey; an
alpha channel is upscaled bicubically beside the model's colours (write it to .png,
.webp or .tif). A folder of inputs gives .png files of the same names in the output
folder. Images of more than --max-pixels pixels are refused before they are decoded.
"""
MIN_TILE = 8
# 4096 x 4096: upscaled x4 into float32 with its blend weights, 4.3 GB of output.
DEFAULT_MAX_PIXELS = 1 << 24


def add_upscale_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", required=True,
                      help="DAT checkpoint (.pth / .safetensors) or a `jattn convert` folder")
  parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                      help="computation dtype (the weights stay float32)")
  parser.add_argument("--tile", type=positive_int, default=256,
                      help=f"tile side in input pixels (at least {MIN_TILE})")
  parser.add_argument("--overlap", type=non_negative_int, default=16,
                      help="input pixels shared by adjacent tiles (less than --tile)")
  parser.add_argument("--max-pixels", type=positive_int, default=DEFAULT_MAX_PIXELS,
                      help="refuse input images of more pixels (width x height): decoding and "
                      "upscaling one takes memory in proportion")
  parser.add_argument("input", help="an image, or a folder of images")
  parser.add_argument("output", help="the output image, or a folder (made if missing)")
  add_verbose(parser)


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog=PROG, description=DESCRIPTION)
  add_upscale_arguments(parser)
  return parser


def plan_jobs(args) -> list[tuple[str, str, str]]:
  """``(input, output, PIL format)`` for each image, every input read and every output
  checked; a ``UsageError`` for the first mistake."""
  if args.tile < MIN_TILE:
    raise UsageError(f"--tile must be at least {MIN_TILE} pixels, got {args.tile}")
  if args.overlap >= args.tile:
    raise UsageError(f"--overlap ({args.overlap}) must be smaller than --tile ({args.tile})")
  model_files = _check_model_path(args.model)
  src, dst = args.input, args.output
  if not os.path.exists(src):
    raise UsageError(f"input {src!r}: no such file or folder")
  if os.path.isdir(src):
    try:
      names = sorted(n for n in os.listdir(src) if n.lower().endswith(IMAGE_SUFFIXES))
    except OSError as e:
      raise UsageError(f"input folder {src!r} cannot be read ({e.strerror})") from None
    if not names:
      raise UsageError(f"input folder {src!r} has no images ({', '.join(IMAGE_SUFFIXES)})")
    if os.path.exists(dst) and not os.path.isdir(dst):
      raise UsageError(f"output {dst!r} is a file; with an input folder it must be a folder")
    outputs = {}  # output name -> its inputs (a.png and a.jpg would both become a.png)
    for n in names:
      outputs.setdefault(os.path.splitext(n)[0] + ".png", []).append(n)
    for out, given in outputs.items():
      if len(given) > 1:
        raise UsageError(f"input folder {src!r}: {' and '.join(map(repr, given))} would both "
                         f"be written to {out!r}")
    writable_folder("output", dst, list(outputs))
    pairs = [(existing_file("input", os.path.join(src, given[0])), os.path.join(dst, out))
             for out, given in outputs.items()]
  else:
    pairs = [(existing_file("input", src), writable_destination("output", dst))]
  jobs = []
  for image_in, image_out in pairs:
    read = [(image_in, "the input")] + [(f, "a file of --model") for f in model_files]
    for path, what in read if os.path.exists(image_out) else ():
      if os.path.samefile(path, image_out):
        raise UsageError(f"output {image_out!r} is {what}: give another name or folder")
    try:
      _, _, has_alpha = inspect_image(image_in, args.max_pixels)
      jobs.append((image_in, image_out, output_format(image_out, has_alpha)))
    except ImageError as e:
      raise UsageError(str(e)) from None
  return jobs


def _check_model_path(path: str) -> list[str]:
  """A checkpoint file's format, or a converted folder's files and config, checked
  without loading JAX; returns the model's files (no output may replace one)."""
  if os.path.isdir(path):
    missing = [n for n in CONVERTED_FILES if not os.path.isfile(os.path.join(path, n))]
    if missing:
      raise UsageError(f"--model {path!r} is a folder without {' and '.join(missing)}: give a "
                       "checkpoint file or a folder written by `jattn convert dat`")
  try:
    if os.path.isdir(path):
      read_converted_config(path, model="DAT")
    else:
      checkpoint_format(path)
  except ValueError as e:
    raise UsageError(f"--model: {about(path, e)}") from None
  return [os.path.join(path, n) for n in CONVERTED_FILES] if os.path.isdir(path) else [path]


def load_model(path: str, precision: str):
  """The DAT model of a checkpoint file or a converted folder; a ``UsageError`` for a
  file that is not a DAT checkpoint. A file's index is read before JAX loads, so that a
  corrupt one is said at once; its tensors once their keys and shapes fit the model."""
  try:
    state = None if os.path.isdir(path) else read_checkpoint(path)
    import jax.numpy as jnp

    from jattn.interop.checkpoints import dat_from_state_dict
    from jattn.interop.converted import load_converted

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[precision]
    if state is None:
      return load_converted(path, dtype=dtype, model="DAT")
    return dat_from_state_dict(state, dtype=dtype)
  except ValueError as e:  # not a DAT checkpoint, or not matching the model it describes
    raise UsageError(f"--model {about(path, e)}") from None


def _progress_bar(name: str, stream=sys.stderr):
  def show(done: int, total: int):
    filled = int(30 * done / total)
    stream.write(f"\r{name} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tiles")
    if done == total:
      stream.write("\n")
    stream.flush()
  return show


def run_upscale(args) -> int:
  jobs = plan_jobs(args)
  model = load_model(args.model, args.precision)
  from jattn.upscale import jit_model, upscale_image

  fn = jit_model(model)
  scale = model.config.upscale
  for src, dst, fmt in jobs:
    start = time.perf_counter()
    try:
      picture = read_image(src, args.max_pixels)
    except ImageError as e:
      raise UsageError(str(e)) from None
    width, height = picture.size
    picture.rgb = upscale_image(fn, picture.rgb, scale=scale, tile=args.tile,
                                overlap=args.overlap, progress=_progress_bar(os.path.basename(src)))
    with atomic_output(dst) as tmp:
      write_image(tmp, picture, fmt)
    print(f"{src} {width}x{height} -> {dst} {width * scale}x{height * scale} "
          f"({time.perf_counter() - start:.1f} s)")
  return 0


def main(argv=None) -> int:
  return run_tool(PROG, build_parser(), run_upscale, argv)


if __name__ == "__main__":
  sys.exit(main())
