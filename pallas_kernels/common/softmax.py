"""The softmax arithmetic every attention kernel shares: matmuls in the precision
each dtype needs, the online softmax (init, step, finish), the merge of two partial
results of the same rows, the logit transform (scale, soft-cap, base-2 exponent)
and the backward's row term. Pure jnp: it runs inside kernels and on the host."""

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


def merge_partials(o1, lse1, o2, lse2, expand=lambda w: w[:, None]):
  """Online-softmax merge of two partial results of the same rows: ``o`` float32 and
  ``lse`` (``EMPTY_ROW_LSE`` where a part saw no key). ``expand`` lays a per-row
  weight (shaped like ``lse``) out against ``o`` (default: rows first, ``[rows, d]``).
  Returns the merged ``(o, lse)``."""
  top = jnp.maximum(lse1, lse2)
  w1, w2 = jnp.exp(lse1 - top), jnp.exp(lse2 - top)
  total = w1 + w2
  return o1 * expand(w1 / total) + o2 * expand(w2 / total), top + jnp.log(total)


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


def backward_delta(o, do, dlse):
  """``rowsum(o * do) - dlse`` as ``[batch, heads, q_len]`` float32.

  d(lse)/d(logits) is the softmax itself, so a cotangent on the returned lse
  folds into the row term that dS subtracts.
  """
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
  return delta - dlse.astype(jnp.float32)
