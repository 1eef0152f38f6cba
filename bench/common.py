"""Timing, FLOP counting and result writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import jax

from jattn.core.timing import median_ms


def attention_flops(batch, q_len, kv_len, heads, head_dim, causal, mode):
  """FLOPs as DESIGN.md counts them: fwd 4*B*H*Sq*Sk*D (halved when causal), fwd+bwd 3.5x."""
  flops = 4.0 * batch * heads * q_len * kv_len * head_dim
  if causal:
    flops /= 2
  return flops * (3.5 if mode == "fwd+bwd" else 1.0)


def time_jax(fn, *args, reps=12, inner=5):
  """Median seconds per call (``jattn.core.timing.median_ms``: warmed up, ``inner``
  calls queued between two syncs to hide dispatch)."""
  return median_ms(fn, args, reps, inner=inner) / 1e3


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


def random_inputs(shape, dtype, seed=0):
  """q, k, v and dO: four normal ``[batch, seq, heads, dim]`` arrays (never zeros)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return [jax.random.normal(key, shape, dtype) for key in keys]


def document_ids(batch: int, seq: int, documents: int, seed: int = 0):
  """``[batch, seq]`` int32 ids of ``documents`` documents of random lengths (each at
  least 1) per row: packed sequences."""
  import numpy as np

  rng = np.random.default_rng(seed)
  ids = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq), documents - 1, replace=False))
    ids[b] = np.searchsorted(cuts, np.arange(seq), side="right")
  return ids


def time_jax_qkv(fn, mode, q, k, v, do):
  """(median seconds, peak bytes) of ``jit(fn)(q, k, v)``, or for ``mode="fwd+bwd"`` of
  the forward and its VJP applied to ``do`` (cut to the output's shape where that is
  smaller: a yardstick summing shorter problems)."""
  if mode == "fwd":
    f, args = jax.jit(fn), (q, k, v)
  else:
    def f(q, k, v, do):
      out, pull = jax.vjp(fn, q, k, v)
      return pull(do[tuple(slice(0, n) for n in out.shape)])
    f, args = jax.jit(f), (q, k, v, do)
  return time_jax(f, *args), jax_peak_bytes(f, *args)


def time_torch_qkv(fn, tensors, warmup=1):
  """(median seconds, bytes) of a CUDA torch callable: the bytes are the peak allocated
  during one call after ``warmup`` calls, plus the input ``tensors`` themselves."""
  import torch

  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  base = torch.cuda.memory_allocated()
  torch.cuda.reset_peak_memory_stats()
  fn()
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated() - base
  return time_torch(fn), peak + sum(x.numel() * x.element_size() for x in tensors)


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


def results_table(rows, key_columns, cell, ratios, ratio, sort_key=None):
  """A markdown table: one line per distinct key, one column per impl, then ratios.

  ``key_columns``: ``[(header, row -> str)]`` naming a line (lines in order of first
  appearance, or sorted by ``sort_key(row)`` of their first row); ``cell(row)`` fills
  an impl's column (rows with ``"error"`` show n/a); ``ratios``: ``[(header, ours,
  peer)]``, each shown as ``ratio(ours_row, peer_row)`` where both impls were timed.
  """
  key_of = lambda r: tuple(f(r) for _, f in key_columns)
  first = {}
  for r in rows:
    first.setdefault(key_of(r), r)
  keys = sorted(first, key=lambda k: sort_key(first[k])) if sort_key else list(first)
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  ratios = [(h, a, b) for h, a, b in ratios if a in impls and b in impls]
  lines = ["| " + " | ".join([h for h, _ in key_columns] + impls + [h for h, _, _ in ratios])
           + " |", "|" + "---|" * (len(key_columns) + len(impls) + len(ratios))]
  for key in keys:
    by = {r["impl"]: r for r in rows if key_of(r) == key}
    cells = ["" if i not in by else "n/a" if "error" in by[i] else cell(by[i]) for i in impls]
    timed = lambda name: name in by and "error" not in by[name]
    shown = [ratio(by[a], by[b]) if timed(a) and timed(b) else "" for _, a, b in ratios]
    lines.append("| " + " | ".join(list(key) + cells + shown) + " |")
  return "\n".join(lines) + "\n"


def bar_chart(rows, group_of, value_of, ylabel: str, path: str, fontsize: int = 7):
  """Grouped bars, one group per ``group_of(row)`` (a label), one bar per impl."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = list(dict.fromkeys(group_of(r) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.2), 4.5))
  width = 0.8 / max(len(impls), 1)
  for n, impl in enumerate(impls):
    vals = [next((value_of(r) for r in rows if r["impl"] == impl and group_of(r) == g), 0)
            for g in groups]
    ax.bar([i + n * width for i in range(len(groups))], vals, width, label=impl)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
  ax.set_xticklabels(groups, fontsize=fontsize)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
