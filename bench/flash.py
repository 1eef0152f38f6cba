"""Flash attention benchmark: jattn's kernels (Triton-lowered and Hopper Mosaic GPU)
against cuDNN, plain XLA, JAX's example Pallas kernels, tokamax's Mosaic GPU kernel
and torch SDPA (through the DLPack bridge), in one run.

    python bench/flash.py --out bench/results            # the issue's shapes
    python bench/flash.py --sweep                        # Triton block-config sweep
    python bench/flash.py --sweep-mosaic                 # Hopper tile sweep
    python bench/flash.py --long                         # 131072-token causal fwd+bwd

Writes flash.json / flash.md / flash.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import (attention_flops, bar_chart, environment,  # noqa: E402
                          random_inputs, results_table, time_jax, time_jax_qkv,
                          time_torch_qkv, write_results)
import jattn  # noqa: E402
from jattn.kernels.common.config import BlockConfig  # noqa: E402
from jattn.kernels.flash import MosaicBlockConfig, default_mosaic_config  # noqa: E402

# (batch, seq, q_heads, head_dim[, kv_heads]): the three shapes, head dim 256, GQA.
SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64), (4, 4096, 16, 256),
          (2, 8192, 32, 128, 8)]
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


# (ours, peer) pairs the markdown table reports as ratios, where both were run.
RATIOS = [("jattn_triton", "jax_example"), ("jattn_triton", "cudnn"), ("jattn_mosaic", "cudnn"),
          ("jattn_mosaic_fused_dq", "cudnn"), ("jattn_mosaic_fused_dq", "jattn_mosaic"),
          ("jattn_mosaic", "tokamax_mosaic"), ("jattn_mosaic", "jax_example_mgpu"),
          ("jattn_mosaic_softcap", "jattn_triton_softcap"),
          ("jattn_mosaic_softcap", "jattn_mosaic"),
          ("jattn_mosaic_persistent", "jattn_mosaic"), ("jattn_mosaic_persistent", "cudnn"),
          ("jattn_mosaic", "jattn_mosaic_heuristic")]
SOFTCAP = 30.0  # the *_softcap impls' cap (Gemma 2's attention cap is 50)


def jax_impls(causal, config=None, mosaic_config=None):
  """The JAX callables by name; ``config`` / ``mosaic_config``: tiles of our kernels
  (sweep candidates; an explicit config is compiled as given, never pruned)."""
  from jax.experimental.pallas.ops.gpu import attention as jax_example

  def ours(q, k, v):
    return jattn.flash_attention(q, k, v, causal=causal, backend="pallas_triton", config=config)

  def ours_mosaic(q, k, v):
    return jattn.flash_attention(q, k, v, causal=causal, backend="pallas_mosaic",
                                 config=mosaic_config)

  def tiles(q):  # the candidate, else the untuned tiles (past any tuned table entry)
    return mosaic_config or default_mosaic_config(q.shape[-1])

  def ours_mosaic_heuristic(q, k, v):
    return jattn.flash_attention(q, k, v, causal=causal, backend="pallas_mosaic",
                                 config=tiles(q))

  def ours_mosaic_persistent(q, k, v):  # the forward on one CTA per SM
    config = dataclasses.replace(tiles(q), persistent=True)
    return jattn.flash_attention(q, k, v, causal=causal, backend="pallas_mosaic", config=config)

  def ours_mosaic_fused_dq(q, k, v):  # deterministic=False: dQ atomics in the dK/dV kernel
    config = dataclasses.replace(tiles(q), fused_dq=True)
    return jattn.flash_attention(q, k, v, causal=causal, backend="pallas_mosaic",
                                 config=config, deterministic=False)

  def softcapped(backend):
    return lambda q, k, v: jattn.flash_attention(q, k, v, causal=causal, softcap=SOFTCAP,
                                                 backend=backend)

  def tokamax_mosaic(q, k, v):
    import tokamax

    return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")

  def example_mgpu(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    d = q.shape[-1]
    config = mgpu.TuningConfig(block_q=64, block_kv=128 if d <= 128 else 64,
                               max_concurrent_steps=2, causal=causal, block_q_dkv=64,
                               block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    return mgpu.attention(q * d ** -0.5, k, v, config)

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

  def example(q, k, v):
    return jax_example.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)

  return {"jattn_triton": ours, "jattn_mosaic": ours_mosaic,
          "jattn_mosaic_heuristic": ours_mosaic_heuristic,
          "jattn_mosaic_fused_dq": ours_mosaic_fused_dq,
          "jattn_mosaic_persistent": ours_mosaic_persistent,
          "jattn_mosaic_softcap": softcapped("pallas_mosaic"),
          "jattn_triton_softcap": softcapped("pallas_triton"), "cudnn": cudnn, "xla": xla,
          "jax_example": example, "jax_example_mgpu": example_mgpu,
          "tokamax_mosaic": tokamax_mosaic}


def time_torch_impl(backend_name, causal, mode, q, k, v, do):
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel

  from jattn.interop import to_torch

  backend = {"torch_sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
             "torch_sdpa_flash": SDPBackend.FLASH_ATTENTION}[backend_name]
  qt, kt, vt, dot = (to_torch(x).permute(0, 2, 1, 3) for x in (q, k, v, do))
  qt, kt, vt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt))
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def fwd():
    with sdpa_kernel(backend):
      return sdpa(qt, kt, vt, is_causal=causal)

  def both():
    with sdpa_kernel(backend):
      o = sdpa(qt, kt, vt, is_causal=causal)
    return torch.autograd.grad(o, (qt, kt, vt), dot)

  if mode == "fwd":
    return time_torch_qkv(fwd, (qt, kt, vt))
  return time_torch_qkv(both, (qt, kt, vt, dot))


def shape_inputs(shape, dtype):
  """q, k, v, dO for a SHAPES entry; a fifth element is the number of KV heads."""
  q, k, v, do = random_inputs(shape[:4], dtype)
  if len(shape) == 5:
    k, v = (x[:, :, :shape[4]] for x in (k, v))
  return q, k, v, do


def run_table(shapes, dtypes, impls, modes, torch_impls):
  rows = []
  for shape, dname, causal, mode in itertools.product(shapes, dtypes, (False, True), modes):
    q, k, v, do = shape_inputs(shape, DTYPES[dname])
    flops = attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], causal, mode)
    named = {**{n: ("jax", f) for n, f in jax_impls(causal).items() if n in impls},
             **{n: ("torch", n) for n in torch_impls}}
    for name, (kind, fn) in named.items():
      row = {"impl": name, "shape": list(shape), "dtype": dname, "causal": causal, "mode": mode}
      try:
        if kind == "jax":
          seconds, peak = time_jax_qkv(fn, mode, q, k, v, do)
        else:
          seconds, peak = time_torch_impl(fn, causal, mode, q, k, v, do)
        row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12, peak_mib=None if peak is None else peak / 2**20)
      except Exception as e:  # a peer lacking a feature or memory is recorded, not fatal
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
      rows.append(row)
      print(_fmt_row(row), flush=True)
  return rows


def _fmt_row(r):
  head = f"{r['impl']:>17} {str(tuple(r['shape'])):>20} {r['dtype']} causal={int(r['causal'])} {r['mode']:>7}"
  if "error" in r:
    return f"{head}  ERROR {r['error']}"
  mem = "" if r.get("peak_mib") is None else f" {r['peak_mib']:9.0f} MiB"
  return f"{head} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s{mem}"


def markdown(rows, env):
  header = [f"# Flash attention, {env['device']} (jax {env['jax']}, {env['time']})", "",
            "TFLOP/s (median; FLOPs per DESIGN.md), peak memory in MiB; ratio = jattn / peer.", ""]
  mem = lambda r: "" if r.get("peak_mib") is None else f" ({r['peak_mib']:.0f} MiB)"
  table = results_table(
      rows, [("shape B,S,H,D", lambda r: ",".join(map(str, r["shape"]))),
             ("dtype", lambda r: r["dtype"]),
             ("causal", lambda r: "yes" if r["causal"] else "no"), ("mode", lambda r: r["mode"])],
      cell=lambda r: f"{r['tflops']:.0f}{mem(r)}",
      ratios=[(f"{ours}/{peer}", ours, peer) for ours, peer in RATIOS],
      ratio=lambda ours, peer: f"{ours['tflops'] / peer['tflops']:.2f}x",
      sort_key=lambda r: (tuple(r["shape"]), r["dtype"], r["causal"], r["mode"]))
  return "\n".join(header) + "\n" + table


def plot(rows, path):
  rows = [r for r in rows if "tflops" in r and r["dtype"] == "fp16"]
  bar_chart(rows, lambda r: (f"{','.join(map(str, r['shape']))}\n"
                             f"{'causal' if r['causal'] else 'full'} {r['mode']}"),
            lambda r: r["tflops"], "TFLOP/s (fp16)", path)


def _time_config(shape, causal, mode, cand, q, k, v, do):
  """TFLOP/s of our kernel with one candidate config, or None if it fails to compile."""
  try:
    fn = jax_impls(causal, BlockConfig(**cand))["jattn_triton"]
    seconds, _ = time_jax_qkv(fn, mode, q, k, v, do)
  except Exception as e:  # e.g. tiles that exceed shared memory
    print("  fail", cand, type(e).__name__, str(e).splitlines()[0][:100], flush=True)
    return None
  return attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], causal, mode) / seconds / 1e12


def sweep(shapes, modes):
  """Times candidate block configs of our kernel; prints the best per shape.

  Forward: a full grid. Backward: the dK/dV tiles with the launch parameters
  first, then the dQ tiles with the winner's (a coordinate search: the two
  kernels share num_warps/num_stages).
  """
  fwd_cands = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
               for bq, bk, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))
               if not (bq == 64 and w == 8)]
  dkv_cands = [dict(block_q_dkv=a, block_k_dkv=b, bwd_num_warps=w, bwd_num_stages=st)
               for (a, b), w, st in itertools.product(
                   ((64, 128), (128, 128), (64, 64), (32, 128), (128, 64)), (4, 8), (2, 3))]
  results = []
  for shape, causal in itertools.product(shapes, (False, True)):
    q, k, v, do = random_inputs(shape, jnp.float16)
    if "fwd" in modes:
      best = _best(results, shape, causal, "fwd", fwd_cands, q, k, v, do)
      print(f"BEST {shape} causal={causal} fwd: {best}", flush=True)
    if "fwd+bwd" in modes:
      best = _best(results, shape, causal, "fwd+bwd", dkv_cands, q, k, v, do)
      dq_cands = [dict(best[1], block_q_dq=a, block_k_dq=b)
                  for a, b in ((128, 64), (64, 64), (128, 128), (64, 128))]
      best = max(best, _best(results, shape, causal, "fwd+bwd", dq_cands, q, k, v, do),
                 key=lambda t: t[0])
      print(f"BEST {shape} causal={causal} fwd+bwd: {best}", flush=True)
  return results


def sweep_mosaic(shapes, modes, dtype=jnp.float16):
  """Times Hopper tile candidates: forward tiles on fwd, then backward tiles on fwd+bwd."""
  from jattn.flash import FLASH, FlashProblem
  from jattn.gpu import gpu_info

  info = gpu_info()
  results = []
  for shape, causal in itertools.product(shapes, (False, True)):
    q, k, v, do = random_inputs(shape, dtype)
    d = shape[3]
    # The autotuner's cost model drops tiles that cannot fit shared memory or registers.
    mosaic = FLASH.impl("pallas_mosaic")  # its fits: a reason the config does not fit, or None
    forward_fits = lambda c, p, info: mosaic.fits(c, p, info, ("forward",))
    problem = FlashProblem(q_len=shape[1], head_dim=d, dtype=dtype, causal=causal)
    fwd = [dict(block_q=bq, block_kv=bk, stages=st)
           for bq, bk, st in itertools.product((64, 128), (64, 128, 192, 256), (2, 3))
           if forward_fits(MosaicBlockConfig(block_q=bq, block_kv=bk, stages=st), problem,
                           info) is None]
    best_fwd = (0.0, {})
    if "fwd" in modes:
      best_fwd = _best_mosaic(results, shape, causal, "fwd", fwd, q, k, v, do)
      print(f"BEST {shape} causal={causal} fwd: {best_fwd}", flush=True)
    if "fwd+bwd" in modes:
      bwd = [dict(best_fwd[1], block_q_dq=a, block_kv_dq=b, block_q_dkv=c, block_kv_dkv=e,
                  bwd_stages=st)
             for (a, b), (c, e), st in itertools.product(((64, 64), (64, 128)),
                                                        ((64, 64), (128, 64)), (2, 3))]
      best = _best_mosaic(results, shape, causal, "fwd+bwd", bwd, q, k, v, do)
      print(f"BEST {shape} causal={causal} fwd+bwd: {best}", flush=True)
  return results


def _best_mosaic(results, shape, causal, mode, cands, q, k, v, do):
  best = (0.0, None)
  flops = attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], causal, mode)
  for cand in cands:
    try:
      fn = jax_impls(causal, mosaic_config=MosaicBlockConfig(**cand))["jattn_mosaic"]
      seconds, _ = time_jax_qkv(fn, mode, q, k, v, do)
    except Exception as e:  # e.g. tiles that exceed shared memory or registers
      print("  fail", cand, type(e).__name__, str(e).splitlines()[0][:100], flush=True)
      continue
    tf = flops / seconds / 1e12
    print(f"  {shape} causal={int(causal)} {mode} {cand}: {tf:.1f} TFLOP/s", flush=True)
    results.append({"shape": shape, "causal": causal, "mode": mode, "config": cand, "tflops": tf})
    if tf > best[0]:
      best = (tf, cand)
  return best


def breakdown(shapes, dtype=jnp.float16):
  """Where a Hopper fwd+bwd step goes: each kernel timed alone on the same inputs."""
  from jattn.kernels.common.masking import MaskSpec
  from jattn.kernels.common.softmax import LOG2E, backward_delta
  from jattn.kernels.flash import default_mosaic_config
  from jattn.kernels.flash.mosaic_bwd import mosaic_dkv, mosaic_dq
  from jattn.kernels.flash.mosaic_fwd import mosaic_forward

  rows = []
  for shape, causal in itertools.product(shapes, (False, True)):
    q, k, v, do = random_inputs(shape, dtype)
    cfg = default_mosaic_config(shape[3])
    spec = MaskSpec.build(shape[1], shape[1], causal=causal, local_window=None,
                          kv_padded=False, segments=False)
    scale = shape[3] ** -0.5
    fwd = jax.jit(lambda q, k, v: mosaic_forward(q, k, v, spec=spec, scale=scale,
                                                 block_q=cfg.block_q, block_kv=cfg.block_kv,
                                                 stages=cfg.stages))
    o, lse = fwd(q, k, v)
    lse2 = lse * LOG2E
    delta = jax.jit(backward_delta)(o, do, jnp.zeros_like(lse))
    kw = dict(spec=spec, scale=scale, stages=cfg.bwd_stages)
    parts = {
        "fwd kernel": (fwd, (q, k, v)),
        "delta (XLA)": (jax.jit(backward_delta), (o, do, jnp.zeros_like(lse))),
        "dq kernel": (jax.jit(lambda *a: mosaic_dq(*a, block_q=cfg.block_q_dq,
                                                   block_kv=cfg.block_kv_dq, **kw)),
                      (q, k, v, do, lse2, delta)),
        "dkv kernel": (jax.jit(lambda *a: mosaic_dkv(*a, block_q=cfg.block_q_dkv,
                                                     block_kv=cfg.block_kv_dkv, **kw)),
                       (q, k, v, do, lse2, delta)),
    }
    full = jax_impls(causal)["jattn_mosaic"]
    total_ms = time_jax_qkv(full, "fwd+bwd", q, k, v, do)[0] * 1e3
    row = {"shape": list(shape), "causal": causal, "fwd+bwd ms": total_ms}
    flops = attention_flops(shape[0], shape[1], shape[1], shape[2], shape[3], causal, "fwd")
    for name, (fn, args) in parts.items():
      row[f"{name} ms"] = time_jax(fn, *args) * 1e3
    # Matmul work of each kernel in units of the forward's two matmuls.
    for name, matmuls in (("fwd kernel", 2), ("dq kernel", 3), ("dkv kernel", 4)):
      row[f"{name} TFLOP/s"] = flops * matmuls / 2 / (row[f"{name} ms"] / 1e3) / 1e12
    print(row, flush=True)
    rows.append(row)
  return rows


def packed(dtypes, modes, backends=("pallas_mosaic", "pallas_triton"), shape=(8, 2048, 16, 128),
           documents=4):
  """Packed sequences (``documents`` equal documents per row, segment ids) against the same
  problem without segment ids, on both our kernel families, causal and not."""
  rows = []
  ids = jnp.repeat(jnp.arange(documents, dtype=jnp.int32), shape[1] // documents)
  seg = jnp.broadcast_to(ids, shape[:2])
  for dname, causal, mode in itertools.product(dtypes, (False, True), modes):
    q, k, v, do = random_inputs(shape, DTYPES[dname])
    flops = attention_flops(*shape[:2], shape[1], *shape[2:], causal, mode)
    for backend, segments in itertools.product(backends, (False, True)):
      extra = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
      fn = lambda q, k, v: jattn.flash_attention(q, k, v, causal=causal, backend=backend,
                                                 **extra)
      seconds, _ = time_jax_qkv(fn, mode, q, k, v, do)
      row = {"impl": backend, "segments": segments, "shape": list(shape), "dtype": dname,
             "causal": causal, "mode": mode, "ms": seconds * 1e3,
             "tflops": flops / seconds / 1e12}  # FLOPs of the unpacked problem
      print(row, flush=True)
      rows.append(row)
  return rows


def packed_markdown(rows, env):
  lines = [f"# Packed sequences (4 documents per row, segment ids), {env['device']} "
           f"(jax {env['jax']}, {env['time']})", "",
           "Median ms; ratio = ms without segment ids / ms with them (>= 0.9x is the bar; "
           "> 1x: the segment ids let the kernels skip blocks).", "",
           "| backend | shape | dtype | causal | mode | no segments ms | segments ms | ratio |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["segments"]:
      base = next(b for b in rows if not b["segments"] and all(
          b[f] == r[f] for f in ("impl", "dtype", "causal", "mode")))
      lines.append(f"| {r['impl']} | {','.join(map(str, r['shape']))} | {r['dtype']} | "
                   f"{'yes' if r['causal'] else 'no'} | {r['mode']} | {base['ms']:.3f} | "
                   f"{r['ms']:.3f} | {base['ms'] / r['ms']:.2f}x |")
  return "\n".join(lines) + "\n"


def _best(results, shape, causal, mode, cands, q, k, v, do):
  best = (0.0, None)
  for cand in cands:
    tf = _time_config(shape, causal, mode, cand, q, k, v, do)
    if tf is None:
      continue
    results.append({"shape": shape, "causal": causal, "mode": mode, "config": cand, "tflops": tf})
    if tf > best[0]:
      best = (tf, cand)
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--sweep", action="store_true")
  parser.add_argument("--sweep-mosaic", action="store_true")
  parser.add_argument("--breakdown", action="store_true",
                      help="time each Hopper kernel of a fwd+bwd step alone")
  parser.add_argument("--sweep-shapes", default="0,2", help="indices into SHAPES to sweep")
  parser.add_argument("--long", action="store_true", help="131072-token causal fwd+bwd at (1,131072,8,128)")
  parser.add_argument("--packed", action="store_true",
                      help="packed sequences (8,2048,16,128), 4 documents per row, against "
                           "no segment ids")
  parser.add_argument("--packed-backends", default="pallas_mosaic,pallas_triton",
                      help="--packed's backends")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--impls", default="jattn_mosaic,jattn_triton,cudnn,tokamax_mosaic,"
                      "jax_example_mgpu,jax_example,xla")
  parser.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
  parser.add_argument("--dtypes", default="fp16,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--stem", default="flash", help="output file stem")
  parser.add_argument("--merge", nargs="+", metavar="JSON",
                      help="combine the rows of earlier runs (same device) into --stem")
  args = parser.parse_args()
  if args.merge:
    runs = [json.load(open(path)) for path in args.merge]
    rows = [row for run in runs for row in run["rows"]]
    env = runs[0]["env"]
    write_results(args.out, args.stem, {"env": env, "rows": rows, "merged_from": args.merge},
                  markdown(rows, env))
    plot(rows, os.path.join(args.out, f"{args.stem}.png"))
    return
  env = environment()
  modes = args.modes.split(",")
  if args.breakdown:
    rows = breakdown([SHAPES[i] for i in map(int, args.shapes.split(","))])
    cols = list(rows[0])
    md = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + "".join(
        "| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
        + " |\n" for r in rows)
    write_results(args.out, "flash_mosaic_breakdown", {"env": env, "rows": rows},
                  f"# Hopper fwd+bwd breakdown (fp16), {env['device']}\n\n" + md)
    print(md)
    return
  if args.packed:
    rows = packed(args.dtypes.split(","), modes, args.packed_backends.split(","))
    md = packed_markdown(rows, env)
    write_results(args.out, f"{args.stem}_packed", {"env": env, "rows": rows}, md)
    print(md)
    return
  if args.sweep_mosaic:
    res = sweep_mosaic([SHAPES[i] for i in map(int, args.sweep_shapes.split(","))], modes)
    write_results(args.out, "flash_sweep_mosaic", {"env": env, "results": res}, "")
    return
  if args.sweep:
    res = sweep([SHAPES[i] for i in map(int, args.sweep_shapes.split(","))], modes)
    write_results(args.out, "flash_sweep", {"env": env, "results": res}, "")
    return
  if args.long:
    shape = (1, 131072, 8, 128)
    q, k, v, do = random_inputs(shape, jnp.float16)
    fn = jax_impls(True)["jattn_triton"]
    seconds, peak = time_jax_qkv(fn, "fwd+bwd", q, k, v, do)
    tf = attention_flops(*shape[:2], shape[1], *shape[2:], True, "fwd+bwd") / seconds / 1e12
    row = {"impl": "jattn_triton", "shape": list(shape), "dtype": "fp16", "causal": True,
           "mode": "fwd+bwd", "ms": seconds * 1e3, "tflops": tf, "peak_mib": peak / 2**20}
    print(_fmt_row(row))
    write_results(args.out, "flash_long", {"env": env, "rows": [row]},
                  f"# 131072-token causal fwd+bwd, {env['device']}\n\n{_fmt_row(row)}\n")
    return
  torch_impls = [] if args.no_torch else ["torch_sdpa_cudnn", "torch_sdpa_flash"]
  rows = []
  for i in map(int, args.shapes.split(",")):  # saved after each shape: a cut run keeps its rows
    rows += run_table([SHAPES[i]], args.dtypes.split(","), args.impls.split(","), modes,
                      torch_impls)
    write_results(args.out, args.stem, {"env": env, "rows": rows}, markdown(rows, env))
  plot(rows, os.path.join(args.out, f"{args.stem}.png"))
  print(markdown(rows, env))


if __name__ == "__main__":
  main()
