"""The Hopper FP8 forward (issue 41): TFLOP/s of ``jattn.flash_attention`` on
``float8_e4m3fn`` inputs against our bf16 forward and cuDNN's in the same run, on the
issue's headline shapes, causal and not; a sweep of the FP8 kernel's tiles; the V
transpose the FP8 path adds (timed apart: the kernel on V already transposed); and the
kernel's error against the float32 attention of the unquantised inputs (RMSE,
Gaussian inputs and inputs with 0.1% outliers ten times larger, with and without the
Hadamard rotation), beside the recipe reference's.

    python bench/fp8.py --label h100            # writes bench/results/fp8_h100.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import attention_flops, environment, time_jax, write_results  # noqa: E402
from bench.fp8_error import inputs, rmse  # noqa: E402
import jattn  # noqa: E402
from jattn.fp8 import (fp8_attention_reference, hadamard_rotation,  # noqa: E402
                       quantize_attention_inputs)
from jattn.kernels.flash import MosaicBlockConfig  # noqa: E402
from jattn.kernels.flash.config import default_fp8_config  # noqa: E402
from jattn.kernels.flash.mosaic import mosaic_layout  # noqa: E402
from jattn.kernels.flash.mosaic_fwd import mosaic_forward  # noqa: E402
from jattn.kernels.hopper.pipeline import eight_bit_values  # noqa: E402
from jattn.reference import flash_attention_reference  # noqa: E402

SHAPES = ((1, 16384, 16, 128), (4, 4096, 16, 128), (8, 2048, 16, 64))
# Each tiling with the default schedule (persistent where not causal) and the other one.
SWEEP = tuple(MosaicBlockConfig(block_q=bq, block_kv=bkv, stages=st)
              for bq in (64, 128) for bkv in (128, 256) for st in (2, 3))


def fp8_call(causal, config=None):
  def run(q8, k8, v8, qd, kd, vd):
    return jattn.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 causal=causal, backend="pallas_mosaic", config=config)
  return jax.jit(run)


def kernel_only(causal, config, shape):
  """The FP8 kernel on padded inputs with V already in its layout (what the op adds on
  top is the padding, a no-op at these shapes, and V's transpose)."""
  batch, seq, heads, d = shape
  _, _, _, spec = mosaic_layout(config, seq, seq, d, causal=causal, local_window=None)

  def run(q8, k8, v_t, qd, kd, vd):
    return mosaic_forward(q8, k8, v_t, spec=spec, scale=d ** -0.5, block_q=config.block_q,
                          block_kv=config.block_kv, stages=config.stages,
                          persistent=config.persistent, descales=(qd * kd, vd),
                          out_dtype=jnp.bfloat16)[0]
  return jax.jit(run)


def timed(fn, args, flops):
  try:
    t = time_jax(fn, *args)
  except Exception as e:  # noqa: BLE001 (a config the compiler refuses is a row, not a crash)
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
  return {"ms": t * 1e3, "tflops": flops / t / 1e12}


def speed(shape, causal, sweep: bool):
  batch, seq, heads, d = shape
  flops = attention_flops(batch, seq, seq, heads, d, causal, "fwd")
  q, k, v = inputs("gaussian", shape)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  fp8_args = (q8, k8, v8, qd, kd, vd)
  bf16 = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
  rows = {
      "fp8": timed(fp8_call(causal), fp8_args, flops),
      "bf16": timed(jax.jit(lambda q, k, v: jattn.flash_attention(
          q, k, v, causal=causal, backend="pallas_mosaic")), bf16, flops),
      "cudnn bf16": timed(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")), bf16, flops),
  }
  heuristic = default_fp8_config(d, masked=causal, kv_len=seq)
  v_t = eight_bit_values(v8)
  per_q_head = lambda x: jnp.repeat(x, heads // k.shape[2])
  rows["fp8 kernel only"] = timed(kernel_only(causal, heuristic, shape),
                                  (q8, k8, v_t, per_q_head(qd), per_q_head(kd),
                                   per_q_head(vd)), flops)
  row = {"shape": list(shape), "causal": causal, "heuristic": dataclasses.asdict(heuristic),
         "impls": rows}
  if sweep:
    configs = [c for base in SWEEP
               for c in (base, dataclasses.replace(base, persistent=causal))]
    row["sweep"] = [dict(dataclasses.asdict(c), **timed(fp8_call(causal, c), fp8_args, flops))
                    for c in configs]
  return row


def errors(shape=(2, 2048, 16, 128)):
  rows = []
  rotation = hadamard_rotation(shape[-1], jax.random.key(7))
  kernel = fp8_call(False)
  for kind in ("gaussian", "outliers"):
    q, k, v = inputs(kind, shape)
    exact = flash_attention_reference(q, k, v)[0]
    row = {"inputs": kind}
    for name, rot in (("per-head", None), ("per-head + rotation", rotation)):
      quantized = quantize_attention_inputs(q, k, v, rotation=rot)
      row[f"kernel {name}"] = rmse(kernel(*quantized), exact)
      row[f"reference {name}"] = rmse(fp8_attention_reference(*quantized), exact)
    rows.append(row)
  return rows


def markdown(payload) -> str:
  env = payload["environment"]
  lines = [f"# FP8 forward on {env['device']} ({payload['label']})", "",
           f"jax {env['jax']}, {env['time']}. TFLOP/s = 4·B·H·S²·D / time (halved when "
           "causal), medians of 12 timings. `fp8`: `jattn.flash_attention` on E4M3 inputs "
           "(the heuristic tiles, V transposed in the call); `fp8 kernel only`: the kernel "
           "on V already transposed; `bf16`: our Hopper forward; `cudnn bf16`: "
           "`jax.nn.dot_product_attention(implementation='cudnn')`.", "",
           "| shape | causal | fp8 | fp8 kernel only | bf16 | cudnn bf16 | fp8 / bf16 | "
           "best swept fp8 | best tiles |", "|---|---|---|---|---|---|---|---|---|"]
  for r in payload["speed"]:
    t = {k: v.get("tflops") for k, v in r["impls"].items()}
    fmt = lambda x: "n/a" if x is None else f"{x:.0f}"
    ok = [s for s in r.get("sweep", ()) if "tflops" in s]
    best = max(ok, key=lambda s: s["tflops"]) if ok else None
    ratio = f"{t['fp8'] / t['bf16']:.2f}x" if t["fp8"] and t["bf16"] else "n/a"
    tiles = (f"{best['block_q']}x{best['block_kv']}, {best['stages']} stages, persistent "
             f"{best['persistent']}" if best else "")
    lines.append(f"| {tuple(r['shape'])} | {r['causal']} | {fmt(t['fp8'])} | "
                 f"{fmt(t['fp8 kernel only'])} | {fmt(t['bf16'])} | {fmt(t['cudnn bf16'])} | "
                 f"{ratio} | {fmt(best['tflops'] if best else None)} | {tiles} |")
  lines += ["", "## Error against float32 attention of the unquantised inputs (RMSE)", "",
            "Shape (2, 2048, 16, 128), not causal; descales per KV head.", "",
            "| inputs | kernel | reference | kernel + rotation | reference + rotation |",
            "|---|---|---|---|---|"]
  for r in payload["errors"]:
    lines.append(f"| {r['inputs']} | {r['kernel per-head']:.2e} | "
                 f"{r['reference per-head']:.2e} | {r['kernel per-head + rotation']:.2e} | "
                 f"{r['reference per-head + rotation']:.2e} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--label", default="h100")
  parser.add_argument("--no-sweep", action="store_true")
  args = parser.parse_args()
  payload = {"label": args.label, "environment": environment(),
             "speed": [speed(s, c, not args.no_sweep) for s in SHAPES for c in (False, True)],
             "errors": errors()}
  write_results(args.out, f"fp8_{args.label}", payload, markdown(payload))
  print(markdown(payload))


if __name__ == "__main__":
  main()
