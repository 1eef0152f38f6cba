"""Pieces shared by the rings (``ring``, ``dilated_ring``): one block's attention as
partial results ``(o float32, lse)`` and its gradients given the final row statistics,
both through the flash-attention op (so through the backend it resolves), the
online-softmax merge of partial results, and the one-hop shift around a ring."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jattn.flash import FLASH, FlashProblem
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, merge_partials


def block_problem(q, k, *, causal: bool, scale: float, segments: bool = False) -> FlashProblem:
  """The flash problem of ``q [b, sq, h, d]`` against ``k [b, sk, hk, d]``, with the
  row statistics a ring merges (``segments``: with segment ids)."""
  return FlashProblem.of(q, k, causal=causal, scale=scale, return_lse=True,
                         segment_ids=segments)


def ring_backend(q, k, *, causal: bool, scale: float, backend: str,
                 segments: bool = False) -> str:
  """The backend every block of a ring runs: ``backend``, or what ``"auto"`` takes for
  the ring's blocks (it needs the row statistics: no cuDNN)."""
  problem = block_problem(q, k, causal=causal, scale=scale, segments=segments)
  return FLASH.prepare(problem, backend).impl.backend.name


def block_forward(q, k, v, q_seg=None, kv_seg=None, *, causal: bool, scale: float,
                  backend: str):
  """``(o float32, lse)`` of ``q [b, sq, h, d]`` against ``k, v [b, sk, hk, d]``
  (segment ids ``[b, sq]`` / ``[b, sk]`` or None)."""
  call = FLASH.prepare(block_problem(q, k, causal=causal, scale=scale,
                                     segments=q_seg is not None), backend)
  return FLASH.partial(call, (q, k, v, q_seg, kv_seg, None, None, None))


def block_backward(q, k, v, o, lse, do, q_seg=None, kv_seg=None, *, causal: bool,
                   scale: float, backend: str):
  """Float32 gradients of one block given the final ``o``, ``lse`` of the whole row."""
  call = FLASH.prepare(block_problem(q, k, causal=causal, scale=scale,
                                     segments=q_seg is not None), backend)
  return FLASH.partial_backward(call, (q, k, v, q_seg, kv_seg, None, None, None), o, lse,
                                do)[:3]


def segments_meet(q_seg, kv_seg):
  """Whether any query's segment id can equal any key's (a necessary condition, from
  their ranges per batch row; True without segment ids): a ring step without it is
  skipped whole."""
  if q_seg is None:
    return jnp.bool_(True)
  return jnp.any((q_seg.min(axis=1) <= kv_seg.max(axis=1))
                 & (kv_seg.min(axis=1) <= q_seg.max(axis=1)))


def merge(acc, block):
  """Online-softmax merge of two ``(o [b, s, h, d] float32, lse [b, h, s])`` partial
  results of the same rows."""
  return merge_partials(*acc, *block, expand=lambda w: jnp.moveaxis(w, 1, 2)[..., None])


def empty_rows(q, v):
  """``(0, EMPTY_ROW_LSE)`` for the rows of ``q [b, s, h, d]`` against values ``v [..,
  dv]``: ``o [b, s, h, dv]`` float32, ``lse [b, h, s]``. Built from q so that inside
  ``shard_map`` they vary over the mesh axis as q does (``lax.cond`` branches must
  agree)."""
  o = jnp.broadcast_to(jnp.zeros_like(q[..., :1], jnp.float32), q.shape[:-1] + v.shape[-1:])
  return o, jnp.moveaxis(o[..., 0], 1, 2) + EMPTY_ROW_LSE


def shift(x, axis_name: str, perm):
  """Sends ``x`` one hop along ``perm`` (``[(src, dst), ...]``) over ``axis_name``."""
  return lax.ppermute(x, axis_name, perm)
