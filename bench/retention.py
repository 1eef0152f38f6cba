"""Retention benchmark: jattn's chunkwise and parallel Pallas kernels against
flash-linear-attention's ``chunk_retention`` / ``parallel_retention`` (torch + Triton),
and our parallel form against our own flash attention, in one run.

    python bench/retention.py --dtypes fp16 --stem retention_fp16   # the issue's table
    python bench/retention.py --parallel-bar       # parallel fwd (Hopper and Triton) vs our flash fwd
    python bench/retention.py --long               # 65536-token chunkwise fwd+bwd
    python bench/retention.py --crossover --dtypes fp16   # parallel vs chunkwise by length
    python bench/retention.py --sweep parallel     # parallel-kernel tile sweep
    python bench/retention.py --sweep chunkwise    # chunk size / launch sweep
    python bench/retention.py --fit --dtypes fp32  # which chunks fit shared memory

fla is installed with ``pip install --no-deps`` (see bench/README.md); its Triton
autotuning runs during the warm-up calls, before timing.
Each writes ``<stem>.json`` and ``<stem>.md`` (the table also ``<stem>.png``) under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import (attention_flops, bar_chart, environment,  # noqa: E402
                          random_inputs, results_table, time_jax_qkv, time_torch_qkv,
                          write_results)
import jattn  # noqa: E402
from jattn.kernels.common.config import BlockConfig  # noqa: E402
from jattn.kernels.retention import ChunkwiseConfig  # noqa: E402
from jattn.reference import default_decay  # noqa: E402
from jattn.retention import RETENTION_CHUNKWISE, RETENTION_PARALLEL  # noqa: E402

SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (4, 4096, 8, 64)]
PARALLEL_SHAPE = (4, 4096, 16, 128)
LONG_SHAPE = (1, 65536, 8, 128)
CROSSOVER_LENGTHS = (128, 256, 512, 1024, 2048)
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}
# (ours, peer): the table's ratios are peer time / our time (> 1: ours is faster).
RATIOS = [("jattn_chunkwise", "jattn_parallel"), ("jattn_chunkwise", "fla_chunk"), ("jattn_parallel", "fla_parallel"),
          ("jattn_parallel", "fla_chunk"), ("jattn_parallel", "jattn_flash_causal"),
          ("jattn_parallel", "jattn_flash_causal_triton"),
          ("jattn_parallel_mosaic", "jattn_flash_causal"),
          ("jattn_parallel_mosaic_abs_sum", "jattn_flash_causal"),
          ("jattn_parallel_mosaic", "jattn_parallel"), ("jattn_parallel_mosaic", "fla_parallel")]


def jax_impls(chunk=None, chunkwise_config=None, parallel_config=None):
  """The JAX callables by name. With ``chunkwise_config`` (a ``ChunkwiseConfig``: chunk
  size, state tiles, warps) or ``parallel_config`` (a ``BlockConfig``) the kernels run
  with exactly that config; without, as ``jattn.retention`` chooses (``chunk`` its
  chunk_size)."""
  def chunkwise(q, k, v):
    if chunkwise_config is None:
      return jattn.retention(q, k, v, mode="chunkwise", chunk_size=chunk, backend="pallas_triton")
    # A zero initial state (None); the final state is dropped.
    return RETENTION_CHUNKWISE(q, k, v, decay=default_decay(q.shape[2]), backend="pallas_triton",
                               config=chunkwise_config)[0]

  def parallel(q, k, v):
    if parallel_config is None:
      return jattn.retention(q, k, v, mode="parallel", backend="pallas_triton")
    return RETENTION_PARALLEL(q, k, v, decay=default_decay(q.shape[2]), backend="pallas_triton",
                              config=parallel_config)

  def parallel_mosaic(q, k, v, normalize=None):
    return jattn.retention(q, k, v, mode="parallel", normalize=normalize,
                           backend="pallas_mosaic")

  def xla_chunkwise(q, k, v):
    return jattn.retention(q, k, v, mode="chunkwise", backend="xla")

  def flash_causal(q, k, v):
    return jattn.flash_attention(q, k, v, causal=True)

  def flash_causal_triton(q, k, v):
    return jattn.flash_attention(q, k, v, causal=True, backend="pallas_triton")

  return {"jattn_chunkwise": chunkwise, "jattn_parallel": parallel,
          "jattn_parallel_mosaic": parallel_mosaic,
          "jattn_parallel_mosaic_abs_sum": lambda q, k, v: parallel_mosaic(q, k, v, "abs_sum"),
          "xla_chunkwise": xla_chunkwise,
          "jattn_flash_causal": flash_causal, "jattn_flash_causal_triton": flash_causal_triton}


def time_fla(name, mode, q, k, v, do):
  import torch
  from fla.ops.retention import chunk_retention, parallel_retention

  from jattn.interop import to_torch

  op = {"fla_chunk": chunk_retention, "fla_parallel": parallel_retention}[name]
  qt, kt, vt, dot = (to_torch(x).contiguous() for x in (q, k, v, do))
  qt, kt, vt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt))

  def fwd():
    return op(qt, kt, vt)[0]

  def both():
    return torch.autograd.grad(op(qt, kt, vt)[0], (qt, kt, vt), dot)

  # Three warm-up calls: fla's Triton autotuning runs on the first ones.
  if mode == "fwd":
    return time_torch_qkv(fwd, (qt, kt, vt), warmup=3)
  return time_torch_qkv(both, (qt, kt, vt, dot), warmup=3)


def _row(impl, shape, dname, mode, run):
  row = {"impl": impl, "shape": list(shape), "dtype": dname, "mode": mode}
  try:
    seconds, peak = run()
    # TFLOP/s of the parallel form's matmuls (the causal attention count): a common
    # yardstick, not the chunkwise form's own (smaller) work.
    flops = attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], True, mode)
    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
               peak_mib=None if peak is None else peak / 2**20)
  except Exception as e:  # a peer lacking memory or a feature is recorded, not fatal
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
  print(_fmt_row(row), flush=True)
  return row


def run_table(shapes, dtypes, impls, modes, fla_impls, rows=None, on_row=None):
  """Times ``impls`` (names in jax_impls(), or a dict name -> fn) and the fla peers,
  appending to ``rows``; ``on_row(rows)`` after each (so a cut-off run keeps its rows)."""
  impls = impls if isinstance(impls, dict) else {name: jax_impls()[name] for name in impls}
  rows = [] if rows is None else rows
  for shape, dname, mode in itertools.product(shapes, dtypes, modes):
    q, k, v, do = random_inputs(shape, DTYPES[dname])
    timers = [(name, lambda fn=fn: time_jax_qkv(fn, mode, q, k, v, do))
              for name, fn in impls.items()]
    timers += [(name, lambda name=name: time_fla(name, mode, q, k, v, do)) for name in fla_impls]
    for name, run in timers:
      rows.append(_row(name, shape, dname, mode, run))
      if on_row is not None:
        on_row(rows)
  return rows


def _fmt_row(r):
  head = f"{r['impl']:>26} {str(tuple(r['shape'])):>20} {r['dtype']} {r['mode']:>7}"
  if "error" in r:
    return f"{head}  ERROR {r['error']}"
  mem = "" if r.get("peak_mib") is None else f" {r['peak_mib']:9.0f} MiB"
  return f"{head} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s{mem}"


def markdown(rows, env, title):
  header = [f"# {title}, {env['device']} (jax {env['jax']}, {env['time']})", "",
            "Median ms (peak MiB); ratio = peer ms / jattn ms (> 1: jattn faster). TFLOP/s in the "
            "JSON count the causal parallel form's matmuls for every impl.", ""]
  mem = lambda r: "" if r.get("peak_mib") is None else f" ({r['peak_mib']:.0f})"
  table = results_table(
      rows, [("shape B,S,H,D", lambda r: ",".join(map(str, r["shape"]))),
             ("dtype", lambda r: r["dtype"]), ("mode", lambda r: r["mode"])],
      cell=lambda r: f"{r['ms']:.3f}{mem(r)}",
      ratios=[(f"{peer}/{ours}", ours, peer) for ours, peer in RATIOS],
      ratio=lambda ours, peer: f"{peer['ms'] / ours['ms']:.2f}x")
  return "\n".join(header) + "\n" + table


def plot(rows, path):
  rows = [r for r in rows if "ms" in r and r["impl"] in ("jattn_chunkwise", "fla_chunk",
                                                          "jattn_parallel", "fla_parallel")]
  bar_chart(rows, lambda r: f"{','.join(map(str, r['shape']))}\n{r['dtype']} {r['mode']}",
            lambda r: r["ms"], "ms (lower is better)", path, fontsize=6)


def sweep_chunkwise(shapes):
  """Chunk size and launch parameters of the chunkwise kernels (fp16): forward first,
  then fwd+bwd around the two best forward launches."""
  results = []
  fwd_cands = [ChunkwiseConfig(chunk=c, state_block=sb, scan_stages=st, out_warps=w)
               for c, sb, st, w in itertools.product((64, 128), (32, 64), (1, 2), (4, 8))]
  for shape in shapes:
    q, k, v, do = random_inputs(shape, jnp.float16)
    timed = []
    for cand in fwd_cands:
      row = _row("sweep_chunkwise", shape, "fp16", "fwd", lambda: time_jax_qkv(
          jax_impls(chunkwise_config=cand)["jattn_chunkwise"], "fwd", q, k, v, do))
      row["cand"] = dataclasses.asdict(cand)  # chunk, state_block, ..., grad_warps
      results.append(row)
      if "ms" in row:
        timed.append((row["ms"], cand))
    timed.sort(key=lambda t: t[0])
    for _, cand in timed[:2]:
      for gw, c in itertools.product((4, 8), (64, 128)):
        config = dataclasses.replace(cand, chunk=c, grad_warps=gw)
        row = _row("sweep_chunkwise", shape, "fp16", "fwd+bwd", lambda: time_jax_qkv(
            jax_impls(chunkwise_config=config)["jattn_chunkwise"], "fwd+bwd", q, k, v, do))
        row["cand"] = dataclasses.asdict(config)
        results.append(row)
  return results


def sweep_parallel():
  """Tiles and launch parameters of the parallel forward kernel at PARALLEL_SHAPE (fp16)."""
  results = []
  q, k, v, do = random_inputs(PARALLEL_SHAPE, jnp.float16)
  cands = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
  cands += [(256, 32, 8, 3), (256, 64, 8, 2), (256, 64, 8, 3)]
  for bq, bk, w, st in cands:
    config = BlockConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
    row = _row("sweep_parallel", PARALLEL_SHAPE, "fp16", "fwd", lambda: time_jax_qkv(
        jax_impls(parallel_config=config)["jattn_parallel"], "fwd", q, k, v, do))
    row["cand"] = {"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": st}
    results.append(row)
  return results


FIT_DIMS = "64x64,128x128,256x64,64x256,128x256,256x128,256x256"


def fit(dtypes, dims, chunks):
  """Which chunk sizes compile (shared memory) for the chunkwise fwd+bwd, per dtype and
  head dims: the data behind ``grad_kernel_bytes`` (tests/test_retention.py checks it)."""
  results = []
  for dname, (dk, dv), chunk in itertools.product(dtypes, dims, chunks):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k = (jax.random.normal(kk, (1, 256, 2, dk), DTYPES[dname]) for kk in ks[:2])
    v, do = (jax.random.normal(kk, (1, 256, 2, dv), DTYPES[dname]) for kk in ks[2:])
    row = {"dtype": dname, "dk": dk, "dv": dv, "chunk": chunk}
    try:
      # Every chunk is compiled, also those the shared-memory model rules out.
      fn = jax_impls(chunkwise_config=ChunkwiseConfig(chunk=chunk))["jattn_chunkwise"]
      jax.block_until_ready(jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))(q, k, v, do))
      row["ok"] = True
    except Exception as e:  # the shared-memory limit shows up as a compile/launch error
      row.update(ok=False, error=str(e).splitlines()[0][:200])
    print(row, flush=True)
    results.append(row)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--sweep", choices=("chunkwise", "parallel"))
  parser.add_argument("--fit", action="store_true", help="which chunk sizes fit, per dtype/dims")
  parser.add_argument("--fit-dims", default=FIT_DIMS, help="dk x dv pairs for --fit")
  parser.add_argument("--fit-chunks", default="16,32,64,128")
  parser.add_argument("--long", action="store_true",
                      help="65536-token chunkwise fwd+bwd at (1,65536,8,128), fp16 and bf16")
  parser.add_argument("--state-blocks", default="",
                      help="with --long: also time these ChunkwiseConfig.state_block values")
  parser.add_argument("--crossover", action="store_true",
                      help="parallel vs chunkwise over sequence lengths (the auto threshold)")
  parser.add_argument("--parallel-bar", action="store_true",
                      help=f"only the parallel forward against our flash forward at {PARALLEL_SHAPE}")
  parser.add_argument("--no-fla", action="store_true")
  parser.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
  parser.add_argument("--stem", help="file names under --out (default: by mode)")
  parser.add_argument("--dtypes", default="fp16,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  args = parser.parse_args()
  env = environment()
  shapes = [SHAPES[i] for i in map(int, args.shapes.split(","))]
  fla = [] if args.no_fla else ["fla_chunk", "fla_parallel"]
  if args.fit:
    dims = [tuple(map(int, d.split("x"))) for d in args.fit_dims.split(",")]
    results = fit(args.dtypes.split(","), dims, list(map(int, args.fit_chunks.split(","))))
    write_results(args.out, args.stem or "retention_fit", {"env": env, "rows": results}, "")
    return
  if args.sweep:
    results = sweep_chunkwise(shapes) if args.sweep == "chunkwise" else sweep_parallel()
    write_results(args.out, args.stem or f"retention_sweep_{args.sweep}",
                  {"env": env, "rows": results}, "")
    return
  if args.crossover:
    shapes = [(b, s, h, d) for b, h, d in ((8, 16, 128), (8, 8, 64)) for s in CROSSOVER_LENGTHS]
    run_table(shapes, args.dtypes.split(","), ["jattn_chunkwise", "jattn_parallel"],
              args.modes.split(","), [], on_row=lambda rows: write_results(
                  args.out, args.stem or "retention_crossover", {"env": env, "rows": rows},
                  markdown(rows, env, "Retention: parallel vs chunkwise kernels by length")))
    return
  if args.long:
    impls = {"jattn_chunkwise": jax_impls()["jattn_chunkwise"]}
    for sb in filter(None, args.state_blocks.split(",")):
      impls[f"jattn_chunkwise_sb{sb}"] = jax_impls(
          chunkwise_config=ChunkwiseConfig(chunk=64, state_block=int(sb)))["jattn_chunkwise"]
    rows = run_table([LONG_SHAPE], args.dtypes.split(","), impls, ["fwd+bwd"], fla[:1])
    write_results(args.out, args.stem or "retention_long", {"env": env, "rows": rows},
                  markdown(rows, env, "Retention, 65536 tokens, chunkwise fwd+bwd"))
    return
  # The bar for the parallel form: its forward against our causal flash forward.
  mosaic = ["jattn_parallel_mosaic", "jattn_parallel_mosaic_abs_sum"] if (
      jattn.gpu.gpu_info().architecture == "hopper") else []
  bar = run_table([PARALLEL_SHAPE], args.dtypes.split(","),
                  [*mosaic, "jattn_parallel", "jattn_flash_causal", "jattn_flash_causal_triton"],
                  ["fwd"], [])
  if args.parallel_bar:
    write_results(args.out, args.stem or "retention_parallel_bar", {"env": env, "rows": bar},
                  markdown(bar, env, "Retention parallel forward vs our causal flash forward"))
    return
  stem = args.stem or "retention"

  def save(rows):
    write_results(args.out, stem, {"env": env, "rows": rows}, markdown(rows, env, "Retention"))

  rows = run_table(shapes, args.dtypes.split(","), ["jattn_chunkwise", "jattn_parallel"],
                   args.modes.split(","), fla, rows=list(bar), on_row=save)
  plot(rows, os.path.join(args.out, f"{stem}.png"))
  print(markdown(rows, env, "Retention"))


if __name__ == "__main__":
  main()
