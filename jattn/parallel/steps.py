"""One step of a context-parallel exchange: the local queries against the K/V shard of
device ``src``, as the sequence's layout makes it (``layout``). Shared by the ring
(one source per hop) and the all-gather exchange of the segment zig-zag layout (every
source, gathered).

- ``contiguous`` (device ``i`` holds chunk ``i``): a causal step is the diagonal
  (``src == me``), whole (``src < me``) or empty (``src > me``, skipped).
- ``zigzag`` (chunks ``i`` and ``2P - 1 - i``): the diagonal; for ``src < me`` every
  local query sees the source's first chunk; for ``src > me`` the local second chunk
  sees all of the source.
- ``segment_zigzag`` (that per segment, segment by segment, ``layout``): the same three
  cases, within each segment. The local shard holds one run per segment, its first
  half the earlier chunk; off the diagonal the step doubles the ids and marks the
  halves (``2 id`` / ``2 id + 1``), so that segment ids alone say which halves meet.
  Ids increasing along the sequence stay sorted so, and the kernels visit only the
  tiles of each document.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jattn.parallel.blocks import block_backward, block_forward, empty_rows, segments_meet
from jattn.parallel.layout import segment_zigzag_halves


def _rows(x, rows: slice):
  """``x[:, rows]``, or None for absent segment ids."""
  return None if x is None else x[:, rows]


def step_needed(q_seg, kv_seg, src, me, *, causal: bool, layout: str):
  """Whether the step against device ``src``'s shard has work (None: every step has):
  not for a later source of a contiguous causal ring, nor where the segment ids of the
  two shards cannot meet. The drivers skip such a step's attention and merge."""
  needed = [src <= me] if causal and layout == "contiguous" else []
  if q_seg is not None and layout != "segment_zigzag":  # there every shard meets every other
    needed.append(segments_meet(q_seg, kv_seg))
  return functools.reduce(jnp.logical_and, needed) if needed else None


def _step(run, earlier, later, q_seg, kv_seg, src, me, *, causal: bool, layout: str):
  """A step by the layout's cases: ``run(q ids, kv ids, causal)`` against the whole
  shard, ``earlier()`` / ``later()`` the zig-zags' steps against a source before /
  after this device."""
  if not causal:
    return run(q_seg, kv_seg, False)
  diagonal = lambda: run(q_seg, kv_seg, True)
  if layout == "contiguous":
    return lax.cond(src == me, diagonal, lambda: run(q_seg, kv_seg, False))
  return lax.cond(src == me, diagonal, lambda: lax.cond(src < me, earlier, later))


def _segment_halves(run, q_seg, kv_seg):
  """``(earlier, later)`` of a ``segment_zigzag`` step: the ids become ``2 id + half``
  (``half``: 1 in a run's second half, the later chunk), so that against an earlier
  source queries meet only the keys of first halves, against a later one only
  second-half queries meet keys."""
  def earlier():
    return run(2 * q_seg, 2 * kv_seg + segment_zigzag_halves(kv_seg), False)

  def later():
    return run(2 * q_seg + segment_zigzag_halves(q_seg), 2 * kv_seg + 1, False)

  return earlier, later


def _chunks(n: int) -> tuple[slice, slice]:
  """A zig-zag shard's two chunks."""
  return slice(None, n // 2), slice(n // 2, None)


def _forward_chunks(block, q, k, v, q_seg, kv_seg):
  """``(earlier, later)`` of a ``zigzag`` forward step."""
  half, rest = _chunks(q.shape[1])

  def earlier():  # every local query sees the source's first chunk
    return block(q, k[:, half], v[:, half], q_seg, _rows(kv_seg, half), causal=False)

  def later():  # only the local second chunk sees the source, all of it
    o, lse = block(q[:, rest], k, v, _rows(q_seg, rest), kv_seg, causal=False)
    o0, l0 = empty_rows(q[:, half], v)
    return jnp.concatenate([o0, o], axis=1), jnp.concatenate([l0, lse], axis=2)

  return earlier, later


def _backward_chunks(grads, q, k, v, o, lse, do, q_seg, kv_seg):
  """``(earlier, later)`` of a ``zigzag`` backward step."""
  half, rest = _chunks(q.shape[1])

  def earlier():
    dq, dk, dv = grads(q, k[:, half], v[:, half], o, lse, do, q_seg, _rows(kv_seg, half),
                       causal=False)
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
    return dq, pad(dk), pad(dv)

  def later():
    dq, dk, dv = grads(q[:, rest], k, v, o[:, rest], lse[:, :, rest], do[:, rest],
                       _rows(q_seg, rest), kv_seg, causal=False)
    return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

  return earlier, later


def step_forward(k, v, kv_seg, *, q, q_seg, src, me, causal, layout, scale, backend):
  """``(o float32, lse)`` of the local queries against the K/V shard of device ``src``,
  a step with work (``step_needed``)."""
  block = functools.partial(block_forward, scale=scale, backend=backend)
  run = lambda qs, ks, c: block(q, k, v, qs, ks, causal=c)
  halves = (_segment_halves(run, q_seg, kv_seg) if layout == "segment_zigzag" else
            _forward_chunks(block, q, k, v, q_seg, kv_seg))
  return _step(run, *halves, q_seg, kv_seg, src, me, causal=causal, layout=layout)


def step_backward(q, k, v, o, lse, do, q_seg, kv_seg, src, me, *, causal, layout, scale,
                  backend):
  """``(dq, dk, dv)`` float32 of the local queries against device ``src``'s shard, a
  step with work."""
  grads = functools.partial(block_backward, scale=scale, backend=backend)
  run = lambda qs, ks, c: grads(q, k, v, o, lse, do, qs, ks, causal=c)
  halves = (_segment_halves(run, q_seg, kv_seg) if layout == "segment_zigzag" else
            _backward_chunks(grads, q, k, v, o, lse, do, q_seg, kv_seg))
  return _step(run, *halves, q_seg, kv_seg, src, me, causal=causal, layout=layout)
