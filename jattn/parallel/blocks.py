"""Pieces shared by the rings (``ring``, ``dilated_ring``): one block's attention as
partial results ``(o float32, lse)`` and its gradients given the final row statistics,
both through the flash-attention op (so through the backend it resolves), the
online-softmax merge of partial results, the one-hop shift around a ring, and the two
ring passes (forward and backward) that move the blocks and the gradient accumulators.

Every hop sends one byte buffer, since XLA may run a second transfer of the same hop
synchronously, and ring blocks run the one-CTA-per-tile Hopper forward, since a
transfer's kernel holds SMs that a persistent kernel's static split counts on (the
measurements: docs/ring.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn.flash import FLASH, FlashProblem
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, merge_partials


def block_problem(q, k, v, *, causal: bool, scale: float,
                  segments: bool = False) -> FlashProblem:
  """The flash problem of ``q [b, sq, h, d]`` against ``k [b, sk, hk, d]`` and ``v
  [b, sk, hk, dv]``, with the row statistics a ring merges (``segments``: with
  segment ids)."""
  return FlashProblem.of(q, k, causal=causal, scale=scale, return_lse=True,
                         segment_ids=segments, value_head_dim=v.shape[-1])


def ring_backend(q, k, v, *, causal: bool, scale: float, backend: str,
                 segments: bool = False) -> str:
  """The backend every block of a ring runs: ``backend``, or what ``"auto"`` takes for
  the ring's blocks (it needs the row statistics: no cuDNN)."""
  problem = block_problem(q, k, v, causal=causal, scale=scale, segments=segments)
  return FLASH.prepare(problem, backend).impl.backend.name


def _beside_transfers(call):
  """``call`` with its forward kernel one CTA per tile where its config could run
  persistent (``persistent`` True, or None: the kernel's own choice; see the module
  docstring)."""
  if getattr(call.config, "persistent", False) is False:
    return call
  return FLASH.prepare(call.problem, call.impl.backend.name,
                       dataclasses.replace(call.config, persistent=False))


def block_forward(q, k, v, q_seg=None, kv_seg=None, *, causal: bool, scale: float,
                  backend: str):
  """``(o float32, lse)`` of ``q [b, sq, h, d]`` against ``k [b, sk, hk, d]`` and ``v
  [b, sk, hk, dv]`` (segment ids ``[b, sq]`` / ``[b, sk]`` or None)."""
  call = _beside_transfers(FLASH.prepare(
      block_problem(q, k, v, causal=causal, scale=scale, segments=q_seg is not None), backend))
  return FLASH.partial(call, (q, k, v, q_seg, kv_seg, None, None, None))


def block_backward(q, k, v, o, lse, do, q_seg=None, kv_seg=None, *, causal: bool,
                   scale: float, backend: str):
  """Float32 gradients of one block given the final ``o``, ``lse`` of the whole row."""
  call = FLASH.prepare(block_problem(q, k, v, causal=causal, scale=scale,
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


def _as_bytes(x):
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).reshape(-1)
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b, shape, dtype):
  if dtype == jnp.bool_:
    return b.reshape(shape) != 0
  width = np.dtype(dtype).itemsize
  return lax.bitcast_convert_type(b.reshape(shape + ((width,) if width > 1 else ())), dtype)


def pack(tree):
  """``(buffer, unpack)``: the arrays of ``tree`` (None leaves allowed) in one uint8
  buffer, and the function that restores the tree from such a buffer. One array is
  its own buffer."""
  leaves, treedef = jax.tree.flatten(tree)
  if len(leaves) == 1:
    return leaves[0], lambda buf: treedef.unflatten([buf])
  parts = [_as_bytes(x) for x in leaves]
  metas = [(x.shape, x.dtype) for x in leaves]
  cuts = np.cumsum([p.size for p in parts])[:-1].tolist()

  def unpack(buf):
    return treedef.unflatten([_from_bytes(b, *meta)
                              for b, meta in zip(jnp.split(buf, cuts), metas)])

  return jnp.concatenate(parts), unpack


