"""The ``jattn`` command line: ``jattn check``, ``jattn convert`` (also installed as
``jattn-convert``) and ``jattn upscale`` (also ``jattn-upscale``).

Every user mistake exits with status 2 and one line (``jattn.command_line``); options
and files are checked before anything slow starts: this module imports neither JAX nor
torch until a command has checked what it was given.
"""

from __future__ import annotations

import argparse
import os
import sys

from jattn.command_line import (Parser, UsageError, about, add_verbose, atomic_folder,
                                check_choices, comma_list, positive_float, positive_int,
                                run_tool, writable_folder)
from jattn.interop.checkpoint_files import checkpoint_format, read_checkpoint
from jattn.interop.converted import CONVERTED_FILES, save_converted
from jattn.interop.upscale_cli import DESCRIPTION as UPSCALE_DESCRIPTION
from jattn.interop.upscale_cli import add_upscale_arguments, run_upscale

MODEL_TYPES = ("dat", "retnet", "llama")


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog="jattn", description="jattn command-line tools")
  sub = parser.add_subparsers(dest="command", required=True, metavar="{check,convert,upscale}")
  check = sub.add_parser(
      "check", help="run every op on every usable backend against the JAX and torch references",
      description="Run every op on every backend usable here against the pure-JAX and torch "
      "references on small built-in problems; print errors and timings.")
  check.add_argument("--backends", type=comma_list,
                     help="comma-separated backends (default: every one usable here)")
  check.add_argument("--dtypes", type=comma_list,
                     help="comma-separated dtypes of float32, bfloat16, float16 (default: "
                     "float32, and the 16-bit ones too on a GPU)")
  check.add_argument("--ops", type=comma_list,
                     help="comma-separated ops, as jattn.gpu.ops() names them (default: all)")
  check.add_argument("--no-torch", action="store_true", help="skip the torch reference")
  check.add_argument("--reps", type=positive_int,
                     help="timed repetitions per case (default: 5 on a GPU, 1 in interpret "
                     "mode, whose timings say nothing of kernel speed)")
  add_verbose(check)
  _add_convert_arguments(sub.add_parser(
      "convert", help="convert a PyTorch checkpoint into Flax params + config.json",
      description="Convert a PyTorch checkpoint into Flax params (params.safetensors) and "
      "config.json in an output folder."))
  add_upscale_arguments(sub.add_parser(
      "upscale", help="super-resolve images with a DAT checkpoint",
      description=UPSCALE_DESCRIPTION))
  return parser


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("model_type", choices=MODEL_TYPES,
                      help="the architecture: DAT, torchscale's RetNetDecoder, or a "
                      "Hugging Face Llama / Qwen2 / Mistral folder")
  parser.add_argument("checkpoint", help=".pth (as torch.save writes it; no pickled code "
                      "runs) or .safetensors; for llama, the model's folder (config.json "
                      "and safetensors weights)")
  parser.add_argument("out_dir", help="writes params.safetensors and config.json here (a new "
                      "or empty folder, unless --overwrite)")
  parser.add_argument("--overwrite", action="store_true",
                      help="write into a folder that holds files (replacing its "
                      "params.safetensors and config.json)")
  parser.add_argument("--img-range", type=positive_float, help="dat: img_range if not 1.0")
  parser.add_argument("--num-heads", type=positive_int,
                      help="retnet: the head count, if the checkpoint has no decay buffer")
  parser.add_argument("--activation", choices=("gelu", "swish"),
                      help="retnet: the FFN activation (torchscale's activation_fn; "
                      "default gelu)")
  add_verbose(parser)


def _converted_model(args):
  """The Flax model of ``args.checkpoint`` and a line describing it."""
  if args.model_type == "llama":
    from jattn.interop.llama_checkpoints import llama_from_state_dict, read_hf_folder

    config, state = read_hf_folder(args.checkpoint)  # before JAX loads
    model = llama_from_state_dict(state, config=config)
    return model, f"{model.config.model_type} {model.config}"
  state = read_checkpoint(args.checkpoint)  # before JAX loads: a corrupt file is said at once
  from jattn.interop.checkpoints import dat_from_state_dict, infer_dat_config
  from jattn.interop.retnet_checkpoints import retnet_from_state_dict

  if args.model_type == "dat":
    overrides = {} if args.img_range is None else {"img_range": args.img_range}
    config, img_size = infer_dat_config(state, **overrides)
    masks = ("no stored shift masks" if img_size is None
             else f"shift masks stored for {img_size}x{img_size} inputs")
    return dat_from_state_dict(state, **overrides), f"DAT {config} ({masks})"
  options = {} if args.activation is None else {"activation": args.activation}
  model = retnet_from_state_dict(state, num_heads=args.num_heads, **options)
  return model, f"RetNet {model.config}"


