"""Argument checks every op shares. Each error names the argument and says what was
expected; shapes are written ``[batch, seq, heads, head_dim]``-style."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_DTYPE_NAMES = "float32, float16, bfloat16"


def _shape(x):
  return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


def check_array(name: str, x, layout: str) -> None:
  """``x`` is a floating-point array of the rank ``layout`` names (``"batch, seq,
  heads, head_dim"``) with no empty dimension."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array [{layout}], got {type(x).__name__}")
  rank = len(layout.split(","))
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} [{layout}], got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"{name} has dtype {x.dtype}; supported: {_DTYPE_NAMES}")
  if 0 in x.shape:
    raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")


def check_same_dtype(**arrays) -> None:
  """All of ``arrays`` share one dtype."""
  dtypes = {name: jnp.dtype(x.dtype) for name, x in arrays.items()}
  if len(set(dtypes.values())) > 1:
    listed = ", ".join(f"{n} {d.name}" for n, d in dtypes.items())
    raise TypeError(f"{', '.join(dtypes)} must share one dtype, got {listed}")


def check_shape(name: str, x, expected: tuple, layout: str) -> None:
  """``x`` has exactly ``expected`` shape (``None`` entries match anything)."""
  shape = _shape(x)
  if not isinstance(shape, tuple) or len(shape) != len(expected) or any(
      e is not None and s != e for s, e in zip(shape, expected)):
    want = ", ".join("?" if e is None else str(e) for e in expected)
    raise ValueError(f"{name} must be [{layout}] = [{want}], got {shape}")


def check_heads(q_heads: int, kv_heads: int, q_name: str = "q", kv_name: str = "k") -> None:
  """Grouped-query attention: query heads a multiple of key/value heads."""
  if q_heads % kv_heads:
    raise ValueError(f"{q_name}'s heads ({q_heads}) must be a multiple of {kv_name}'s heads "
                     f"({kv_heads}) for grouped-query attention")


def check_attention_inputs(q, k, v, *, same_length: bool = False,
                           value_head_dim: bool = False) -> None:
  """``q: [batch, q_len, heads, head_dim]``, ``k, v: [batch, kv_len, kv_heads, head_dim]``
  of one float dtype, ``heads`` a multiple of ``kv_heads``; with ``same_length``,
  ``kv_len == q_len``; with ``value_head_dim``, v's last axis may differ."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_array(name, x, "batch, seq, heads, head_dim")
  check_same_dtype(q=q, k=k, v=v)
  batch, q_len, _, head_dim = q.shape
  layout = f"batch, {'seq' if same_length else 'kv_len'}, kv_heads, head_dim"
  check_shape("k", k, (batch, q_len if same_length else None, None, head_dim), layout)
  if value_head_dim:
    check_shape("v", v, tuple(k.shape[:3]) + (None,), layout[:-len("head_dim")] + "head_dim_v")
  else:
    check_shape("v", v, tuple(k.shape), layout)
  check_heads(q.shape[2], k.shape[2])


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_positive_int(name: str, value, *, optional: bool = False) -> None:
  if optional and value is None:
    return
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
    raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, "
                     f"got {value!r}")


def check_integer_array(name: str, x, expected: tuple, layout: str) -> None:
  """Integer ids of shape ``expected``."""
  check_shape(name, x, expected, layout)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got dtype {x.dtype}")


def scale_of(scale, head_dim: int) -> float:
  """The logit scale: ``scale`` if given (a finite number > 0), else ``head_dim ** -0.5``."""
  if scale is None:
    return head_dim ** -0.5
  if not (isinstance(scale, (int, float, np.floating, np.integer)) and not isinstance(scale, bool)
          and math.isfinite(scale) and scale > 0):
    raise ValueError(f"scale must be a finite number > 0 or None, got {scale!r}")
  return float(scale)
