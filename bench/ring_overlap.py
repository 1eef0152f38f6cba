"""Does a ring's transfer hide behind its blocks' attention? (Measurement only; 2 and 4 GPUs.)

Per variant, in one process (XLA / NCCL flags come from the environment, so run one
process per flag set), 32k tokens per GPU, 8 heads, hd128, bf16, milliseconds:
``flash_P{n}``: flash_attention on each GPU's shard; ``ppermute_P{n}``: one hop of K
and V alone; ``flash+ppermute_P{n}``: the two side by side in one program, independent
of each other (flash's time if the transfer hides, their sum if it runs after the
kernel, more if the two slow each other); ``ring_fwd_P{n}`` and ``allgather_fwd_P{n}``:
``ring_attention`` with ``kv_exchange="ring"`` / ``"allgather"``; at P = 4 also the
zig-zag causal fwd of both, and (not with --quick) their fwd+bwd.

Variants: ``default`` (the library as is: ring blocks one CTA per tile),
``persistent`` (ring blocks with flash_attention's own config: the persistent Hopper
forward where it takes it), ``nonpersistent`` (every Hopper forward one CTA per tile),
``reserve<N>`` (persistent Hopper forwards, ring blocks too, on N SMs fewer than the
GPU has), ``reserve<N>all`` (the same, and the ring's masked blocks persistent too);
a suffix after ``_`` names the flags set (``reserve8_p2p8``); any other name runs as ``default``.
--devices / --exchanges: which P and which ``kv_exchange`` to time.
--trace DIR: a profile of flash+ppermute and of each exchange at the largest P (forward,
zig-zag causal forward; --trace-backward: forward+backward too), and their compiled HLO,
under --out.

    python bench/ring_overlap.py --variant default --out OUT
    XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true python bench/ring_overlap.py --variant memcpy_p2p
    python bench/ring_overlap.py --table --out OUT   # ring_overlap.md from OUT's JSON files

Writes ring_overlap_<variant>.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, time_jax  # noqa: E402
import jattn  # noqa: E402
from jattn.flash import FLASH  # noqa: E402
from jattn.parallel import blocks, ring_attention  # noqa: E402

SPEC = PartitionSpec(None, "sp")
COLUMNS = ("flash_P2", "ppermute_P2", "flash+ppermute_P2", "ring_fwd_P2", "allgather_fwd_P2",
           "flash_P4", "ppermute_P4", "flash+ppermute_P4", "ring_fwd_P4", "allgather_fwd_P4",
           "ring_fwdbwd_P4", "allgather_fwdbwd_P4", "zigzag_fwd_P4", "allgather_zigzag_fwd_P4")


def apply_variant(name: str) -> None:
  """Patches the Hopper forward's persistence (and SM count) as the variant says."""
  if name == "persistent":
    blocks._beside_transfers = lambda call: call
  elif name == "nonpersistent":
    prepare = FLASH.prepare

    def one_cta_per_tile(problem, backend="auto", config=None, info=None):
      call = prepare(problem, backend, config, info)
      if getattr(call.config, "persistent", False) is not False:
        call = prepare(problem, call.impl.backend.name,
                       dataclasses.replace(call.config, persistent=False), info)
      return call

    FLASH.prepare = one_cta_per_tile
  elif name.startswith("reserve"):
    import jattn.kernels.hopper.pipeline as pipeline

    base = name.split("_")[0]  # what follows "_" names flags, not the variant
    reserve, full = int(base[len("reserve"):].removesuffix("all")), pipeline.num_sms
    pipeline.num_sms = lambda: full() - reserve
    if base.endswith("all"):  # masked blocks persistent too (their config leaves it None)
      blocks._beside_transfers = lambda call: (
          call if getattr(call.config, "persistent", False) is not None else
          FLASH.prepare(call.problem, call.impl.backend.name,
                        dataclasses.replace(call.config, persistent=True)))
    else:
      blocks._beside_transfers = lambda call: call


