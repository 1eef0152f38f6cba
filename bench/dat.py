"""DAT super-resolution benchmark: our Flax DAT under ``jax.jit`` against the same
random weights in PyTorch (the torch reference in ``jattn.interop.dat_torch``, eager and
``torch.compile``), batch 1, fp32 and bf16, with compile times and the bf16-vs-fp32
PSNR of our outputs.

    python bench/dat.py                                   # DAT-2 x4, 64/128/256, fp32+bf16
    python bench/dat.py --presets DAT-2 --sizes 128 --dtypes fp32 --compile-at ""
    python bench/dat.py --presets DAT-light --sizes 16 --depth 1 --reps 2 --compile-at "" --window-xla  # CPU smoke

Writes dat.json / dat.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import environment, results_table, write_results  # noqa: E402
from jattn.interop.checkpoints import dat_from_state_dict  # noqa: E402
from jattn.interop.dat_torch import dat_torch  # noqa: E402
from jattn.nn import DAT_PRESETS  # noqa: E402
from jattn.upscale import jit_model  # noqa: E402

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def _median_seconds(fn, reps: int, sync) -> float:
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    sync(fn())
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def time_ours(state, config, dname, x, reps, *, precision="default", backend="auto"):
  """Our model under ``jax.jit``; ``precision`` is JAX's default matmul precision for
  the dense layers and convolutions ("default": TF32 on Ampere+ for float32, "highest":
  true float32); the Pallas window kernels are float32-exact either way."""
  model = dat_from_state_dict(state, dtype=DTYPES[dname], backend=backend,
                              **dataclasses.asdict(config))
  xj = jnp.asarray(x)
  with jax.default_matmul_precision(precision):
    fn = jit_model(model)
    start = time.perf_counter()
    out = jax.block_until_ready(fn(xj))
    compile_s = time.perf_counter() - start
    seconds = _median_seconds(lambda: fn(xj), reps, jax.block_until_ready)
  return seconds, compile_s, np.asarray(out)


def time_torch(reference, dname, x, reps, compiled: bool, tf32: bool = False):
  """PyTorch's defaults (float32 matmuls in IEEE float32, cuDNN convolutions in TF32),
  or with ``tf32`` matmuls in TF32 too (``torch.backends.cuda.matmul.allow_tf32``)."""
  import torch

  torch.backends.cuda.matmul.allow_tf32 = tf32

  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
  model = reference.to(device=device, dtype=dtype)
  run = torch.compile(model) if compiled else model
  xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().to(device=device, dtype=dtype)
  sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
  with torch.no_grad():
    start = time.perf_counter()
    out = run(xt)
    sync(out)
    compile_s = time.perf_counter() - start
    seconds = _median_seconds(lambda: run(xt), reps, sync)
  return seconds, compile_s, out.float().permute(0, 2, 3, 1).cpu().numpy()


def _psnr(a, b) -> float:
  mse = float(np.mean((np.clip(a, 0, 1) - np.clip(b, 0, 1)) ** 2))
  return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def markdown(rows, env):
  header = [f"# DAT x{rows[0]['upscale'] if rows else ''}, {env['device']} (jax {env['jax']}, "
            f"{env['time']})", "",
            "Median ms per image, batch 1 (first-call / compile seconds); ratio = torch ms / "
            "jattn ms (> 1: jattn faster). Same random weights in every implementation. "
            "`jattn_jit`: JAX's default precision (float32 convolutions and dense layers in "
            "TF32 on the GPU, as PyTorch's cuDNN convolutions by default); `jattn_jit_exact`: "
            "`jax.default_matmul_precision('highest')` (true float32 everywhere, as PyTorch's "
            "float32 matmuls by default; its window attention takes float32 products as three "
            "TF32 ones, relative error near 1e-7); `torch_*_tf32`: PyTorch with TF32 float32 "
            "matmuls too (`torch.backends.cuda.matmul.allow_tf32`); `jattn_jit_xla_window`: the window attention in "
            "plain XLA instead of the Pallas kernels.", ""]
  cell = lambda r: f"{r['ms']:.1f} ({r['compile_s']:.1f} s)"
  table = results_table(
      rows, [("preset", lambda r: r["preset"]), ("input", lambda r: f"{r['size']}x{r['size']}"),
             ("dtype", lambda r: r["dtype"])],
      cell=cell, ratios=[(f"{peer[6:]}/{ours[6:] or 'jattn'}", ours, peer)
                         for ours, peer in (("jattn_jit", "torch_eager"),
                                            ("jattn_jit", "torch_compile"),
                                            ("jattn_jit", "torch_eager_tf32"),
                                            ("jattn_jit", "torch_compile_tf32"),
                                            ("jattn_jit_exact", "torch_eager"),
                                            ("jattn_jit_exact", "torch_compile"))],
      ratio=lambda ours, peer: f"{peer['ms'] / ours['ms']:.2f}x")
  notes = [f"- {r['preset']} {r['size']}x{r['size']} {r['dtype']} {r['impl']}: max |jattn - "
           f"torch eager| = {r['max_abs_vs_torch']:.2e}" +
           (f", PSNR vs our fp32 = {r['psnr_vs_fp32']:.1f} dB" if "psnr_vs_fp32" in r else "")
           for r in rows if r["impl"].startswith("jattn") and "max_abs_vs_torch" in r]
  return "\n".join(header) + "\n" + table + "\n" + "\n".join(notes) + "\n"


def _cells(spec: str | None) -> set | None:
  """``"128:fp32,64:bf16"`` -> {(128, "fp32"), (64, "bf16")}; None means every cell."""
  if spec is None:
    return None
  return {(int(size), dname) for size, dname in (c.split(":") for c in spec.split(",") if c)}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="dat")
  parser.add_argument("--presets", default="DAT-2")
  parser.add_argument("--sizes", default="64,128,256")
  parser.add_argument("--dtypes", default="fp32,bf16")
  parser.add_argument("--upscale", type=int, default=4)
  parser.add_argument("--depth", type=int, help="blocks per group (smoke runs)")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--compile-at", metavar="SIZE:DTYPE,...",
                      help="run torch.compile only in these cells (default: every cell); "
                           "'' skips it (each compile takes minutes)")
  parser.add_argument("--torch-tf32", action="store_true",
                      help="also time PyTorch with TF32 float32 matmuls (fp32 cells)")
  parser.add_argument("--window-xla", action="store_true",
                      help="also time our model with the window attention in plain XLA")
  args = parser.parse_args()
  env = environment()
  compile_at = _cells(args.compile_at)
  rows = []
  for preset, size in itertools.product(args.presets.split(","), map(int, args.sizes.split(","))):
    config = dataclasses.replace(DAT_PRESETS[preset], upscale=args.upscale)
    if args.depth:
      config = dataclasses.replace(config, depth=(args.depth,) * len(config.depth))
    # img_size = the input size: the shifted-window masks are stored buffers, as in the
    # original at its training size (other sizes rebuild them on the host every call).
    reference = dat_torch(config, img_size=size)
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    x = np.random.default_rng(0).uniform(size=(1, size, size, config.in_chans)).astype(np.float32)
    ours_fp32 = None
    for dname in args.dtypes.split(","):
      base = dict(preset=preset, size=size, dtype=dname, upscale=config.upscale)
      torch_out = None
      compiling = compile_at is None or (size, dname) in compile_at
      peers = [("torch_eager", False, False)] + [("torch_compile", True, False)] * compiling
      if args.torch_tf32 and dname == "fp32":
        peers += [("torch_eager_tf32", False, True)] + [("torch_compile_tf32", True, True)] * compiling
      for name, compiled, tf32 in peers:
        try:
          seconds, compile_s, out = time_torch(dat_torch(config, img_size=size), dname, x,
                                               args.reps, compiled, tf32)
          rows.append(dict(base, impl=name, ms=seconds * 1e3, compile_s=compile_s))
          torch_out = out if name == "torch_eager" else torch_out
        except Exception as e:  # a peer that cannot run is recorded, not fatal
          rows.append(dict(base, impl=name, error=f"{type(e).__name__}: {str(e)[:160]}"))
        print(rows[-1], flush=True)
      ours = [("jattn_jit", {})]
      if dname == "fp32":
        ours.append(("jattn_jit_exact", dict(precision="highest")))
      if args.window_xla:
        ours.append(("jattn_jit_xla_window", dict(backend="xla")))
      for name, options in ours:
        seconds, compile_s, out = time_ours(state, config, dname, x, args.reps, **options)
        row = dict(base, impl=name, ms=seconds * 1e3, compile_s=compile_s)
        if torch_out is not None:
          row["max_abs_vs_torch"] = float(np.max(np.abs(out - torch_out)))
        if name == "jattn_jit_exact":
          ours_fp32 = out
        elif dname != "fp32" and ours_fp32 is not None and name == "jattn_jit":
          row["psnr_vs_fp32"] = _psnr(out, ours_fp32)
          row["max_abs_vs_fp32"] = float(np.max(np.abs(out - ours_fp32)))
        rows.append(row)
        print(row, flush=True)
        write_results(args.out, args.stem, {"env": env, "rows": rows}, markdown(rows, env))
  print(markdown(rows, env))


if __name__ == "__main__":
  main()
