"""Where our DAT's GPU time goes: one jitted forward traced with ``jax.profiler``, its
kernels summed by name and by kind (matmul, convolution, window attention, fusions).

    python bench/dat_profile.py --size 128 --dtype fp32 --precision highest

Writes dat_profile_<dtype>_<precision>.md / .json under --out.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, write_results  # noqa: E402
from jattn.nn import DAT  # noqa: E402
from jattn.upscale import jit_model  # noqa: E402

KINDS = [  # first match wins
    ("window attention (Pallas)", r"jattn_window"),
    ("matmul", r"gemm|xmma|cutlass|cublas|sm\d+_|ampere|hopper|wgmma|triton_gemm|dot"),
    ("convolution", r"conv|cudnn|implicit|winograd|dgrad|wgrad|fprop"),
    ("reduction fusion", r"reduce|reduction|norm"),
    ("transpose / copy", r"transpose|copy|memcpy|memset|concatenate|pad|slice"),
    ("other fusion", r"fusion|loop|input|triton"),
]


def kind_of(name: str) -> str:
  for kind, pattern in KINDS:
    if re.search(pattern, name, re.IGNORECASE):
      return kind
  return "other"


def kernel_times(trace_dir: str) -> dict[str, float]:
  """Kernel name -> total microseconds, from the perfetto trace ``jax.profiler`` wrote
  (events on the GPU's tracks, told apart by their process name)."""
  path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  path = path or glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path[0]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and re.search(r"gpu|cuda|/device:", str(e.get("args", {}).get("name", "")),
                            re.IGNORECASE)}
  # A GPU's tracks hold its streams' kernels and, beside them, the same time again as
  # XLA ops and modules: count only the streams where they are named.
  threads = {(e["pid"], e["tid"]): str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu_pids}
  streams = {key for key, name in threads.items() if name.lower().startswith("stream")}
  totals = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e and (
        not streams or (e["pid"], e.get("tid")) in streams):
      totals[e["name"]] += float(e["dur"])
  if not totals:
    raise RuntimeError(f"no GPU kernels in {path[0]}; processes: "
                       f"{[e['args'] for e in events if e.get('name') == 'process_name']}")
  return dict(totals)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--preset", default="DAT-2")
  parser.add_argument("--size", type=int, default=128)
  parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
  parser.add_argument("--precision", default="default", choices=["default", "highest"])
  parser.add_argument("--backend", default="auto")
  parser.add_argument("--iters", type=int, default=5)
  args = parser.parse_args()
  dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
  model = DAT.preset(args.preset, dtype=dtype, backend=args.backend)
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(1, args.size, args.size, 3)),
                  jnp.float32)
  with jax.default_matmul_precision(args.precision):
    fn = jit_model(model)
    jax.block_until_ready(fn(x))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(args.iters):
        jax.block_until_ready(fn(x))
  totals = {name: us / args.iters for name, us in kernel_times(trace_dir).items()}
  total = sum(totals.values())
  by_kind = collections.Counter()
  for name, us in totals.items():
    by_kind[kind_of(name)] += us
  stem = f"dat_profile_{args.dtype}_{args.precision}"
  env = environment()
  lines = [f"# {args.preset} x4 on {args.size}x{args.size}, {args.dtype}, precision "
           f"{args.precision}: GPU time by kernel ({env['device']}, jax {env['jax']})", "",
           f"Kernel time per forward: {total / 1e3:.2f} ms (mean of {args.iters}).", "",
           "| kind | ms | share |", "|---|---|---|"]
  lines += [f"| {k} | {us / 1e3:.2f} | {us / total:.0%} |" for k, us in by_kind.most_common()]
  lines += ["", "| kernel | kind | ms | share |", "|---|---|---|---|"]
  lines += [f"| `{n[:70]}` | {kind_of(n)} | {us / 1e3:.3f} | {us / total:.1%} |"
            for n, us in sorted(totals.items(), key=lambda kv: -kv[1])[:30]]
  write_results(args.out, stem, {"env": env, "args": vars(args), "kernels_us": totals},
                "\n".join(lines) + "\n")
  print("\n".join(lines[:40]))


if __name__ == "__main__":
  main()
