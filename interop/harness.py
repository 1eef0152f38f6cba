"""Runs a jattn op and its torch reference on the same random inputs and compares
outputs and gradients.

Each op registers an :class:`OpPair`: how to draw inputs, the JAX call and the
torch call. The inputs are drawn once in JAX and handed to torch through the
DLPack bridge, so both sides see bit-identical tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from interop.dlpack import to_torch

# Error budget per input dtype, relative to the largest magnitude of the reference.
TOLERANCE = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class OpPair:
  """A jattn op and its torch reference.

  ``make_inputs(key, dtype, **case) -> (diff_args, static_kwargs)``: the
  arrays to differentiate (``[batch, seq, heads, head_dim]`` and so on) and
  the non-differentiable keyword arguments (segment ids, flags).
  ``jax_fn(*diff_args, backend=..., **kwargs)`` and ``torch_fn(*diff_args, **kwargs)``
  return one array each; arrays inside ``kwargs`` reach torch as tensors.
  """

  arg_names: tuple[str, ...]
  make_inputs: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]
  jax_fn: Callable[..., Any]
  torch_fn: Callable[..., Any]


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


def _flash_inputs(key, dtype, *, batch=2, q_len=48, kv_len=None, q_heads=4, kv_heads=2,
                  head_dim=32, segments=False, **flags):
  kv_len = q_len if kv_len is None else kv_len
  keys = jax.random.split(key, 4)
  shape_q = (batch, q_len, q_heads, head_dim)
  shape_kv = (batch, kv_len, kv_heads, head_dim)
  q = jax.random.normal(keys[0], shape_q, jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], shape_kv, jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], shape_kv, jnp.float32).astype(dtype)
  kwargs = dict(flags)
  if segments:
    # Sorted ids (packed sequences); kv ids shifted so some queries see nothing.
    ids = jnp.sort(jax.random.randint(keys[3], (batch, max(q_len, kv_len)), 0, 3), axis=1)
    kwargs["q_segment_ids"] = ids[:, :q_len]
    kwargs["kv_segment_ids"] = ids[:, :kv_len] + (ids[:, :kv_len] == 2)
  return (q, k, v), kwargs


def _flash_jax(q, k, v, *, backend, **kwargs):
  from jattn import flash_attention

  return flash_attention(q, k, v, backend=backend, **kwargs)


def _flash_torch(q, k, v, **kwargs):
  from interop.torch_reference import flash_attention_torch

  return flash_attention_torch(q, k, v, **kwargs)


def _retention_inputs(key, dtype, *, batch=2, q_len=48, kv_len=None, heads=3, dk=16, dv=24,
                      **flags):
  kv_len = q_len if kv_len is None else kv_len
  keys = jax.random.split(key, 3)
  q = jax.random.normal(keys[0], (batch, q_len, heads, dk), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (batch, kv_len, heads, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (batch, kv_len, heads, dv), jnp.float32).astype(dtype)
  # Decays from fast to RetNet-slow, so that γ^(n-m) spans orders of magnitude.
  return (q, k, v), dict(flags, decay=jnp.linspace(0.7, 0.99, heads, dtype=jnp.float32))


def _retention_jax(q, k, v, *, backend, **kwargs):
  from jattn import retention

  return retention(q, k, v, backend=backend, **kwargs)


def _retention_torch(q, k, v, **kwargs):
  from interop.torch_reference import retention_torch

  return retention_torch(q, k, v, **kwargs)


def _window_inputs(key, dtype, *, windows=8, tokens=64, heads=2, head_dim=30, mask_windows=4,
                   **flags):
  keys = jax.random.split(key, 5)
  q, k, v = (jax.random.normal(kk, (windows, tokens, heads, head_dim), jnp.float32).astype(dtype)
             for kk in keys[:3])
  bias = jax.random.normal(keys[3], (heads, tokens, tokens), jnp.float32)
  kwargs = dict(flags)
  if mask_windows:  # shifted-window style: 0 within a region, -100 across regions
    region = jax.random.randint(keys[4], (mask_windows, tokens), 0, 3)
    kwargs["mask"] = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
  return (q, k, v, bias), kwargs


def _window_jax(q, k, v, bias, *, backend, **kwargs):
  from jattn import window_attention

  return window_attention(q, k, v, bias, backend=backend, **kwargs)


def _window_torch(q, k, v, bias, **kwargs):
  from interop.torch_reference import window_attention_torch

  return window_attention_torch(q, k, v, bias, **kwargs)


def _dilated_inputs(key, dtype, *, batch=2, seq=48, heads=4, kv_heads=2, head_dim=16,
                    segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), **flags):
  keys = jax.random.split(key, 3)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
  k, v = (jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
          for kk in keys[1:])
  return (q, k, v), dict(flags, segment_lengths=tuple(segment_lengths),
                         dilation_rates=tuple(dilation_rates))


def _dilated_jax(q, k, v, *, backend, **kwargs):
  from jattn import dilated_attention

  return dilated_attention(q, k, v, backend=backend, **kwargs)


def _dilated_torch(q, k, v, **kwargs):
  from interop.longnet_torch import dilated_attention_torch

  return dilated_attention_torch(q, k, v, **kwargs)


OPS: dict[str, OpPair] = {
    "flash_attention": OpPair(("q", "k", "v"), _flash_inputs, _flash_jax, _flash_torch),
    "retention": OpPair(("q", "k", "v"), _retention_inputs, _retention_jax, _retention_torch),
    "window_attention": OpPair(("q", "k", "v", "bias"), _window_inputs, _window_jax,
                               _window_torch),
    "dilated_attention": OpPair(("q", "k", "v"), _dilated_inputs, _dilated_jax, _dilated_torch),
}


def _errors(ours, ref) -> tuple[float, float]:
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  max_abs = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
  scale = float(np.max(np.abs(ref))) if ref.size else 0.0
  return max_abs, max_abs / max(scale, 1e-30)


def _as_numpy(tensor) -> np.ndarray:
  return tensor.detach().float().cpu().numpy()


@dataclasses.dataclass(frozen=True)
class _JaxRun:
  diff_args: tuple
  kwargs: dict
  cotangent: Any
  out: Any
  grads: tuple
  fwd_bwd: Callable[..., Any]  # jitted forward + backward, for timing


def run_jax_side(op: str, *, dtype, backend: str, seed: int, **case) -> _JaxRun:
  """Draws the inputs of ``op`` and runs it forward and backward (jitted) in JAX."""
  pair = OPS[op]
  key_inputs, key_cotangent = jax.random.split(jax.random.PRNGKey(seed))
  diff_args, kwargs = pair.make_inputs(key_inputs, jnp.dtype(dtype), **case)
  forward = lambda *a: pair.jax_fn(*a, backend=backend, **kwargs)
  out_shape = jax.eval_shape(forward, *diff_args)
  cotangent = jax.random.normal(key_cotangent, out_shape.shape, jnp.float32)
  cotangent = cotangent.astype(out_shape.dtype)

  @jax.jit
  def fwd_bwd(*args):
    out, pull = jax.vjp(forward, *args)
    return out, pull(cotangent)

  out, grads = fwd_bwd(*diff_args)
  return _JaxRun(diff_args, kwargs, cotangent, out, grads, fwd_bwd)


def jax_reference_errors(op: str, run: _JaxRun) -> dict[str, tuple[float, float]]:
  """Errors of a JAX run against the pure-jnp reference computed in float32."""
  pair = OPS[op]
  f32 = [x.astype(jnp.float32) for x in run.diff_args]

  @jax.jit  # one compile: eagerly, each op of the reference would compile on its own
  def reference(args, cotangent):
    ref, pull = jax.vjp(lambda *a: pair.jax_fn(*a, backend="xla", **run.kwargs), *args)
    return ref, pull(cotangent)

  ref, ref_grads = reference(f32, run.cotangent.astype(jnp.float32))
  errors = {"out": _errors(run.out, ref)}
  for name, g, g_ref in zip(pair.arg_names, run.grads, ref_grads):
    errors[f"d{name}"] = _errors(g, g_ref)
  return errors


def torch_reference_errors(op: str, run: _JaxRun, torch_device: str):
  """Errors of a JAX run against the op's torch reference on ``torch_device``."""
  import torch

  pair = OPS[op]

  def torch_tensor(x):
    t = to_torch(x) if isinstance(x, jax.Array) else torch.as_tensor(np.asarray(x))
    return t.to(torch_device)

  t_args = [torch_tensor(x).clone().requires_grad_(True) for x in run.diff_args]
  t_kwargs = {n: torch_tensor(x) if isinstance(x, jax.Array) else x
              for n, x in run.kwargs.items()}
  t_out = pair.torch_fn(*t_args, **t_kwargs)
  t_out.backward(torch_tensor(run.cotangent))
  errors = {"out": _errors(run.out, _as_numpy(t_out))}
  for name, g, t_arg in zip(pair.arg_names, run.grads, t_args):
    errors[f"d{name}"] = _errors(g, _as_numpy(t_arg.grad))
  return errors


