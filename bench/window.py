"""Window attention benchmark: jattn's Pallas kernels against XLA (plain jnp, and
``jax.nn.dot_product_attention``), cuDNN where it runs, and torch SDPA, at DAT's shapes.

DAT-2's spatial attention runs 3 heads of 30 channels per branch over 8x32 = 256-token
windows; an H x W image has (H/8) * (W/32) windows per branch, each shifted block with a
mask per window.

    python bench/window.py                      # fp32 + bf16, fwd and fwd+bwd
    python bench/window.py --dtypes bf16 --modes fwd
    python bench/window.py --sweep              # tile sweep of the Pallas kernels

Writes window.json / window.md / window.png under --out (window_sweep.json / .md with
--sweep).
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

from bench.common import (bar_chart, environment, results_table, time_jax, jax_peak_bytes,  # noqa: E402
                          time_torch_qkv, write_results)
import jattn  # noqa: E402
from jattn.kernels.window import default_window_config  # noqa: E402

# (windows, tokens, heads, head_dim): DAT-2 on 64x64, 128x128 and 256x256 inputs.
SHAPES = [(16, 256, 3, 30), (64, 256, 3, 30), (256, 256, 3, 30)]
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def window_inputs(shape, dtype, seed=0):
  windows, tokens, heads, head_dim = shape
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  q, k, v, do = (jax.random.normal(kk, shape, dtype) for kk in keys[:4])
  bias = jax.random.normal(keys[4], (heads, tokens, tokens), jnp.float32)
  region = jax.random.randint(keys[5], (windows, tokens), 0, 4)  # shifted-window style
  mask = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
  return q, k, v, bias, mask, do


def _dense_bias(bias, mask, dtype):
  return (bias[None] + mask[:, None]).astype(dtype)  # [windows, heads, tokens, tokens]


def jax_impls(mask):
  def pallas(q, k, v, bias):
    return jattn.window_attention(q, k, v, bias, mask=mask, backend="pallas_triton")

  def xla_jnp(q, k, v, bias):
    # What one writes by hand in the input dtype (as DAT's PyTorch code does).
    logits = jnp.einsum("wqhd,wkhd->whqk", q * q.shape[-1] ** -0.5, k)
    p = jax.nn.softmax(logits + _dense_bias(bias, mask, q.dtype), axis=-1)
    return jnp.einsum("whqk,wkhd->wqhd", p, v)

  def dot_product_attention(implementation):
    def run(q, k, v, bias):
      return jax.nn.dot_product_attention(q, k, v, bias=_dense_bias(bias, mask, q.dtype),
                                          implementation=implementation)
    return run

  return {"jattn_pallas": pallas, "xla_jnp": xla_jnp, "jax_nn_xla": dot_product_attention("xla"),
          "cudnn": dot_product_attention("cudnn")}


def time_jax_window(fn, mode, q, k, v, bias, do):
  if mode == "fwd":
    f, args = jax.jit(fn), (q, k, v, bias)
  else:
    def f(q, k, v, bias, do):
      return jax.vjp(fn, q, k, v, bias)[1](do)
    f, args = jax.jit(f), (q, k, v, bias, do)
  return time_jax(f, *args), jax_peak_bytes(f, *args)


def time_torch_sdpa(mode, q, k, v, bias, mask, do):
  import torch
  import torch.nn.functional as F

  from jattn.interop import to_torch

  qt, kt, vt, dot = (to_torch(x).transpose(1, 2).contiguous() for x in (q, k, v, do))
  bt = to_torch(_dense_bias(bias, mask, q.dtype)).contiguous()
  qt, kt, vt, bt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt, bt))

  def fwd():
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bt)

  def both():
    return torch.autograd.grad(fwd(), (qt, kt, vt, bt), dot)

  if mode == "fwd":
    return time_torch_qkv(fwd, (qt, kt, vt, bt))
  return time_torch_qkv(both, (qt, kt, vt, bt, dot))


def _row(impl, shape, dname, mode, run):
  row = {"impl": impl, "shape": list(shape), "dtype": dname, "mode": mode}
  try:
    seconds, peak = run()
    row.update(ms=seconds * 1e3, peak_mib=None if peak is None else peak / 2**20)
  except Exception as e:  # a peer lacking a feature (cuDNN: head dim 30) is recorded
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
  desc = f"ERROR {row['error']}" if "error" in row else f"{row['ms']:9.3f} ms"
  print(f"{impl:>14} {str(tuple(shape)):>20} {dname} {mode:>7} {desc}", flush=True)
  return row


def markdown(rows, env):
  header = [f"# Window attention, {env['device']} (jax {env['jax']}, {env['time']})", "",
            "Median ms (peak MiB); ratio = peer ms / jattn ms (> 1: jattn faster). Shapes are "
            "[windows, tokens, heads, head_dim] with a bias and a per-window mask.", ""]
  mem = lambda r: "" if r.get("peak_mib") is None else f" ({r['peak_mib']:.0f})"
  peers = ("xla_jnp", "jax_nn_xla", "cudnn", "torch_sdpa")
  table = results_table(
      rows, [("shape W,T,H,D", lambda r: ",".join(map(str, r["shape"]))),
             ("dtype", lambda r: r["dtype"]), ("mode", lambda r: r["mode"])],
      cell=lambda r: f"{r['ms']:.3f}{mem(r)}",
      ratios=[(f"{peer}/jattn", "jattn_pallas", peer) for peer in peers],
      ratio=lambda ours, peer: f"{peer['ms'] / ours['ms']:.2f}x")
  return "\n".join(header) + "\n" + table


def sweep_configs(dtype_bytes: int):
  """(mode, config) pairs: forward tiles alone, then the dK/dV pair and the dQ / d(bias)
  pair of the backward one at a time around the default (the kernels are independent)."""
  base = default_window_config(32, dtype_bytes)
  for bq, bk, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2)):
    yield "fwd", dataclasses.replace(base, block_q=bq, block_k=bk, num_warps=warps,
                                     num_stages=stages)
  pairs = ((32, 32), (64, 32), (32, 64), (64, 64), (128, 64), (64, 128))
  for (bq, bk), warps in itertools.product(pairs, (4, 8)):
    yield "fwd+bwd", dataclasses.replace(base, block_q_dkv=bq, block_k_dkv=bk,
                                         bwd_num_warps=warps)
  for (bq, bk), warps in itertools.product(pairs, (4, 8)):
    yield "fwd+bwd", dataclasses.replace(base, block_q_dq=bq, block_k_dq=bk, bwd_num_warps=warps)


def _sweep_markdown(rows, env):
  best = {}
  for r in rows:
    key = (tuple(r["shape"]), r["dtype"], r["mode"])
    if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
      best[key] = r
  lines = [f"# Window-attention tile sweep, {env['device']} (jax {env['jax']}, {env['time']})",
           "", "| shape | dtype | mode | best ms | config |", "|---|---|---|---|---|"]
  lines += [f"| {','.join(map(str, k[0]))} | {k[1]} | {k[2]} | {r['ms']:.3f} | {r['config']} |"
            for k, r in best.items()]
  return "\n".join(lines) + "\n"


def run_sweep(args, env, shapes):
  """Times every ``sweep_configs`` config on ``shapes`` (default: the largest), saving
  after each one so a run cut off by its time limit keeps what it measured."""
  rows = []
  for shape, dname in itertools.product(shapes, args.dtypes.split(",")):
    q, k, v, bias, mask, do = window_inputs(shape, DTYPES[dname])
    for mode, config in sweep_configs(jnp.dtype(DTYPES[dname]).itemsize):
      fn = lambda q, k, v, b, config=config: jattn.window_attention(
          q, k, v, b, mask=mask, backend="pallas_triton", config=config)
      row = _row("jattn_pallas", shape, dname, mode,
                 lambda: time_jax_window(fn, mode, q, k, v, bias, do))
      rows.append(dict(row, config=dataclasses.asdict(config)))
      write_results(args.out, f"{args.stem}_sweep", {"env": env, "rows": rows},
                    _sweep_markdown(rows, env))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="window")
  parser.add_argument("--dtypes", default="fp32,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--windows", help="only the shapes with these window counts, e.g. 256")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--sweep", action="store_true", help="tile sweep instead of the peers")
  args = parser.parse_args()
  env = environment()
  rows = []

  def save():
    write_results(args.out, args.stem, {"env": env, "rows": rows}, markdown(rows, env))

  shapes = [s for s in SHAPES if not args.windows or str(s[0]) in args.windows.split(",")]
  if args.sweep:
    return run_sweep(args, env, shapes if args.windows else SHAPES[-1:])
  for shape, dname, mode in itertools.product(shapes, args.dtypes.split(","),
                                              args.modes.split(",")):
    q, k, v, bias, mask, do = window_inputs(shape, DTYPES[dname])
    for name, fn in jax_impls(mask).items():
      rows.append(_row(name, shape, dname, mode,
                       lambda: time_jax_window(fn, mode, q, k, v, bias, do)))
      save()
    if not args.no_torch:
      rows.append(_row("torch_sdpa", shape, dname, mode,
                       lambda: time_torch_sdpa(mode, q, k, v, bias, mask, do)))
      save()
  bar_chart([r for r in rows if "ms" in r],
            lambda r: f"{','.join(map(str, r['shape']))}\n{r['dtype']} {r['mode']}",
            lambda r: r["ms"], "ms (lower is better)", os.path.join(args.out, f"{args.stem}.png"))
  print(markdown(rows, env))


if __name__ == "__main__":
  main()
