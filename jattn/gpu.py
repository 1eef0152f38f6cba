"""What GPU this is, which backends it can run, and which one each op uses.

``gpu_info()`` describes the first JAX device. ``select_backend`` gives the backend
``backend="auto"`` takes for a problem of any op (and why), ``backend_choices`` says
for every backend why it would or would not run it, and ``benchmark_backends`` times
every backend that can (and can store the times, which ``"auto"`` then ranks by). All of them iterate the ops' implementations (``jattn.core.op.OPS``):
no op is special-cased here. Everything answers on a CPU-only machine too (the
backends there: ``xla``, and the Pallas kernels in interpret mode when
``JATTN_INTERPRET=1``).
"""

from __future__ import annotations

from jattn.core.device import (GPUInfo, architecture_name, current_device,
                               describe, gpu_info, interpret_mode, recommended_dtype,
                               shared_memory_limit)
from jattn.core.op import OPS, Op
from jattn.core.timing import MODES, time_op
from jattn.core.cache import save_backend_times, writable_cache_path

__all__ = ["GPUInfo", "architecture_name", "backend_choices", "benchmark_backends", "describe",
           "gpu_info", "interpret_mode", "ops", "recommended_dtype", "select_backend",
           "shared_memory_limit", "usable_backends"]


def ops() -> tuple[str, ...]:
  """The names of every op jattn has."""
  return tuple(sorted(OPS))


def usable_backends(info: GPUInfo | None = None) -> tuple[str, ...]:
  """The backends this device (``info``'s, default this machine's) runs, in ``"auto"`` order."""
  return (current_device() if info is None else info).backends


def _op(op: str) -> Op:
  if op not in OPS:
    raise ValueError(f"op must be one of {ops()}, got {op!r}")
  return OPS[op]


def select_backend(op: str = "flash_attention", *, info: GPUInfo | None = None,
                   explain: bool = False, **problem):
  """The backend ``"auto"`` uses for ``op`` on ``problem``; see docs/backends.md.

  ``problem``: keywords of the op's problem class (``jattn.flash.FlashProblem`` for
  ``"flash_attention"``: dtype, head_dim, q_len, kv_len, causal, segment_ids,
  softcap, return_lse, local_window, deterministic, ...). The answer is always a
  backend usable on ``info`` (default: this machine) that supports the problem: the
  measured fastest where the user's cache or jattn's shipped table has times for
  the problem on this GPU, else the first in the op's order. With ``explain=True``,
  ``(backend, text)``: the text says why that one (the times it compared, or that
  none were stored) and why each other backend can or cannot run the problem.
  """
  the_op = _op(op)
  the_problem = the_op.problem(**problem)
  if explain:
    return the_op.select(the_problem, info=info), the_op.explain(the_problem, info=info)
  return the_op.select(the_problem, info=info)


def backend_choices(op: str = "flash_attention", *, info: GPUInfo | None = None,
                    **problem) -> list[tuple[str, str | None]]:
  """Every backend of ``op`` in ``"auto"`` order with why it cannot run ``problem`` on
  ``info``'s device (None where it can): ``"auto"`` takes the first None."""
  return _op(op).choices(_op(op).problem(**problem), info=info)


def benchmark_backends(op: str = "flash_attention", *, mode: str = "fwd+bwd", reps: int = 10,
                       info: GPUInfo | None = None, save: bool = False,
                       **problem) -> list[dict]:
  """Times every backend of ``op`` that can run ``problem`` here; rows, fastest first.

  Each row: ``backend``, ``ms`` (``median_ms`` over ``reps`` samples of the jitted
  call on random inputs), ``speedup`` over the slowest. ``mode``: ``"fwd"`` or
  ``"fwd+bwd"`` (the gradients of the output's sum). Without ``dtype``, the device's
  ``recommended_dtype``. The timing runs on this machine; ``info`` (default: its
  description) says which backends to try. ``save=True`` (on a GPU) stores the times
  in the user cache (``jattn.core.cache``), so that ``"auto"`` takes the fastest
  backend for problems with the same key (e.g. flash attention's dtype, head dim,
  causal and length bucket); to include cuDNN for flash attention, pass
  ``deterministic=False``.
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if not (isinstance(reps, int) and not isinstance(reps, bool) and reps >= 1):
    raise ValueError(f"reps must be a positive int, got {reps!r}")
  info = gpu_info() if info is None else info
  the_op = _op(op)
  problem = the_op.problem(**{"dtype": recommended_dtype(info), **problem})
  key = the_op.speed_tuning_key(problem, info) if save else None
  if save and (not info.is_gpu or key is None):
    raise ValueError(f"save=True stores times for a GPU and a problem with a tuning key; "
                     f"this {op} problem on {info.name} has none")
  if save:
    writable_cache_path()  # before the timing, whose result would be lost
  rows = [{"backend": name, "ms": time_op(the_op, problem, name, mode=mode, reps=reps)}
          for name, reason in the_op.choices(problem, info) if reason is None]
  rows.sort(key=lambda r: r["ms"])
  slowest = max(r["ms"] for r in rows)
  for r in rows:
    r["speedup"] = slowest / r["ms"]
  if save:
    save_backend_times(key, {r["backend"]: r["ms"] for r in rows}, mode=mode)
  return rows