def measure(args) -> dict:
  length, heads, head_dim = args.local, 8, 128
  res = dict(variant=args.variant, xla_flags=os.environ.get("XLA_FLAGS", ""),
             nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
  t = lambda fn, *x: time_jax(fn, *x, reps=5, inner=3) * 1e3

  def smap(f, mesh, n_in, n_out=1):
    return jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * n_in,
                         out_specs=SPEC if n_out == 1 else (SPEC,) * n_out, check_vma=False)

  flash = lambda q, k, v: jattn.flash_attention(q, k, v, backend=args.backend)
  for n in args.devices:
    if n > len(jax.devices()):
      continue
    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    sharding = NamedSharding(mesh, SPEC)
    make = jax.jit(lambda: tuple(jax.random.normal(key, (1, n * length, heads, head_dim),
                                                   jnp.bfloat16)
                                 for key in jax.random.split(jax.random.PRNGKey(0), 4)),
                   out_shardings=(sharding,) * 4)
    q, k, v, do = make()
    perm = [(i, (i + 1) % n) for i in range(n)]
    send = lambda q, k, v: jax.lax.ppermute((k, v), "sp", perm)
    both = lambda q, k, v: (flash(q, k, v),) + send(q, k, v)
    res[f"flash_P{n}"] = t(jax.jit(smap(flash, mesh, 3)), q, k, v)
    res[f"ppermute_P{n}"] = t(jax.jit(smap(send, mesh, 3, 2)), q, k, v)
    res[f"flash+ppermute_P{n}"] = t(jax.jit(smap(both, mesh, 3, 3)), q, k, v)
    for exchange in args.exchanges:
      attend = functools.partial(ring_attention, axis_name="sp", backend=args.backend,
                                 kv_exchange=exchange)
      res[f"{exchange}_fwd_P{n}"] = t(jax.jit(smap(attend, mesh, 3)), q, k, v)
      if n == 4:
        zigzag = functools.partial(attend, causal=True, layout="zigzag")
        res["zigzag_fwd_P4" if exchange == "ring" else "allgather_zigzag_fwd_P4"] = t(
            jax.jit(smap(zigzag, mesh, 3)), q, k, v)
      if n == 4 and not args.quick:
        f = smap(attend, mesh, 3)
        res[f"{exchange}_fwdbwd_P4"] = t(
            jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)), q, k, v, do)
    if n == max(args.devices) and args.trace:
      programs = dict(together=jax.jit(smap(both, mesh, 3, 3)))
      for exchange in args.exchanges:
        attend = functools.partial(ring_attention, axis_name="sp", backend=args.backend,
                                   kv_exchange=exchange)
        programs[exchange] = jax.jit(smap(attend, mesh, 3))
        programs[f"{exchange}_zigzag"] = jax.jit(smap(
            functools.partial(attend, causal=True, layout="zigzag"), mesh, 3))
      programs = {name: functools.partial(fn, q, k, v) for name, fn in programs.items()}
      for exchange in args.exchanges if args.trace_backward else ():
        forward = smap(functools.partial(ring_attention, axis_name="sp", backend=args.backend,
                                         kv_exchange=exchange), mesh, 3)
        programs[f"{exchange}_fwdbwd"] = functools.partial(
            jax.jit(lambda q, k, v, do, f=forward: jax.vjp(f, q, k, v)[1](do)), q, k, v, do)
      with open(os.path.join(args.out, f"hlo_{args.variant}.txt"), "w") as f:
        for name, fn in programs.items():
          f.write(f"\n\n=== {name} ===\n" + fn.func.lower(*fn.args).compile().as_text())
      for fn in programs.values():  # compiled and warm before the profile
        jax.block_until_ready(fn())
      with jax.profiler.trace(args.trace, create_perfetto_trace=True):
        for _ in range(2):
          for name, fn in programs.items():
            with jax.profiler.TraceAnnotation(name):
              jax.block_until_ready(fn())
      for path in glob.glob(os.path.join(args.trace, "**", "perfetto_trace.json.gz"),
                            recursive=True):
        shutil.copy(path, os.path.join(args.out, f"perfetto_{args.variant}.json.gz"))
    print(json.dumps(res), flush=True)
  return res


def table(out: str) -> str:
  """A markdown table of every ``ring_overlap_*.json`` under ``out``."""
  rows = [json.load(open(path)) for path in sorted(glob.glob(
      os.path.join(out, "ring_overlap_*.json")))]
  env = rows[0].get("env", {}) if rows else {}
  lines = [f"# Ring transfers beside the blocks, {env.get('device', '?')} ({env.get('time', '')})",
           "", "Milliseconds (`bench/ring_overlap.py`; its docstring says what each column "
           "times).", "", "| variant | " + " | ".join(COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
  lines += [f"| {r['variant']} | " + " | ".join(
      f"{r[c]:.2f}" if c in r else "" for c in COLUMNS) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--variant", default="default")
  parser.add_argument("--backend", default="auto")
  parser.add_argument("--local", type=int, default=32768, help="tokens per GPU")
  parser.add_argument("--trace", help="profile directory (the largest P)")
  parser.add_argument("--trace-backward", action="store_true",
                      help="--trace: also each exchange's forward+backward")
  parser.add_argument("--quick", action="store_true", help="P = 4: forward rings only (no fwd+bwd)")
  parser.add_argument("--devices", type=lambda s: [int(n) for n in s.split(",")],
                      default=[2, 4], help="device counts P, e.g. 2,4")
  parser.add_argument("--exchanges", type=lambda s: s.split(","), default=["ring", "allgather"],
                      help="kv_exchange values to time")
  parser.add_argument("--table", action="store_true", help="only write ring_overlap.md")
  parser.add_argument("--out", default=".")
  args = parser.parse_args()
  if args.table:
    with open(os.path.join(args.out, "ring_overlap.md"), "w") as f:
      f.write(table(args.out))
    return
  apply_variant(args.variant)
  res = measure(args)
  res["env"] = environment()
  with open(os.path.join(args.out, f"ring_overlap_{args.variant}.json"), "w") as f:
    json.dump(res, f)


if __name__ == "__main__":
  main()
