"""Ready score and mask functions for ``flex_attention``. Each is a few lines of jnp,
called elementwise with int32 indices; those built from arrays close over them, so
the arrays get gradients.

Positions are the raw indices: ``q_idx`` and ``kv_idx`` both count from 0. For a
query block that ends where the keys end (decoding, ``q_len < kv_len``), pass
``offset = kv_len - q_len`` to the positional masks (flash_attention's bottom-right
alignment).
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import jax.numpy as jnp

from jattn.flex.functions import built_function


def from_arrays(build: Callable, *arrays) -> Callable:
  """A ``score_mod`` or ``mask_mod`` of arrays, ``build(*arrays)``, that
  ``flex_attention`` traces with the arrays as its inputs instead of closing over
  them. The same function; under ``jax.set_mesh`` of ``Explicit`` axes it is the way to
  read arrays given sharded there (indexing a closed-over sharded array is refused
  while tracing). E.g. ``from_arrays(lambda x: lambda s, b, h, i, j: s + x[h], x)``."""
  return built_function(build, arrays)


def _from_arrays(build: Callable, *expected, dense_bias: bool = False) -> Callable:
  """``build(*arrays)``: a function of the arrays ``expected`` names as ``(name, array,
  dims)``, ``dims`` naming each axis (``"batch"``, ``"heads"``, ``"q_len"``,
  ``"kv_len"``) or None (any size); an axis named with a leading ``"1|"`` may also
  have size 1 (broadcast). ``flex_attention`` checks their shapes against its call
  (``check_shapes``: an index past an array's end would be clamped, a wrong answer
  that looks right), and traces the function from the arrays (``built_function``)."""
  fn = built_function(build, tuple(array for _, array, _ in expected), dense_bias)

  def check_shapes(sizes: dict):
    for name, array, dims in expected:
      want = tuple(None if d is None else sizes[d.removeprefix("1|")] for d in dims)
      ok = len(dims) == array.ndim and all(
          w is None or n == w or (n == 1 and d.startswith("1|"))
          for n, w, d in zip(array.shape, want, dims))
      if not ok:
        wanted = ", ".join("any" if d is None else d.replace("1|", "1 or ") + f" = {w}"
                           for d, w in zip(dims, want))
        raise ValueError(f"{name} must be [{wanted}] for this call, got shape "
                         f"{tuple(array.shape)}")

  fn.check_shapes = check_shapes
  return fn


# --- masks: (b, h, q_idx, kv_idx) -> bool ---------------------------------------------------

def causal_mask(offset: int = 0) -> Callable:
  """A query at position ``q_idx + offset`` sees keys at or before it."""
  return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset


def sliding_window_mask(left: int, right: int = 0, offset: int = 0) -> Callable:
  """A query at position ``a = q_idx + offset`` sees keys in ``[a - left, a + right]``
  (``right = 0``: causal sliding window)."""
  def mask(b, h, q_idx, kv_idx):
    a = q_idx + offset
    return (kv_idx >= a - left) & (kv_idx <= a + right)
  return mask


def document_mask(q_documents, kv_documents=None) -> Callable:
  """Packed sequences: queries see keys of their own document only.

  ``q_documents``: integer ids ``[q_len]`` (shared by the batch) or ``[batch, q_len]``;
  ``kv_documents`` likewise over keys (default: ``q_documents``, self-attention).
  """
  q_documents = jnp.asarray(q_documents)
  kv_documents = q_documents if kv_documents is None else jnp.asarray(kv_documents)

  def ids(documents, b, i):
    return documents[i] if documents.ndim == 1 else documents[b, i]

  dims = lambda x, length: (length,) if x.ndim == 1 else ("1|batch", length)
  return _from_arrays(
      lambda q_documents, kv_documents: lambda b, h, q_idx, kv_idx: (
          ids(q_documents, b, q_idx) == ids(kv_documents, b, kv_idx)),
      ("document_mask's q_documents", q_documents, dims(q_documents, "q_len")),
      ("document_mask's kv_documents", kv_documents, dims(kv_documents, "kv_len")))


def prefix_lm_mask(prefix_length) -> Callable:
  """Prefix LM: every query sees the first ``prefix_length`` keys (an int, or per batch
  row ``[batch]``) and, past them, causally."""
  prefix = jnp.asarray(prefix_length, jnp.int32)
  build = lambda prefix: lambda b, h, q_idx, kv_idx: (
      kv_idx < (prefix if prefix.ndim == 0 else prefix[b])) | (kv_idx <= q_idx)
  return build(prefix) if prefix.ndim == 0 else _from_arrays(
      build, ("prefix_lm_mask's prefix_length", prefix, ("batch",)))


def and_masks(*masks: Callable) -> Callable:
  """Pairs every mask allows."""
  return lambda *index: functools.reduce(operator.and_, (m(*index) for m in masks))


def or_masks(*masks: Callable) -> Callable:
  """Pairs any mask allows."""
  return lambda *index: functools.reduce(operator.or_, (m(*index) for m in masks))


# --- scores: (score, b, h, q_idx, kv_idx) -> score -------------------------------------------

def alibi_slopes(heads: int):
  """ALiBi's per-head slopes ``2 ** (-8 (h + 1) / heads)``, ``[heads]`` float32 (for a
  power-of-two head count, as in the paper)."""
  return 2.0 ** (-8.0 * (jnp.arange(heads, dtype=jnp.float32) + 1) / heads)


def alibi_score(slopes) -> Callable:
  """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)`` (a penalty growing with distance
  to earlier keys). ``slopes``: ``[q_heads]``; it gets a gradient."""
  slopes = jnp.asarray(slopes)
  return _from_arrays(
      lambda slopes: lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
      ("alibi_score's slopes", slopes, ("heads",)))


def softcap_score(cap: float) -> Callable:
  """Gemma 2's soft cap: ``cap * tanh(score / cap)``."""
  return lambda score, b, h, q_idx, kv_idx: cap * jnp.tanh(score / cap)


