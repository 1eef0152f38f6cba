"""Timing, FLOP counting and result writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax


def attention_flops(batch, q_len, kv_len, heads, head_dim, causal, mode):
  """FLOPs as DESIGN.md counts them: fwd 4*B*H*Sq*Sk*D (halved when causal), fwd+bwd 3.5x."""
  flops = 4.0 * batch * heads * q_len * kv_len * head_dim
  if causal:
    flops /= 2
  return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def time_jax(fn, *args, reps=12, inner=5, warmup=3):
  """Median seconds per call; ``inner`` calls are queued between two syncs to hide dispatch."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return statistics.median(samples)


def time_torch(fn, reps=12, inner=5, warmup=3):
  """Median seconds per call of a CUDA torch callable, timed with CUDA events."""
  import torch

  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
      fn()
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / inner)
  return statistics.median(samples)


def jax_peak_bytes(fn, *args):
  """Arguments + outputs + temporaries of the compiled function, from XLA's memory analysis."""
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)


def environment():
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
          "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_results(out_dir, stem, payload, markdown):
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
    json.dump(payload, f, indent=1)
  with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
    f.write(markdown)
