"""Runs a jattn op and its torch reference on the same random inputs and compares
outputs and gradients.

The JAX side is the op core's: the op draws its inputs for a problem
(``Op.example``), and the call, the backend and the config go through
``Op.prepare``. The inputs reach torch through the DLPack bridge, so both sides see
bit-identical tensors. What this module adds per op is only the torch side
(``TORCH_REFERENCES``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.op import OPS, Op, run
from jattn.kernels.common.dropout import keep_mask
from jattn.interop.dlpack import to_torch
from jattn.interop.torch_reference import (flash_attention_torch, flex_attention_torch,
                                           retention_step_torch, retention_torch,
                                           window_attention_torch)

# Error budget per input dtype, relative to the largest magnitude of the reference.
TOLERANCE = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 2e-2}


def _retention(p, q, k, v, decay, state):
  if p.initial_state:
    raise ValueError("the torch retention reference starts from a zero state")
  return retention_torch(q, k, v, decay=decay, scale=p.scale, normalize=p.normalize)


def _flex(p, q, k, v, *arrays):
  if p.example is None:
    raise ValueError("the torch reference of flex_attention covers the named examples "
                     "(jattn.flex.examples) only")
  return flex_attention_torch(q, k, v, example=p.example, scale=p.scale)


def _dilated(p, q, k, v):
  # longnet_torch defines torch modules, so it imports torch: only when it is needed.
  from jattn.interop.longnet_torch import dilated_attention_torch

  return dilated_attention_torch(q, k, v, p.segment_lengths, p.dilation_rates,
                                 causal=p.causal, scale=p.scale)


# op name -> ``fn(problem, *tensors)`` giving the op's primary output in torch; the
# tensors are the op's arrays (``Op.arg_names``), None where the op has none.
def _dropout_keep(p, seed, device):
  """jattn's dropout keep-mask of a flash problem as a torch tensor (None without
  dropout): torch's own RNG could not draw the same one."""
  if not p.dropout_rate:
    return None
  import torch

  b, h, q, k = (np.arange(n).reshape(shape) for n, shape in (
      (p.batch, (-1, 1, 1, 1)), (p.q_heads, (1, -1, 1, 1)), (p.q_len, (1, 1, -1, 1)),
      (p.kv_len, (1, 1, 1, -1))))
  keep = keep_mask(jnp.asarray(seed.cpu().numpy()), p.dropout_rate, b, h, q, k)
  return torch.as_tensor(np.array(keep)).to(device)


TORCH_REFERENCES: dict[str, Callable[..., Any]] = {
    "flash_attention": lambda p, q, k, v, q_seg, kv_seg, sinks, seed: flash_attention_torch(
        q, k, v, causal=p.causal, scale=p.scale, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        local_window=p.local_window, softcap=p.softcap, sinks=sinks,
        dropout_keep=_dropout_keep(p, seed, q.device), dropout_rate=p.dropout_rate),
    "window_attention": lambda p, q, k, v, bias, mask: window_attention_torch(
        q, k, v, bias, mask=mask, scale=p.scale),
    "dilated_attention": _dilated,
    "flex_attention": _flex,
    "retention_parallel": _retention,
    "retention_chunkwise": _retention,
    "retention_recurrent": _retention,
    "retention_step": lambda p, q, k, v, state, decay: retention_step_torch(
        q, k, v, state, decay=decay, scale=p.scale)[0],
}


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


def _as_numpy(tensor) -> np.ndarray:
  return tensor.detach().float().cpu().numpy()


@dataclasses.dataclass(frozen=True)
class _JaxRun:
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


def run_jax_side(op_name: str, *, dtype, backend: str, seed: int, **case) -> _JaxRun:
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
  return _JaxRun(op, problem, arrays, cotangent, out, grads,
                 lambda *d: fwd_bwd(cotangent, *d))


def jax_reference_errors(run: _JaxRun) -> dict[str, tuple[float, float]]:
  """Errors of a JAX run against the op's pure-jnp backend, computed in float32."""
  problem = dataclasses.replace(run.problem, dtype=jnp.float32)
  arrays = tuple(x.astype(jnp.float32) if x is not None and jnp.issubdtype(
      x.dtype, jnp.floating) else x for x in run.arrays)
  _, reference = _vjp_fn(run.op, problem, arrays, "xla")
  ref, ref_grads = reference(run.cotangent.astype(jnp.float32),
                             *(arrays[i] for i in run.op.diff_argnums))
  return _named_errors(run, ref, ref_grads)


def _named_errors(run: _JaxRun, ref, ref_grads) -> dict[str, tuple[float, float]]:
  """Errors of the output and of each gradient the reference gives (None: it has none)."""
  errors = {"out": _errors(run.out, ref)}
  for i, g, g_ref in zip(run.op.diff_argnums, run.grads, ref_grads):
    if g_ref is not None:
      errors[f"d{run.op.arg_names[i]}"] = _errors(g, g_ref)
  return errors


def torch_reference_errors(run: _JaxRun, torch_device: str):
  """Errors of a JAX run against the op's torch reference on ``torch_device``."""
  import torch

  def tensor(x):
    if x is None:
      return None
    return (to_torch(x) if isinstance(x, jax.Array) else torch.as_tensor(np.asarray(x))).to(
        torch_device)

  tensors = [tensor(x) for x in run.arrays]
  for i in run.op.diff_argnums:
    if tensors[i] is not None:  # (an optional array the case does not use)
      tensors[i] = tensors[i].clone().requires_grad_(True)
  out = TORCH_REFERENCES[run.op.name](run.problem, *tensors)
  if out.requires_grad:  # (torch's FlexAttention has no backward on the CPU)
    out.backward(tensor(run.cotangent))
  # A torch reference that does not model an input (retention's state when it starts
  # from zeros) gives it no gradient: that one is not compared.
  return _named_errors(run, _as_numpy(out),
                       [None if tensors[i] is None or tensors[i].grad is None
                        else _as_numpy(tensors[i].grad) for i in run.op.diff_argnums])


def default_torch_device() -> str:
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


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
  run = run_jax_side(op, dtype=dtype_name, backend=backend, seed=seed, **case)
  if reference == "jax":
    device, errors = "jax", jax_reference_errors(run)
  else:
    device = torch_device or default_torch_device()
    errors = torch_reference_errors(run, device)
  return CrosscheckReport(op=op, dtype=dtype_name, backend=backend, device=device,
                          errors=errors, tolerance=tolerance)


__all__ = ["TOLERANCE", "TORCH_REFERENCES", "CrosscheckReport", "crosscheck"]
