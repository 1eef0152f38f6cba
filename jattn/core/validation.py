"""Argument checks every op shares. Each error names the argument and says what was
expected; shapes are written ``[batch, seq, heads, head_dim]``-style."""

from __future__ import annotations

import math

import jax
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


def check_flag(name: str, value) -> bool:
  """``value`` as a Python bool: a Python or numpy bool only. A flag decides which
  kernels run (their shapes), so it cannot be a traced value, and a truthy string or
  number is more likely a mistake than a choice."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a Python or numpy bool, not a traced value: it picks the "
                    "kernels to run (mark it static under jit, e.g. static_argnames)")
  raise TypeError(f"{name} must be True or False, got {value!r}")


def is_number(value) -> bool:
  """A real Python or numpy number that is not a bool."""
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
      value, (bool, np.bool_))


def is_int(value) -> bool:
  """A Python or numpy integer that is not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_number(name: str, value) -> float:
  """``value`` (a finite Python, numpy or concrete 0-d JAX number > 0) as a float. A
  traced one is refused: the kernels are compiled for the number."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"{name} must be a concrete number > 0 or None (the kernels are "
                     "compiled for it), got a traced value: pass a Python float, or make "
                     "it a static argument of the jit")
  if isinstance(value, jax.Array) and value.shape == ():
    value = np.asarray(value)[()]
  if not (is_number(value) and math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
  return float(value)


def check_choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_positive_int(name: str, value, *, optional: bool = False) -> None:
  if optional and value is None:
    return
  if not (is_int(value) and value >= 1):
    raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, "
                     f"got {value!r}")


def check_integer_array(name: str, x, expected: tuple, layout: str) -> None:
  """Integer ids of shape ``expected``."""
  check_shape(name, x, expected, layout)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got dtype {x.dtype}")


def segment_ids_arg(q_segment_ids, kv_segment_ids, batch: int, q_len: int, kv_len: int):
  """Both segment ids as int32 (``[batch, q_len]``, ``[batch, kv_len]`` integers), or
  ``(None, None)``; one without the other is an error."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is None:
    return None, None
  check_integer_array("q_segment_ids", q_segment_ids, (batch, q_len), "batch, q_len")
  check_integer_array("kv_segment_ids", kv_segment_ids, (batch, kv_len), "batch, kv_len")
  return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def scale_of(scale, head_dim: int) -> float:
  """The logit scale: ``scale`` if given (a finite number > 0), else ``head_dim ** -0.5``."""
  if scale is None:
    return head_dim ** -0.5
  return positive_number("scale", scale)


def window_arg(local_window) -> tuple:
  """``(left, right)`` as Python ints or None, from ints of any kind (numpy's too)."""
  ok = isinstance(local_window, (tuple, list)) and len(local_window) == 2 and all(
      w is None or (is_int(w) and w >= 0) for w in local_window)
  if not ok:
    raise ValueError("local_window must be (left, right) with each a non-negative int or "
                     f"None (unbounded), got {local_window!r}")
  return tuple(None if w is None else int(w) for w in local_window)
