"""Ring attention: exact attention over a sequence sharded across devices;
``ring_attention`` runs inside ``shard_map``, K/V blocks passed around a ring with
``jax.lax.ppermute``.

Forward: each device keeps its query shard and an online-softmax merge of
``(o, lse)`` while the K/V shards travel; the next shard is sent before the current
one is used, so XLA can overlap the transfer with the block's attention. Backward,
also a ring: with the final ``(o, lse)``, every block's gradient is plain attention
backward (``p = exp(s - lse)``); dK / dV accumulators travel one step behind their
K / V shard, in the same transfer, and arrive home after a full turn
(``blocks.ring_forward`` / ``ring_backward``).

Causal load balance (``layout="zigzag"``): the sequence is cut into ``2P`` chunks and
device ``i`` holds chunks ``i`` and ``2P - 1 - i`` (``zigzag_order`` arranges a
sequence so); then at every step each device does half a block of unmasked work,
so no device idles. With ``layout="contiguous"`` (device ``i`` holds chunk ``i``)
causal rings leave later devices the most work. For packed sequences
``layout="segment_zigzag"`` applies the zig-zag to every document (``steps``), which
balances the work whatever the documents' lengths.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from jattn.core.validation import (check_attention_inputs, check_choice, check_flag, scale_of,
                                   segment_ids_arg)
from jattn.flash import FLASH
from jattn.parallel.allgather import allgather_attention
from jattn.parallel.blocks import ring_backend, ring_backward, ring_forward
from jattn.parallel.checks import bound_axis_size, check_split, mesh_axis_size
from jattn.parallel.layout import (LAYOUTS, check_segment_zigzag, segment_zigzag_order,
                                   segment_zigzag_restore, zigzag_order, zigzag_restore)
from jattn.parallel.steps import step_backward, step_forward, step_needed

# How the K/V shards reach every device: around a ring, or in one all-gather.
KV_EXCHANGES = ("ring", "allgather")

# --- the ring -------------------------------------------------------------------------

def _ring_hop(devices: int, step: int):
  """The ``ppermute`` pairs of every hop: one step along the ring."""
  del step
  return [(i, (i + 1) % devices) for i in range(devices)]


def _needed(st, q_seg, devices: int, me):
  """The drivers' ``needed(step, blocks)``: ``step_needed`` of the step's source."""
  _, causal, layout = st[:3]
  return lambda step, blocks: step_needed(q_seg, blocks[2], (me - step) % devices, me,
                                           causal=causal, layout=layout)


def _ring_forward(st, q, k, v, q_seg, kv_seg):
  axis_name, causal, layout, scale, backend = st
  devices, me = lax.axis_size(axis_name), lax.axis_index(axis_name)

  def attend(step, blocks):  # the key segment ids travel with their shard
    return step_forward(*blocks, q=q, q_seg=q_seg, src=(me - step) % devices, me=me,
                         causal=causal, layout=layout, scale=scale, backend=backend)

  return ring_forward((k, v, kv_seg), devices, functools.partial(_ring_hop, devices), attend,
                      axis_name, _needed(st, q_seg, devices, me))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st, q, k, v, q_seg, kv_seg):
  o, _ = _ring_forward(st, q, k, v, q_seg, kv_seg)
  return o.astype(q.dtype)


def _ring_fwd(st, q, k, v, q_seg, kv_seg):
  o, lse = _ring_forward(st, q, k, v, q_seg, kv_seg)
  o = o.astype(q.dtype)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _ring_bwd(st, res, do):
  axis_name, causal, layout, scale, backend = st
  q, k, v, q_seg, kv_seg, o, lse = res
  devices, me = lax.axis_size(axis_name), lax.axis_index(axis_name)

  def grads(step, blocks):
    g_q, g_k, g_v = step_backward(q, blocks[0], blocks[1], o, lse, do, q_seg, blocks[2],
                                   (me - step) % devices, me, causal=causal, layout=layout,
                                   scale=scale, backend=backend)
    return g_q, (g_k, g_v)

  dq, (dk, dv) = ring_backward((k, v, kv_seg), devices, functools.partial(_ring_hop, devices),
                               grads, axis_name, _needed(st, q_seg, devices, me))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check_layout(layout: str, q, q_seg, kv_seg) -> None:
  """The local shards' needs of ``layout`` (the segment ids or None)."""
  if layout != "contiguous" and q.shape[1] % 2:
    raise ValueError(f"layout={layout!r} needs an even local sequence length, got {q.shape[1]}")
  if layout == "segment_zigzag":
    if q_seg is None or kv_seg is None:
      raise ValueError("layout='segment_zigzag' needs q_segment_ids and kv_segment_ids (it "
                       "lays out each segment); without them use layout='zigzag'")


