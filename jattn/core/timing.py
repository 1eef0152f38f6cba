"""Timing an op on a problem, as the autotuner and ``benchmark_backends`` do it."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from jattn.core.op import Op, run
from jattn.kernels.common.config import MODES


def median_ms(fn, args, reps: int, *, inner: int = 5, warmup_s: float = 0.1) -> float:
  """Median milliseconds per call of ``fn(*args)`` over ``reps`` samples, after one
  call that compiles. On a GPU, calls for ``warmup_s`` seconds first (a GPU idle
  through a compile runs its first calls at a lower clock; docs/backends.md), and a
  sample queues ``inner`` calls between two syncs, to hide the dispatch (one call
  where a call takes 10 ms or more: nothing to hide). Elsewhere (kernels interpreted,
  times that say nothing of a GPU's) one call per sample."""
  jax.block_until_ready(fn(*args))
  if jax.default_backend() == "gpu":
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = inner if time.perf_counter() - start < 0.01 else 1
    while time.perf_counter() - start < warmup_s:
      jax.block_until_ready(fn(*args))
  else:
    inner = 1
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return statistics.median(samples) * 1e3


def timed_call(op: Op, problem, backend: str, *, config=None, mode: str = "fwd", seed: int = 0):
  """``(fn, args)``: the jitted forward (``mode="fwd"``) or the gradients of the sum of
  the primary output (``"fwd+bwd"``) of ``op`` on random inputs for ``problem``."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  arrays = op.example(problem, jax.random.PRNGKey(seed))
  call = op.prepare(problem, backend, config)

  def forward(*diff):
    args = list(arrays)
    for i, x in zip(op.diff_argnums, diff):
      args[i] = x
    return op.primary(op.finish(problem, run(call, tuple(args))))

  diff = tuple(arrays[i] for i in op.diff_argnums)
  if mode == "fwd":
    return jax.jit(forward), diff
  loss = lambda *d: jnp.sum(forward(*d).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(diff))))), diff


def time_op(op: Op, problem, backend: str, *, config=None, mode: str = "fwd",
            reps: int = 10) -> float:
  """Median milliseconds of ``op`` on ``problem`` with ``backend`` (and ``config``)."""
  fn, args = timed_call(op, problem, backend, config=config, mode=mode)
  return median_ms(fn, args, reps)
