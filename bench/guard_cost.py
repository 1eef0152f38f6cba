"""What the non-finite guard costs: each masked call timed with the op's ``guard`` as it
is and with it switched off (every other step the same), and the guard alone.

    python bench/guard_cost.py --out bench/results/guard_cost.json

The guard (``nonfinite.guard_masked_values``: a key whose value row is not finite
leaves the matmuls, docs/flash_attention.md "Non-finite inputs") runs in front of every
backend for flash and flex attention with a mask, and for dilated attention. Writes JSON
and a markdown table beside it; medians of ``common.time_jax``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jattn
from common import attention_flops, time_jax
from jattn.core.op import OPS
from jattn.kernels.common.nonfinite import guard_masked_values


def cases():
  """(name, op, shape, dtype, fn(q, k, v)); shapes ``[batch, seq, heads, d]``."""
  flash = lambda backend: lambda q, k, v: jattn.flash_attention(q, k, v, causal=True,
                                                                backend=backend)
  flex = lambda q, k, v: jattn.flex_attention(q, k, v, mask_mod=jattn.flex.causal_mask(),
                                              backend="pallas_mosaic")
  dilated = lambda q, k, v: jattn.dilated_attention(
      q, k, v, segment_lengths=(2048, 4096, 8192, 16384), dilation_rates=(1, 2, 4, 8),
      causal=True, backend="pallas_triton")
  return [
      ("flash mosaic causal", "flash_attention", (4, 4096, 16, 128), jnp.float16,
       flash("pallas_mosaic")),
      ("flash mosaic causal d64", "flash_attention", (8, 2048, 16, 64), jnp.float16,
       flash("pallas_mosaic")),
      ("flash triton causal", "flash_attention", (4, 4096, 16, 128), jnp.float16,
       flash("pallas_triton")),
      ("flex mosaic causal", "flex_attention", (4, 4096, 16, 128), jnp.float16, flex),
      ("dilated causal", "dilated_attention", (1, 65536, 8, 128), jnp.bfloat16, dilated),
  ]


def timed(fn, mode, q, k, v, do):
  if mode == "fwd":
    return time_jax(jax.jit(fn), q, k, v, reps=15) * 1e3
  f = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
  return time_jax(f, q, k, v, do, reps=15) * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="JSON path; the markdown goes beside it")
  ap.add_argument("--only", default="", help="comma-separated name prefixes")
  args = ap.parse_args()
  rows = []
  for name, op_name, shape, dtype, fn in cases():
    if args.only and not any(name.startswith(p) for p in args.only.split(",")):
      continue
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    op = OPS[op_name]
    guard = op.guard
    alone = time_jax(jax.jit(guard_masked_values), k, v, reps=15) * 1e3
    for mode in ("fwd", "fwd+bwd"):
      # Off, on, on, off: drift over the run falls on both alike.
      times = {"guarded": [], "unguarded": []}
      for label in ("unguarded", "guarded", "guarded", "unguarded"):
        op.guard = guard if label == "guarded" else (lambda problem, arrays: arrays)
        jax.clear_caches()  # the op's jitted run is cached per call: trace it anew
        try:
          times[label].append(timed(fn, mode, q, k, v, do))
        finally:
          op.guard = guard
      ms = {label: min(t) for label, t in times.items()}
      flops = attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], True, mode)
      rows.append(dict(name=name, shape=list(shape), dtype=jnp.dtype(dtype).name, mode=mode,
                       guarded_ms=ms["guarded"], unguarded_ms=ms["unguarded"],
                       guard_alone_ms=alone, ratio=ms["unguarded"] / ms["guarded"],
                       guarded_tflops=flops / ms["guarded"] / 1e9,
                       device=jax.devices()[0].device_kind))
      print(f"{name:26s} {mode:8s} unguarded {ms['unguarded']:.3f} ms  guarded "
            f"{ms['guarded']:.3f} ms  ({ms['unguarded'] / ms['guarded']:.3f}x)  guard alone "
            f"{alone:.3f} ms", flush=True)
  json.dump(rows, open(args.out, "w"), indent=1)
  lines = ["| case | shape | dtype | mode | unguarded ms | guarded ms | unguarded / guarded "
           "| guard alone ms |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['name']} | {','.join(map(str, r['shape']))} | {r['dtype']} | "
                 f"{r['mode']} | {r['unguarded_ms']:.3f} | {r['guarded_ms']:.3f} | "
                 f"{r['ratio']:.3f}x | {r['guard_alone_ms']:.3f} |")
  device = rows[0]["device"] if rows else ""
  with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
    f.write(f"# The non-finite guard's cost ({device}; best of two runs each, mirrored)\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