def _check_causal_segments(q_ids, kv_ids, causal: bool) -> None:
  """A causal segment zig-zag orders queries and keys within each segment, not across
  segments: refused where concrete ids are cut into other segments, or where a query
  segment's id names a key segment other than its own (a query segment whose id no
  key has is fine: it gives zeros). Traced ids are not checked."""
  if not causal or any(isinstance(x, jax.core.Tracer) for x in (q_ids, kv_ids)):
    return
  q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
  if not np.array_equal(np.diff(q_ids, axis=1) != 0, np.diff(kv_ids, axis=1) != 0):
    raise ValueError("layout='segment_zigzag' with causal=True needs kv_segment_ids cut into "
                     "the same segments as q_segment_ids (queries and keys laid out alike)")
  for b, (q_row, kv_row) in enumerate(zip(q_ids, kv_ids)):
    elsewhere = (q_row != kv_row) & np.isin(q_row, kv_row)
    if elsewhere.any():
      t = int(np.argmax(elsewhere))
      raise ValueError(
          f"layout='segment_zigzag' with causal=True: row {b}'s query segment at token {t} has "
          f"id {q_row[t]}, which names another segment of the keys (its own keys have id "
          f"{kv_row[t]}); a query segment may attend only its own keys, or none")


def _check_causal_lengths(q, k, causal: bool, shards: str) -> None:
  """A causal ring masks over one global sequence: query ``i`` against key ``i``. The
  bottom-right alignment ``flash_attention`` gives ``kv_len != q_len`` would move every
  block's diagonal by a device-dependent offset; it is refused, not approximated."""
  if causal and q.shape[1] != k.shape[1]:
    raise ValueError(
        f"causal=True needs q and k of one sequence length{shards}, got q {tuple(q.shape)} and "
        f"k {tuple(k.shape)}: a causal ring masks one global sequence, and the bottom-right "
        "alignment of kv_len != q_len is not supported; use causal=False, or "
        "jattn.flash_attention on one device")


def ring_attention(q, k, v, *, axis_name: str, causal: bool = False, scale: float | None = None,
                   layout: str = "contiguous", backend: str = "auto", q_segment_ids=None,
                   kv_segment_ids=None, kv_exchange: str = "ring"):
  """Exact attention over a sequence sharded on mesh axis ``axis_name``; call it
  inside ``shard_map`` with the sequence axis split over ``axis_name``.

  Args:
    q: the local ``[batch, seq / P, heads, head_dim]`` shard; k: ``[batch, kv_len / P,
      kv_heads, head_dim]``, v: ``[batch, kv_len / P, kv_heads, head_dim_v]``
      (grouped-query attention allowed; ``head_dim_v`` may differ from ``head_dim``).
    axis_name: the mesh axis the sequence is split over, one ``shard_map`` maps.
    causal: causal over the global sequence (a bool); needs ``kv_len == seq``
      (``flash_attention``'s bottom-right alignment of ``kv_len != q_len`` is not
      supported over a ring: a ValueError says so). Without ``causal`` any ``kv_len``.
    layout: how the global sequence sits on the devices: ``"contiguous"`` (device
      ``i`` holds chunk ``i``), ``"zigzag"`` (chunks ``i`` and ``2P - 1 - i``, see
      ``zigzag_order``; balances causal work, needs an even local length) or
      ``"segment_zigzag"`` (packed sequences: that zig-zag applied to every segment,
      see ``segment_zigzag_order``; balances causal and non-causal work whatever the
      documents' lengths, needs segment ids, and with ``causal`` query and key ids
      cut into the same segments, each query segment's id that of its own keys or of
      no key: a segment attends within itself, causally by position).
    backend: the blocks' backend, one of ``jattn.flash_attention``'s that gives the
      row statistics (``"auto"``: the first such that runs here; with
      ``kv_exchange="allgather"``, chosen per query chunk as ``flash_attention`` would).
    q_segment_ids, kv_segment_ids: the local shards ``[batch, seq / P]`` / ``[batch,
      kv_len / P]`` of integer segment ids (packed sequences, laid out as q and k are):
      a query attends only to keys of its segment. The key ids travel with their K/V
      shard; in the plain layouts a ring step whose ids cannot meet (their ranges per
      batch row do not overlap) is skipped, and the blocks skip the tiles no segment
      needs.
    kv_exchange: ``"ring"`` (the K/V shards travel ``P - 1`` hops; each device holds
      two shards at a time) or ``"allgather"`` (each device gathers the whole K/V in
      one collective and attends its queries to it, one flash call per query chunk
      (per source shard with ``"segment_zigzag"``), and the backward reduce-scatters
      dK / dV home: ``P`` times the K/V memory, one collective instead of ``P - 1``
      hops; see ``jattn.parallel.allgather``). Same results, same layouts and segment
      ids.

  Returns:
    the local output shard ``[batch, seq / P, heads, head_dim_v]`` in q's dtype.
    Differentiable: the backward runs as a ring too (or gathers again and
    reduce-scatters) and returns each device's dK / dV home.
  """
  check_choice("layout", layout, LAYOUTS)
  check_choice("kv_exchange", kv_exchange, KV_EXCHANGES)
  causal = check_flag("causal", causal)
  _, arrays = FLASH.bind(q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
                         kv_segment_ids=kv_segment_ids)  # the flash checks, on the local shards
  q_seg, kv_seg = arrays[3:5]
  _check_causal_lengths(q, k, causal, " (here: the local shards)")
  _check_layout(layout, q, q_seg, kv_seg)
  bound_axis_size(axis_name, "ring_attention")  # now, so that an unknown axis is named
  scale = scale_of(scale, q.shape[-1])
  if kv_exchange == "allgather":
    # One flash call per query chunk: "auto" chooses for each as flash_attention would.
    return allgather_attention((axis_name, causal, layout, scale, backend), q, k, v, q_seg,
                               kv_seg)
  name = ring_backend(q, k, v, causal=causal, scale=scale, backend=backend,
                      segments=q_seg is not None)
  return _ring((axis_name, causal, layout, scale, name), q, k, v, q_seg, kv_seg)