def default_torch_device() -> str:
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


def crosscheck(op: str = "flash_attention", *, dtype="float32", backend: str = "auto",
               seed: int = 0, reference: str = "torch", torch_device: str | None = None,
               tolerance: float | None = None, **case) -> CrosscheckReport:
  """Compares ``op`` with a reference on the same random inputs, forward and gradients.

  Args:
    op: a key of ``OPS`` (``"flash_attention"``, ``"retention"``, ``"window_attention"``,
      ``"dilated_attention"``).
    dtype: input dtype name or jnp dtype (``float32``, ``float16``, ``bfloat16``).
    backend: the jattn backend to test.
    reference: ``"torch"`` (the torch reference, inputs handed over through
      DLPack) or ``"jax"`` (the pure-jnp reference in float32).
    torch_device: where torch computes; default CUDA when torch sees a GPU, else CPU.
    tolerance: max relative error allowed; default ``TOLERANCE[dtype]``.
    **case: shape and flags for the op, e.g. ``q_len=64, causal=True, segments=True``.

  Returns:
    A :class:`CrosscheckReport`: ``.ok``, ``.errors`` (name -> (max abs, max abs
    relative to the reference's largest magnitude)); printable.
  """
  if op not in OPS:
    raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
  if reference not in ("torch", "jax"):
    raise ValueError(f"reference must be 'torch' or 'jax', got {reference!r}")
  dtype_name = jnp.dtype(dtype).name
  if dtype_name not in TOLERANCE:
    raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, got {dtype_name!r}")
  tolerance = TOLERANCE[dtype_name] if tolerance is None else tolerance
  run = run_jax_side(op, dtype=dtype_name, backend=backend, seed=seed, **case)
  if reference == "jax":
    device, errors = "jax", jax_reference_errors(op, run)
  else:
    device = torch_device or default_torch_device()
    errors = torch_reference_errors(op, run, device)
  return CrosscheckReport(op=op, dtype=dtype_name, backend=backend, device=device,
                          errors=errors, tolerance=tolerance)


__all__ = ["OPS", "TOLERANCE", "CrosscheckReport", "OpPair", "crosscheck"]
