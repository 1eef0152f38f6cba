"""``jattn.flash_attention``: validation, backend choice, dispatch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jattn.backends import resolve_backend
from jattn.gpu import flash_backend_gaps, select_backend
from jattn.reference import flash_attention_reference
from pallas_kernels.flash import (FlashBlockConfig, MosaicBlockConfig, default_config,
                                  default_mosaic_config, flash_attention_mosaic,
                                  flash_attention_triton)

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
MAX_PALLAS_HEAD_DIM = 256


def _check_array(name, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if x.ndim != 4:
    raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {x.shape}")
  if x.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
  if any(d == 0 for d in x.shape):
    raise ValueError(f"{name} has an empty dimension: shape {x.shape}")


def _validate(q, k, v, q_segment_ids, kv_segment_ids, local_window, softcap, scale):
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_array(name, x)
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape [batch, kv_len, kv_heads, head_dim], "
                     f"got k {k.shape} and v {v.shape}")
  if k.shape[0] != q.shape[0]:
    raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
  if k.shape[3] != q.shape[3]:
    raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"q_heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]}) "
                     "for grouped-query attention")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is not None:
    for name, ids, length in (("q_segment_ids", q_segment_ids, q.shape[1]),
                              ("kv_segment_ids", kv_segment_ids, k.shape[1])):
      expected = (q.shape[0], length)
      if not hasattr(ids, "shape") or tuple(ids.shape) != expected:
        raise ValueError(f"{name} must have shape [batch, seq] = {expected}, "
                         f"got {getattr(ids, 'shape', type(ids).__name__)}")
      if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")
  if local_window is not None:
    ok = isinstance(local_window, (tuple, list)) and len(local_window) == 2 and all(
        w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0)
        for w in local_window)
    if not ok:
      raise ValueError("local_window must be (left, right) with each a non-negative int or "
                       f"None (unbounded), got {local_window!r}")
  if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
    raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
  if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                and scale > 0):
    raise ValueError(f"scale must be a finite number > 0 or None, got {scale!r}")


def _check_gaps(backend, q, k, *, causal, q_segment_ids, softcap, return_lse, advice):
  gaps = flash_backend_gaps(backend, dtype=q.dtype, q_len=q.shape[1], kv_len=k.shape[1],
                            causal=causal, segment_ids=q_segment_ids is not None,
                            softcap=softcap is not None, return_lse=return_lse)
  if gaps:
    raise ValueError(f"backend={backend!r} does not support: " + ", ".join(gaps) + advice)


def _cudnn(q, k, v, *, causal, scale, q_segment_ids, local_window, softcap, return_lse):
  _check_gaps("cudnn", q, k, causal=causal, q_segment_ids=q_segment_ids, softcap=softcap,
              return_lse=return_lse, advice="; use backend='pallas_triton' or 'xla'")
  window = None if local_window is None else tuple(
      -1 if w is None else w for w in local_window)
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                      local_window_size=window, implementation="cudnn")


_CONFIG_TYPES = {"pallas_triton": FlashBlockConfig, "pallas_mosaic": MosaicBlockConfig}


def _pallas_config(backend, config, q, k, causal):
  """The tiles a Pallas backend runs with: the caller's, the tuned ones, or defaults."""
  expected = _CONFIG_TYPES[backend]
  if config is not None:
    if not isinstance(config, expected):
      raise TypeError(f"config for backend={backend!r} must be a {expected.__name__}, "
                      f"got {type(config).__name__}")
    return config
  from jattn.autotune import lookup_config

  head_dim = q.shape[-1]
  tuned = lookup_config("flash_attention", backend, dtype=q.dtype, head_dim=head_dim,
                        q_len=q.shape[1], kv_len=k.shape[1], causal=causal)
  if tuned is not None:
    return tuned
  if backend == "pallas_mosaic":
    return default_mosaic_config(head_dim)
  return default_config(head_dim, jnp.dtype(q.dtype).itemsize)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    q_segment_ids=None, kv_segment_ids=None, local_window=None,
                    softcap: float | None = None, deterministic: bool = True,
                    return_lse: bool = False, backend: str = "auto",
                    config: FlashBlockConfig | MosaicBlockConfig | None = None):
  """Memory-efficient exact attention, differentiable (custom VJP on Pallas backends).

  ``softmax(softcap(q kᵀ · scale) + mask) v`` computed tile by tile in fp32,
  never materialising the ``[q_len, kv_len]`` matrix on the Pallas backends.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``. ``q_heads`` must be a multiple
      of ``kv_heads`` (grouped-query / multi-query attention). float32, float16
      or bfloat16, all the same dtype; any lengths; head_dim up to 256.
    causal: mask keys after the query. With ``q_len != kv_len`` the mask is
      aligned at the bottom-right (as flash-attn does): query ``i`` sits at key
      position ``i + kv_len - q_len``, so with ``q_len > kv_len`` the first rows
      see no key.
    scale: logit scale (> 0), default ``head_dim ** -0.5``.
    q_segment_ids, kv_segment_ids: ``[batch, q_len]`` / ``[batch, kv_len]``
      integers for packed sequences: a query attends only to keys of its segment.
    local_window: ``(left, right)``: query at position ``a`` sees keys in
      ``[a - left, a + right]`` (same alignment as ``causal``); ``None`` on a side
      means unbounded. Combined with ``causal``, ``right`` becomes 0.
    softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    deterministic: the Pallas backward never uses atomics, so it is always
      bitwise reproducible; the flag is accepted for API compatibility.
    return_lse: also return the log-sum-exp of each row.
    backend: ``"auto"``, ``"pallas_triton"``, ``"pallas_mosaic"``, ``"cudnn"`` or ``"xla"``.
      ``"auto"`` takes the best usable backend that supports the call
      (``jattn.gpu.select_backend``; rules in docs/backends.md).
    config: tiles for the Pallas kernels: a ``FlashBlockConfig`` for ``pallas_triton``,
      a ``MosaicBlockConfig`` for ``pallas_mosaic``. Default: the autotuner's cache
      (``jattn.autotune``), else a heuristic by head_dim.

  Returns:
    ``o: [batch, q_len, q_heads, head_dim]`` in q's dtype; with ``return_lse``
    also ``lse: [batch, q_heads, q_len]`` float32. A query row that sees no key
    gives zeros and ``lse = -1e30`` (finite), never NaN. Gradients flow to q, k,
    v (and through ``lse`` when it is used); segment ids get none.
  """
  del deterministic  # Every backward here is deterministic.
  _validate(q, k, v, q_segment_ids, kv_segment_ids, local_window, softcap, scale)
  head_dim = q.shape[-1]
  name, interpret = resolve_backend(backend, lambda: select_backend(
      dtype=q.dtype, head_dim=head_dim, q_len=q.shape[1], kv_len=k.shape[1], causal=causal,
      segment_ids=q_segment_ids is not None, softcap=softcap is not None,
      return_lse=return_lse, local_window=local_window is not None))
  scale = head_dim ** -0.5 if scale is None else float(scale)
  if local_window is not None:
    local_window = tuple(local_window)
  if q_segment_ids is not None:
    q_segment_ids = q_segment_ids.astype(jnp.int32)
    kv_segment_ids = kv_segment_ids.astype(jnp.int32)

  if name == "cudnn":
    return _cudnn(q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
                  local_window=local_window, softcap=softcap, return_lse=return_lse)
  if name == "xla":
    o, lse = flash_attention_reference(
        q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, local_window=local_window, softcap=softcap)
  else:
    if head_dim > MAX_PALLAS_HEAD_DIM:
      raise ValueError(f"head_dim {head_dim} is above {MAX_PALLAS_HEAD_DIM}, the largest the "
                       "Pallas kernels support; use backend='xla'")
    config = _pallas_config(name, config, q, k, causal)
    if name == "pallas_mosaic":
      _check_gaps("pallas_mosaic", q, k, causal=causal, q_segment_ids=q_segment_ids,
                  softcap=softcap, return_lse=return_lse,
                  advice="; use backend='pallas_triton' (or 'auto')")
      o, lse = flash_attention_mosaic(q, k, v, causal=causal, scale=scale,
                                      local_window=local_window, config=config)
    else:
      o, lse = flash_attention_triton(
          q, k, v, q_segment_ids, kv_segment_ids, causal=causal, scale=scale,
          local_window=local_window, softcap=softcap, config=config, interpret=interpret)
  return (o, lse) if return_lse else o