def relative_position_score(table) -> Callable:
  """A learned bias by relative distance: ``score + table[h, clip(kv_idx - q_idx, -m, m)
  + m]`` for ``table: [q_heads, 2 m + 1]`` (distances past ``m`` share the end entries).
  The table gets a gradient."""
  if table.ndim != 2 or table.shape[1] % 2 == 0:
    raise ValueError(f"table must be [heads, 2 m + 1], got shape {tuple(table.shape)}")
  m = (table.shape[1] - 1) // 2
  return _from_arrays(
      lambda table: lambda score, b, h, q_idx, kv_idx: (
          score + table[h, jnp.clip(kv_idx - q_idx, -m, m) + m]),
      ("relative_position_score's table", table, ("heads", None)))


def broadcast_at(x, b, h, q_idx, kv_idx):
  """``x[b, h, q_idx, kv_idx]`` of an array broadcastable to ``[batch, q_heads, q_len,
  kv_len]`` (``[q_heads, q_len, kv_len]`` when 3-d): index 0 on its axes of size 1."""
  index = (b, h, q_idx, kv_idx)[4 - x.ndim:]
  return x[tuple(0 if n == 1 else i for n, i in zip(x.shape, index))]


def _added(bias) -> Callable:
  """``score + bias[b, h, q_idx, kv_idx]`` (``broadcast_at``)."""
  return lambda score, b, h, q_idx, kv_idx: score + broadcast_at(bias, b, h, q_idx, kv_idx)


def bias_score(bias) -> Callable:
  """An additive bias ``[q_heads, q_len, kv_len]`` (or ``[batch, q_heads, q_len,
  kv_len]``; axes of size 1 broadcast), e.g. DAT's and Swin's relative-position bias.
  It gets a gradient: the score gradients summed over the axes it broadcasts, one
  block of query rows at a time. Rows of large values are taken shifted
  (``jattn.kernels.common.softmax.shared_row_shift``)."""
  if bias.ndim not in (3, 4):
    raise ValueError("bias must be [heads, q_len, kv_len] or [batch, heads, q_len, kv_len], "
                     f"got shape {tuple(bias.shape)}")

  dims = ("1|heads", "1|q_len", "1|kv_len")
  # (dense_bias: flex_attention takes the bias's gradient as dS summed over its broadcasts)
  return _from_arrays(_added, ("bias_score's bias", bias,
                               dims if bias.ndim == 3 else ("1|batch",) + dims), dense_bias=True)
