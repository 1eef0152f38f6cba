"""Runs a jattn op and its torch reference on the same random inputs and compares
outputs and gradients.

The JAX side is the op core's: the op draws its inputs for a problem
(``Op.example``), and the call, the backend and the config go through
``Op.prepare``. The inputs reach torch through the DLPack bridge, so both sides see
bit-identical tensors. What is added per op is only the torch side, in
``jattn.interop.torch_crosscheck`` (``TORCH_REFERENCES``): this module runs without
torch, and imports that one only for ``reference="torch"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.op import OPS, Op, run
from jattn.core.validation import FLOAT_DTYPES
from jattn.interop.torch_import import require_torch

# Error budget per input dtype, relative to the largest magnitude of the reference.
# (float8_e4m3fn: the FP8 recipe's probabilities round to 3 mantissa bits, so a last-bit
# difference of exp between two implementations can move one by an eighth)
TOLERANCE = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 2e-2, "float8_e4m3fn": 3e-2}


@dataclasses.dataclass(frozen=True)
class CrosscheckReport:
  """Max abs / relative error of the output and of every gradient."""

  op: str
  dtype: str
  backend: str
  device: str  # the reference: "jax", or the torch device ("cpu", "cuda")
  errors: dict[str, tuple[float, float]]  # name -> (max_abs, relative)
  tolerance: float

  @property
  def ok(self) -> bool:
    return all(rel <= self.tolerance for _, rel in self.errors.values())

  @property
  def worst(self) -> float:
    return max(rel for _, rel in self.errors.values())

  def __str__(self) -> str:
    parts = ", ".join(f"{n}: abs {a:.2e} rel {r:.2e}" for n, (a, r) in self.errors.items())
    verdict = "ok" if self.ok else "FAIL"
    return (f"{self.op} [{self.dtype}, {self.backend} vs {self.device}] {parts} "
            f"(tol {self.tolerance:.0e}) {verdict}")


def _errors(ours, ref) -> tuple[float, float]:
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  max_abs = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
  scale = float(np.max(np.abs(ref))) if ref.size else 0.0
  return max_abs, max_abs / max(scale, 1e-30)


@dataclasses.dataclass(frozen=True)
class JaxRun:
  """An op run forward and backward on drawn inputs (``run_jax_side``): what both
  references are compared with."""

  op: Op
  problem: Any
  arrays: tuple
  cotangent: Any
  out: Any
  grads: tuple  # one per ``op.diff_argnums``
  fwd_bwd: Callable[..., Any]  # jitted forward + backward of the differentiable arrays

  @property
  def diff_args(self) -> tuple:
    return tuple(self.arrays[i] for i in self.op.diff_argnums)


def _vjp_fn(op: Op, problem, arrays: tuple, backend: str):
  """``f(cotangent, *diff) -> (output, grads)``, jitted: the op's primary output and the
  gradients of its differentiable arrays."""
  call = op.prepare(problem, backend)

  def forward(*diff):
    args = list(arrays)
    for i, x in zip(op.diff_argnums, diff):
      args[i] = x
    return op.primary(op.finish(problem, run(call, tuple(args))))

  @jax.jit
  def fwd_bwd(cotangent, *diff):
    out, pull = jax.vjp(forward, *diff)
    return out, pull(cotangent)

  return forward, fwd_bwd


def op_of(name: str) -> Op:
  if name not in OPS:
    raise ValueError(f"op must be one of {sorted(OPS)}, got {name!r}")
  return OPS[name]


def run_jax_side(op_name: str, *, dtype, backend: str, seed: int, **case) -> JaxRun:
  """Draws the inputs of ``op_name`` for the problem ``case`` describes (keywords of
  its problem class) and runs it forward and backward (jitted)."""
  op = op_of(op_name)
  problem = op.problem(**case, dtype=dtype)
  key_inputs, key_cotangent = jax.random.split(jax.random.PRNGKey(seed))
  arrays = op.example(problem, key_inputs)
  forward, fwd_bwd = _vjp_fn(op, problem, arrays, backend)
  diff = tuple(arrays[i] for i in op.diff_argnums)
  out_shape = jax.eval_shape(forward, *diff)
  cotangent = jax.random.normal(key_cotangent, out_shape.shape, jnp.float32).astype(
      out_shape.dtype)
  out, grads = fwd_bwd(cotangent, *diff)
  return JaxRun(op, problem, arrays, cotangent, out, grads,
                lambda *d: fwd_bwd(cotangent, *d))


def jax_reference_errors(run: JaxRun) -> dict[str, tuple[float, float]]:
  """Errors of a JAX run against the op's pure-jnp backend, computed in float32."""
  # 16-bit inputs widen to float32; FP8 ones are the op's own dtype (its reference
  # takes them as they are)
  widen = lambda x: x is not None and jnp.dtype(x.dtype) in FLOAT_DTYPES
  problem, cotangent = run.problem, run.cotangent
  if jnp.dtype(problem.dtype) in FLOAT_DTYPES:
    problem = dataclasses.replace(problem, dtype=jnp.float32)
    cotangent = cotangent.astype(jnp.float32)
  arrays = tuple(x.astype(jnp.float32) if widen(x) else x for x in run.arrays)
  _, reference = _vjp_fn(run.op, problem, arrays, "xla")
  ref, ref_grads = reference(cotangent,
                             *(arrays[i] for i in run.op.diff_argnums))
  return _named_errors(run, ref, ref_grads)


