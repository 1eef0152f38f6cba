"""Keeping a non-finite value (inf, NaN) in the rows that see it.

A masked product ``where(visible, w, 0) @ X`` still carries a non-finite row of ``X``
into every row of the result: the masked weights are 0, and ``0 · inf = NaN``. Two
guards keep it to the rows that see it; either makes such a row NaN as a whole
(where the dense product might leave some of its columns finite).

- In the tiles that straddle the mask (the others need nothing):
  ``bad = nonfinite_rows(k, v)`` marks the rows (keys) where ``k`` or ``v`` holds
  one; ``clear(v, bad)`` zeroes them in the operand the masked weights multiply, and
  ``poison(k, bad)`` fills them with NaN in the operand the weights are computed
  from (``guard_rows`` does both). After the mask, a row that sees the key has a NaN
  weight, one that does not has the mask's 0 and meets a 0 value. Free of memory
  traffic: for kernels that hold both operands' tiles in registers.
- On the host, for a causal kernel whose value tiles it cannot change (they sit in
  shared memory that rows on both sides of a key read): ``clear_nonfinite(v)`` and
  ``first_nonfinite_row(v)``, the first position per (batch, head) whose row held
  one; the kernel then writes NaN to the rows at and after it. Costs about one copy
  of ``v``.

The helpers are plain jnp (the tile guard's on ``[..., rows, d]``), so one code
serves kernel tiles and whole arrays.
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


def clear_nonfinite(x):
  """``x`` with every inf and NaN entry replaced by 0."""
  return jnp.where(jnp.isfinite(x), x, 0.0)


def first_nonfinite_row(x):
  """``[batch, heads]`` int32: the first position whose row of ``x`` (``[batch, seq,
  heads, d]``) holds an inf or NaN, ``seq`` where none does."""
  bad = ~jnp.isfinite(x).all(-1)
  positions = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :, None]
  return jnp.where(bad, positions, jnp.int32(x.shape[1])).min(axis=1)
