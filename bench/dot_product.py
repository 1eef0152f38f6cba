"""``jattn.dot_product_attention`` against ``jax.nn.dot_product_attention``, same GPU,
same inputs, bf16, forward and forward+backward (gradients of q, k, v, and of the
bias where there is one).

Cases at the flash headline shapes:
- ``bias``: an additive bias ``[1, heads, seq, seq]`` (a learned relative-position bias);
- ``bias_causal``: the same under ``is_causal=True``;
- ``mask``: a boolean ``[batch, 1, seq, seq]`` mask of 4 documents per row (random
  lengths, block-diagonal).

JAX's side runs as its default does (``implementation=None``: cuDNN where it takes the
call, else XLA); each row records which ran. FLOPs count the whole ``seq x seq``
product (halved when causal), so TFLOP/s compare like with like.

    python bench/dot_product.py
    python bench/dot_product.py --shapes 4,4096,16,128 --cases bias --modes fwd
    python bench/dot_product.py --triton   # and jattn on its Triton kernels alone
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (attention_flops, document_ids, environment,  # noqa: E402
                          random_inputs, results_table, time_jax, write_results)

import jattn  # noqa: E402

SHAPES = ((4, 4096, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 64))
CASES = ("bias", "bias_causal", "mask")
DOCUMENTS = 4


def case_arrays(case: str, shape, seed: int = 0):
  """``(bias, mask, is_causal)`` of a case."""
  batch, seq, heads, _ = shape
  if case.startswith("bias"):
    # drawn on the device: a [1, 16, 16k, 16k] float32 draw on the host takes minutes
    bias = jax.random.normal(jax.random.key(seed), (1, heads, seq, seq), jnp.bfloat16)
    return bias, None, case == "bias_causal"
  ids = document_ids(batch, seq, DOCUMENTS, seed)
  return None, jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :]), False


def timed(fn, mode: str, q, k, v, do, bias):
  """Median seconds of ``fn(q, k, v, bias)`` (``fwd``), or of it and its VJP of ``do``
  (gradients of q, k, v and the bias)."""
  args = (q, k, v) if bias is None else (q, k, v, bias)
  call = lambda *a: fn(*a[:3], a[3] if len(a) > 3 else None)
  if mode == "fwd":
    return time_jax(jax.jit(call), *args)

  def step(do, *args):
    return jax.vjp(call, *args)[1](do)

  return time_jax(jax.jit(step), do, *args)


def measure(row, fn, mode, q, k, v, do, bias):
  try:
    seconds = timed(fn, mode, q, k, v, do, bias)
  except Exception as e:  # noqa: BLE001 - a refused case is a result
    return dict(row, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  return dict(row, ms=seconds * 1e3, tflops=row["flops"] / seconds / 1e12)


def run(shapes, cases, modes, save, triton: bool = False):
  rows = []
  for shape, case, mode in ((s, c, m) for s in shapes for c in cases for m in modes):
    bias, mask, causal = case_arrays(case, shape)
    q, k, v, do = random_inputs(shape, jnp.bfloat16)
    base = dict(shape=list(shape), case=case, mode=mode, causal=causal,
                flops=attention_flops(*shape[:2], shape[1], *shape[2:], causal, mode))
    ours = lambda q, k, v, b: jattn.dot_product_attention(q, k, v, bias=b, mask=mask,
                                                          is_causal=causal)
    rows.append(measure(dict(base, impl="jattn", runs="jattn"), ours, mode, q, k, v, do, bias))
    if triton:
      on_triton = lambda q, k, v, b: jattn.dot_product_attention(
          q, k, v, bias=b, mask=mask, is_causal=causal, implementation="pallas_triton")
      rows.append(measure(dict(base, impl="jattn_triton", runs="pallas_triton"), on_triton,
                          mode, q, k, v, do, bias))
    for name in ("cudnn", "xla"):  # JAX's default: cuDNN where it takes the call
      theirs = lambda q, k, v, b, name=name: jax.nn.dot_product_attention(
          q, k, v, bias=b, mask=mask, is_causal=causal, implementation=name)
      row = measure(dict(base, impl="jax_nn", runs=name), theirs, mode, q, k, v, do, bias)
      if "error" not in row or name == "xla":
        break
      print(f"cudnn refused {case} {shape} {mode}: {row['error']}", flush=True)
    rows.append(row)
    print(*rows[-3 if triton else -2:], sep="\n", flush=True)
    save(rows)
  return rows


def markdown(rows):
  key = [("shape", lambda r: "x".join(map(str, r["shape"]))), ("case", lambda r: r["case"]),
         ("mode", lambda r: r["mode"])]
  ratios = [("jattn / jax.nn", "jattn", "jax_nn"),
            ("jattn / jattn on Triton", "jattn", "jattn_triton")]  # (where --triton ran)
  table = results_table(rows, key, lambda r: f"{r['tflops']:.0f} ({r['runs']})", ratios,
                        lambda a, b: f"{b['ms'] / a['ms']:.2f}x")
  return ("# jattn.dot_product_attention vs jax.nn.dot_product_attention (bf16, TFLOP/s, "
          "median)\n\n" + table)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="dot_product")
  parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES),
                      help="batch,seq,heads,head_dim;...")
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--triton", action="store_true",
                      help="also time jattn with implementation='pallas_triton'")
  args = parser.parse_args()
  shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";")]
  save = lambda rows: write_results(args.out, args.stem, {"env": environment(), "rows": rows},
                                    markdown(rows))
  run(shapes, args.cases.split(","), args.modes.split(","), save, args.triton)


if __name__ == "__main__":
  main()
