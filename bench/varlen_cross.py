"""Varlen with queries and keys packed differently, on one GPU (bf16, 16 heads, d128,
causal bottom-right): the Hopper kernels on the gathered ``[num_seqs, max_seqlen]``
batch (``backend="pallas_mosaic"``) against the Triton kernels on packed rows
(``pallas_triton``), forward and forward+backward
(gradients of sum(o) for q, k, v). Two packings (seed 0): 16 prefill chunks of
256-1024 queries against 1024-8192 keys, and 64 sequences of 128-4096 queries and
keys drawn apart (log-uniform; keys at least the queries). Real-FLOP TFLOP/s:
4 * sum(Lq * Lk - Lq (Lq - 1) / 2) * H * D forward, 3.5x forward+backward.

    python bench/varlen_cross.py --out bench/results    # on the GPU

Writes ``varlen_cross_<label>.json`` and ``.md`` (label: the GPU's short name).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, time_jax, write_results  # noqa: E402
from bench.decode import _with_grads, short_device_name  # noqa: E402

BACKENDS = ("pallas_mosaic", "pallas_triton")
HEADS, HEAD_DIM = 16, 128


def packings(seed: int = 0) -> dict:
  """name -> (query lengths, key lengths)."""
  rng = np.random.default_rng(seed)
  chunks = (rng.integers(256, 1025, 16), rng.integers(1024, 8193, 16))
  apart = np.rint(np.exp(rng.uniform(np.log(128), np.log(4096), (2, 64)))).astype(np.int64)
  return {"16 prefill chunks": chunks, "64 sequences apart": (apart[0], apart[1])}


def run(name: str, lq, lk) -> list:
  import jattn

  lk = np.maximum(lk, lq)
  cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32) for x in (lq, lk))
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (int(lq.sum()), HEADS, HEAD_DIM), jnp.bfloat16)
  k, v = (jax.random.normal(key, (int(lk.sum()), HEADS, HEAD_DIM), jnp.bfloat16)
          for key in keys[1:])
  flops = 4.0 * float(np.sum(lq * lk - lq * (lq - 1) / 2)) * HEADS * HEAD_DIM
  rows = []
  for backend in BACKENDS:
    def attend(q, k, v, cu_q, cu_k, backend=backend):
      return jattn.flash_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=int(lq.max()),
                                          max_seqlen_k=int(lk.max()), causal=True,
                                          backend=backend)
    for mode, fn, factor in (("fwd", attend, 1.0), ("fwd+bwd", _with_grads(attend), 3.5)):
      ms = time_jax(jax.jit(fn), q, k, v, cu_q, cu_k, reps=10, inner=5) * 1e3
      rows.append(dict(packing=name, backend=backend, mode=mode, ms=ms,
                       tflops=flops * factor / ms / 1e9, queries=int(lq.sum()),
                       keys=int(lk.sum())))
      print(f"{name} {backend} {mode}: {ms:.3f} ms ({rows[-1]['tflops']:.0f} TFLOP/s)",
            flush=True)
  return rows


def markdown(env, rows) -> str:
  lines = [f"# Varlen, queries and keys packed differently ({env['device']}, jax {env['jax']}, "
           f"{env['time']})", "", "bf16, 16 heads, d128, causal; median ms (real-FLOP TFLOP/s).",
           "", "| packing | mode | pallas_mosaic (gathered batch) | pallas_triton (packed rows) "
           "| triton / mosaic (ms) |", "|---|---|---|---|---|"]
  by = {(r["packing"], r["mode"], r["backend"]): r for r in rows}
  for packing, mode in dict.fromkeys((r["packing"], r["mode"]) for r in rows):
    m, t = by[(packing, mode, "pallas_mosaic")], by[(packing, mode, "pallas_triton")]
    lines.append(f"| {packing} ({m['queries']} q, {m['keys']} k) | {mode} | {m['ms']:.3f} "
                 f"({m['tflops']:.0f}) | {t['ms']:.3f} ({t['tflops']:.0f}) | "
                 f"{t['ms'] / m['ms']:.2f}x |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  env = environment()
  rows = [row for name, (lq, lk) in packings().items() for row in run(name, lq, lk)]
  label = short_device_name(env["device"])
  write_results(args.out, f"varlen_cross_{label}", {"env": env, "rows": rows},
                markdown(env, rows))
  print(markdown(env, rows))


if __name__ == "__main__":
  main()
