"""Pieces shared by the rings (``ring``, ``dilated_ring``): one block's attention as
partial results ``(o float32, lse)`` and its gradients given the final row statistics,
both through the flash-attention op (so through the backend it resolves), the
online-softmax merge of partial results, and the one-hop shift around a ring."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jattn.flash import FLASH, FlashProblem
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, merge_partials


def block_problem(q, k, *, causal: bool, scale: float) -> FlashProblem:
  """The flash problem of ``q [b, sq, h, d]`` against ``k [b, sk, hk, d]``, with the
  row statistics a ring merges."""
  return FlashProblem.of(q, k, causal=causal, scale=scale, return_lse=True)


def ring_backend(q, k, *, causal: bool, scale: float, backend: str) -> str:
  """The backend every block of a ring runs: ``backend``, or what ``"auto"`` takes for
  the ring's blocks (it needs the row statistics: no cuDNN)."""
  return FLASH.prepare(block_problem(q, k, causal=causal, scale=scale), backend).impl.backend.name


def block_forward(q, k, v, *, causal: bool, scale: float, backend: str):
  """``(o float32, lse)`` of ``q [b, sq, h, d]`` against ``k, v [b, sk, hk, d]``."""
  call = FLASH.prepare(block_problem(q, k, causal=causal, scale=scale), backend)
  return FLASH.partial(call, (q, k, v, None, None, None, None, None))


def block_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, backend: str):
  """Float32 gradients of one block given the final ``o``, ``lse`` of the whole row."""
  call = FLASH.prepare(block_problem(q, k, causal=causal, scale=scale), backend)
  return FLASH.partial_backward(call, (q, k, v, None, None, None, None, None), o, lse, do)[:3]


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
