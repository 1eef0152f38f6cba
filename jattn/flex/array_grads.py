"""Gradients of the arrays a ``score_mod`` closes over, for the kernel backends.

``d loss / d array = sum over (b, h, i, j) of dS_ij * d score_mod(x_ij) / d array``,
with ``dS = P * (dP - delta)`` the gradient of the transformed scores. The kernels do
not keep dS, so it is recomputed here in XLA one block of query rows at a time (a
``scan``), from the saved log-sum-exp, with the products in the inputs' dtype as the
kernels take them. It costs about one dense attention pass; when the arrays'
gradients are not used (the common case: a fixed ALiBi or table), the compiler drops
it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.elementwise import dense_indices
from jattn.kernels.common.softmax import backward_delta

# Query rows per step: about this many [batch, heads, rows, kv_len] float32 elements.
_STEP_ELEMENTS = 1 << 25


def score_array_grads(problem, consts, mask_consts, q, k, v, o, lse, do, dlse) -> list:
  """One gradient per array ``problem.score_mod`` closes over (``consts``; None for
  integer and boolean ones), float32.

  Args:
    problem: the ``FlexProblem`` (its ``score_mod``, ``mask_mod`` and ``scale``).
    consts, mask_consts: the arrays the score and mask functions close over.
    q: ``[batch, q_len, heads, d]``; k, v: ``[batch, kv_len, kv_heads, d]``.
    o, lse, do, dlse: the forward's output and row log-sum-exp ``[batch, heads,
      q_len]``, and their cotangents.
  """
  wanted = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]
  if not any(wanted):
    return [None] * len(consts)
  batch, q_len, heads, _ = q.shape
  kv_len, group = k.shape[1], heads // k.shape[2]
  rows = max(1, min(q_len, _STEP_ELEMENTS // (batch * heads * kv_len)))
  steps = -(-q_len // rows)
  pad = steps * rows - q_len
  pad_rows = lambda x, axis: jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
  # The products as the kernels take them: the inputs' dtype, float32 sums (float32
  # inputs at full float32 precision).
  dtype = jnp.promote_types(q.dtype, k.dtype)
  precision = lax.Precision.DEFAULT if dtype.itemsize < 4 else lax.Precision.HIGHEST
  product = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision,
                                          preferred_element_type=jnp.float32)
  delta = backward_delta(o, do, dlse)
  q, do = pad_rows(q.astype(dtype), 1), pad_rows(do.astype(dtype), 1)
  lse, delta = pad_rows(lse, 2), pad_rows(delta, 2)
  k = jnp.repeat(k.astype(dtype), group, axis=2)
  v = jnp.repeat(v.astype(dtype), group, axis=2)
  b, h, _, kv_idx = dense_indices(batch, heads, 1, kv_len)
  fixed = list(consts)

  def with_floats(floats):
    it = iter(floats)
    return [next(it) if w else c for c, w in zip(fixed, wanted)]

  def step(acc, i):
    start = i * rows
    block = lambda x, axis: lax.dynamic_slice_in_dim(x, start, rows, axis)
    q_idx = (start + jnp.arange(rows, dtype=jnp.int32))[None, None, :, None]
    x = product("bqhd,bkhd->bhqk", block(q, 1), k) * problem.scale
    index = (b, h, q_idx, kv_idx)
    scores = lambda floats: problem.score_mod(with_floats(floats), x, *index).astype(jnp.float32)
    y, vjp = jax.vjp(scores, [c for c, w in zip(fixed, wanted) if w])
    allowed = q_idx < q_len
    if problem.mask_mod is not None:
      allowed = allowed & problem.mask_mod(mask_consts, *index)
    p = jnp.where(allowed, jnp.exp(y - block(lse, 2)[..., None]), 0.0)
    dp = product("bqhd,bkhd->bhqk", block(do, 1), v)
    (grads,) = vjp(p * (dp - block(delta, 2)[..., None]))
    return [a + g.astype(jnp.float32) for a, g in zip(acc, grads)], None

  zeros = [jnp.zeros(c.shape, jnp.float32) for c, w in zip(fixed, wanted) if w]
  grads, _ = lax.scan(step, zeros, jnp.arange(steps, dtype=jnp.int32))  # int32 under x64 too
  it = iter(grads)
  return [next(it) if w else None for w in wanted]
