"""One GPU: the flash calls one device of a causal zig-zag all-gather ring runs on packed
documents, with the chunk's keys bounded by ``kv_lengths`` (as
``ring_attention(..., kv_exchange="allgather")`` does) and with the same keys sliced
statically. The gap is what per-row lengths cost the kernels' element mask.

    python bench/ring_documents_probe.py --devices 4 --ranks 0,1

Writes ring_documents_probe.json / .md under --out (``--stem`` to rename).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jattn  # noqa: E402
from bench.common import document_ids, environment, time_jax, write_results  # noqa: E402


def probe(args):
  """Per rank and query chunk, ms of the two ways to bound the chunk's keys."""
  seq, half = args.devices * args.local, args.local // 2
  ids = jnp.asarray(document_ids(1, seq, args.documents))
  q_all, k, v = (jax.random.normal(key, (1, seq, args.heads, args.head_dim), jnp.bfloat16)
                 for key in jax.random.split(jax.random.PRNGKey(0), 3))

  def by_lengths(q, q_ids, keys):
    return jattn.flash_attention(q, k, v, causal=True, q_segment_ids=q_ids,
                                 kv_segment_ids=ids, kv_lengths=jnp.full((1,), keys, jnp.int32))

  def by_slicing(q, q_ids, keys):
    return jattn.flash_attention(q, k[:, :keys], v[:, :keys], causal=True, q_segment_ids=q_ids,
                                 kv_segment_ids=ids[:, :keys])

  rows = []
  for rank in map(int, args.ranks.split(",")):
    # Zig-zag: chunks rank and 2P - 1 - rank, each seeing the keys up to its end.
    for start in (rank * half, (2 * args.devices - 1 - rank) * half):
      keys = start + half
      q, q_ids = q_all[:, start:start + half], ids[:, start:start + half]
      for name, fn in (("kv_lengths", by_lengths), ("sliced", by_slicing)):
        call = jax.jit(fn, static_argnums=2)
        ms = 1e3 * time_jax(call, q, q_ids, keys, reps=args.reps, inner=2)
        rows.append(dict(rank=rank, q_start=start, keys=keys, bound=name, ms=ms))
        print(rows[-1], flush=True)
  return rows


def markdown(rows, env, args) -> str:
  lines = [f"# All-gather ring, one device's calls on packed documents, {env['device']} "
           f"(jax {env['jax']}, {env['time']})", "",
           f"{args.devices} devices x {args.local} tokens, {args.documents} documents, "
           f"{args.heads} heads, hd {args.head_dim}, bf16, causal zig-zag; median ms.", "",
           "| rank | query chunk start | keys | kv_lengths ms | sliced ms |", "|---|---|---|---|---|"]
  for r in rows:
    if r["bound"] == "kv_lengths":
      other = next(s for s in rows if s["bound"] == "sliced" and s["rank"] == r["rank"]
                   and s["q_start"] == r["q_start"])
      lines.append(f"| {r['rank']} | {r['q_start']} | {r['keys']} | {r['ms']:.2f} | "
                   f"{other['ms']:.2f} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="ring_documents_probe")
  parser.add_argument("--devices", type=int, default=4, help="the ring's size P")
  parser.add_argument("--ranks", default="0,1", help="which devices' calls to time")
  parser.add_argument("--local", type=int, default=32768, help="tokens per device")
  parser.add_argument("--documents", type=int, default=8)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  env = environment()
  rows = probe(args)
  write_results(args.out, args.stem, {"env": env, "args": vars(args), "rows": rows},
                markdown(rows, env, args))


if __name__ == "__main__":
  main()
