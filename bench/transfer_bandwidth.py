"""How fast one ring hop's K/V shard moves between the GPUs of one host, by the
collective that moves it (measurement only; all visible GPUs).

One shard: 32768 tokens x 16 heads (K and V, 8 each) x hd128, bf16 = 128 MiB per GPU.
``ppermute`` variants send it to the next GPU (``one_way``), in 4 pieces, or half each
way round the ring (``two_way``: two peers per GPU); ``all_gather`` brings every GPU
the P - 1 other shards. Median of 10 synchronised calls. NCCL reads its environment,
so compare flags in separate processes (``--tag`` names the run).

    python bench/transfer_bandwidth.py --out bench/results
    NCCL_MIN_NCHANNELS=32 python bench/transfer_bandwidth.py --tag minch32 --out OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import environment, time_jax, write_results  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 32768, 16, 128


def measure(tag: str) -> list[dict]:
  devices = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("sp",))
  shard = PartitionSpec("sp")
  x = jax.device_put(jnp.ones((devices * TOKENS, HEADS, HEAD_DIM), jnp.bfloat16),
                     NamedSharding(mesh, shard))
  nbytes = TOKENS * HEADS * HEAD_DIM * 2
  ahead = [(i, (i + 1) % devices) for i in range(devices)]
  behind = [(i, (i - 1) % devices) for i in range(devices)]

  def hops(pieces: int, both_ways: bool):
    def move(a):
      return tuple(jax.lax.ppermute(p, "sp", behind if both_ways and i % 2 else ahead)
                   for i, p in enumerate(jnp.split(a, pieces, axis=1)))
    return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=shard, out_specs=(shard,) * pieces,
                                 check_vma=False))

  gather = jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "sp", tiled=True), mesh=mesh,
                                 in_specs=shard, out_specs=PartitionSpec(), check_vma=False))
  cases = {"one_way": (hops(1, False), 1), "one_way_4pieces": (hops(4, False), 1),
           "two_way": (hops(2, True), 1), "two_way_4pieces": (hops(4, True), 1),
           "all_gather": (gather, devices - 1)}
  rows = []
  for name, (fn, shards_in) in cases.items():
    seconds = time_jax(fn, x, reps=10, inner=1)
    rows.append(dict(tag=tag, devices=devices, collective=name, ms=seconds * 1e3,
                     gb_per_s=shards_in * nbytes / seconds / 1e9))
    print(rows[-1], flush=True)
  return rows


def markdown(rows, env) -> str:
  lines = [f"# One ring hop's K/V shard (128 MiB per GPU), {env['device']} x{rows[0]['devices']} "
           f"(jax {env['jax']}, {env['time']})", "",
           "GB/s: bytes each GPU receives / time (median of 10 calls).", "",
           "| run | collective | ms | GB/s per GPU |", "|---|---|---|---|"]
  lines += [f"| {r['tag']} | {r['collective']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} |"
            for r in rows]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tag", default="default")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  env = environment()
  rows = measure(args.tag)
  stem = f"transfer_bandwidth_{args.tag}"
  write_results(args.out, stem, {"env": env, "rows": rows}, markdown(rows, env))


if __name__ == "__main__":
  main()
