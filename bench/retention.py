"""Retention benchmark: jattn's chunkwise and parallel Pallas kernels against
flash-linear-attention's ``chunk_retention`` / ``parallel_retention`` (torch + Triton),
and our parallel form against our own flash attention, in one run.

    python bench/retention.py --out bench/results          # the issue's table + bar shapes
    python bench/retention.py --sweep                      # chunk size / launch sweep
    python bench/retention.py --long                       # 65536-token chunkwise fwd+bwd

fla is installed with ``pip install --no-deps`` (see bench/README.md); its Triton
autotuning runs during the warm-up calls, before timing.
Writes retention.json / retention.md / retention.png under --out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import attention_flops, environment, jax_peak_bytes, time_jax, time_torch, write_results  # noqa: E402
import jattn  # noqa: E402
from jattn.reference import default_decay  # noqa: E402
from pallas_kernels.flash import FlashBlockConfig  # noqa: E402
from pallas_kernels.retention import ChunkwiseLaunch, retention_chunkwise_triton, retention_parallel_triton  # noqa: E402

SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (4, 4096, 8, 64)]
PARALLEL_SHAPE = (4, 4096, 16, 128)
LONG_SHAPE = (1, 65536, 8, 128)
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp32": jnp.float32}
# (ours, peer): the table's ratios are peer time / our time (> 1: ours is faster).
RATIOS = [("jattn_chunkwise", "fla_chunk"), ("jattn_parallel", "fla_parallel"),
          ("jattn_parallel", "fla_chunk")]


def jax_impls(chunk=None, launch=None, parallel_config=None):
  def chunkwise(q, k, v):
    if launch is None:
      return jattn.retention(q, k, v, mode="chunkwise", chunk_size=chunk, backend="pallas_triton")
    state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    return retention_chunkwise_triton(q, k, v, default_decay(q.shape[2]), state,
                                      scale=q.shape[-1] ** -0.5, chunk=chunk, launch=launch)[0]

  def parallel(q, k, v):
    if parallel_config is None:
      return jattn.retention(q, k, v, mode="parallel", backend="pallas_triton")
    return retention_parallel_triton(q, k, v, default_decay(q.shape[2]),
                                     scale=q.shape[-1] ** -0.5, normalize=False,
                                     config=parallel_config)

  def xla_chunkwise(q, k, v):
    return jattn.retention(q, k, v, mode="chunkwise", backend="xla")

  def flash_causal(q, k, v):
    return jattn.flash_attention(q, k, v, causal=True)

  def flash_causal_triton(q, k, v):
    return jattn.flash_attention(q, k, v, causal=True, backend="pallas_triton")

  return {"jattn_chunkwise": chunkwise, "jattn_parallel": parallel, "xla_chunkwise": xla_chunkwise,
          "jattn_flash_causal": flash_causal, "jattn_flash_causal_triton": flash_causal_triton}


def time_jax_impl(fn, mode, q, k, v, do):
  if mode == "fwd":
    f, args = jax.jit(fn), (q, k, v)
  else:
    def f(q, k, v, do):
      return jax.vjp(fn, q, k, v)[1](do)
    f, args = jax.jit(f), (q, k, v, do)
  return time_jax(f, *args), jax_peak_bytes(f, *args)


def time_fla(name, mode, q, k, v, do):
  import torch
  from fla.ops.retention import chunk_retention, parallel_retention

  from interop import to_torch

  op = {"fla_chunk": chunk_retention, "fla_parallel": parallel_retention}[name]
  qt, kt, vt, dot = (to_torch(x).contiguous() for x in (q, k, v, do))
  qt, kt, vt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt))

  def fwd():
    return op(qt, kt, vt)[0]

  def both():
    return torch.autograd.grad(op(qt, kt, vt)[0], (qt, kt, vt), dot)

  fn = fwd if mode == "fwd" else both
  for _ in range(3):  # Triton autotuning happens on the first calls
    fn()
  torch.cuda.synchronize()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  fn()
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated() - base
  inputs = sum(x.numel() * x.element_size() for x in (qt, kt, vt)) + (
      0 if mode == "fwd" else dot.numel() * dot.element_size())
  return time_torch(fn), peak + inputs


def inputs(shape, dtype, seed=0):
  b, s, h, d = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return [jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys]


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


def run_table(shapes, dtypes, impls, modes, fla_impls):
  rows = []
  for shape, dname, mode in itertools.product(shapes, dtypes, modes):
    q, k, v, do = inputs(shape, DTYPES[dname])
    for name in impls:
      fn = jax_impls()[name]
      rows.append(_row(name, shape, dname, mode, lambda: time_jax_impl(fn, mode, q, k, v, do)))
    for name in fla_impls:
      rows.append(_row(name, shape, dname, mode, lambda: time_fla(name, mode, q, k, v, do)))
  return rows


def _fmt_row(r):
  head = f"{r['impl']:>26} {str(tuple(r['shape'])):>20} {r['dtype']} {r['mode']:>7}"
  if "error" in r:
    return f"{head}  ERROR {r['error']}"
  mem = "" if r.get("peak_mib") is None else f" {r['peak_mib']:9.0f} MiB"
  return f"{head} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s{mem}"


def markdown(rows, env, title):
  lines = [f"# {title}, {env['device']} (jax {env['jax']}, {env['time']})", "",
           "Median ms (peak MiB); ratio = peer ms / jattn ms (> 1: jattn faster). TFLOP/s in the "
           "JSON count the causal parallel form's matmuls for every impl.", ""]
  keys = list(dict.fromkeys((tuple(r["shape"]), r["dtype"], r["mode"]) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  ratios = [(a, b) for a, b in RATIOS if a in impls and b in impls]
  lines.append("| shape B,S,H,D | dtype | mode | " + " | ".join(impls) + " | "
               + " | ".join(f"{b}/{a}" for a, b in ratios) + " |")
  lines.append("|" + "---|" * (len(impls) + len(ratios) + 3))
  for key in keys:
    by = {r["impl"]: r for r in rows if (tuple(r["shape"]), r["dtype"], r["mode"]) == key}
    cells = []
    for i in impls:
      r = by.get(i)
      if r is None:
        cells.append("")
      elif "error" in r:
        cells.append("n/a")
      else:
        mem = "" if r.get("peak_mib") is None else f" ({r['peak_mib']:.0f})"
        cells.append(f"{r['ms']:.3f}{mem}")

    def ratio(ours, peer):
      a, b = by.get(ours), by.get(peer)
      return f"{b['ms'] / a['ms']:.2f}x" if a and b and "ms" in a and "ms" in b else ""

    lines.append(f"| {','.join(map(str, key[0]))} | {key[1]} | {key[2]} | " + " | ".join(cells)
                 + " | " + " | ".join(ratio(a, b) for a, b in ratios) + " |")
  return "\n".join(lines) + "\n"


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [r for r in rows if "ms" in r and r["impl"] in ("jattn_chunkwise", "fla_chunk",
                                                          "jattn_parallel", "fla_parallel")]
  groups = list(dict.fromkeys((tuple(r["shape"]), r["dtype"], r["mode"]) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.1), 4.5))
  width = 0.8 / max(len(impls), 1)
  for n, impl in enumerate(impls):
    vals = [next((r["ms"] for r in rows if r["impl"] == impl
                  and (tuple(r["shape"]), r["dtype"], r["mode"]) == g), 0) for g in groups]
    ax.bar([i + n * width for i in range(len(groups))], vals, width, label=impl)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
  ax.set_xticklabels([f"{','.join(map(str, g[0]))}\n{g[1]} {g[2]}" for g in groups], fontsize=6)
  ax.set_ylabel("ms (lower is better)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def sweep(shapes):
  """Chunk size and launch parameters of the chunkwise kernels (fp16), then the parallel
  kernel's tiles at PARALLEL_SHAPE; prints and returns every timing."""
  results = []
  fwd_cands = [dict(chunk=c, launch=ChunkwiseLaunch(state_block=sb, scan_stages=st, out_warps=w))
               for c, sb, st, w in itertools.product((64, 128), (32, 64), (1, 2), (4, 8))]
  for shape in shapes:
    q, k, v, do = inputs(shape, jnp.float16)
    timed = []
    for cand in fwd_cands:
      row = _row("sweep_chunkwise", shape, "fp16", "fwd", lambda: time_jax_impl(
          jax_impls(**cand)["jattn_chunkwise"], "fwd", q, k, v, do))
      row["cand"] = {"chunk": cand["chunk"], **cand["launch"].__dict__}
      results.append(row)
      if "ms" in row:
        timed.append((row["ms"], cand))
    timed.sort(key=lambda t: t[0])
    for _, cand in timed[:2]:
      for gw, c in itertools.product((4, 8), (64, 128)):
        launch = ChunkwiseLaunch(**{**cand["launch"].__dict__, "grad_warps": gw})
        row = _row("sweep_chunkwise", shape, "fp16", "fwd+bwd", lambda: time_jax_impl(
            jax_impls(chunk=c, launch=launch)["jattn_chunkwise"], "fwd+bwd", q, k, v, do))
        row["cand"] = {"chunk": c, **launch.__dict__}
        results.append(row)
  q, k, v, do = inputs(PARALLEL_SHAPE, jnp.float16)
  for bq, bk, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
    config = FlashBlockConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
    row = _row("sweep_parallel", PARALLEL_SHAPE, "fp16", "fwd", lambda: time_jax_impl(
        jax_impls(parallel_config=config)["jattn_parallel"], "fwd", q, k, v, do))
    row["cand"] = {"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": st}
    results.append(row)
  return results