def _named_errors(run: JaxRun, ref, ref_grads) -> dict[str, tuple[float, float]]:
  """Errors of the output and of each gradient the reference gives (None: it has none)."""
  errors = {"out": _errors(run.out, ref)}
  for i, g, g_ref in zip(run.op.diff_argnums, run.grads, ref_grads):
    if g_ref is not None:
      errors[f"d{run.op.arg_names[i]}"] = _errors(g, g_ref)
  return errors


def torch_reference_errors(run: JaxRun, torch_device: str) -> dict[str, tuple[float, float]]:
  """Errors of a JAX run against the op's torch reference on ``torch_device`` (its
  module, which imports torch, is imported now)."""
  from jattn.interop.torch_crosscheck import torch_reference

  return _named_errors(run, *torch_reference(run, torch_device))


def crosscheck(op: str = "flash_attention", *, dtype="float32", backend: str = "auto",
               seed: int = 0, reference: str = "torch", torch_device: str | None = None,
               tolerance: float | None = None, **case) -> CrosscheckReport:
  """Compares ``op`` with a reference on the same random inputs, forward and gradients.

  Args:
    op: an op of jattn's core (``jattn.gpu.ops()``: ``"flash_attention"``,
      ``"window_attention"``, ``"dilated_attention"``, ``"retention_parallel"``, ...).
    dtype: input dtype name or jnp dtype (``float32``, ``float16``, ``bfloat16``).
    backend: the jattn backend to test.
    reference: ``"torch"`` (the torch reference, inputs handed over through
      DLPack) or ``"jax"`` (the op's pure-jnp backend in float32).
    torch_device: where torch computes; default CUDA when torch sees a GPU, else CPU.
    tolerance: max relative error allowed; default ``TOLERANCE[dtype]``.
    **case: the op's problem, as keywords of its problem class, e.g.
      ``q_len=64, causal=True, segment_ids=True`` for flash attention.

  Returns:
    A :class:`CrosscheckReport`: ``.ok``, ``.errors`` (name -> (max abs, max abs
    relative to the reference's largest magnitude)); printable.
  """
  op_of(op)
  if reference not in ("torch", "jax"):
    raise ValueError(f"reference must be 'torch' or 'jax', got {reference!r}")
  dtype_name = jnp.dtype(dtype).name
  if dtype_name not in TOLERANCE:
    raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {dtype_name!r}")
  tolerance = TOLERANCE[dtype_name] if tolerance is None else tolerance
  if reference == "torch":  # said before the JAX side runs
    require_torch("crosscheck(reference='torch')")
  run = run_jax_side(op, dtype=dtype_name, backend=backend, seed=seed, **case)
  if reference == "jax":
    device, errors = "jax", jax_reference_errors(run)
  else:
    from jattn.interop.torch_crosscheck import default_torch_device

    device = torch_device or default_torch_device()
    errors = torch_reference_errors(run, device)
  return CrosscheckReport(op=op, dtype=dtype_name, backend=backend, device=device,
                          errors=errors, tolerance=tolerance)


__all__ = ["TOLERANCE", "CrosscheckReport", "crosscheck"]
