"""All-gather context parallelism, ``ring_attention(..., kv_exchange="allgather")``:
each device gathers the whole sequence's K/V (and key segment ids) over the mesh axis
in one collective each, then attends its query shard to them with one flash call per
query chunk. A causal chunk's rows are bounded by a per-row key length (the flash
kernels' ``kv_lengths``, which align causal masks on it), so no step is merged with
another and, on the Pallas backends, no tile past a chunk's last key runs. The
backward gathers again, runs the kernels' float32 dK / dV of the whole sequence and
reduce-scatters them home.

With ``layout="segment_zigzag"`` a query chunk's keys are no prefix of the gathered
sequence; there each source's shard is attended as the ring's step would (``steps``)
and the partial results merged.

Against a ring it trades memory (each device holds the whole K/V during the call) for
one collective per pass instead of ``P - 1`` hops and merges, which pays where the hops
cost more than the one gather, as on 4 H100s on every dense row (docs/ring.md). Llama 3
trained its long-context stage this way, for the same reasons and for document masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jattn.flash import FLASH
from jattn.parallel.blocks import merge
from jattn.parallel.layout import zigzag_order, zigzag_restore
from jattn.parallel.steps import step_backward, step_forward


def _gathered(x, axis_name: str, devices: int, natural: bool):
  """``x [batch, n, ...]`` of every device, concatenated along axis 1 in device
  order, or in the sequence's order (``natural``: undo the zig-zag layout)."""
  if x is None:
    return None
  whole = lax.all_gather(x, axis_name, axis=1, tiled=True)
  return zigzag_restore(whole, devices) if natural else whole


def _query_chunks(q_len: int, devices: int, me, *, causal: bool, layout: str):
  """``[(local query rows, number of keys those rows' last one sees or None)]``."""
  if not causal:
    return [(slice(None), None)]
  if layout == "contiguous":
    return [(slice(None), (me + 1) * q_len)]
  half = q_len // 2  # zig-zag: chunks me and 2P - 1 - me
  return [(slice(None, half), (me + 1) * half), (slice(half, None), (2 * devices - me) * half)]


def _chunk_calls(st, q, q_seg, k, v, kv_seg):
  """Per query chunk ``(rows, prepared flash call, its arrays)``, the arrays holding
  the gathered K, V and key ids."""
  axis_name, causal, layout, scale, backend = st
  devices, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
  natural = causal and layout == "zigzag"
  k_all, v_all, seg_all = (_gathered(x, axis_name, devices, natural) for x in (k, v, kv_seg))
  calls = []
  for rows, keys in _query_chunks(q.shape[1], devices, me, causal=causal, layout=layout):
    lengths = None if keys is None else jnp.full((q.shape[0],), keys, jnp.int32)
    problem, arrays = FLASH.bind(q[:, rows], k_all, v_all, causal=causal, scale=scale,
                                 q_segment_ids=None if q_seg is None else q_seg[:, rows],
                                 kv_segment_ids=seg_all, return_lse=True, kv_lengths=lengths)
    calls.append((rows, FLASH.prepare(problem, backend), arrays))
  return calls


def _sources(st, q, k, v, kv_seg):
  """``[(source device, its K, V, key ids)]`` from the gathered shards (the segment
  zig-zag: each source's shard is a ring step's, ``steps``)."""
  axis_name = st[0]
  devices, n = lax.axis_size(axis_name), k.shape[1]
  k_all, v_all, seg_all = (_gathered(x, axis_name, devices, False) for x in (k, v, kv_seg))
  cut = lambda x, j: x[:, j * n:(j + 1) * n]
  return [(j, cut(k_all, j), cut(v_all, j), cut(seg_all, j)) for j in range(devices)]


def _step_options(st):
  axis_name, causal, layout, scale, backend = st
  return lax.axis_index(axis_name), dict(causal=causal, layout=layout, scale=scale,
                                         backend=backend)


def _forward(st, q, k, v, q_seg, kv_seg):
  if st[2] == "segment_zigzag":
    me, options = _step_options(st)
    parts = [step_forward(k_j, v_j, seg_j, q=q, q_seg=q_seg, src=j, me=me, **options)
             for j, k_j, v_j, seg_j in _sources(st, q, k, v, kv_seg)]
    o, lse = functools.reduce(merge, parts)
    return o.astype(q.dtype), lse
  parts = [FLASH.partial(call, arrays) for _, call, arrays in
           _chunk_calls(st, q, q_seg, k, v, kv_seg)]
  o = jnp.concatenate([o for o, _ in parts], axis=1).astype(q.dtype)
  return o, jnp.concatenate([lse for _, lse in parts], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def allgather_attention(st, q, k, v, q_seg, kv_seg):
  """The local output shard; ``st = (axis_name, causal, layout, scale, backend)``
  (``ring_attention`` checks the arguments and resolves the backend)."""
  return _forward(st, q, k, v, q_seg, kv_seg)[0]


def _fwd(st, q, k, v, q_seg, kv_seg):
  o, lse = _forward(st, q, k, v, q_seg, kv_seg)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _gradients(st, q, k, v, q_seg, kv_seg, o, lse, do):
  """``(dq, dK, dV)`` float32, the last two of the whole gathered sequence in the
  devices' order."""
  axis_name, causal, layout = st[:3]
  if layout == "segment_zigzag":
    me, options = _step_options(st)
    parts = [step_backward(q, k_j, v_j, o, lse, do, q_seg, seg_j, j, me, **options)
             for j, k_j, v_j, seg_j in _sources(st, q, k, v, kv_seg)]
    return (sum(g[0] for g in parts),
            *(jnp.concatenate([g[i] for g in parts], axis=1) for i in (1, 2)))
  dq, dk_all, dv_all = [], 0.0, 0.0
  for rows, call, arrays in _chunk_calls(st, q, q_seg, k, v, kv_seg):
    g_q, g_k, g_v = FLASH.partial_backward(call, arrays, o[:, rows], lse[:, :, rows],
                                           do[:, rows])[:3]
    dq.append(g_q)
    dk_all, dv_all = dk_all + g_k, dv_all + g_v
  if causal and layout == "zigzag":  # back to the devices' order
    devices = lax.axis_size(axis_name)
    dk_all, dv_all = zigzag_order(dk_all, devices), zigzag_order(dv_all, devices)
  return jnp.concatenate(dq, axis=1), dk_all, dv_all


def _bwd(st, res, do):
  q, k, v, q_seg, kv_seg, o, lse = res
  dq, dk_all, dv_all = _gradients(st, q, k, v, q_seg, kv_seg, o, lse, do)
  dk, dv = (lax.psum_scatter(g, st[0], scatter_dimension=1, tiled=True)
            for g in (dk_all, dv_all))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


allgather_attention.defvjp(_fwd, _bwd)
