"""K/V addressing: where a tile of keys (and of values) lies in global memory. One of
the two extension points of the Hopper pipeline (the other is ``work``).

An addressing is a hashable object with

- ``n_inputs``: how many extra kernel inputs it reads (index arrays such as a block
  table), passed after the kernel's other inputs;
- ``kv_len(k)``: the logical (padded) key positions per sequence, from K's shape;
- ``bind(refs) -> bound``: the bound addressing in a kernel, given its ``n_inputs``
  refs, with ``bound.tile(ref, batch, kv_head, start, size)``: the
  ``[size, head_dim]`` view of ``ref`` (K or V) holding logical key positions
  ``[start, start + size)`` of sequence ``batch`` and KV head ``kv_head``, which the
  producer copies by TMA. ``start`` is a multiple of ``size`` (the key tile).

Per-position inputs of the keys (segment ids, a mask function's parts) stay in
logical order: only K and V move.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class ContiguousKV:
  """K and V as ``[batch, kv_len, kv_heads, head_dim]``: a sequence's keys lie in
  order in its batch row."""

  n_inputs = 0

  def kv_len(self, k) -> int:
    return k.shape[1]

  def bind(self, refs) -> "ContiguousKV":
    del refs
    return self

  def tile(self, ref, batch, kv_head, start, size: int):
    return ref.at[batch, pl.ds(start, size), kv_head]
