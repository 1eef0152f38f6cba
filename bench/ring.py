"""Ring attention over several GPUs: weak scaling, the longest sequence, and dilated
ring attention at a million tokens.

    python bench/ring.py                         # weak scaling, 32k tokens per GPU, hd128
    python bench/ring.py --longest               # double the sequence until too slow / OOM
    python bench/ring.py --dilated 1048576       # dilated ring, fwd and fwd+bwd
    python bench/ring.py --documents 8           # packed sequences: with segment ids vs without

Weak scaling: on the first P GPUs (P in --devices), one sequence of P x --local tokens,
sharded over the mesh axis; ``ring_attention`` runs inside ``shard_map`` on inputs
already in the layout (contiguous, or zig-zag for balanced causal), as a model would
keep them. Per-device TFLOP/s = attention FLOPs / time / P; efficiency = that over
single-GPU ``flash_attention`` on --local tokens (same mode, causal or not; the backend the
ring blocks run).

Documents: the same rings with the sequence packed with --documents documents of random
lengths (multiples of 2P; segment ids, laid out as q and k, in the plain layout and in
the per-document zig-zag), against the ring without ids; TFLOP/s count the real FLOPs
(attention within each document), so their ratio says how much of the skipped work the
ring turns into time saved.

Writes ring.json / ring.md (ring_longest.*, ring_dilated.*, ring_documents.*) under --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import (attention_flops, document_ids, environment, time_jax,  # noqa: E402
                          write_results)
from bench.dilated import RATES, SEGMENTS, dilated_flops  # noqa: E402
import jattn  # noqa: E402
from jattn.parallel import (dilated_ring_attention, ring_attention,  # noqa: E402
                            segment_zigzag_order, zigzag_order)
from jattn.parallel.blocks import ring_backend  # noqa: E402

SPEC = PartitionSpec(None, "sp", None, None)


def sharded_inputs(mesh, shape, dtype, seed=0):
  """q, k, v, dO generated on the devices, already sharded along the sequence."""
  sharding = NamedSharding(mesh, SPEC)

  @functools.partial(jax.jit, out_shardings=(sharding,) * 4)
  def make():
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(key, shape, dtype) for key in keys)

  return make()


def stacked(attend, layers: int):
  """``attend`` applied ``layers`` times, each layer's output the next one's q, k and v:
  the layers of a model in one program, which pays a program's own costs (its launch
  on every device, the collectives' first rendezvous) once for all its layers."""
  if layers == 1:
    return attend

  def run(q, k, v, *rest):
    o = attend(q, k, v, *rest)
    for _ in range(layers - 1):
      o = attend(o, o, o, *rest)
    return o

  return run


def step_fn(attend, mesh, mode, layers: int = 1):
  """jit of the sharded forward (``layers`` of them, ``stacked``), or of the forward
  and its VJP."""
  fn = jax.shard_map(stacked(attend, layers), mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC,
                     check_vma=False)
  if mode == "fwd":
    return jax.jit(fn), 3
  return jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do)), 4


def _time(fn, args, reps, inner):
  return time_jax(fn, *args, reps=reps, inner=inner)


def weak_scaling(args, env):
  rows = []
  shape1 = (1, args.local, args.heads, args.head_dim)
  for causal, mode in itertools.product((False, True), args.modes.split(",")):
    mesh1 = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q, k, v, do = sharded_inputs(mesh1, shape1, jnp.bfloat16)
    # The yardstick runs the ring blocks' kernels ("auto" may take cuDNN, no ring block).
    backend = ring_backend(q, k, v, causal=causal, scale=args.head_dim ** -0.5,
                           backend=args.backend)
    flash = lambda q, k, v: jattn.flash_attention(q, k, v, causal=causal, backend=backend)
    fn, n = step_fn(flash, mesh1, mode, args.layers)
    seconds = _time(fn, (q, k, v, do)[:n], args.reps, args.inner)
    base = args.layers * attention_flops(1, args.local, args.local, args.heads, args.head_dim,
                                         causal, mode)
    base_tflops = base / seconds / 1e12
    rows.append(dict(impl=f"flash (1 GPU, {backend})", devices=1, seq=args.local, causal=causal,
                     mode=mode, layers=args.layers, ms=seconds * 1e3,
                     tflops_per_device=base_tflops, efficiency=1.0))
    print(rows[-1], flush=True)
    layouts = args.causal_layouts.split(",") if causal else ("contiguous",)
    for devices, layout, exchange in itertools.product(
        map(int, args.devices.split(",")), layouts, args.kv_exchanges.split(",")):
      if devices > len(jax.devices()):
        continue
      mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
      seq = devices * args.local
      q, k, v, do = sharded_inputs(mesh, (1, seq, args.heads, args.head_dim), jnp.bfloat16)
      ring = functools.partial(ring_attention, axis_name="sp", causal=causal, layout=layout,
                               backend=args.backend, kv_exchange=exchange)
      fn, n = step_fn(ring, mesh, mode, args.layers)
      seconds = _time(fn, (q, k, v, do)[:n], args.reps, args.inner)
      flops = args.layers * attention_flops(1, seq, seq, args.heads, args.head_dim, causal, mode)
      per_device = flops / seconds / devices / 1e12
      rows.append(dict(impl=_impl(exchange, layout), devices=devices, seq=seq, causal=causal,
                       mode=mode, layers=args.layers, ms=seconds * 1e3,
                       tflops_per_device=per_device, efficiency=per_device / base_tflops))
      print(rows[-1], flush=True)
      write_results(args.out, args.stem, {"env": env, "rows": rows}, _markdown(rows, env, args))
  return rows