def fit(dtypes):
  """Which chunk sizes compile (shared memory) for the chunkwise fwd+bwd, per dtype and
  head dims: the data behind the kernel chunk cap in pallas_kernels/retention."""
  results = []
  for dname, (dk, dv), chunk in itertools.product(dtypes, [(64, 64), (128, 128), (256, 64),
                                                             (64, 256), (256, 256)],
                                                  (16, 32, 64, 128)):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k = (jax.random.normal(kk, (1, 256, 2, dk), DTYPES[dname]) for kk in ks[:2])
    v, do = (jax.random.normal(kk, (1, 256, 2, dv), DTYPES[dname]) for kk in ks[2:])
    fn = jax_impls(chunk=chunk, launch=ChunkwiseLaunch())["jattn_chunkwise"]
    row = {"dtype": dname, "dk": dk, "dv": dv, "chunk": chunk}
    try:
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
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--fit", action="store_true", help="which chunk sizes fit, per dtype/dims")
  parser.add_argument("--long", action="store_true",
                      help="65536-token chunkwise fwd+bwd at (1,65536,8,128), fp16 and bf16")
  parser.add_argument("--no-fla", action="store_true")
  parser.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
  parser.add_argument("--dtypes", default="fp16,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  args = parser.parse_args()
  env = environment()
  shapes = [SHAPES[i] for i in map(int, args.shapes.split(","))]
  fla = [] if args.no_fla else ["fla_chunk", "fla_parallel"]
  if args.fit:
    results = fit(["fp32"] + args.dtypes.split(","))
    write_results(args.out, "retention_fit", {"env": env, "rows": results}, "")
    return
  if args.sweep:
    results = sweep(shapes)
    write_results(args.out, "retention_sweep", {"env": env, "rows": results}, "")
    return
  if args.long:
    rows = run_table([LONG_SHAPE], args.dtypes.split(","), ["jattn_chunkwise"], ["fwd+bwd"],
                     fla[:1])
    write_results(args.out, "retention_long", {"env": env, "rows": rows},
                  markdown(rows, env, "Retention, 65536 tokens, chunkwise fwd+bwd"))
    return
  modes = args.modes.split(",")
  rows = run_table(shapes, args.dtypes.split(","), ["jattn_chunkwise", "jattn_parallel"],
                   modes, fla)
  # The bar for the parallel form: its forward against our causal flash forward.
  rows += run_table([PARALLEL_SHAPE], args.dtypes.split(","),
                    ["jattn_parallel", "jattn_flash_causal", "jattn_flash_causal_triton"],
                    ["fwd"], [])
  md = markdown(rows, env, "Retention")
  write_results(args.out, "retention", {"env": env, "rows": rows}, md)
  plot(rows, os.path.join(args.out, "retention.png"))
  print(md)


if __name__ == "__main__":
  main()
