"""Puts measured flash-attention backend times (``bench/flash.py`` results) into the
table shipped with jattn, where ``backend="auto"`` ranks backends by them.

    python bench/ship_backend_times.py bench/results/flash_issue16.json

For every problem key (GPU, dtype, padded head dim, causal, length bucket) with at
least two of our backends' times (``jattn_mosaic``, ``jattn_triton``, ``cudnn``), the
median forward+backward milliseconds per backend go under
``gpu|flash_attention/auto|<fields>`` in ``jattn/core/shipped.json``; ``--mode fwd``
takes the forward times instead.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax.numpy as jnp  # noqa: E402

from jattn.flash import FLASH  # noqa: E402
from jattn.core.cache import RANKING, TuningKey  # noqa: E402

BACKENDS = {"jattn_mosaic": "pallas_mosaic", "jattn_triton": "pallas_triton", "cudnn": "cudnn"}
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "jattn", "core", "shipped.json")


def backend_times(runs, mode: str) -> dict[str, dict]:
  """Shipped-table entries from ``bench/flash.py`` result payloads."""
  times = collections.defaultdict(lambda: collections.defaultdict(list))
  measured = {}  # key -> (jax version, time of the run)
  for run in runs:
    gpu = run["env"]["device"]
    for row in run["rows"]:
      if row.get("mode") != mode or "ms" not in row or row["impl"] not in BACKENDS:
        continue
      batch, seq, heads, head_dim = row["shape"][:4]
      kv_heads = row["shape"][4] if len(row["shape"]) == 5 else heads
      problem = FLASH.problem(batch=batch, q_len=seq, q_heads=heads, kv_heads=kv_heads,
                              head_dim=head_dim, dtype=DTYPES[row["dtype"]],
                              causal=row["causal"])
      key = str(TuningKey(gpu, FLASH.name, RANKING, FLASH.speed_key(problem)))
      times[key][BACKENDS[row["impl"]]].append(row["ms"])
      measured[key] = (run["env"]["jax"], run["env"]["time"])
  return {key: {"backend_ms": {b: round(statistics.median(ms), 4) for b, ms in per.items()},
                "mode": mode, "jax": measured[key][0], "tuned_at": measured[key][1]}
          for key, per in times.items() if len(per) >= 2}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("results", nargs="+", help="bench/flash.py JSON files")
  parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
  parser.add_argument("--table", default=SHIPPED)
  args = parser.parse_args()
  runs = [json.load(open(path)) for path in args.results]
  entries = backend_times(runs, args.mode)
  with open(args.table) as f:
    table = json.load(f)
  table["entries"].update(entries)
  with open(args.table, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.write("\n")
  for key, entry in sorted(entries.items()):
    print(key, entry["backend_ms"])


if __name__ == "__main__":
  main()
