"""Gradients of the arrays a ``score_mod`` closes over, for the kernel backends.

``d loss / d array = sum over (b, h, i, j) of dS_ij * d score_mod(x_ij) / d array``,
with ``dS = P * (dP - delta)`` the gradient of the transformed scores. For a dense
bias (``bias_score``) the Triton backward writes dS out and the gradient is its sum
over the bias's broadcast axes (``summed_over_broadcast``). For any other function the
kernels do not keep dS, so it is recomputed here in XLA one block of query rows at a
time (a ``scan``), from the saved log-sum-exp, with the products in the inputs' dtype
as the kernels take them. It costs about one dense attention pass, paid only for
arrays that are differentiated (a fixed ALiBi table or a bias under ``stop_gradient``
costs nothing: ``Call.wants_grad``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jattn.kernels.common.elementwise import dense_indices
from jattn.kernels.common.softmax import backward_delta

# Query rows per step: about this many [batch, heads, rows, kv_len] float32 elements.
_STEP_ELEMENTS = 1 << 25


def score_array_grads(problem, consts, wanted, mask_consts, q, k, v, o, lse, do,
                      dlse) -> list:
  """One gradient per array ``problem.score_mod`` closes over (``consts``; None where
  ``wanted`` is False), float32.

  Args:
    problem: the ``FlexProblem`` (its ``score_mod``, ``mask_mod`` and ``scale``).
    consts, mask_consts: the arrays the score and mask functions close over.
    wanted: per array of ``consts``, whether its gradient is used (float and
      differentiated).
    q: ``[batch, q_len, heads, d]``; k, v: ``[batch, kv_len, kv_heads, d]``.
    o, lse, do, dlse: the forward's output and row log-sum-exp ``[batch, heads,
      q_len]``, and their cotangents.
  """
  if not any(wanted):
    return [None] * len(consts)
  return _RowBlocks(problem, mask_consts, q, k, v, o, lse, do, dlse).array_grads(consts, wanted)


def summed_over_broadcast(ds, bias_shape: tuple):
  """A bias's gradient from dS ``[batch, heads, q_len, kv_len]``: summed over the axes
  the bias (3-d or 4-d, ``bias_score``'s) broadcasts, float32, shaped as the bias."""
  shape = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
  axes = tuple(a for a in range(4) if shape[a] == 1)
  return jnp.sum(ds.astype(jnp.float32), axis=axes, keepdims=True).reshape(bias_shape)


class _RowBlocks:
  """dS one block of query rows at a time: the products as the kernels take them (the
  inputs' dtype, float32 sums; float32 inputs at full float32 precision)."""

  def __init__(self, problem, mask_consts, q, k, v, o, lse, do, dlse):
    batch, q_len, heads, _ = q.shape
    kv_len, group = k.shape[1], heads // k.shape[2]
    self.problem, self.mask_consts, self.q_len = problem, mask_consts, q_len
    self.rows = max(1, min(q_len, _STEP_ELEMENTS // (batch * heads * kv_len)))
    self.steps = -(-q_len // self.rows)
    pad = self.steps * self.rows - q_len
    pad_rows = lambda x, axis: jnp.pad(x, [(0, pad) if a == axis else (0, 0)
                                           for a in range(x.ndim)])
    dtype = jnp.promote_types(q.dtype, k.dtype)
    self.precision = lax.Precision.DEFAULT if dtype.itemsize < 4 else lax.Precision.HIGHEST
    delta = backward_delta(o, do, dlse)
    self.q, self.do = pad_rows(q.astype(dtype), 1), pad_rows(do.astype(dtype), 1)
    self.lse, self.delta = pad_rows(lse, 2), pad_rows(delta, 2)
    self.k = jnp.repeat(k.astype(dtype), group, axis=2)
    self.v = jnp.repeat(v.astype(dtype), group, axis=2)
    self.b, self.h, _, self.kv_idx = dense_indices(batch, heads, 1, kv_len)

  def _product(self, a, b):
    return jnp.einsum("bqhd,bkhd->bhqk", a, b, precision=self.precision,
                      preferred_element_type=jnp.float32)

  def ds(self, i, scores):
    """``(dS, aux)`` of row block ``i`` ``[batch, heads, rows, kv_len]``, given
    ``scores(x, index) -> (transformed scores, aux)`` of the scaled logits ``x``."""
    start = i * self.rows
    block = lambda x, axis: lax.dynamic_slice_in_dim(x, start, self.rows, axis)
    q_idx = (start + jnp.arange(self.rows, dtype=jnp.int32))[None, None, :, None]
    index = (self.b, self.h, q_idx, self.kv_idx)
    y, aux = scores(self._product(block(self.q, 1), self.k) * self.problem.scale, index)
    allowed = q_idx < self.q_len
    if self.problem.mask_mod is not None:
      allowed = allowed & self.problem.mask_mod(self.mask_consts, *index)
    p = jnp.where(allowed, jnp.exp(y - block(self.lse, 2)[..., None]), 0.0)
    dp = self._product(block(self.do, 1), self.v)
    return p * (dp - block(self.delta, 2)[..., None]), aux

  def _scan(self, step, init):
    return lax.scan(step, init, jnp.arange(self.steps, dtype=jnp.int32))  # int32 under x64

  def array_grads(self, consts, wanted) -> list:
    """Any score function: the gradients pulled back through it, summed over blocks."""
    fixed = list(consts)

    def with_floats(floats):
      it = iter(floats)
      return [next(it) if w else c for c, w in zip(fixed, wanted)]

    def step(acc, i):
      def scores(x, index):
        fn = lambda floats: self.problem.score_mod(with_floats(floats), x, *index)
        return jax.vjp(lambda floats: fn(floats).astype(jnp.float32),
                       [c for c, w in zip(fixed, wanted) if w])

      ds, vjp = self.ds(i, scores)
      (grads,) = vjp(ds)
      return [a + g.astype(jnp.float32) for a, g in zip(acc, grads)], None

    zeros = [jnp.zeros(c.shape, jnp.float32) for c, w in zip(fixed, wanted) if w]
    grads, _ = self._scan(step, zeros)
    it = iter(grads)
    return [next(it) if w else None for w in wanted]