def sharded_ring_attention(q, k, v, *, mesh, axis_name: str, causal: bool = False,
                           scale: float | None = None, layout: str = "contiguous",
                           backend: str = "auto", q_segment_ids=None, kv_segment_ids=None,
                           kv_exchange: str = "ring"):
  """``ring_attention`` on whole arrays (``q [batch, seq, heads, head_dim]``, k, v
  ``[batch, kv_len, kv_heads, head_dim(_v)]``) in their natural order: shards the
  sequence over ``mesh``'s ``axis_name`` with ``shard_map`` (ordered for the layout
  first and restored after for ``"zigzag"`` and ``"segment_zigzag"``), so the caller
  needs no ``shard_map``.

  ``seq`` and ``kv_len`` must be multiples of the axis size (twice it for the
  zig-zags; for ``"segment_zigzag"`` every segment's length, see
  ``segment_zigzag_order``); ``causal`` needs ``kv_len == seq``. Segment ids:
  ``[batch, seq]`` / ``[batch, kv_len]``, sharded (and ordered) as q and k. The
  ``shard_map`` runs with ``check_vma=False``: Pallas calls inside it declare no
  per-axis variance.
  """
  check_choice("layout", layout, LAYOUTS)
  check_choice("kv_exchange", kv_exchange, KV_EXCHANGES)
  causal = check_flag("causal", causal)
  check_attention_inputs(q, k, v, value_head_dim=True)  # on the whole arrays: errors name them
  _check_causal_lengths(q, k, causal, "")
  q_segment_ids, kv_segment_ids = segment_ids_arg(q_segment_ids, kv_segment_ids, q.shape[0],
                                                  q.shape[1], k.shape[1])
  devices = mesh_axis_size(mesh, axis_name)
  check_split({"q": q, "k": k}, devices=devices, axis_name=axis_name,
              chunks=1 if layout == "contiguous" else 2)
  if layout == "segment_zigzag":
    _check_layout(layout, q, q_segment_ids, kv_segment_ids)
    for name, ids in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
      check_segment_zigzag(ids, devices, name)
    _check_causal_segments(q_segment_ids, kv_segment_ids, causal)
  scale = scale_of(scale, q.shape[-1])  # a number: the compiled program's key
  ids = () if q_segment_ids is None and kv_segment_ids is None else (
      q_segment_ids, kv_segment_ids)
  return _sharded_ring((mesh, axis_name, causal, scale, layout, backend, kv_exchange),
                       q, k, v, ids)


# One program per call, also when called eagerly (shard_map alone runs op by op).
@functools.partial(jax.jit, static_argnums=0)
def _sharded_ring(options, q, k, v, ids):
  mesh, axis_name, causal, scale, layout, backend, kv_exchange = options
  devices = mesh_axis_size(mesh, axis_name)
  spec = jax.sharding.PartitionSpec(None, axis_name, None, None)

  def local(q, k, v, *ids):
    segments = dict(zip(("q_segment_ids", "kv_segment_ids"), ids))
    return ring_attention(q, k, v, axis_name=axis_name, causal=causal, scale=scale,
                          layout=layout, backend=backend, kv_exchange=kv_exchange, **segments)

  ids_spec = jax.sharding.PartitionSpec(None, axis_name)
  ring = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (ids_spec,) * len(ids),
                       out_specs=spec, check_vma=False)
  # The inputs and the output sharded as the ring runs (and so their gradients): XLA's
  # propagation lost it through the segment zig-zag's gathers at batch 1.
  sharded = lambda x: lax.with_sharding_constraint(x, jax.NamedSharding(mesh, spec))
  q, k, v = map(sharded, (q, k, v))
  if layout == "zigzag":
    ordered = (zigzag_order(x, devices) for x in (q, k, v, *ids))
    return sharded(zigzag_restore(ring(*ordered), devices))
  if layout == "segment_zigzag":
    # Ids a caller's jit closes over would be constants here, which XLA's GPU compiler
    # folds through the layout's sort and scans for minutes (docs/ring.md).
    q_ids, kv_ids = lax.optimization_barrier(ids)  # one permutation for each side's arrays
    q_laid, q_ids_laid = segment_zigzag_order((q, q_ids), q_ids, devices)
    k_laid, v_laid, kv_ids_laid = segment_zigzag_order((k, v, kv_ids), kv_ids, devices)
    return sharded(segment_zigzag_restore(ring(q_laid, k_laid, v_laid, q_ids_laid,
                                               kv_ids_laid), q_ids, devices))
  return sharded(ring(q, k, v, *ids))
