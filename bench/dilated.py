"""Dilated attention benchmark (one GPU): jattn's Pallas kernels against the same
computation in plain XLA (gather the dilated rows, dense attention per segment in the
input dtype with float32 softmax, scatter, mix) and against our flash kernel on the
equivalent gathered problem (gather, ``flash_attention(return_lse=True)`` per pair,
scatter, mix), at LongNet's pairs ``w = [2048, 4096, 8192, 16384]``, ``r = [1, 2, 4,
8]``. ``jattn_mosaic``: our Hopper kernels (the backward on each pair's rows in place);
``flash_pairs``: the pairs' FLOPs as plain flash calls (issue 42's yardstick).

    python bench/dilated.py                          # seq 32k-256k, bf16, fwd and fwd+bwd
    python bench/dilated.py --seqs 65536 --causal 0,1
    python bench/dilated.py --sweep                  # Pallas tile sweep at 64k

Writes dilated.json / dilated.md / dilated.png under --out. Effective TFLOP/s count
the pairs' attention work: ``Σ_i 4 B H (S / r_i) (w_i / r_i) D`` forward (halved when
causal), 3.5x that forward+backward.
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

from bench.common import (bar_chart, environment, random_inputs,  # noqa: E402
                          results_table, time_jax_qkv, write_results)
import jattn  # noqa: E402
from jattn.kernels.common.config import default_block_config  # noqa: E402
from jattn.reference import dilated_positions  # noqa: E402

SEGMENTS, RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def dilated_flops(batch, seq, heads, head_dim, segments, rates, causal, mode):
  flops = sum(4.0 * batch * heads * (seq / r) * (min(w, seq) / r) * head_dim
              for w, r in zip(segments, rates))
  return flops / (2 if causal else 1) * (3.5 if mode == "fwd+bwd" else 1.0)


def _gather(x, pos, heads):
  """``x [b, S, kv_heads, D]`` at ``pos [n, rows, heads]`` -> ``[b, n, rows, heads, D]``."""
  group = heads // x.shape[2]
  return x[:, pos, jnp.arange(heads) // group]


def _mix(outs, lses, q):
  """Scattered per-pair ``(o [b, S, h, D], lse [b, S, h])`` mixed by softmax of lse."""
  lses = jnp.stack(lses)
  weights = jax.nn.softmax(lses, axis=0)[..., None]
  return sum(w * o for w, o in zip(weights, outs)).astype(q.dtype)


def _scatter(o, lse, pos, seq, heads):
  """``o [b, n, rows, h, D]``, ``lse [b, n, rows, h]`` back to positions (unique per head)."""
  b, d = o.shape[0], o.shape[-1]
  h_idx = jnp.arange(heads)
  o_full = jnp.zeros((b, seq, heads, d), o.dtype).at[:, pos, h_idx].set(o)
  lse_full = jnp.full((b, seq, heads), -1e30, jnp.float32).at[:, pos, h_idx].set(lse)
  return o_full, lse_full


def xla_dilated(q, k, v, *, causal):
  """Gather + dense attention per pair in plain XLA (``seq`` a multiple of every w)."""
  batch, seq, heads, head_dim = q.shape
  outs, lses = [], []
  for w, r in zip(SEGMENTS, RATES):
    pos = dilated_positions(seq, heads, min(w, seq), r)
    qs, ks, vs = (_gather(x, pos, heads) for x in (q, k, v))
    logits = jnp.einsum("bnqhd,bnkhd->bnhqk", qs, ks,
                        preferred_element_type=jnp.float32) * head_dim ** -0.5
    if causal:
      rows = jnp.arange(pos.shape[1])
      logits = jnp.where(rows[None, :] <= rows[:, None], logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - top)
    total = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bnhqk,bnkhd->bnqhd", p.astype(q.dtype), vs,
                   preferred_element_type=jnp.float32)
    o = o / jnp.moveaxis(total, 2, 3)
    lse = jnp.moveaxis((top + jnp.log(total))[..., 0], 2, 3)
    o_full, lse_full = _scatter(o, lse, pos, seq, heads)
    outs.append(o_full)
    lses.append(lse_full)
  return _mix(outs, lses, q)


def flash_gathered(q, k, v, *, causal):
  """Our flash kernel on the gathered problem: per pair, the dilated rows of every
  segment as a batch of dense sequences."""
  batch, seq, heads, head_dim = q.shape
  outs, lses = [], []
  for w, r in zip(SEGMENTS, RATES):
    pos = dilated_positions(seq, heads, min(w, seq), r)
    n, rows = pos.shape[:2]
    qs, ks, vs = (_gather(x, pos, heads).reshape(batch * n, rows, heads, head_dim)
                  for x in (q, k, v))
    o, lse = jattn.flash_attention(qs, ks, vs, causal=causal, return_lse=True,
                                   backend="pallas_triton")
    o_full, lse_full = _scatter(o.reshape(batch, n, rows, heads, head_dim).astype(jnp.float32),
                                jnp.moveaxis(lse, 1, 2).reshape(batch, n, rows, heads), pos,
                                seq, heads)
    outs.append(o_full)
    lses.append(lse_full)
  return _mix(outs, lses, q)


def jattn_dilated(config=None, backend="pallas_triton"):
  """Our Pallas kernels, with ``config`` (a sweep candidate) if given."""
  def run(q, k, v, *, causal):
    return jattn.dilated_attention(q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES,
                                   causal=causal, backend=backend, config=config)
  return run


def flash_pairs(q, k, v, *, causal):
  """The pairs' FLOPs as plain flash calls (``backend="auto"``: Hopper's on an H100):
  pair ``(w, r)`` is ``seq / w`` segments of ``w / r`` rows, here the first ``seq / r``
  positions cut into such segments, no gather. The bar's yardstick, not dilated
  attention."""
  batch, seq, heads, head_dim = q.shape
  out = 0.0
  for w, r in zip(SEGMENTS, RATES):
    w = min(w, seq)
    cut = lambda x: x[:, :seq // r].reshape(batch * seq // w, w // r, x.shape[2], head_dim)
    o = jattn.flash_attention(cut(q), cut(k), cut(v), causal=causal)
    out = out + o.reshape(batch, seq // r, heads, head_dim)[:, :seq // RATES[-1]]
  return out


IMPLS = {"jattn_pallas": jattn_dilated(), "jattn_mosaic": jattn_dilated(backend="pallas_mosaic"),
         "flash_pairs": flash_pairs, "xla_gather_dense": xla_dilated,
         "flash_gathered": flash_gathered}


def _row(impl, shape, dname, mode, causal, run):
  row = {"impl": impl, "shape": list(shape), "dtype": dname, "mode": mode, "causal": causal}
  try:
    seconds, peak = run()
    batch, seq, heads, head_dim = shape
    flops = dilated_flops(batch, seq, heads, head_dim, SEGMENTS, RATES, causal, mode)
    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12,
               peak_mib=None if peak is None else peak / 2**20)
  except Exception as e:  # out of memory for the dense XLA version at long sequences
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  desc = f"ERROR {row['error']}" if "error" in row else f"{row['ms']:9.3f} ms"
  print(f"{impl:>16} {str(tuple(shape)):>24} {dname} {mode:>7} causal={causal} {desc}",
        flush=True)
  return row


def markdown(rows, env):
  header = [f"# Dilated attention, {env['device']} (jax {env['jax']}, {env['time']})", "",
            f"LongNet pairs w={list(SEGMENTS)}, r={list(RATES)}. Median ms (effective "
            "TFLOP/s, peak MiB); ratio = peer ms / jattn ms (> 1: jattn faster).", ""]
  mem = lambda r: "" if r.get("peak_mib") is None else f", {r['peak_mib']:.0f}"
  table = results_table(
      rows, [("shape B,S,H,D", lambda r: ",".join(map(str, r["shape"]))),
             ("dtype", lambda r: r["dtype"]), ("causal", lambda r: str(r["causal"])),
             ("mode", lambda r: r["mode"])],
      cell=lambda r: f"{r['ms']:.2f} ({r['tflops']:.0f}{mem(r)})",
      ratios=[(f"{peer}/jattn", "jattn_pallas", peer)
              for peer in ("xla_gather_dense", "flash_gathered")]
      + [("jattn_pallas/jattn_mosaic", "jattn_mosaic", "jattn_pallas"),
         ("flash_pairs/jattn_mosaic (the bar: >= 0.85)", "jattn_mosaic", "flash_pairs")],
      ratio=lambda ours, peer: f"{peer['ms'] / ours['ms']:.2f}x")
  return "\n".join(header) + "\n" + table


def run_sweep(args, env):
  """Forward tiles first; then the backward's dK/dV tiles, then its dQ tiles, each
  around the best so far (the kernels are independent). Saves after every config."""
  rows = []
  shape = (1, int(args.seqs.split(",")[0]), args.heads, args.head_dim)
  dname = args.dtypes.split(",")[0]
  q, k, v, do = random_inputs(shape, DTYPES[dname])
  best = default_block_config(args.head_dim, jnp.dtype(DTYPES[dname]).itemsize)
  launches = ((4, 2), (8, 2), (8, 3))
  stages = [
      ("fwd", [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
               for bq, bk, (w, s) in itertools.product((64, 128), (32, 64, 128), launches)]),
      ("fwd+bwd", [dict(block_q_dkv=bq, block_k_dkv=bk, bwd_num_warps=w, bwd_num_stages=s)
                   for bq, bk, (w, s) in itertools.product((32, 64, 128), (64, 128), launches)]),
      ("fwd+bwd", [dict(block_q_dq=bq, block_k_dq=bk)
                   for bq, bk in itertools.product((64, 128), (32, 64, 128))]),
  ]
  for mode, changes in stages:
    timed = []
    for change in changes:
      config = dataclasses.replace(best, **change)
      fn = jattn_dilated(config)
      row = _row("jattn_pallas", shape, dname, mode, False, lambda: time_jax_qkv(
          lambda q, k, v: fn(q, k, v, causal=False), mode, q, k, v, do))
      rows.append(dict(row, config=dataclasses.asdict(config)))
      if "ms" in row:
        timed.append((row["ms"], config))
      lines = [f"# Dilated tile sweep, {env['device']} ({env['time']}), shape {shape} {dname}",
               "", "| mode | ms | config |", "|---|---|---|"]
      lines += [f"| {r['mode']} | {r.get('ms', float('nan')):.3f} | {r['config']} |"
                for r in rows]
      write_results(args.out, f"{args.stem}_sweep", {"env": env, "rows": rows},
                    "\n".join(lines) + "\n")
    best = min(timed, key=lambda t: t[0])[1] if timed else best
  print("best", best)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="dilated")
  parser.add_argument("--seqs", default="32768,65536,131072,262144")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtypes", default="bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--causal", default="0,1")
  parser.add_argument("--impls", default=",".join(IMPLS))
  parser.add_argument("--sweep", action="store_true", help="tile sweep at the first seq")
  args = parser.parse_args()
  env = environment()
  if args.sweep:
    return run_sweep(args, env)
  rows = []
  for seq, dname, causal, mode in itertools.product(
      map(int, args.seqs.split(",")), args.dtypes.split(","),
      (bool(int(c)) for c in args.causal.split(",")), args.modes.split(",")):
    shape = (1, seq, args.heads, args.head_dim)
    q, k, v, do = random_inputs(shape, DTYPES[dname])
    for name in args.impls.split(","):
      fn = IMPLS[name]
      rows.append(_row(name, shape, dname, mode, causal, lambda: time_jax_qkv(
          lambda q, k, v: fn(q, k, v, causal=causal), mode, q, k, v, do)))
      write_results(args.out, args.stem, {"env": env, "rows": rows}, markdown(rows, env))
  bar_chart([r for r in rows if "ms" in r],
            lambda r: f"S={r['shape'][1] // 1024}k {'causal' if r['causal'] else ''}\n{r['mode']}",
            lambda r: r["ms"], "ms (lower is better)", os.path.join(args.out, f"{args.stem}.png"))
  print(markdown(rows, env))


if __name__ == "__main__":
  main()
