"""Dilated ring attention: LongNet's dilated attention (``jattn.dilated_attention``)
over a sequence sharded contiguously across devices; ``dilated_ring_attention`` runs
inside ``shard_map``.

Per pair ``(w, r)``, with ``L`` positions per device:

- ``w <= L`` (``L % w == 0``): every segment lies on one device; no communication.
  These pairs run as one ``jattn.dilated_attention`` mixture on the shard (the
  in-place kernels with the Pallas backend), and the rest merge into it.
- ``w > L`` (``w % L == 0``, or ``w >= seq``): a segment spans a group of ``G = w / L``
  consecutive devices (the last group may be smaller). Each device gathers its
  *sparsified* K/V, only the rows ``≡ h (mod r)`` that some head reads (``1 / r`` of
  the shard for plain multi-head attention), and those travel around the group's
  ring with ``ppermute`` while the current block is computed, merged with an online
  softmax as in ``ring``.

All pairs' partial results are merged into one ``(o, lse)``: LongNet's mixing
``Σ softmax_i(lse_i) O_i`` is exactly that merge. The backward runs the same rings
with the final ``(o, lse)`` (every block is plain attention backward with
``p = exp(s - lse)``), so gradients are exact, mixing weights included; the
sparsified dK / dV travel home and are scattered back into the shard.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jattn.core.op import Call
from jattn.core.validation import check_flag, scale_of
from jattn.dilated import DILATED
from jattn.kernels.common.softmax import EMPTY_ROW_LSE
from jattn.parallel.blocks import (block_backward, block_forward, empty_rows, merge,
                                   ring_backward, ring_forward)
from jattn.parallel.checks import bound_axis_size, check_split, mesh_axis_size


@dataclasses.dataclass(frozen=True)
class _Pair:
  """One ``(w, r)`` pair as it falls on ``devices`` shards of ``local`` positions."""
  w: int
  r: int
  slots: tuple[int, ...]        # per query head: its slot h mod r
  combos: tuple[tuple[int, int], ...]  # the (kv head, slot) rows that are sent
  head_combo: tuple[int, ...]   # per query head: its index in combos
  group: int                    # devices one segment spans (1: no communication)


@dataclasses.dataclass(frozen=True)
class _Static:
  axis_name: str
  devices: int
  pairs: tuple[_Pair, ...]
  causal: bool
  scale: float
  backend: str
  local: Call | None  # the dilated op's call for the pairs that stay on a device


def plan_pair(w: int, r: int, *, local: int, devices: int, heads: int, kv_heads: int) -> _Pair:
  """How pair ``(w, r)`` maps onto ``devices`` shards of ``local`` positions each."""
  seq = local * devices
  if local % r:
    raise ValueError(f"dilation_rates: the local sequence length {local} ({seq} over {devices} "
                     f"devices) must be a multiple of every dilation rate, got r={r}")
  if w <= local and local % w == 0:
    group = 1
  elif w >= seq:
    group = devices
  elif w > local and w % local == 0:
    group = w // local
  else:
    raise ValueError(f"segment_lengths: {w} must divide the local sequence length {local}, "
                     f"be a multiple of it, or reach the whole sequence {seq} (segments may "
                     "not straddle a device boundary)")
  group_size = heads // kv_heads
  slots = tuple(h % r for h in range(heads))
  combos = tuple(sorted({(h // group_size, h % r) for h in range(heads)}))
  head_combo = tuple(combos.index((h // group_size, h % r)) for h in range(heads))
  return _Pair(w=w, r=r, slots=slots, combos=combos, head_combo=head_combo, group=group)


# --- between the shard and a spanning pair's dilated rows -----------------------------

def _queries(x, pair: _Pair):
  """``[b, L, heads, D] -> [b, L / r, heads, D]``: each head's rows of its slot."""
  b, n, h, d = x.shape
  return x.reshape(b, n // pair.r, pair.r, h, d)[:, :, jnp.array(pair.slots), jnp.arange(h), :]


def _sparse_kv(x, pair: _Pair):
  """``[b, L, kv_heads, D] -> [b, L / r, len(combos), D]``: the rows sent."""
  b, n, hk, d = x.shape
  slot = jnp.array([s for _, s in pair.combos])
  head = jnp.array([g for g, _ in pair.combos])
  return x.reshape(b, n // pair.r, pair.r, hk, d)[:, :, slot, head, :]


def _per_head(x, pair: _Pair):
  """Sparsified ``[.., combos, D]`` rows -> one per query head ``[.., heads, D]``."""
  return x[:, :, jnp.array(pair.head_combo), :]


def _row_stats(lse, pair: _Pair):
  """``lse [b, heads, L] -> [b, heads, L / r]`` at each head's slot."""
  b, h, n = lse.shape
  return jnp.take_along_axis(lse.reshape(b, h, n // pair.r, pair.r),
                             jnp.array(pair.slots).reshape(1, h, 1, 1), axis=3)[..., 0]


def _scatter(o, lse, pair: _Pair):
  """A pair's ``(o [b, rows, h, D], lse [b, h, rows])`` back on the shard's positions;
  positions the pair does not cover get ``(0, EMPTY_ROW_LSE)``."""
  b, rows, h, d = o.shape
  covered = jnp.arange(pair.r)[:, None] == jnp.array(pair.slots)[None, :]  # [r, h]
  o = jnp.where(covered[None, None, :, :, None], o[:, :, None], 0.0)
  lse = jnp.where(covered.T[None, :, None, :], lse[..., None], EMPTY_ROW_LSE)
  return o.reshape(b, rows * pair.r, h, d), lse.reshape(b, h, rows * pair.r)


# --- the group rings -------------------------------------------------------------------

def _group_of(devices: int, group: int):
  """Per device: its group's first device and size (the last group may be short)."""
  first = [(i // group) * group for i in range(devices)]
  size = [min(group, devices - f) for f in first]
  return first, size


def _hop(devices: int, group: int, step: int):
  """The ``ppermute`` pairs of hop ``step``: one turn of each group's ring; groups
  shorter than ``step + 1`` stay put, so after ``group`` hops every block is home."""
  first, size = _group_of(devices, group)
  return [(i, first[i] + (i - first[i] + 1) % size[i] if step < size[i] else i)
          for i in range(devices)]


def _position(st: _Static, pair: _Pair, step: int):
  """``(local index in the group, source's local index, whether the step is real)``."""
  first, size = _group_of(st.devices, pair.group)
  me = lax.axis_index(st.axis_name)
  mine = me - jnp.array(first)[me]
  group_size = jnp.array(size)[me]
  return mine, (mine - step) % group_size, step < group_size


def _needed(st: _Static, pair: _Pair, step: int):
  """Whether a step of the pair's group ring has work: it is real (in a short group the
  steps past its size are not: their source index wraps onto blocks already counted)
  and, if causal, its source is not a later device of the group."""
  mine, src, real = _position(st, pair, step)
  return real & (src <= mine) if st.causal else real


def _attend(st: _Static, q, k, v, src, mine):
  """One block's ``(o, lse)`` of a step with work: causal against itself, full
  against earlier devices of the group (or all of them when not causal)."""
  block = functools.partial(block_forward, scale=st.scale, backend=st.backend)
  if not st.causal:
    return block(q, k, v, causal=False)
  return lax.cond(src == mine, lambda: block(q, k, v, causal=True),
                  lambda: block(q, k, v, causal=False))


def _attend_backward(st: _Static, q, k, v, o, lse, do, src, mine):
  grads = functools.partial(block_backward, scale=st.scale, backend=st.backend)
  if not st.causal:
    return grads(q, k, v, o, lse, do, causal=False)
  return lax.cond(src == mine, lambda: grads(q, k, v, o, lse, do, causal=True),
                  lambda: grads(q, k, v, o, lse, do, causal=False))


def _pair_forward(st: _Static, pair: _Pair, q, k, v):
  """``(o, lse)`` of one spanning pair on the shard's positions: its group's ring."""
  qd = _queries(q, pair)

  def attend(step, blocks):
    mine, src, _ = _position(st, pair, step)
    return _attend(st, qd, *(_per_head(x, pair) for x in blocks), src, mine)

  acc = ring_forward((_sparse_kv(k, pair), _sparse_kv(v, pair)), pair.group,
                     functools.partial(_hop, st.devices, pair.group), attend, st.axis_name,
                     lambda step, blocks: _needed(st, pair, step))
  return _scatter(*acc, pair)


def _forward(st: _Static, q, k, v):
  acc = DILATED.partial(st.local, (q, k, v)) if st.local else empty_rows(q, v)
  for pair in st.pairs:
    if pair.group > 1:
      acc = merge(acc, _pair_forward(st, pair, q, k, v))
  return acc


def _pair_backward(st: _Static, pair: _Pair, q, k, v, o, lse, do):
  """``(dq, dk, dv)`` float32 of one spanning pair's blocks, given the mixture's
  ``(o, lse)``."""
  # The gathers are linear: their transposes scatter the gradients back. Taken as VJPs
  # at the arrays themselves, so that they vary over the axes those do (a user's
  # shard_map checks it).
  transpose = lambda f, x: jax.vjp(f, x.astype(jnp.float32))[1]
  pull_q = transpose(lambda x: _queries(x, pair), q)
  pull_kv = transpose(lambda x: _sparse_kv(x, pair), k)
  qd, od, dod = (_queries(x, pair) for x in (q, o, do))
  lsed = _row_stats(lse, pair)
  kc, vc = _sparse_kv(k, pair), _sparse_kv(v, pair)
  to_combos = transpose(lambda x: _per_head(x, pair), kc)

  def grads(step, blocks):
    mine, src, _ = _position(st, pair, step)
    g_q, g_k, g_v = _attend_backward(st, qd, _per_head(blocks[0], pair),
                                     _per_head(blocks[1], pair), od, lsed, dod, src, mine)
    return g_q, (to_combos(g_k)[0], to_combos(g_v)[0])

  dq, (dk, dv) = ring_backward((kc, vc), pair.group,
                               functools.partial(_hop, st.devices, pair.group), grads,
                               st.axis_name, lambda step, blocks: _needed(st, pair, step))
  return pull_q(dq)[0], pull_kv(dk)[0], pull_kv(dv)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dilated_ring(st: _Static, q, k, v):
  return _forward(st, q, k, v)[0].astype(q.dtype)


def _dilated_ring_fwd(st: _Static, q, k, v):
  o, lse = _forward(st, q, k, v)
  o = o.astype(q.dtype)
  return o, (q, k, v, o, lse)


def _dilated_ring_bwd(st: _Static, res, do):
  q, k, v, o, lse = res
  if st.local:
    dq, dk, dv = DILATED.partial_backward(st.local, (q, k, v), o, lse, do)
  else:
    dq, dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
  for pair in st.pairs:
    if pair.group > 1:
      g_q, g_k, g_v = _pair_backward(st, pair, q, k, v, o, lse, do)
      dq, dk, dv = dq + g_q, dk + g_k, dv + g_v
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_dilated_ring.defvjp(_dilated_ring_fwd, _dilated_ring_bwd)


def dilated_ring_attention(q, k, v, *, axis_name: str, segment_lengths, dilation_rates,
                           causal: bool = False, scale: float | None = None,
                           backend: str = "auto"):
  """``jattn.dilated_attention`` over a sequence split contiguously along mesh axis
  ``axis_name``; call it inside ``shard_map`` (device ``i`` holds positions
  ``[i L, (i + 1) L)``).

  Args:
    q: the local ``[batch, L, heads, head_dim]`` shard; k, v: ``[batch, L, kv_heads,
      head_dim]`` (self-attention: one sequence length, as ``jattn.dilated_attention``).
    axis_name: the mesh axis the sequence is split over, one ``shard_map`` maps.
    segment_lengths, dilation_rates: the pairs ``(w_i, r_i)`` as in
      ``jattn.dilated_attention``; ``L`` must be a multiple of every ``r_i``, and each
      ``w_i`` must divide ``L``, be a multiple of it, or cover the whole sequence
      (segments never straddle a device boundary).
    causal: within segments, over the global positions (a bool).
    backend: ``"auto"`` (the shard's own pairs run ``dilated_attention``'s choice for
      them, the rings' blocks ``flash_attention``'s for theirs: on an H100 the Hopper
      kernels where they run), or one of ``"pallas_mosaic"``, ``"pallas_triton"``,
      ``"xla"`` for both.

  Returns:
    the local output shard, like ``q``; equal to ``jattn.dilated_attention`` on the
    whole sequence. Differentiable (exact gradients, mixing weights included).
  """
  problem, _ = DILATED.bind(q, k, v, segment_lengths=segment_lengths,
                            dilation_rates=dilation_rates, causal=check_flag("causal", causal),
                            scale=scale)
  devices = bound_axis_size(axis_name, "dilated_ring_attention")
  _, local, heads, head_dim = q.shape
  pairs = tuple(plan_pair(w, r, local=local, devices=devices, heads=heads, kv_heads=k.shape[2])
                for w, r in problem.pairs)
  on_device = [p for p in pairs if p.group == 1]
  local_call = DILATED.prepare(dataclasses.replace(
      problem, segment_lengths=tuple(p.w for p in on_device),
      dilation_rates=tuple(p.r for p in on_device)), backend) if on_device else None
  st = _Static(axis_name=axis_name, devices=devices, pairs=pairs, causal=problem.causal,
               scale=problem.scale, backend=backend, local=local_call)
  return _dilated_ring(st, q, k, v)


def sharded_dilated_ring_attention(q, k, v, *, mesh, axis_name: str, segment_lengths,
                                   dilation_rates, causal: bool = False,
                                   scale: float | None = None, backend: str = "auto"):
  """``dilated_ring_attention`` on whole ``[batch, seq, heads, head_dim]`` arrays: shards
  the sequence over ``mesh``'s ``axis_name`` with ``shard_map`` (``check_vma=False``,
  as Pallas calls declare no per-axis variance). ``seq`` must be a multiple of the
  axis size."""
  # The dilated checks on the whole arrays, so that errors name their shapes.
  DILATED.bind(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
               causal=check_flag("causal", causal), scale=scale)
  devices = mesh_axis_size(mesh, axis_name)
  check_split({"q": q}, devices=devices, axis_name=axis_name)
  scale = scale_of(scale, q.shape[-1])  # a number: the compiled program's key
  pairs = tuple(tuple(int(x) for x in xs) for xs in (segment_lengths, dilation_rates))
  return _sharded_dilated_ring((mesh, axis_name, *pairs, causal, scale, backend), q, k, v)


# One program per call, also when called eagerly (shard_map alone runs op by op).
@functools.partial(jax.jit, static_argnums=0)
def _sharded_dilated_ring(options, q, k, v):
  mesh, axis_name, segment_lengths, dilation_rates, causal, scale, backend = options
  spec = jax.sharding.PartitionSpec(None, axis_name, None, None)
  fn = functools.partial(dilated_ring_attention, axis_name=axis_name,
                         segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                         causal=causal, scale=scale, backend=backend)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)(q, k, v)