def _impl(exchange: str, layout: str) -> str:
  return f"ring {layout}" if exchange == "ring" else f"{exchange} {layout}"


def _markdown(rows, env, args):
  return _table(rows, env, "Ring attention weak scaling",
                f"{args.local} tokens per GPU, batch 1, {args.heads} heads, head dim "
                f"{args.head_dim}, bf16, backend {args.backend}, {_layers(args)}. Per-device "
                "TFLOP/s = attention FLOPs / time / GPUs; efficiency = that / single-GPU "
                "flash_attention on the per-GPU length (as many layers), on the ring blocks' "
                "backend.",
                "efficiency", lambda r: f"{100 * r['efficiency']:.0f}%")


def _layers(args) -> str:
  return ("one attention call per timed program" if args.layers == 1 else
          f"{args.layers} layers per timed program (`stacked`), ms for all of them")


def _table(rows, env, title: str, note: str, last: str, last_cell) -> str:
  """A ring table: one line per row, ``last_cell(row)`` in the ``last`` column."""
  lines = [f"# {title}, {env['device']} x{len(jax.devices())} (jax {env['jax']}, "
           f"{env['time']})", "", note, "",
           f"| impl | GPUs | seq | causal | mode | ms | TFLOP/s per GPU | {last} |",
           "|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['impl']} | {r['devices']} | {r['seq']} | {r['causal']} | {r['mode']} | "
            f"{r['ms']:.1f} | {r['tflops_per_device']:.0f} | {last_cell(r)} |" for r in rows]
  return "\n".join(lines) + "\n"


def document_flops(ids: np.ndarray, heads, head_dim, causal, mode) -> float:
  """Attention FLOPs within each document of ``ids`` (``attention_flops``' counting)."""
  lengths = np.bincount(ids[0])
  return sum(attention_flops(1, int(n), int(n), heads, head_dim, causal, mode)
             for n in lengths if n)


def split_ceiling(ids: np.ndarray, devices: int, causal: bool, layout: str) -> float:
  """The best ratio the document split allows: mean over max of the devices' real work
  (query-key pairs within documents), for ``ids [seq]`` (sorted) in the natural order,
  laid out on the devices by ``layout``. The busiest device sets a step's time."""
  seq = ids.shape[0]
  start = np.searchsorted(ids, ids, side="left")  # each token's document start (sorted ids)
  end = np.searchsorted(ids, ids, side="right")
  pairs = np.arange(seq) - start + 1 if causal else end - start  # keys each query sees
  laid = _laid_out(pairs[None], ids[None], devices, layout)
  work = np.asarray(laid)[0].reshape(devices, -1).sum(axis=1)
  return float(np.mean(work) / np.max(work))


def _laid_out(x, ids, devices: int, layout: str):
  """``x [batch, seq, ...]`` in the natural order, in ``layout`` (ids: natural order)."""
  if layout == "zigzag":
    return zigzag_order(x, devices)
  return segment_zigzag_order(x, ids, devices) if layout == "segment_zigzag" else x


