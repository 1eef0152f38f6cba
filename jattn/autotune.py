"""``python -m jattn.autotune``: search the tiles of any Pallas implementation on this
GPU and store the fastest in the cache (``jattn.tuning``).

    python -m jattn.autotune --op flash_attention --backend pallas_triton --batch 4 \\
        --seq 4096 --heads 16 --head-dim 128 --dtype bfloat16 --causal
    python -m jattn.autotune --op window_attention --windows 512 --tokens 64 --heads 3 \\
        --head-dim 30
    python -m jattn.autotune --op retention_chunkwise --seq 8192 --heads 16 --head-dim 128
    python -m jattn.autotune --list          # what can be tuned
    python -m jattn.autotune --show-cache    # what has been

The size flags fill the op's problem fields (``--seq`` is ``q_len``, ``seq`` or
``tokens``, whichever the op has); ``--set name=value`` sets any other field.
``--dry-run`` lists the candidates and what the cost model prunes, timing nothing;
``--timings FILE`` writes every candidate's time as JSON beside the cache entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

from jattn.command_line import (Parser, UsageError, add_verbose, atomic_output, run_tool,
                                writable_destination)
from jattn.core.device import gpu_info, shared_memory_limit
from jattn.core.op import OPS
from jattn.core.cache import cache_path, load_cache, writable_cache_path
from jattn.tuning.search import fields_text, plan, tune, tunable, tuning_key

# flag -> the problem fields it fills, first match wins
FLAG_FIELDS = {
    "batch": ("batch",), "seq": ("q_len", "seq", "tokens"), "kv_seq": ("kv_len",),
    "tokens": ("tokens",), "windows": ("windows",), "heads": ("q_heads", "heads"),
    "kv_heads": ("kv_heads",), "head_dim": ("head_dim", "dk"), "dv": ("dv",),
    "dtype": ("dtype",), "causal": ("causal",), "segment_lengths": ("segment_lengths",),
    "dilation_rates": ("dilation_rates",), "chunk_size": ("chunk_size",),
}
ALIASES = {"flash": "flash_attention", "window": "window_attention",
           "dilated": "dilated_attention"}


PROG = "python -m jattn.autotune"


def _ints(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _value(text: str):
  for parse in (int, float):
    try:
      return parse(text)
    except ValueError:
      pass
  return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def build_parser() -> argparse.ArgumentParser:
  parser = Parser(prog=PROG, description=(
      "Search the tiles of a Pallas kernel on this GPU and store the fastest in the cache."))
  parser.add_argument("--op", default="flash_attention", help="the op (--list shows them)")
  parser.add_argument("--backend", default="pallas_triton")
  for flag in ("batch", "seq", "kv-seq", "tokens", "windows", "heads", "kv-heads",
               "head-dim", "dv", "chunk-size"):
    parser.add_argument(f"--{flag}", type=int)
  parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"))
  parser.add_argument("--causal", action="store_true", default=None)
  parser.add_argument("--segment-lengths", type=_ints, help="dilated attention: w1,w2,...")
  parser.add_argument("--dilation-rates", type=_ints, help="dilated attention: r1,r2,...")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="any other field of the op's problem")
  parser.add_argument("--reps", type=int, default=10, help="timed samples per candidate")
  parser.add_argument("--max-candidates", type=int, help="time at most this many per stage")
  parser.add_argument("--timings", metavar="FILE",
                      help="also write every candidate's time (JSON) to FILE")
  parser.add_argument("--dry-run", action="store_true",
                      help="list the candidates and the pruned ones, time nothing")
  listing = parser.add_mutually_exclusive_group()
  listing.add_argument("--list", action="store_true", help="list what can be tuned and exit")
  listing.add_argument("--show-cache", action="store_true", help="print the cache and exit")
  add_verbose(parser)
  return parser


def problem_from_args(op, args):
  """The op's problem from the size flags and ``--set``; a flag the op has no field for
  is an error (checked before anything slow)."""
  fields = {f.name for f in dataclasses.fields(op.problem_cls)}
  values = {}
  for flag, names in FLAG_FIELDS.items():
    given = getattr(args, flag)
    if given is None:
      continue
    name = next((n for n in names if n in fields), None)
    if name is None:
      raise UsageError(f"--{flag.replace('_', '-')} does not apply to {op.name} (its problem "
                       f"fields: {', '.join(sorted(fields))})")
    values[name] = given
  for item in args.set:
    name, sep, text = item.partition("=")
    if not sep or name not in fields:
      raise UsageError(f"--set takes FIELD=VALUE with FIELD one of "
                       f"{', '.join(sorted(fields))}, got {item!r}")
    values[name] = _value(text)
  for name in ("batch", "q_len", "kv_len", "seq", "tokens", "windows", "heads", "q_heads",
               "kv_heads", "head_dim", "dk", "dv"):
    if name in values and not (isinstance(values[name], int) and values[name] >= 1):
      raise UsageError(f"{name} must be a positive int, got {values[name]!r}")
  try:
    return op.problem(**values)
  except (TypeError, ValueError) as e:
    raise UsageError(f"not a {op.name} problem: {e}") from None


def _show_cache(stream) -> int:
  try:
    path = cache_path()
  except ValueError as e:
    raise UsageError(str(e)) from None
  entries = load_cache(path)
  stream.write(f"{path}: {len(entries)} entries\n")
  for key, entry in sorted(entries.items()):
    if not isinstance(entry, dict):  # hand-edited: lookups skip it too
      stream.write(f"{key} (not an entry: {json.dumps(entry)[:80]})\n")
      continue
    ms = entry.get("ms")
    timing = (f" {ms:.3f} ms ({entry.get('mode')})" if isinstance(ms, (int, float))
              and not isinstance(ms, bool) else "")
    stream.write(f"{key}{timing} jax {entry.get('jax')} {entry.get('tuned_at')}\n"
                 f"  {json.dumps(entry.get('config'), sort_keys=True)}\n")
  return 0


def _list(stream) -> int:
  for op in sorted(OPS.values(), key=lambda o: o.name):
    for impl in op.impls:
      stages = impl.tuning_stages()
      if stages:
        stream.write(f"{op.name} --backend {impl.backend.name}: "
                     + "; ".join(f"{s.name} ({', '.join(s.space)})" for s in stages) + "\n")
  return 0


def main(argv=None) -> int:
  """``python -m jattn.autotune ...`` (see the module docstring)."""
  return run_tool(PROG, build_parser(), _run, argv)


def _run(args) -> int:
  if args.show_cache:
    return _show_cache(sys.stdout)
  if args.list:
    return _list(sys.stdout)
  op_name = ALIASES.get(args.op, args.op)
  try:
    op, impl = tunable(op_name, args.backend)
  except ValueError as e:
    raise UsageError(str(e))
  problem = problem_from_args(op, args)
  for name in ("reps", "max_candidates"):
    value = getattr(args, name)
    if value is not None and value < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
  if not args.dry_run:
    try:
      writable_cache_path()  # where the results go, checked before the search
    except ValueError as e:
      raise UsageError(str(e)) from None
    if args.timings is not None:
      writable_destination("--timings", args.timings)
  info = gpu_info()
  unusable = impl.supported_on(info)
  if unusable is not None:
    raise UsageError(f"backend {args.backend!r} is not usable on {info.name}: it {unusable}")
  if args.dry_run:
    print(f"{tuning_key(op_name, args.backend, problem, info)} "
          f"(shared memory limit {shared_memory_limit(info) // 1024} KiB)")
    cands = plan(op_name, args.backend, problem, info=info)
    for stage in dict.fromkeys(c.stage for c in cands):
      mine = [c for c in cands if c.stage == stage]
      pruned = [c for c in mine if c.reason is not None]
      print(f"stage {stage.name} ({stage.mode}): {len(mine)} candidates, "
            f"{len(mine) - len(pruned)} kept, {len(pruned)} pruned")
      for c in mine:
        verdict = "keep " if c.reason is None else "prune"
        print(f"  {verdict} {fields_text(c.config, stage.space)}"
              + ("" if c.reason is None else f"  [{c.reason}]"))
    return 0
  timings = []
  best = tune(op_name, args.backend, problem, reps=args.reps, info=info,
              max_candidates=args.max_candidates, timings=timings)
  if args.timings is not None:
    record = {"key": str(tuning_key(op_name, args.backend, problem, info)), "device": info.name,
              "jax": jax.__version__, "problem": dataclasses.asdict(problem), "reps": args.reps,
              "best": dataclasses.asdict(best), "timings": timings}
    with atomic_output(args.timings) as tmp, open(tmp, "w") as f:
      json.dump(record, f, indent=1, default=str)  # default: dtypes by name
  print(json.dumps(dataclasses.asdict(best)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
