"""Does a ring's transfer overlap its blocks' attention? (Measurement only; 2 and 4 GPUs.)

Per variant, in one process (XLA / NCCL flags come from the environment, so run one
process per flag set): flash_attention on each GPU's 32k tokens (``flash_P{n}``); a
ppermute of K and V alone; the two side by side in one program, independent of each
other (``flash+ppermute``: flash's time if the transfer hides, their sum if it runs
after, more if it slows the kernel); ring fwd at P = 2, 4; ring fwd+bwd and zig-zag
causal fwd at P = 4 (not with --quick). Variants: ``nonpersistent`` (Hopper forward
one CTA per tile), ``fewer_sms`` (persistent on 16 SMs fewer); any other name runs as
is (name the flags you set). --trace DIR: a profile of the ring and of
flash+ppermute at P = 2, with their compiled HLO.

    python bench/ring_overlap.py --variant default --out bench/results
    XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true python bench/ring_overlap.py --variant memcpy_p2p

Writes ring_overlap_<variant>.json (milliseconds) under --out."""
import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bench.common import time_jax
import jattn
from jattn.flash import FLASH
from jattn.parallel import ring_attention

ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="default")
ap.add_argument("--backend", default="auto")
ap.add_argument("--trace")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--out", default=".")
a = ap.parse_args()
if a.variant.startswith("nonpersistent"):
  orig = FLASH.prepare
  def prepare(problem, backend="auto", config=None, info=None):
    call = orig(problem, backend, config, info)
    if call.impl.backend.name == "pallas_mosaic" and config is None:
      call = orig(problem, call.impl.backend.name,
                  dataclasses.replace(call.config, persistent=False), info)
    return call
  FLASH.prepare = prepare

if a.variant.startswith("fewer_sms"):
  import jattn.kernels.hopper.pipeline as mp
  full = mp.num_sms
  mp.num_sms = lambda: full() - 16
L, H, D = int(os.environ.get("PROBE_L", 32768)), 8, 128
SPEC = P(None, "sp")
res = dict(variant=a.variant, xla_flags=os.environ.get("XLA_FLAGS", ""),
           nccl={k: v for k, v in os.environ.items() if k.startswith("NCCL")})

def mesh_of(n):
  return Mesh(np.array(jax.devices()[:n]), ("sp",))

def inputs(mesh, seq):
  sh = NamedSharding(mesh, SPEC)
  @functools.partial(jax.jit, out_shardings=(sh,) * 4)
  def make():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(k, (1, seq, H, D), jnp.bfloat16) for k in ks)
  return make()

def t(fn, *x):
  return time_jax(fn, *x, reps=5, inner=3, warmup=1) * 1e3

def smap(f, mesh, n_in, n_out=1):
  return jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * n_in,
                       out_specs=SPEC if n_out == 1 else (SPEC,) * n_out, check_vma=False)

flash = lambda q, k, v: jattn.flash_attention(q, k, v, backend=a.backend)
for n in (2, 4):
  mesh = mesh_of(n)
  q, k, v, do = inputs(mesh, n * L)
  perm = [(i, (i + 1) % n) for i in range(n)]
  send = lambda q, k, v: jax.lax.ppermute((k, v), "sp", perm)
  res[f"flash_P{n}"] = t(jax.jit(smap(flash, mesh, 3)), q, k, v)
  res[f"ppermute_P{n}"] = t(jax.jit(smap(send, mesh, 3, 2)), q, k, v)
  both = lambda q, k, v: (flash(q, k, v),) + send(q, k, v)
  res[f"flash+ppermute_P{n}"] = t(jax.jit(smap(both, mesh, 3, 3)), q, k, v)
  ring = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", backend=a.backend)
  res[f"ring_fwd_P{n}"] = t(jax.jit(smap(ring, mesh, 3)), q, k, v)
  if n == 2 and a.trace:
    with open(os.path.join(a.out, f"hlo_{a.variant}.txt"), "w") as f:
      f.write(jax.jit(smap(both, mesh, 3, 3)).lower(q, k, v).compile().as_text())
      f.write("\n\n=== ring ===\n")
      f.write(jax.jit(smap(ring, mesh, 3)).lower(q, k, v).compile().as_text())
  if n == 4 and not a.quick:
    f = smap(ring, mesh, 3)
    res["ring_fwdbwd_P4"] = t(jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)), q, k, v, do)
    zz = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", causal=True, layout="zigzag",
                                        backend=a.backend)
    res["zigzag_fwd_P4"] = t(jax.jit(smap(zz, mesh, 3)), q, k, v)
  print(json.dumps(res), flush=True)
if a.trace:
  mesh = mesh_of(2)
  q, k, v, do = inputs(mesh, 2 * L)
  fn = jax.jit(smap(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", backend=a.backend), mesh, 3))
  jax.block_until_ready(fn(q, k, v))
  both = jax.jit(smap(lambda q, k, v: (flash(q, k, v),) + jax.lax.ppermute(
      (k, v), "sp", [(0, 1), (1, 0)]), mesh, 3, 3))
  jax.block_until_ready(both(q, k, v))
  with jax.profiler.trace(a.trace, create_perfetto_trace=True):
    for _ in range(2):
      jax.block_until_ready(fn(q, k, v))
      jax.block_until_ready(both(q, k, v))
  import glob, shutil
  for path in glob.glob(os.path.join(a.trace, "**", "perfetto_trace.json.gz"), recursive=True):
    shutil.copy(path, os.path.join(a.out, f"perfetto_{a.variant}.json.gz"))
with open(os.path.join(a.out, f"ring_overlap_{a.variant}.json"), "w") as f:
  json.dump(res, f)
