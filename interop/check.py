"""``jattn check``: every op on every backend usable here, against the pure-JAX
and torch references, on small built-in problems; prints errors and timings."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax

from interop.harness import (TOLERANCE, default_torch_device, jax_reference_errors,
                                run_jax_side, torch_reference_errors)
from jattn.backends import INTERPRET_ENV, gpu_compute_capability, usable_backends
from jattn.gpu import flash_backend_supports

# (op, case name, case kwargs); the op's inputs default to batch 2, 4 q heads, 2 kv heads.
CASES = [
    ("flash_attention", "dense", dict(q_len=64, head_dim=32)),
    ("flash_attention", "causal gqa", dict(q_len=64, head_dim=64, causal=True)),
    ("flash_attention", "segments", dict(q_len=64, head_dim=32, causal=True, segments=True)),
    ("flash_attention", "sq!=sk d=30", dict(q_len=24, kv_len=70, head_dim=30, causal=True)),
    ("flash_attention", "window+softcap", dict(q_len=64, head_dim=32, local_window=(16, 8),
                                               softcap=5.0)),
    ("retention", "parallel abs_sum", dict(q_len=40, kv_len=56, mode="parallel",
                                           normalize="abs_sum")),
    ("retention", "chunkwise", dict(q_len=50, mode="chunkwise", chunk_size=16)),
    ("window_attention", "8x8 shift d30", dict(tokens=64, head_dim=30)),
    ("dilated_attention", "3 pairs gqa", dict(seq=64)),
    ("dilated_attention", "causal s=50 w>s", dict(seq=50, causal=True, segment_lengths=(16, 64),
                                                   dilation_rates=(2, 8))),
]
# Backends each op has; the rest are skipped for it.
OP_BACKENDS = {"retention": ("pallas_triton", "xla"), "window_attention": ("pallas_triton", "xla"),
               "dilated_attention": ("pallas_triton", "xla")}


def _supported(op: str, backend: str, dtype: str, case: dict) -> bool:
  """Whether ``backend`` computes this case (cuDNN and the Hopper kernel lack features)."""
  if op == "flash_attention":
    q_len = case["q_len"]
    return flash_backend_supports(
        backend, dtype=dtype, head_dim=case["head_dim"], q_len=q_len,
        kv_len=case.get("kv_len", q_len), causal=case.get("causal", False),
        segment_ids=case.get("segments", False), softcap="softcap" in case,
        local_window="local_window" in case)
  return backend in OP_BACKENDS.get(op, (backend,))


@dataclasses.dataclass
class CheckRow:
  op: str
  case: str
  backend: str
  dtype: str
  err_jax: float
  err_torch: float | None
  tolerance: float
  ms: float

  @property
  def ok(self) -> bool:
    errs = [self.err_jax] + ([self.err_torch] if self.err_torch is not None else [])
    return all(e <= self.tolerance for e in errs)


def _median_ms(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


def _torch_available() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


def plan(backends=None, dtypes=None):
  """The (backend, dtype) pairs to check here and whether Pallas runs interpreted."""
  on_gpu = gpu_compute_capability() is not None
  if backends is None:
    backends = list(usable_backends())
    if "pallas_triton" not in backends:
      backends.insert(0, "pallas_triton")  # interpret mode off-GPU
  if dtypes is None:
    dtypes = ["float32", "bfloat16", "float16"] if on_gpu else ["float32", "bfloat16"]
  return backends, dtypes, not on_gpu


def run_check(backends=None, dtypes=None, torch_reference: bool = True, reps: int = 5,
              progress=None, ops=None) -> list[CheckRow]:
  """Runs every case (of ``ops`` only, if given); returns one row per (case, backend,
  dtype)."""
  unknown = set(ops or ()) - {op for op, _, _ in CASES}
  if unknown:
    raise ValueError(f"unknown ops {sorted(unknown)}; known: "
                     f"{sorted({op for op, _, _ in CASES})}")
  backends, dtypes, interpret = plan(backends, dtypes)
  if interpret:
    os.environ[INTERPRET_ENV] = "1"
  use_torch = torch_reference and _torch_available()
  torch_device = default_torch_device() if use_torch else None
  rows = []
  for op, case_name, case in CASES:
    if ops and op not in ops:
      continue
    for backend in backends:
      for dtype in dtypes:
        if not _supported(op, backend, dtype, case):
          continue
        run = run_jax_side(op, dtype=dtype, backend=backend, seed=0, **case)
        err_jax = max(r for _, r in jax_reference_errors(op, run).values())
        err_torch = None
        if use_torch:
          err_torch = max(r for _, r in torch_reference_errors(op, run, torch_device).values())
        ms = _median_ms(run.fwd_bwd, run.diff_args, reps)
        row = CheckRow(op, case_name, backend, dtype, err_jax, err_torch, TOLERANCE[dtype], ms)
        rows.append(row)
        if progress:
          progress(row)
  return rows


def format_row(row: CheckRow, interpret: bool) -> str:
  backend = row.backend + ("*" if interpret and row.backend.startswith("pallas") else "")
  torch_err = "-" if row.err_torch is None else f"{row.err_torch:.1e}"
  status = "ok" if row.ok else "FAIL"
  return (f"{row.op:<16} {row.case:<15} {backend:<15} {row.dtype:<9} {row.err_jax:>9.1e} "
          f"{torch_err:>9} {row.tolerance:>7.0e} {row.ms:>10.2f}  {status}")


HEADER = (f"{'op':<16} {'case':<15} {'backend':<15} {'dtype':<9} {'err jax':>9} "
          f"{'err torch':>9} {'tol':>7} {'fwd+bwd ms':>10}  status")


def main_check(args) -> int:
  backends = args.backends.split(",") if args.backends else None
  dtypes = args.dtypes.split(",") if args.dtypes else None
  backends, dtypes, interpret = plan(backends, dtypes)
  dev = jax.devices()[0]
  print(f"jattn check on {getattr(dev, 'device_kind', dev.platform)} (jax {jax.__version__}); "
        f"backends {', '.join(backends)}; dtypes {', '.join(dtypes)}")
  if not _torch_available() or args.no_torch:
    print("torch reference: skipped (" + ("--no-torch" if args.no_torch else "torch not installed")
          + ")")
  print("errors: max |ours - reference| / max |reference| over the output and every gradient")
  print(HEADER)
  rows = run_check(backends, dtypes, torch_reference=not args.no_torch, reps=args.reps,
                   progress=lambda r: print(format_row(r, interpret), flush=True),
                   ops=args.ops.split(",") if args.ops else None)
  if interpret:
    print("* Pallas kernel in interpret mode (no GPU here): timings are not kernel speed")
  failed = [r for r in rows if not r.ok]
  print(f"{len(rows) - len(failed)}/{len(rows)} checks within tolerance")
  return 1 if failed else 0


__all__ = ["CASES", "CheckRow", "run_check", "main_check"]
