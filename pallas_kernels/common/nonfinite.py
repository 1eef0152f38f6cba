"""Keeping a non-finite value (inf, NaN) in the rows that see it.

A masked product ``where(visible, w, 0) @ X`` still carries a non-finite row of ``X``
into every row of the result: the masked weights are 0, and ``0 · inf = NaN``. The
kernels guard the tiles that straddle the mask (the others need nothing), in
registers, at no cost in memory traffic; a guarded row that sees such a value is NaN
as a whole (where the dense product might leave some of its columns finite):

- ``bad = nonfinite_rows(k, v)`` marks the rows (keys) where ``k`` or ``v`` holds
  one; ``clear(v, bad)`` zeroes them in the operand the masked weights multiply, and
  ``poison(k, bad)`` fills them with NaN in the operand the weights are computed
  from (``guard_rows`` does both: retention). After the mask, a row that sees the key
  has a NaN weight, one that does not has the mask's 0 and meets a 0 value.
- The softmax kernels mark the keys by their values alone (``guard_values``: a non-finite
  key row follows the dense formula, whose -inf logits are weights of 0), and clear the
  rows of the operands their backward matmuls multiply by masked gradients
  (``clear_nonfinite_rows``); their references (``guard_values=True``) do the same on
  whole arrays.

The Hopper kernels read V tiles from shared memory that rows on both sides of the mask
share; they do not guard (docs/flash_attention.md says what that leaves).
"""

from __future__ import annotations

import jax.numpy as jnp


def nonfinite_rows(*xs):
  """``[..., rows, 1]`` bool: True where a row of any of ``xs`` (``[..., rows, d_i]``,
  the same rows) holds an inf or a NaN."""
  bad = None
  for x in xs:
    # A max over 0/1, not an any(): Triton-lowered Pallas reduces floats only.
    row = jnp.max(jnp.where(jnp.isfinite(x), 0.0, 1.0), axis=-1, keepdims=True) > 0.0
    bad = row if bad is None else bad | row
  return bad


def poison(x, bad):
  """``x`` with NaN in the rows ``bad`` (``[..., rows, 1]``)."""
  return jnp.where(bad, jnp.nan, x)


def clear(x, bad):
  """``x`` with zeros in the rows ``bad`` (``[..., rows, 1]``)."""
  return jnp.where(bad, 0.0, x)


def guard_rows(scored, multiplied):
  """Rows where either operand is non-finite: NaN in ``scored`` (the operand a masked
  weight is computed from), zeros in ``multiplied`` (the one it multiplies).
  Returns the two guarded operands."""
  bad = nonfinite_rows(scored, multiplied)
  return poison(scored, bad), clear(multiplied, bad)


def finite_or(x, fallback):
  """``x`` where finite, else ``fallback`` (a comparison, which every lowering has)."""
  return jnp.where(jnp.abs(x) < jnp.inf, x, fallback)


def guard_values(k, v):
  """The key and value rows ``[..., keys, d]`` of a tile that straddles a mask, guarded:
  a key whose value row is not finite gets a NaN key row (its logits are NaN: the rows
  that see it come out NaN, those that do not are masked as usual) and a zero value row
  (the masked weights meet zeros). Returns ``(k, v)``."""
  bad = nonfinite_rows(v)
  return poison(k, bad), clear(v, bad)


def clear_nonfinite_rows(x):
  """``x [rows, d]`` with the rows that hold an inf or a NaN zeroed: the operand a masked
  weight (or its gradient) multiplies in a backward matmul."""
  return clear(x, nonfinite_rows(x))
