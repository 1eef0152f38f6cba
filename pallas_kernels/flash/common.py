"""Pieces shared by the forward and backward flash kernels: the logit transform
(scale, soft-cap, base-2 exponent), matmuls in the precision each dtype needs, and
the host-side padding and row terms that the kernel wrappers share."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Stand-in for -inf in the saved log-sum-exp of rows that see no key: finite, so
# that merging or subtracting it never produces NaN.
EMPTY_ROW_LSE = -1e30


def dot(a, b, contract_a: int, contract_b: int, fast_fp32: bool = False):
  """2-D matmul contracting ``a``'s and ``b``'s given axes, accumulating in fp32.

  fp32 operands use IEEE fp32 products (not TF32), so fp32 calls are as exact as
  the reference; ``fast_fp32`` uses three TF32 products instead (Triton's tf32x3:
  relative error near 1e-7, on the tensor cores; compiled GPU kernels only, as
  XLA on the CPU has no such dot).
  """
  precision = None
  if a.dtype == jnp.float32:
    precision = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if fast_fp32 else lax.Precision.HIGHEST
  return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)


def online_softmax_init(rows: int, width: int):
  """Carry ``(acc, m, l)`` of the online softmax before the first key tile."""
  return (jnp.zeros((rows, width), jnp.float32), jnp.full((rows,), EMPTY_ROW_LSE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry, s, c, v, fast_fp32: bool = False):
  """Folds one key tile into ``(acc, m, l)``: logits ``s * c`` in base-2 units
  (``[rows, keys]``, -inf where masked) and values ``v: [keys, width]``
  (``fast_fp32`` as in ``dot``)."""
  acc, m_prev, l_prev = carry
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=1) * c)
  alpha = jnp.exp2(m_prev - m_next)
  p = jnp.exp2(s * c - m_next[:, None])
  l_next = l_prev * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, 1, 0, fast_fp32)
  return acc, m_next, l_next


def online_softmax_finish(carry):
  """``(o, lse)`` from the final carry: o float32, lse in natural log; rows that saw
  no key give zeros and ``EMPTY_ROW_LSE``."""
  acc, m, l = carry
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  return acc / l_safe[:, None], jnp.where(empty, EMPTY_ROW_LSE, m * LN2 + jnp.log(l_safe))


def log2_logits(qk, scale: float, softcap: float | None):
  """Raw q.k products -> ``(s, c, t)`` with ``s * c`` the logits in base-2 units.

  Without a soft-cap ``s`` is ``qk`` itself and the multiply by ``c`` is left to
  the caller, where it fuses with the max subtraction; with one, ``c = 1`` and
  ``t = tanh(.)`` is kept for the VJP.
  """
  if softcap is None:
    return qk, scale * LOG2E, None
  t = jnp.tanh(qk * (scale / softcap))
  return t * (softcap * LOG2E), 1.0, t


def logit_grad(ds, tanh_value):
  """d(loss)/d(scaled logit) from d(loss)/d(capped logit)."""
  if tanh_value is None:
    return ds
  return ds * (1.0 - tanh_value * tanh_value)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def pad_to(x, length: int, width: int | None = None):
  """Zero-pads axis 1 to ``length`` and (if given) the last axis to ``width``."""
  pads = [(0, 0)] * x.ndim
  pads[1] = (0, length - x.shape[1])
  if width is not None:
    pads[-1] = (0, width - x.shape[-1])
  if all(p == (0, 0) for p in pads):
    return x
  return jnp.pad(x, pads)


def pad_rows(x, length: int):
  """Zero-pads the last axis of a ``[batch, heads, q_len]`` row statistic."""
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])))


def backward_delta(o, do, dlse):
  """``rowsum(o * do) - dlse`` as ``[batch, heads, q_len]`` float32.

  d(lse)/d(logits) is the softmax itself, so a cotangent on the returned lse
  folds into the row term that dS subtracts.
  """
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
  return delta - dlse.astype(jnp.float32)
