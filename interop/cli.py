"""The ``jattn`` command line: ``jattn check`` and ``jattn convert`` (also installed as
``jattn-convert``)."""

from __future__ import annotations

import argparse
import sys

from jattn.core.device import compile_interpreted_programs_fast
from jattn.interop.check import CASES, main_check
from jattn.interop.checkpoints import (dat_from_state_dict, infer_dat_config, read_state_dict,
                                       save_converted)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jattn", description="jattn command line tools")
  sub = parser.add_subparsers(dest="command", required=True)
  check = sub.add_parser(
      "check", help="run every op on every usable backend against the JAX and torch references")
  check.add_argument("--backends", help="comma-separated backends (default: all usable here)")
  check.add_argument("--dtypes", help="comma-separated dtypes (default: float32, and "
                     "bfloat16,float16 on a GPU)")
  check.add_argument("--ops", help="comma-separated ops (default: all: " + ", ".join(
      sorted({op for op, _, _ in CASES})) + ")")
  check.add_argument("--no-torch", action="store_true", help="skip the torch reference")
  check.add_argument("--reps", type=int, help="timed repetitions per case (default: 5 on a "
                     "GPU, 1 in interpret mode, whose timings say nothing of kernel speed)")
  _add_convert_arguments(sub.add_parser(
      "convert", help="convert a PyTorch checkpoint into Flax params + config.json"))
  return parser


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("model_type", choices=("dat",), help="the architecture")
  parser.add_argument("checkpoint", help=".pth / .pt (torch.load weights_only) or .safetensors")
  parser.add_argument("out_dir", help="writes params.safetensors and config.json here")
  parser.add_argument("--img-range", type=float, help="DAT's img_range if not 1.0")


def run_convert(args) -> int:
  overrides = {} if args.img_range is None else {"img_range": args.img_range}
  state = read_state_dict(args.checkpoint)
  config, img_size = infer_dat_config(state, **overrides)
  model = dat_from_state_dict(state, **overrides)
  params, config_path = save_converted(model, args.out_dir)
  print(f"{args.checkpoint}: DAT {config} (masks stored for {img_size}x{img_size} inputs)")
  print(f"wrote {params} and {config_path}")
  return 0


def convert_main(argv=None) -> int:
  """``jattn-convert dat model.pth out_dir``."""
  parser = argparse.ArgumentParser(prog="jattn-convert", description="convert a PyTorch "
                                   "checkpoint into Flax params + config.json")
  _add_convert_arguments(parser)
  return run_convert(parser.parse_args(argv))


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "check":
    compile_interpreted_programs_fast()  # before JAX starts: the check is compile-bound
    return main_check(args)
  if args.command == "convert":
    return run_convert(args)
  return 2


if __name__ == "__main__":
  sys.exit(main())
