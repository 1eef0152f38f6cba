"""flash_attention's features beside the mask, on one GPU, peers in the same run:

- ``value_head_dim``: dk = 192, dv = 128 against our own dk = dv = 128 at the same
  shape, in TFLOP/s (FLOPs ``2 B H Sq Sk (dk + dv)`` forward, 2.5x that for the
  backward; causal halves them);
- ``dropout``: rate 0.1 against the same call without dropout (``auto``: the Hopper
  kernels on an H100; the Triton kernels alongside), and against torch's
  ``scaled_dot_product_attention`` with ``dropout_p=0.1`` on its flash backend (same
  GPU, same inputs through the DLPack bridge);
- ``sinks``: a learned sink logit per head against the same call without sinks.

    python bench/flash_features.py --out bench/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (environment, results_table, time_jax_qkv, time_torch_qkv,  # noqa: E402
                          write_results)

import jattn  # noqa: E402

DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
BATCH, SEQ, HEADS = 4, 4096, 16
RATE = 0.1


def _inputs(dk: int, dv: int, dtype, seed: int = 0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  shapes = [(BATCH, SEQ, HEADS, dk), (BATCH, SEQ, HEADS, dk), (BATCH, SEQ, HEADS, dv),
            (BATCH, SEQ, HEADS, dv)]
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(ks, shapes)]


def _flops(dk: int, dv: int, causal: bool, mode: str) -> float:
  fwd = 2.0 * BATCH * HEADS * SEQ * SEQ * (dk + dv) * (0.5 if causal else 1.0)
  return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _timed(rows, row: dict, seconds_of, flops: float | None = None):
  """Appends ``row`` with its median ms (``seconds_of()``) and TFLOP/s where ``flops``
  is given; a failure is recorded in the row, not raised."""
  try:
    seconds = seconds_of()
    row.update(ms=seconds * 1e3)
    if flops is not None:
      row.update(tflops=flops / seconds / 1e12)
  except Exception as e:  # recorded, not fatal
    row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  rows.append(row)
  print(row, flush=True)


def head_dim_rows(dtypes, modes, save, rows):
  for dname, causal, mode, (dk, dv) in itertools.product(dtypes, (False, True), modes,
                                                          ((128, 128), (192, 128))):
    q, k, v, do = _inputs(dk, dv, DTYPES[dname])
    fn = lambda q, k, v, causal=causal: jattn.flash_attention(q, k, v, causal=causal)
    row = dict(study="head_dims", impl=f"jattn_dk{dk}_dv{dv}", dtype=dname, causal=causal,
               mode=mode)
    _timed(rows, row, lambda: time_jax_qkv(fn, mode, q, k, v, do)[0],
           _flops(dk, dv, causal, mode))
    save(rows)


def dropout_rows(dtypes, modes, save, rows):
  import torch
  import torch.nn.functional as F

  from jattn.interop import to_torch

  key = jax.random.PRNGKey(1)
  for dname, causal, mode in itertools.product(dtypes, (False, True), modes):
    q, k, v, do = _inputs(128, 128, DTYPES[dname])
    qt, kt, vt, dot = (to_torch(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v, do))
    qt, kt, vt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt))
    call = lambda rate, backend: lambda q, k, v: jattn.flash_attention(
        q, k, v, causal=causal, dropout_rate=rate, dropout_key=key, backend=backend)
    impls = {"jattn_dropout": call(RATE, "auto"), "jattn_no_dropout": call(0.0, "auto"),
             "jattn_triton_dropout": call(RATE, "pallas_triton"),
             "jattn_triton_no_dropout": call(0.0, "pallas_triton")}
    for name, fn in impls.items():
      _timed(rows, dict(study="dropout", impl=name, dtype=dname, causal=causal, mode=mode),
             lambda: time_jax_qkv(fn, mode, q, k, v, do)[0])

    def torch_seconds(p):
      with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        fwd = lambda: F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)
        run = fwd if mode == "fwd" else (lambda: torch.autograd.grad(fwd(), (qt, kt, vt), dot))
        return time_torch_qkv(run, (qt, kt, vt))[0]

    for name, p in (("torch_sdpa_dropout", RATE), ("torch_sdpa_no_dropout", 0.0)):
      _timed(rows, dict(study="dropout", impl=name, dtype=dname, causal=causal, mode=mode),
             lambda: torch_seconds(p))
    save(rows)


def sink_rows(dtypes, modes, save, rows):
  sinks = jax.random.normal(jax.random.PRNGKey(2), (HEADS,), jnp.float32)
  for dname, causal, mode in itertools.product(dtypes, (False, True), modes):
    q, k, v, do = _inputs(128, 128, DTYPES[dname])
    for name, s in (("jattn_sinks", sinks), ("jattn_no_sinks", None)):
      fn = lambda q, k, v, s=s: jattn.flash_attention(q, k, v, causal=causal, sinks=s)
      _timed(rows, dict(study="sinks", impl=name, dtype=dname, causal=causal, mode=mode),
             lambda: time_jax_qkv(fn, mode, q, k, v, do)[0])
    save(rows)


def markdown(rows) -> str:
  key = [("dtype", lambda r: r["dtype"]), ("causal", lambda r: str(r["causal"])),
         ("mode", lambda r: r["mode"])]
  heads = [r for r in rows if r["study"] == "head_dims"]
  drops = [r for r in rows if r["study"] == "dropout"]
  sinks = [r for r in rows if r["study"] == "sinks"]
  out = [f"# flash_attention features, ({BATCH}, {SEQ}, {HEADS}), one GPU\n"]
  if heads:
    out += ["## dk = 192, dv = 128 against dk = dv = 128 (TFLOP/s; ratio > 1: dk192 faster "
            "per FLOP)\n",
            results_table(heads, key, lambda r: f"{r['tflops']:.0f} TFLOP/s ({r['ms']:.3f} ms)",
                          [("dk192/dv128 vs dk=dv=128", "jattn_dk192_dv128",
                            "jattn_dk128_dv128")],
                          lambda a, b: f"{a['tflops'] / b['tflops']:.2f}x")]
  if drops:
    out += [f"## dropout {RATE} (median ms; ratio = peer ms / ours, > 1: ours faster)\n",
            results_table(drops, key, lambda r: f"{r['ms']:.3f} ms",
                          [("vs no dropout", "jattn_dropout", "jattn_no_dropout"),
                           ("vs torch SDPA dropout", "jattn_dropout", "torch_sdpa_dropout"),
                           ("Triton: vs no dropout", "jattn_triton_dropout",
                            "jattn_triton_no_dropout")],
                          lambda a, b: f"{b['ms'] / a['ms']:.2f}x")]
  if sinks:
    out += ["## sinks (median ms; ratio = without / with, 1.00x: free)\n",
            results_table(sinks, key, lambda r: f"{r['ms']:.3f} ms",
                          [("vs no sinks", "jattn_sinks", "jattn_no_sinks")],
                          lambda a, b: f"{b['ms'] / a['ms']:.3f}x")]
  return "\n".join(out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="flash_features")
  parser.add_argument("--studies", default="head_dims,dropout,sinks")
  parser.add_argument("--dtypes", default="fp16,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--keep-other-studies", action="store_true",
                      help="keep the rows of the studies not run now from the existing results "
                           "(a run split over several device calls)")
  args = parser.parse_args()
  rows = []
  studies = args.studies.split(",")
  existing = os.path.join(args.out, f"{args.stem}.json")
  if args.keep_other_studies and os.path.exists(existing):
    with open(existing) as f:
      rows = [r for r in json.load(f)["rows"] if r["study"] not in studies]
  save = lambda rows: write_results(args.out, args.stem, {"env": environment(), "rows": rows},
                                    markdown(rows))
  dtypes, modes = args.dtypes.split(","), args.modes.split(",")
  if "head_dims" in studies:
    head_dim_rows(dtypes, modes, save, rows)
  if "dropout" in studies:
    dropout_rows(dtypes, modes, save, rows)
  if "sinks" in studies:
    sink_rows(dtypes, modes, save, rows)


if __name__ == "__main__":
  main()