def documents(args, env):
  """Per (causal, mode, GPUs, exchange): the ring without ids in the plain layout, then
  with ids in each of --document-layouts (documents' lengths multiples of 2P, so that
  every layout takes the same documents)."""
  rows = []
  ids_spec = PartitionSpec(None, "sp")
  for causal, mode, devices, exchange in itertools.product(
      [c == "causal" for c in args.document_masks.split(",")], args.modes.split(","),
      map(int, args.devices.split(",")), args.kv_exchanges.split(",")):
    if devices > len(jax.devices()):
      continue
    plain = "zigzag" if causal else "contiguous"
    layouts = [plain if layout == "plain" else layout
               for layout in args.document_layouts.split(",")]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    seq = devices * args.local
    q, k, v, do = sharded_inputs(mesh, (1, seq, args.heads, args.head_dim), jnp.bfloat16)
    grain = 2 * devices
    ids = document_ids(1, seq // grain, args.documents).repeat(grain, axis=1)
    for layout in [None] + layouts:  # None: without ids
      laid = jax.device_put(_laid_out(jnp.asarray(ids), ids, devices, layout or plain),
                            NamedSharding(mesh, ids_spec))

      def attend(q, k, v, ids):
        segments = dict(q_segment_ids=ids, kv_segment_ids=ids) if layout else {}
        return ring_attention(q, k, v, axis_name="sp", causal=causal, layout=layout or plain,
                              backend=args.backend, kv_exchange=exchange, **segments)

      fn = jax.shard_map(stacked(attend, args.layers), mesh=mesh,
                         in_specs=(SPEC,) * 3 + (ids_spec,), out_specs=SPEC, check_vma=False)
      if mode == "fwd":
        step, call_args = jax.jit(fn), (q, k, v, laid)
      else:
        step = jax.jit(lambda q, k, v, ids, do: jax.vjp(lambda *a: fn(*a, ids), q, k, v)[1](do))
        call_args = (q, k, v, laid, do)
      seconds = _time(step, call_args, args.reps, args.inner)
      flops = args.layers * (
          document_flops(ids, args.heads, args.head_dim, causal, mode) if layout
          else attention_flops(1, seq, seq, args.heads, args.head_dim, causal, mode))
      row = dict(impl=_impl(exchange, layout or plain) + (
          f" {args.documents} documents" if layout else ""), devices=devices, seq=seq,
          causal=causal, mode=mode, layers=args.layers, ms=seconds * 1e3,
          tflops_per_device=flops / seconds / devices / 1e12, backend=args.backend)
      if layout:
        dense = next(r for r in reversed(rows) if "ratio" not in r)
        row["ratio"] = row["tflops_per_device"] / dense["tflops_per_device"]
        row["ceiling"] = split_ceiling(ids[0], devices, causal, layout)
      rows.append(row)
      print(row, flush=True)
      write_results(args.out, f"{args.stem}_documents", {"env": env, "rows": rows},
                    _documents_markdown(rows, env, args))
  return rows


def _documents_markdown(rows, env, args):
  ratio = lambda r: (f"{r['ratio']:.2f}x (split: {r['ceiling']:.2f}x)" if "ratio" in r
                     else "")
  return _table(rows, env, "Ring attention on packed sequences",
                f"{args.local} tokens per GPU, {args.documents} documents of random lengths per "
                f"sequence, batch 1, {args.heads} heads, head dim {args.head_dim}, bf16, "
                f"backend {args.backend}, {_layers(args)}. TFLOP/s per GPU count real FLOPs "
                "(within documents); "
                "ratio = with ids / without; split = the best ratio the documents' split over "
                "the devices allows (mean over busiest device's real work).", "ratio", ratio)


def longest(args, env):
  """Causal zig-zag fwd+bwd on every GPU, doubling the per-GPU length until a step
  exceeds --max-seconds or fails."""
  devices = len(jax.devices())
  mesh = Mesh(np.array(jax.devices()), ("sp",))
  rows, local = [], args.local
  while True:
    seq = devices * local
    row = dict(devices=devices, seq=seq, local=local)
    try:
      q, k, v, do = sharded_inputs(mesh, (1, seq, args.heads, args.head_dim), jnp.bfloat16)
      ring = functools.partial(ring_attention, axis_name="sp", causal=True, layout="zigzag",
                               backend=args.backend)
      fn, _ = step_fn(ring, mesh, "fwd+bwd")
      stats = fn.lower(q, k, v, do).compile().memory_analysis()
      jax.block_until_ready(fn(q, k, v, do))
      t0 = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, do))
      seconds = time.perf_counter() - t0
      flops = attention_flops(1, seq, seq, args.heads, args.head_dim, True, "fwd+bwd")
      row.update(seconds=seconds, tflops_per_device=flops / seconds / devices / 1e12,
                 temp_gib_per_device=None if stats is None else stats.temp_size_in_bytes / 2**30)
    except Exception as e:
      row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    rows.append(row)
    print(row, flush=True)
    lines = [f"# Longest causal ring attention fwd+bwd, {env['device']} x{devices} "
             f"({env['time']})", "", f"batch 1, {args.heads} heads, hd {args.head_dim}, bf16, "
             "zig-zag; one timed step after a warm-up.", "",
             "| seq | per GPU | s | TFLOP/s per GPU | temp GiB per GPU |", "|---|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['local']} | " + (
        f"{r['seconds']:.2f} | {r['tflops_per_device']:.0f} | {r['temp_gib_per_device']:.2f} |"
        if "seconds" in r else f"{r['error']} | | |") for r in rows]
    write_results(args.out, f"{args.stem}_longest", {"env": env, "rows": rows},
                  "\n".join(lines) + "\n")
    if "error" in row or row["seconds"] > args.max_seconds:
      return rows
    local *= 2


