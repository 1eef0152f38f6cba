"""flex_attention against PyTorch's FlexAttention (compiled), same GPU, same inputs.

Cases at (4, 4096, 16, 128), fp16 and bf16, forward and forward+backward (gradients
of q, k, v):
- ``alibi_causal``: ALiBi (slopes closed over, ``[heads]``) + causal mask;
- ``documents``: 4 documents per row (random lengths, ids closed over, ``[batch, seq]``);
- ``sliding_window``: causal sliding window of 1024 keys;
- ``causal``: a causal ``mask_mod``, also against our ``flash_attention(causal=True)``
  on the same kernel family.

Ours on both kernel families: ``jattn_flex`` on the Hopper (Mosaic GPU) kernels,
``jattn_flex_triton`` on the Triton ones (``jattn_flash`` / ``jattn_flash_triton`` the
same for flash attention).

Both sides build their block masks once, outside the timed calls (jattn at 64 x 64,
the finest of its kernels' tiles; torch at its default 128). Each row also records
the largest difference of the forward output from torch's.

    python bench/flex.py                       # every case, fp16 + bf16
    python bench/flex.py --cases causal --dtypes bf16 --modes fwd
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

# JAX and torch share the GPU here: no preallocation, or torch's backward runs out.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (document_ids, environment, random_inputs,  # noqa: E402
                          results_table, time_jax_qkv, time_torch_qkv, write_results)

import jattn  # noqa: E402
from jattn import flex  # noqa: E402

SHAPE = (4, 4096, 16, 128)
DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
CASES = ("alibi_causal", "documents", "sliding_window", "causal")
WINDOW = 1024
DOCUMENTS = 4
RATIOS = [("jattn_flex", "torch_flex"), ("jattn_flex_triton", "torch_flex"),
          ("jattn_flex", "jattn_flash"), ("jattn_flex_triton", "jattn_flash_triton")]
BACKENDS = {"jattn_flex": "pallas_mosaic", "jattn_flex_triton": "pallas_triton",
            "jattn_flash": "pallas_mosaic", "jattn_flash_triton": "pallas_triton"}


def jattn_case(case: str, shape, docs):
  """``(score_mod, mask_mod, batch or None, heads or None)`` for jattn."""
  heads = shape[2]
  causal = flex.causal_mask()
  if case == "alibi_causal":
    return flex.alibi_score(flex.alibi_slopes(heads)), causal, None, None
  if case == "documents":
    return None, flex.document_mask(jnp.asarray(docs)), shape[0], None
  if case == "sliding_window":
    return None, flex.sliding_window_mask(WINDOW - 1, 0), None, None
  return None, causal, None, None


def torch_case(case: str, shape, docs):
  """The same functions written for torch: ``(score_mod, mask_mod, batch or None)``."""
  import torch

  heads = shape[2]
  causal = lambda b, h, q, kv: q >= kv
  if case == "alibi_causal":
    slopes = torch.tensor(np.asarray(flex.alibi_slopes(heads)), device="cuda")
    return (lambda score, b, h, q, kv: score + slopes[h] * (kv - q)), causal, None
  if case == "documents":
    ids = torch.tensor(docs, device="cuda")
    return None, (lambda b, h, q, kv: ids[b, q] == ids[b, kv]), shape[0]
  if case == "sliding_window":
    return None, (lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW)), None
  return None, causal, None


def run_jattn(case, mode, q, k, v, do, docs, backend):
  score_mod, mask_mod, batch, heads = jattn_case(case, q.shape, docs)
  block_mask = jattn.create_block_mask(mask_mod, batch, heads, q.shape[1], k.shape[1], block=64)
  fn = lambda q, k, v: jattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                            backend=backend)
  seconds, peak = time_jax_qkv(fn, mode, q, k, v, do)
  return seconds, peak, jax.jit(fn)(q, k, v)


def run_flash(mode, q, k, v, do, backend):
  fn = lambda q, k, v: jattn.flash_attention(q, k, v, causal=True, backend=backend)
  seconds, peak = time_jax_qkv(fn, mode, q, k, v, do)
  return seconds, peak, None


def run_torch(case, mode, q, k, v, do, docs):
  import torch
  from torch.nn.attention.flex_attention import create_block_mask, flex_attention

  from jattn.interop import to_torch

  # A fresh compile per case: the cases' functions would otherwise pile up as
  # recompiles of one code object until dynamo gives up and runs unfused.
  torch._dynamo.reset()
  torch._dynamo.config.recompile_limit = 64
  qt, kt, vt, dot = (to_torch(x).permute(0, 2, 1, 3) for x in (q, k, v, do))
  qt, kt, vt = (x.detach().requires_grad_(mode != "fwd") for x in (qt, kt, vt))
  score_mod, mask_mod, batch = torch_case(case, q.shape, docs)
  block_mask = create_block_mask(mask_mod, batch, None, q.shape[1], k.shape[1], device="cuda")
  compiled = torch.compile(flex_attention)
  fwd = lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block_mask)

  def both():
    return torch.autograd.grad(fwd(), (qt, kt, vt), dot)

  seconds, peak = time_torch_qkv(fwd if mode == "fwd" else both,
                                 (qt, kt, vt) + ((dot,) if mode != "fwd" else ()))
  out = fwd().detach().permute(0, 2, 1, 3).float().cpu().numpy()
  return seconds, peak, out


def run(shape, cases, dtypes, modes, impls, save):
  """Times every (case, dtype, mode, impl); ``save(rows)`` after each row."""
  rows = []
  docs = document_ids(shape[0], shape[1], DOCUMENTS)
  for case, dname, mode in itertools.product(cases, dtypes, modes):
    q, k, v, do = random_inputs(shape, DTYPES[dname])
    outputs = {}
    for impl in impls:
      if impl.startswith("jattn_flash") and case != "causal":
        continue
      row = {"impl": impl, "case": case, "shape": list(shape), "dtype": dname, "mode": mode}
      try:
        if impl.startswith("jattn_flex"):
          seconds, peak, out = run_jattn(case, mode, q, k, v, do, docs, BACKENDS[impl])
        elif impl.startswith("jattn_flash"):
          seconds, peak, out = run_flash(mode, q, k, v, do, BACKENDS[impl])
        else:
          seconds, peak, out = run_torch(case, mode, q, k, v, do, docs)
        row.update(ms=seconds * 1e3, peak_mib=None if peak is None else peak / 2**20)
        if out is not None:
          outputs[impl] = np.asarray(out, np.float32)
      except Exception as e:  # a failing peer is recorded, not fatal
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
      if impl == "torch_flex" and "jattn_flex" in outputs and impl in outputs:
        row["max_abs_diff_vs_jattn"] = float(np.max(np.abs(outputs[impl] - outputs["jattn_flex"])))
      rows.append(row)
      print(row, flush=True)
      save(rows)
  return rows


def markdown(rows) -> str:
  table = results_table(
      rows, [("case", lambda r: r["case"]), ("dtype", lambda r: r["dtype"]),
             ("mode", lambda r: r["mode"])],
      lambda r: f"{r['ms']:.3f} ms",
      [(f"{a} vs {b}", a, b) for a, b in RATIOS],
      lambda a, b: f"{b['ms'] / a['ms']:.2f}x")
  diffs = [f"- {r['case']} {r['dtype']} {r['mode']}: {r['max_abs_diff_vs_jattn']:.2e}"
           for r in rows if "max_abs_diff_vs_jattn" in r]
  shape = tuple(rows[0]["shape"]) if rows else SHAPE
  return (f"# flex_attention vs torch FlexAttention (compiled), {shape}\n\n"
          "Median ms; ratios are peer ms / ours (> 1: ours faster).\n\n" + table +
          "\nLargest |o_torch - o_jattn| of the forward output:\n\n" + "\n".join(diffs) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="flex")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--dtypes", default="fp16,bf16")
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--impls", default="jattn_flex,jattn_flex_triton,torch_flex,jattn_flash,"
                      "jattn_flash_triton")
  parser.add_argument("--shape", default=",".join(map(str, SHAPE)),
                      help="batch,seq,heads,head_dim")
  args = parser.parse_args()
  save = lambda rows: write_results(args.out, args.stem, {"env": environment(), "rows": rows},
                                    markdown(rows))
  run(tuple(int(n) for n in args.shape.split(",")), args.cases.split(","),
      args.dtypes.split(","), args.modes.split(","), args.impls.split(","), save)


if __name__ == "__main__":
  main()
