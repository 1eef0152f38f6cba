"""Times a fixed list of public calls in whichever ``jattn`` is importable, so two
checkouts can be compared in one device run (the drift between runs on different
days is as large as the differences we look for).

    PYTHONPATH=old_checkout python bench/ab_checkouts.py --label old --out ab.json
    python bench/ab_checkouts.py --label new --out ab.json     # appends
    python bench/ab_checkouts.py --out ab.json --summarize old > ab.md

Run the labels in mirrored order (old, new, new, old) so the GPU's drift over the run
falls on both alike; the summary gives each label's median over its runs and the
ratio to the base label.

Only public signatures are used (they are the same in every checkout since the
core landed). The script imports ``common`` from its own folder (``time_jax``, which
needs only jax), never the repository root, so ``jattn`` is the checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax
import jax.numpy as jnp

import jattn
from common import time_jax

SEGMENTS, RATES = (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def _inputs(shape, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _window_case(shape, dtype, mode):
  """Window attention as bench/window.py calls it: a relative-position bias (also
  differentiated) and a shift mask of four regions."""
  windows, tokens, heads, _ = shape
  keys = jax.random.split(jax.random.key(1), 2)
  bias = jax.random.normal(keys[0], (heads, tokens, tokens), jnp.float32)
  region = jax.random.randint(keys[1], (windows, tokens), 0, 4)
  mask = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
  fn = lambda q, k, v, bias: jattn.window_attention(q, k, v, bias, mask=mask,
                                                   backend="pallas_triton")
  return ("window", shape, dtype, mode, fn, (bias,))


def _flex_alibi(q, k, v):
  """FlexAttention with a per-head linear bias and a causal mask (bench/flex.py's ALiBi)."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, q.shape[2] + 1) / q.shape[2])
  return jattn.flex_attention(
      q, k, v, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j),
      mask_mod=lambda b, h, i, j: j <= i, backend="pallas_mosaic")


def _dot_product_bias_case(shape, dtype, mode):
  """``dot_product_attention`` with a dense bias ``[1, heads, seq, seq]`` (also
  differentiated), as bench/dot_product.py's bias case."""
  _, seq, heads, _ = shape
  bias = lambda: (jax.random.normal(jax.random.key(2), (1, heads, seq, seq), dtype),)
  fn = lambda q, k, v, bias: jattn.dot_product_attention(q, k, v, bias)
  return ("dot_product bias", shape, dtype, mode, fn, bias)


def cases():
  """(name, shape, dtype, mode, fn(q, k, v, *extra), extra): ``extra`` arrays are
  differentiated too (a function making them, for large ones: made only if run)."""
  dil = lambda causal: lambda q, k, v: jattn.dilated_attention(
      q, k, v, segment_lengths=SEGMENTS, dilation_rates=RATES, causal=causal,
      backend="pallas_triton")
  flash = lambda backend, causal: lambda q, k, v: jattn.flash_attention(
      q, k, v, causal=causal, backend=backend)
  ret = lambda mode: lambda q, k, v: jattn.retention(q, k, v, mode=mode, backend="pallas_triton")
  out = []
  for s in (65536, 131072):
    out.append(("dilated noncausal", (1, s, 8, 128), jnp.bfloat16, "fwd", dil(False)))
  out.append(("dilated causal", (1, 65536, 8, 128), jnp.bfloat16, "fwd", dil(True)))
  out.append(("flash mosaic causal", (1, 16384, 16, 128), jnp.float16, "fwd",
              flash("pallas_mosaic", True)))
  out.append(("flash mosaic noncausal", (1, 16384, 16, 128), jnp.float16, "fwd",
              flash("pallas_mosaic", False)))
  for backend in ("pallas_mosaic", "pallas_triton"):
    out.append((f"flash {backend[7:]} causal d64", (8, 2048, 16, 64), jnp.float16, "fwd",
                flash(backend, True)))
    for causal in (True, False):
      for m in ("fwd", "fwd+bwd"):
        out.append((f"flash {backend[7:]} {'causal' if causal else 'noncausal'} d128",
                    (4, 4096, 16, 128), jnp.float16, m, flash(backend, causal)))
  for mode in ("chunkwise", "parallel"):
    for m in ("fwd", "fwd+bwd"):
      out.append((f"retention {mode}", (8, 2048, 16, 128), jnp.float16, m, ret(mode)))
  for m in ("fwd", "fwd+bwd"):  # the Hopper forward with retention's row rule
    out.append(("retention mosaic parallel", (8, 2048, 16, 128), jnp.float16, m,
                lambda q, k, v: jattn.retention(q, k, v, mode="parallel",
                                                backend="pallas_mosaic")))
    out.append(("flex mosaic alibi causal", (4, 4096, 16, 128), jnp.float16, m, _flex_alibi))
  out = [case + ((),) for case in out]
  for windows in (16, 256):
    for m in ("fwd", "fwd+bwd"):
      out.append(_window_case((windows, 256, 3, 30), jnp.float32, m))
  for shape in ((4, 4096, 16, 128), (1, 16384, 16, 128)):
    for m in ("fwd", "fwd+bwd"):
      out.append(_dot_product_bias_case(shape, jnp.bfloat16, m))
  return out