PAIR_SETS = {
    "longnet": (SEGMENTS, RATES),
    # Segments up to the whole sequence: the long pairs cross devices (group rings).
    "to_full": ((2048, 16384, 131072, 1048576), (1, 4, 16, 64)),
}


def dilated(args, env):
  rows = []
  seq = args.dilated
  sets = [(name, PAIR_SETS[name]) for name in args.pair_sets.split(",")]
  for (name, (segments, rates)), devices, mode in itertools.product(
      sets, map(int, args.devices.split(",")), args.modes.split(",")):
    if devices > len(jax.devices()):
      continue
    segments = tuple(min(w, seq) for w in segments)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    row = dict(pairs=name, segments=segments, rates=rates, devices=devices, seq=seq, mode=mode)
    try:
      q, k, v, do = sharded_inputs(mesh, (1, seq, args.heads, args.head_dim), jnp.bfloat16)
      if devices == 1:  # the single-device op and its in-place kernels
        attend = functools.partial(jattn.dilated_attention, segment_lengths=segments,
                                   dilation_rates=rates, causal=True, backend=args.backend)
      else:
        attend = functools.partial(dilated_ring_attention, axis_name="sp",
                                   segment_lengths=segments, dilation_rates=rates, causal=True,
                                   backend=args.backend)
      fn, n = step_fn(attend, mesh, mode)
      seconds = _time(fn, (q, k, v, do)[:n], args.reps, args.inner)
      flops = dilated_flops(1, seq, args.heads, args.head_dim, segments, rates, True, mode)
      row.update(ms=seconds * 1e3, tflops_per_device=flops / seconds / devices / 1e12)
    except Exception as e:
      row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    rows.append(row)
    print(row, flush=True)
    lines = [f"# Dilated (ring) attention at {seq} tokens, {env['device']} ({env['time']})", "",
             f"batch 1, {args.heads} heads, hd {args.head_dim}, bf16, causal. 1 GPU: "
             "jattn.dilated_attention; more: dilated_ring_attention.", "",
             "| pairs (w; r) | GPUs | mode | ms | TFLOP/s per GPU |", "|---|---|---|---|---|"]
    lines += [f"| {r['segments']}; {r['rates']} | {r['devices']} | {r['mode']} | " + (
        f"{r['ms']:.1f} | {r['tflops_per_device']:.0f} |" if "ms" in r else f"{r['error']} | |")
        for r in rows]
    write_results(args.out, f"{args.stem}_dilated", {"env": env, "rows": rows},
                  "\n".join(lines) + "\n")
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  parser.add_argument("--stem", default="ring")
  parser.add_argument("--devices", default="1,2,4")
  parser.add_argument("--local", type=int, default=32768)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--layers", type=int, default=1,
                      help="attention layers per timed program (weak scaling, documents): "
                           "each layer's output the next one's q, k, v (stacked)")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--inner", type=int, default=2)
  parser.add_argument("--causal-layouts", default="zigzag,contiguous",
                      help="the causal rings' layouts in the weak-scaling table")
  parser.add_argument("--kv-exchanges", default="ring,allgather",
                      help="ring_attention's kv_exchange values (weak scaling, --documents)")
  parser.add_argument("--longest", action="store_true")
  parser.add_argument("--max-seconds", type=float, default=15.0)
  parser.add_argument("--dilated", type=int, help="dilated ring attention at this length")
  parser.add_argument("--pair-sets", default=",".join(PAIR_SETS),
                      help=f"with --dilated: which of {', '.join(PAIR_SETS)}")
  parser.add_argument("--documents", type=int, help="packed sequences of this many documents")
  parser.add_argument("--document-masks", default="full,causal",
                      help="--documents' rows: full (non-causal) and / or causal")
  parser.add_argument("--document-layouts", default="plain,segment_zigzag",
                      help="--documents' layouts with ids (plain: zigzag when causal, else "
                           "contiguous)")
  parser.add_argument("--backend", default="auto",
                      help="the blocks' backend (rings, the 1-GPU baseline, the dilated op)")
  args = parser.parse_args()
  env = environment()
  if args.longest:
    longest(args, env)
  elif args.dilated:
    dilated(args, env)
  elif args.documents:
    documents(args, env)
  else:
    weak_scaling(args, env)


if __name__ == "__main__":
  main()
