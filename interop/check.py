"""``jattn check``: every op on every backend usable here, against the pure-JAX
and torch references, on small built-in problems; prints errors and timings.

The ops, their backends and which backend can run which case all come from the op
core (``jattn.core.op.OPS``); this module only lists the cases.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp

from jattn.core.device import INTERPRET_ENV, current_device
from jattn.core.op import OPS
from jattn.core.timing import median_ms
from jattn.flex.examples import EXAMPLES
from jattn.interop.harness import (TOLERANCE, jax_reference_errors, run_jax_side,
                                   torch_reference_errors)
from jattn.interop.torch_import import torch_available

# (op, case name, problem keywords); small, so that interpret mode stays quick. The
# first flash cases allow a backward that is not bitwise repeatable: cuDNN runs them.
CASES = [
    ("flash_attention", "dense", dict(batch=2, q_len=64, q_heads=4, kv_heads=2, head_dim=32,
                                      deterministic=False)),
    ("flash_attention", "causal gqa", dict(batch=2, q_len=64, q_heads=4, kv_heads=2,
                                           head_dim=64, causal=True, deterministic=False)),
    ("flash_attention", "segments", dict(batch=2, q_len=64, q_heads=4, kv_heads=2, head_dim=32,
                                         causal=True, segment_ids=True)),
    ("flash_attention", "sq!=sk d=30", dict(batch=2, q_len=24, kv_len=70, q_heads=4, kv_heads=2,
                                            head_dim=30, causal=True)),
    ("flash_attention", "window+softcap", dict(batch=2, q_len=64, q_heads=4, kv_heads=2,
                                               head_dim=32, local_window=(16, 8), softcap=5.0)),
    ("flash_attention", "dv!=dk+sinks", dict(batch=2, q_len=64, q_heads=4, kv_heads=2,
                                             head_dim=64, value_head_dim=32, causal=True,
                                             sinks=True)),
    ("flash_attention", "dropout", dict(batch=2, q_len=64, q_heads=4, kv_heads=2, head_dim=32,
                                        causal=True, dropout_rate=0.1)),
    ("flash_attention", "lengths", dict(batch=2, q_len=24, kv_len=70, q_heads=4, kv_heads=2,
                                        head_dim=32, causal=True, lengths=True)),
    ("flash_attention", "decode", dict(batch=2, q_len=2, kv_len=70, q_heads=4, kv_heads=2,
                                       head_dim=32, causal=True, lengths=True)),
    ("flash_attention_fp8", "causal gqa", dict(batch=2, q_len=64, q_heads=4, kv_heads=2,
                                               head_dim=32, causal=True)),
    ("flash_attention_varlen", "5 sequences gqa", dict(batch=5, q_len=40, kv_len=40,
                                                     total_q=96, total_k=96, q_heads=4,
                                                     kv_heads=2, head_dim=32, causal=True)),
    ("paged_attention", "pages of 8", dict(batch=2, q_len=3, kv_len=64, q_heads=4, kv_heads=2,
                                           head_dim=32, page_size=8, causal=True)),
    ("retention_parallel", "abs_sum", dict(batch=2, q_len=40, kv_len=56, heads=3, dk=16, dv=24,
                                           normalize="abs_sum")),
    ("retention_chunkwise", "chunks of 16", dict(batch=2, q_len=50, heads=3, dk=16, dv=24,
                                                 chunk_size=16)),
    ("retention_recurrent", "with a prefix", dict(batch=2, q_len=9, kv_len=12, heads=3, dk=16,
                                                  dv=24)),
    ("retention_step", "one step", dict(batch=2, heads=3, dk=16, dv=24, initial_state=True)),
    ("window_attention", "8x8 shift d30", dict(windows=8, tokens=64, heads=2, head_dim=30,
                                               mask_windows=4)),
    *(("flex_attention", example.replace("_", " "),
       dict(example=example, batch=2, q_len=40, kv_len=48, q_heads=4, kv_heads=2, head_dim=16))
      for example in EXAMPLES),
    ("dilated_attention", "3 pairs gqa", dict(batch=2, seq=64, heads=4, kv_heads=2, head_dim=16,
                                              segment_lengths=(8, 16, 32),
                                              dilation_rates=(1, 2, 4))),
    ("dilated_attention", "causal s=50 w>s", dict(batch=2, seq=50, heads=4, kv_heads=2,
                                                  head_dim=16, causal=True,
                                                  segment_lengths=(16, 64),
                                                  dilation_rates=(2, 8))),
]


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


# The model checked against transformers' own (where torch and transformers are
# installed): a row per family and backend.
MODEL_CHECK = "LlamaForCausalLM"
CHECK_OPS = tuple(sorted({op for op, _, _ in CASES} | {MODEL_CHECK}))  # what --ops names


def _torch_errors():
  """``run -> errors`` against the torch reference, on the default torch device (the
  torch side, which imports torch, is imported now)."""
  from jattn.interop.torch_crosscheck import default_torch_device

  device = default_torch_device()
  return lambda run: torch_reference_errors(run, device)


def plan(backends=None, dtypes=None):
  """The backends and dtypes to check here, and whether Pallas runs interpreted."""
  on_gpu = current_device().is_gpu
  if backends is None:
    backends = list(current_device().backends)
    if not on_gpu and "pallas_triton" not in backends:
      backends.insert(0, "pallas_triton")  # interpret mode off-GPU
  if dtypes is None:
    # In interpret mode 16-bit math is emulated: it adds time, not coverage (the tests
    # run the 16-bit kernel paths); --dtypes asks for it.
    dtypes = ["float32", "bfloat16", "float16"] if on_gpu else ["float32"]
  return backends, dtypes, not on_gpu


def run_check(backends=None, dtypes=None, torch_reference: bool = True, reps: int = 5,
              progress=None, ops=None) -> list[CheckRow]:
  """Runs every case (of ``ops`` only, if given) on every backend that can run it;
  returns one row per (case, backend, dtype)."""
  unknown = set(ops or ()) - set(CHECK_OPS)
  if unknown:
    raise ValueError(f"unknown ops {sorted(unknown)}; known: {list(CHECK_OPS)}")
  backends, dtypes, interpret = plan(backends, dtypes)
  if interpret:
    os.environ[INTERPRET_ENV] = "1"
  torch_errors = _torch_errors() if torch_reference and torch_available() else None
  rows = []
  for op_name, case_name, case in CASES:
    if ops and op_name not in ops:
      continue
    op = OPS[op_name]
    # an op of other inputs (FP8) runs once, in its own
    takes = [d for d in dtypes if jnp.dtype(d) in op.problem_cls.input_dtypes]
    for dtype in takes or [jnp.dtype(op.problem_cls.input_dtypes[0]).name]:
      can_run = dict(op.choices(op.problem(**case, dtype=dtype)))
      for backend in backends:
        if can_run.get(backend, "not a backend of this op") is not None:
          continue
        run = run_jax_side(op_name, dtype=dtype, backend=backend, seed=0, **case)
        err_jax = max(r for _, r in jax_reference_errors(run).values())
        err_torch = None
        if torch_errors:
          err_torch = max(r for _, r in torch_errors(run).values())
        ms = median_ms(run.fwd_bwd, run.diff_args, reps)
        row = CheckRow(op_name, case_name, backend, dtype, err_jax, err_torch,
                       TOLERANCE[dtype], ms)
        rows.append(row)
        if progress:
          progress(row)
  if (torch_errors and "float32" in dtypes and (not ops or MODEL_CHECK in ops)
      and importlib.util.find_spec("transformers") is not None):
    from jattn.interop.llama_check import llama_check_rows

    def model_row(case, backend, err_jax, err_torch, ms):
      row = CheckRow(MODEL_CHECK, case, backend, "float32", err_jax, err_torch,
                     TOLERANCE["float32"], ms)
      if progress:
        progress(row)
      return row

    rows += llama_check_rows(backends, reps, model_row)
  return rows


def format_row(row: CheckRow, interpret: bool) -> str:
  backend = row.backend + ("*" if interpret and row.backend.startswith("pallas") else "")
  torch_err = "-" if row.err_torch is None else f"{row.err_torch:.1e}"
  status = "ok" if row.ok else "FAIL"
  return (f"{row.op:<19} {row.case:<15} {backend:<15} {row.dtype:<13} {row.err_jax:>9.1e} "
          f"{torch_err:>9} {row.tolerance:>7.0e} {row.ms:>10.2f}  {status}")


HEADER = (f"{'op':<19} {'case':<15} {'backend':<15} {'dtype':<13} {'err jax':>9} "
          f"{'err torch':>9} {'tol':>7} {'fwd+bwd ms':>10}  status")


def main_check(args) -> int:
  backends, dtypes, interpret = plan(args.backends or None, args.dtypes or None)
  dev = jax.devices()[0]
  print(f"jattn check on {getattr(dev, 'device_kind', dev.platform)} (jax {jax.__version__}); "
        f"backends {', '.join(backends)}; dtypes {', '.join(dtypes)}")
  if not torch_available() or args.no_torch:
    print("torch reference: skipped (" + ("--no-torch" if args.no_torch else "torch not installed")
          + ")")
  print("errors: max |ours - reference| / max |reference| over the output and every gradient")
  print(HEADER)
  reps = args.reps if args.reps is not None else (1 if interpret else 5)
  rows = run_check(backends, dtypes, torch_reference=not args.no_torch, reps=reps,
                   progress=lambda r: print(format_row(r, interpret), flush=True),
                   ops=args.ops or None)
  if interpret:
    print("* Pallas kernel in interpret mode (no GPU here): timings are not kernel speed")
  if any(r.op == MODEL_CHECK for r in rows):
    print(f"{MODEL_CHECK}: float32 logits of a tiny random model of each family; err jax "
          "against jattn's model on xla, err torch against transformers; ms: the forward")
  failed = [r for r in rows if not r.ok]
  print(f"{len(rows) - len(failed)}/{len(rows)} checks within tolerance")
  return 1 if failed else 0


__all__ = ["CASES", "CHECK_OPS", "CheckRow", "run_check", "main_check"]