def summarize(rows, base: str) -> str:
  """Markdown: per case, each label's median ms over its runs and base ms / label ms."""
  labels = list(dict.fromkeys(r["label"] for r in rows))
  if base not in labels:
    raise SystemExit(f"--summarize: no runs labelled {base!r} (labels: {', '.join(labels)})")
  runs = {}
  for r in rows:
    runs.setdefault((r["name"], tuple(r["shape"]), r["dtype"], r["mode"]), {}).setdefault(
        r["label"], []).append(r["ms"])
  others = [l for l in labels if l != base]
  lines = ["| case | shape | dtype | mode | " + " | ".join(f"{l} ms" for l in labels) + " | "
           + " | ".join(f"{base}/{l}" for l in others) + " |",
           "|---" * (4 + len(labels) + len(others)) + "|"]
  for (name, shape, dtype, mode), by_label in runs.items():
    med = {l: statistics.median(v) for l, v in by_label.items()}
    cells = [f"{med[l]:.3f} ({len(by_label[l])})" if l in med else "" for l in labels]
    ratios = [f"{med[base] / med[l]:.3f}x" if l in med and base in med else "" for l in others]
    lines.append(f"| {name} | {','.join(map(str, shape))} | {dtype} | {mode} | "
                  + " | ".join(cells + ratios) + " |")
  return "\n".join(lines) + "\n"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--label")
  ap.add_argument("--out", required=True, help="the JSON the runs append to")
  ap.add_argument("--only", default="", help="comma-separated name prefixes")
  ap.add_argument("--hlo", default="", help="write each case's compiled HLO under this folder")
  ap.add_argument("--summarize", metavar="BASE", default="",
                  help="print the runs in --out as a markdown table against label BASE")
  args = ap.parse_args()
  if args.summarize:
    print(summarize(json.load(open(args.out)), args.summarize), end="")
    return
  if not args.label:
    ap.error("--label is required to time")
  print(f"{args.label}: jattn from {os.path.dirname(jattn.__file__)}", flush=True)
  rows = json.load(open(args.out)) if os.path.exists(args.out) else []
  for name, shape, dtype, mode, fn, extra in cases():
    if args.only and not any(name.startswith(p) for p in args.only.split(",")):
      continue
    q, k, v, do = _inputs(shape, dtype)
    extra = extra() if callable(extra) else extra
    if mode == "fwd":
      f, xs = jax.jit(fn), (q, k, v, *extra)
    else:
      f = jax.jit(lambda *xs, fn=fn: jax.vjp(fn, *xs[:-1])[1](xs[-1]))  # xs: inputs, do
      xs = (q, k, v, *extra, do)
    ms = time_jax(f, *xs, reps=15) * 1e3
    if args.hlo:
      os.makedirs(args.hlo, exist_ok=True)
      tag = f"{args.label}_{name}_{shape[1]}_{mode}".replace(" ", "_").replace("+", "")
      with open(os.path.join(args.hlo, tag + ".hlo"), "w") as fh:
        fh.write(f.lower(*xs).compile().as_text())
    rows.append(dict(label=args.label, name=name, shape=list(shape),
                     dtype=jnp.dtype(dtype).name, mode=mode, ms=ms))
    print(f"{args.label:6s} {name:28s} {str(shape):22s} {mode:8s} {ms:8.3f} ms", flush=True)
  json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
  main()