def _check_out_dir(args) -> None:
  """A ``UsageError`` if writing ``out_dir`` would replace the checkpoint (even with
  ``--overwrite``), or files there without ``--overwrite``."""
  if not os.path.isdir(args.out_dir):
    return
  if os.path.isdir(args.checkpoint) and os.path.samefile(args.out_dir, args.checkpoint):
    raise UsageError(f"out_dir {args.out_dir!r} is the model folder being converted; give "
                     "another folder")
  for name in CONVERTED_FILES:
    path = os.path.join(args.out_dir, name)
    if os.path.exists(path) and os.path.samefile(path, args.checkpoint):
      raise UsageError(f"out_dir {args.out_dir!r}: writing {path!r} would replace the checkpoint "
                       "being converted; give another folder")
  try:
    taken = os.listdir(args.out_dir)
  except OSError as e:
    raise UsageError(f"out_dir {args.out_dir!r} cannot be read ({e.strerror})") from None
  if taken and not args.overwrite:
    raise UsageError(f"out_dir {args.out_dir!r} is not empty: give a new or empty folder, or "
                     "--overwrite to replace its params.safetensors and config.json")


# The options that only one model type reads: given for the other, they are mistakes.
MODEL_OPTIONS = {"dat": ("img_range",), "retnet": ("num_heads", "activation")}


def run_convert(args) -> int:
  for model_type, names in MODEL_OPTIONS.items():
    for name in names:
      if model_type != args.model_type and getattr(args, name) is not None:
        raise UsageError(f"--{name.replace('_', '-')} applies to {model_type} checkpoints, "
                         f"not {args.model_type}")
  writable_folder("out_dir", args.out_dir, CONVERTED_FILES)
  try:
    if args.model_type == "llama":
      if not os.path.isdir(args.checkpoint):
        raise ValueError(f"checkpoint {args.checkpoint!r}: a llama conversion reads a model "
                         "folder (config.json and safetensors weights)")
    else:
      checkpoint_format(args.checkpoint)
  except ValueError as e:
    raise UsageError(str(e)) from None
  _check_out_dir(args)
  try:
    model, description = _converted_model(args)
  except ValueError as e:  # not a checkpoint of that model, or not matching its config
    raise UsageError(about(args.checkpoint, e)) from None
  with atomic_folder(args.out_dir) as tmp:
    save_converted(model, tmp)
  print(f"{args.checkpoint}: {description}")
  print("wrote " + " and ".join(os.path.join(args.out_dir, name) for name in CONVERTED_FILES))
  return 0


def run_check(args) -> int:
  from jattn.core.device import (BACKEND_NAMES, BACKENDS, compile_interpreted_programs_fast,
                                 current_device)
  from jattn.interop.check import CHECK_OPS, main_check, plan
  from jattn.interop.harness import TOLERANCE

  compile_interpreted_programs_fast()  # before JAX starts: the check is compile-bound
  check_choices("--dtypes", args.dtypes or (), tuple(TOLERANCE))
  check_choices("--ops", args.ops or (), CHECK_OPS)
  check_choices("--backends", args.backends or (), BACKEND_NAMES)
  usable = plan()[0]  # what the check runs by default here
  for backend in args.backends or ():
    if backend not in usable:
      why = next(b.needs(current_device()) for b in BACKENDS if b.name == backend)
      raise UsageError(f"--backends: {backend} is not usable here: it {why}; usable: "
                       f"{', '.join(usable)}")
  return main_check(args)


def main(argv=None) -> int:
  """``jattn check | convert | upscale``."""
  handlers = {"check": run_check, "convert": run_convert, "upscale": run_upscale}
  return run_tool("jattn", build_parser(), lambda args: handlers[args.command](args), argv)


def convert_main(argv=None) -> int:
  """``jattn-convert dat|retnet model.pth out_dir``, ``jattn-convert llama folder out_dir``."""
  parser = Parser(prog="jattn-convert", description="Convert a PyTorch checkpoint into Flax "
                  "params (params.safetensors) and config.json in an output folder.")
  _add_convert_arguments(parser)
  return run_tool("jattn-convert", parser, run_convert, argv)


if __name__ == "__main__":
  sys.exit(main())
