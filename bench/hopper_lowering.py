"""Trace and lowering time of the Hopper kernels of one flash call, and the size of each
Mosaic GPU module, lowered for CUDA on whatever machine runs it (a CPU takes a stand-in
H100): the part of a first call that happens before the GPU compiler, and how much code
the GPU compiler is handed.

    python bench/hopper_lowering.py                       # causal fwd+bwd, (4, 4096, 16, 128) bf16
    python bench/hopper_lowering.py --noncausal --reps 5

Prints one line per repetition: seconds to trace (cold in the first only: later ones
reuse the kernels' traces), seconds to lower, and each kernel's module (forward, then the
backward's) in MB of MLIR text, as Mosaic GPU serializes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["JATTN_INTERPRET"] = "0"  # the compiled kernels' lowering, also on a CPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.mosaic.gpu import core as mosaic_core  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jattn  # noqa: E402
from jattn.core import op  # noqa: E402
from jattn.core.device import describe  # noqa: E402

H100_SMEM = 232448


def stand_in_h100() -> None:
  """Where no GPU is here: ``"pallas_mosaic"`` sees an H100, and Mosaic GPU its shared
  memory."""
  if jax.default_backend() == "gpu":
    return
  op.current_device = lambda: describe("NVIDIA H100 80GB HBM3", (9, 0),
                                       shared_memory_per_block_bytes=H100_SMEM,
                                       interpret=False)

  class Device:
    shared_memory_per_block_optin = H100_SMEM

  devices = jax.local_devices
  jax.local_devices = lambda *a, **k: devices(*a, **k) if a or k else [Device()]


def module_sizes() -> list[int]:
  """The list Mosaic GPU's modules' sizes (bytes of MLIR text) are appended to, as each
  kernel is lowered."""
  sizes = []
  serialize = mosaic_core._run_serde_pass

  def counted(module, *args, **kwargs):
    sizes.append(len(module.operation.get_asm(enable_debug_info=False)))
    return serialize(module, *args, **kwargs)

  mosaic_core._run_serde_pass = counted
  return sizes


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--noncausal", action="store_true")
  parser.add_argument("--shape", default="4,4096,16,128", help="batch,seq,heads,head_dim")
  parser.add_argument("--reps", type=int, default=3)
  args = parser.parse_args()
  stand_in_h100()
  sizes = module_sizes()
  x = jax.ShapeDtypeStruct(tuple(int(n) for n in args.shape.split(",")), jnp.bfloat16)
  for _ in range(args.reps):
    del sizes[:]
    loss = lambda q, k, v: jnp.sum(jattn.flash_attention(  # a new function: traced afresh
        q, k, v, causal=not args.noncausal, backend="pallas_mosaic").astype(jnp.float32))
    start = time.perf_counter()
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x)
    mid = time.perf_counter()
    traced.lower(lowering_platforms=("cuda",))
    end = time.perf_counter()
    print(f"trace {mid - start:.2f} s, lower {end - mid:.2f} s, modules (MB): "
          f"{[round(n / 1e6, 2) for n in sizes]}", flush=True)


if __name__ == "__main__":
  main()