def shift(tree, axis_name: str, perm):
  """Sends the arrays of ``tree`` one hop along ``perm`` (``[(src, dst), ...]``) over
  ``axis_name``, as one transfer."""
  buf, unpack = pack(tree)
  return unpack(lax.ppermute(buf, axis_name, perm))


def _needed(needed, step: int, blocks):
  """The step's work predicate, or None where it always runs (the first step, on the
  device's own blocks, always does)."""
  return None if needed is None or step == 0 else needed(step, blocks)


def _after(buf, work):
  """``buf``, held back until ``work`` (a tree of arrays) is computed. The hops of a
  forward ring depend only on each other, so XLA would otherwise run them all before
  the first block, all but one synchronously, instead of each beside its step's block
  (docs/ring.md)."""
  return lax.optimization_barrier((buf, work))[0]


def ring_forward(kv, steps: int, perm, attend, axis_name: str, needed=None):
  """The forward pass of a ring: ``kv`` (a tree of this device's blocks) travels
  ``steps - 1`` hops, hop ``i`` along ``perm(i)``, sent when step ``i``'s work starts
  so that the transfer overlaps it; returns the merge of ``attend(i, blocks held at
  step i)``, each an ``(o, lse)`` partial result. ``needed(i, blocks)``: whether step
  ``i`` has work (a bool array, or None: it has); without, its attention and merge
  are skipped."""
  buf, unpack = pack(kv)
  acc = None
  for step in range(steps):
    if acc is not None and step + 1 < steps:
      buf = _after(buf, acc)
    nxt = lax.ppermute(buf, axis_name, perm(step)) if step + 1 < steps else None
    blocks = kv if step == 0 else unpack(buf)
    pred = _needed(needed, step, blocks)
    if acc is None:  # (no merge with nothing first)
      acc = attend(step, blocks)
    elif pred is None:
      acc = merge(acc, attend(step, blocks))
    else:
      acc = lax.cond(pred, lambda acc: merge(acc, attend(step, blocks)), lambda acc: acc, acc)
    buf = nxt
  return acc


def ring_backward(kv, steps: int, perm, grads, axis_name: str, needed=None):
  """The backward pass of a ring: ``kv`` travels as in ``ring_forward``; ``grads(i,
  blocks)`` gives ``(dq part, tree of float32 gradients of the blocks)``, skipped where
  ``needed(i, blocks)`` is False. Returns ``(dq, gradients of this device's own
  blocks)``.

  Each block's gradient accumulator follows it one step behind: the hop that carries
  the blocks of step ``i + 1`` also carries the accumulators of step ``i - 1``'s blocks
  (one transfer, overlapping step ``i``'s work; the receiver adds its part at the end
  of step ``i``). After the last step the accumulators take one more hop, home."""
  buf, unpack = pack(kv)
  dq, out = None, None
  for step in range(steps):
    blocks = kv if step == 0 else unpack(buf)
    nxt = arrived = None
    if step + 1 < steps and out is not None and perm(step) == perm(step - 1):
      nxt, arrived = shift((buf, out), axis_name, perm(step))
    else:
      if step + 1 < steps:
        nxt = lax.ppermute(buf if out is None else _after(buf, out), axis_name, perm(step))
      if out is not None:
        arrived = shift(out, axis_name, perm(step - 1))
    pred = _needed(needed, step, blocks)
    if pred is None:
      g_q, g_blocks = grads(step, blocks)
      dq = g_q if dq is None else dq + g_q
      out = g_blocks if arrived is None else jax.tree.map(jnp.add, arrived, g_blocks)
    else:  # (not the first step: dq and the arrived accumulators exist)
      def add(dq, arrived):
        g_q, g_blocks = grads(step, blocks)
        return dq + g_q, jax.tree.map(jnp.add, arrived, g_blocks)

      dq, out = lax.cond(pred, add, lambda dq, arrived: (dq, arrived), dq, arrived)
    buf = nxt
  return dq, shift(out, axis_name, perm(steps - 1))
