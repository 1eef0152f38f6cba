"""Time to the first result: trace + lower + compile + run of one flash-attention call
(causal forward+backward by default) in a fresh process, for several implementations
in the same run, with JAX's persistent compilation cache off.

    python bench/first_call.py --out bench/results             # (4, 4096, 16, 128) bf16
    python bench/first_call.py --impls jattn_mosaic --repeats 5
    python bench/first_call.py --cache-dir /tmp/jax_cache    # with the persistent cache

Each (implementation, repeat) runs in its own Python process, alternating the
implementations; the child reports its phases (trace, lower, compile, first run) and
the parent the median of each. With ``--cache-dir``, JAX's persistent compilation cache
lives there (emptied first): each implementation's first process fills it, the later
ones read it (the median is then theirs). Writes first_call.json / first_call.md under
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PHASES = ("trace", "lower", "compile", "run", "total")


def _child(impl: str, shape, dtype: str, causal: bool, mode: str, cache_dir) -> dict:
  """Runs in the fresh process: one call of ``impl``, timed phase by phase."""
  start = time.perf_counter()
  import jax
  import jax.numpy as jnp

  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  else:
    jax.config.update("jax_enable_compilation_cache", False)
  from bench.common import random_inputs
  from bench.flash import jax_impls

  fn = jax_impls(causal)[impl]
  q, k, v, do = random_inputs(tuple(shape), {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype])
  if mode == "fwd":
    step = fn
  else:
    def step(q, k, v):
      o, pullback = jax.vjp(fn, q, k, v)
      return o, pullback(do)
  jax.block_until_ready((q, k, v, do))
  ready = time.perf_counter()
  traced = jax.jit(step).trace(q, k, v)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3 = time.perf_counter()
  jax.block_until_ready(compiled(q, k, v))
  t4 = time.perf_counter()
  return {"trace": t1 - ready, "lower": t2 - t1, "compile": t3 - t2, "run": t4 - t3,
          "total": t4 - ready, "import_and_inputs": ready - start}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--impls", default="jattn_mosaic,tokamax_mosaic,jattn_triton,cudnn")
  parser.add_argument("--shape", default="4,4096,16,128")
  parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
  parser.add_argument("--causal", type=int, default=1)
  parser.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cache-dir", help="use JAX's persistent compilation cache there")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="first_call")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  shape = [int(x) for x in args.shape.split(",")]
  if args.child:
    print(json.dumps(_child(args.child, shape, args.dtype, bool(args.causal), args.mode,
                            args.cache_dir)))
    return
  if args.cache_dir:
    import shutil

    shutil.rmtree(args.cache_dir, ignore_errors=True)

  from bench.common import environment, write_results

  impls = args.impls.split(",")
  samples = {impl: [] for impl in impls}
  errors = {}
  for repeat in range(args.repeats):
    for impl in impls:
      if impl in errors:
        continue
      cmd = [sys.executable, __file__, "--child", impl, "--shape", args.shape, "--dtype",
             args.dtype, "--causal", str(args.causal), "--mode", args.mode]
      cmd += ["--cache-dir", args.cache_dir] if args.cache_dir else []
      done = subprocess.run(cmd, capture_output=True, text=True)
      lines = done.stdout.strip().splitlines()
      if done.returncode or not lines:
        said = [l for l in done.stderr.splitlines() if "Error" in l or "Exception" in l]
        errors[impl] = (said or done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        print(f"{impl}: ERROR {errors[impl]}", flush=True)
        continue
      phases = json.loads(lines[-1])
      samples[impl].append(phases)
      print(f"{impl} #{repeat}: " + ", ".join(f"{p} {phases[p]:.2f} s" for p in PHASES),
            flush=True)
  # With a cache the first process of each implementation filled it: the rest read it.
  timed = {impl: runs[1:] if args.cache_dir and len(runs) > 1 else runs
           for impl, runs in samples.items()}
  rows = [{"impl": impl, "repeats": len(runs),
           **{p: statistics.median(r[p] for r in runs) for p in PHASES}}
          for impl, runs in timed.items() if runs]
  env = environment()
  payload = {"env": env, "shape": shape, "dtype": args.dtype, "causal": bool(args.causal),
             "mode": args.mode, "cache": bool(args.cache_dir), "rows": rows,
             "samples": samples, "errors": errors}
  lines = [f"# First call, {env['device']} (jax {env['jax']}, {env['time']})", "",
           "Fresh process per sample, persistent compilation cache "
           + ("on (the first process of each filled it; the others are timed); "
              if args.cache_dir else "off; ") +
           f"{'causal ' if args.causal else ''}{args.mode} at {tuple(shape)} {args.dtype}. "
           "Seconds, median of the repeats.", "",
           "| impl | repeats | " + " | ".join(PHASES) + " |",
           "|---|---|" + "---|" * len(PHASES)]
  lines += [f"| {r['impl']} | {r['repeats']} | " + " | ".join(f"{r[p]:.2f}" for p in PHASES)
            + " |" for r in rows]
  lines += [f"| {impl} | error: {msg} |" for impl, msg in errors.items()]
  write_results(args.out, args.stem, payload, "\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
