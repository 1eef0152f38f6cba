"""The ``jattn`` command line: ``jattn check`` (more subcommands join as ops grow)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jattn", description="jattn command line tools")
  sub = parser.add_subparsers(dest="command", required=True)
  check = sub.add_parser(
      "check", help="run every op on every usable backend against the JAX and torch references")
  check.add_argument("--backends", help="comma-separated backends (default: all usable here)")
  check.add_argument("--dtypes", help="comma-separated dtypes (default: float32,bfloat16"
                     "[,float16 on GPU])")
  check.add_argument("--no-torch", action="store_true", help="skip the torch reference")
  check.add_argument("--reps", type=int, default=5, help="timed repetitions per case")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "check":
    from interop.check import main_check

    return main_check(args)
  return 2


if __name__ == "__main__":
  sys.exit(main())
