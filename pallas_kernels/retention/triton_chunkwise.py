"""Chunkwise retention (Triton-lowered Pallas): the forward and backward kernels.

Sequence positions are cut into chunks of ``C``. With ``S_c`` the state before chunk
``c`` (``S_0`` = the initial state), chunk length ``L_c`` (``C``, or less for the last)
and local positions ``i, j`` inside a chunk:

- states:  ``S_{c+1} = γ^L_c S_c + Σ_j γ^(L_c-1-j) k_jᵀ v_j`` — a sequential kernel per
  (batch, head) that stores every ``S_c`` (``[chunks, dk, dv]`` float32);
- outputs: ``o_i = scale · (Σ_{j<=i} γ^(i-j) (q_i·k_j) v_j + γ^(i+1) q_i S_c)`` — a
  parallel kernel over (chunk, batch, head).

The backward mirrors it: a reverse sequential kernel for ``dS_c`` (the gradient of the
state before chunk ``c``; ``dS_0`` is the initial state's gradient), then a parallel
kernel for dQ, dK, dV of every chunk. No atomics.

Inside a chunk the masked weights meet rows they do not see, so the per-chunk kernels
guard their tiles (``nonfinite.py``): a non-finite value reaches exactly the rows at
and after it. The states hold only earlier chunks, which every later row sees.

Packed sequences (``cu_seqlens``; ``packing.py``: ``start[t]``, the first position of
t's sequence). ``S_c`` is then the state of the sequence holding position ``cC - 1``:
only query rows whose sequence began before the chunk (``start < cC``) read it, only
the keys of the chunk's last sequence (``>= start`` of its last position) feed
``S_{c+1}``, and ``S_c`` itself carries on only where that sequence began before the
chunk; inside the chunk key ``j`` reaches row ``i`` where ``j >= start[i]``. All by
selection, so that a non-finite value stays in its sequence. Each sequence's last
state (``final_states``) comes from the stored ``S_c`` of the chunk it ends in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.config import padded_head_dim
from jattn.kernels.common.launch import HEAD_SCALAR, tile_spec, triton_call
from jattn.kernels.common.nonfinite import clear, guard_rows, nonfinite_rows, poison
from jattn.kernels.common.softmax import dot
from jattn.kernels.common.tiling import pad_to, round_up
from jattn.kernels.retention.config import ChunkwiseConfig
from jattn.kernels.retention.packing import (final_states, padded_bound, sequence_bounds,
                                             sequence_ids)


def _pow(exponent, log2_decay):
  """``γ^exponent`` for float32 exponents (``log2_decay`` = log2 γ)."""
  return jnp.exp2(exponent * log2_decay)


def _chunk_len(c, chunk: int, length: int):
  return jnp.minimum(jnp.int32(chunk), jnp.int32(length) - c * chunk)


def _key_weights(c, chunk: int, length: int, log2_decay, shape, axis: int):
  """``γ^(L_c-1-j)`` for the keys of chunk ``c`` (0 for padding), iota along ``axis``."""
  j = lax.broadcasted_iota(jnp.int32, shape, axis)
  n = _chunk_len(c, chunk, length)
  return jnp.where(j < n, _pow(jnp.maximum(n - 1 - j, 0).astype(jnp.float32), log2_decay), 0.0)


def _local_decayed(s, log2_decay, c=None, chunk=None, start=None):
  """``s[i, j] · γ^(i-j)`` for ``i >= j`` inside a chunk (and, packed, ``cC + j >=
  start[i]``: ``start`` ``[chunk, 1]``), else 0: selected, not multiplied by a 0/1
  mask, as a score past the diagonal may be non-finite."""
  i = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  j = lax.broadcasted_iota(jnp.int32, s.shape, 1)
  visible = i >= j if start is None else (i >= j) & (c * chunk + j >= start)
  return jnp.where(visible, s * _pow(jnp.maximum(i - j, 0).astype(jnp.float32), log2_decay),
                   0.0)


def _read_state(c, chunk: int, start, shape):
  """Packed (``start``: the chunk's rows' sequence starts, ``shape``-broadcast): which
  rows read the state before chunk ``c``: those whose sequence began before it."""
  return jnp.broadcast_to(start < c * chunk, shape)


def _last_sequence_keys(c, chunk: int, last_start, keys):
  """Packed: the chunk's key rows (``[chunk, d]`` each) with those of sequences before
  its last (which starts at ``last_start``) zeroed: they do not reach the next state."""
  j = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
  return tuple(jnp.where(j >= last_start, x, 0.0) for x in keys)


def _carries(c, chunk: int, last_start, carried):
  """Packed: ``carried`` (the state before chunk ``c``, decayed through it), or zeros
  where the chunk's last sequence starts inside it."""
  return jnp.where(last_start < c * chunk, carried, 0.0)


def _states_kernel(k_ref, v_ref, s0_ref, log2_decay_ref, start_ref, states_ref, final_ref, *,
                   chunk: int, length: int, n_chunks: int):
  log2_decay = log2_decay_ref[...]

  def body(c, state):
    states_ref[c] = state.astype(states_ref.dtype)
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    k = k_ref[rows, :]
    w = _key_weights(c, chunk, length, log2_decay, (chunk, 1), 0)
    decay_all = _pow(_chunk_len(c, chunk, length).astype(jnp.float32), log2_decay)
    if start_ref is None:
      return decay_all * state + dot((k * w).astype(k.dtype), v_ref[rows, :], 0, 0)
    last_start = start_ref[c * chunk + chunk - 1]
    k, v = _last_sequence_keys(c, chunk, last_start, (k, v_ref[rows, :]))
    return (_carries(c, chunk, last_start, decay_all * state)
            + dot((k * w).astype(k.dtype), v, 0, 0))

  final_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...])


def _output_kernel(q_ref, k_ref, v_ref, states_ref, log2_decay_ref, start_ref, o_ref, *,
                   chunk: int, scale: float):
  c = pl.program_id(0)
  log2_decay = log2_decay_ref[...]
  q = q_ref[...]
  start = None if start_ref is None else start_ref[...][:, None]
  k, v = guard_rows(k_ref[...], v_ref[...])  # every chunk straddles the mask
  inner = _local_decayed(dot(q, k, 1, 1), log2_decay, c, chunk, start)
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)
  q_w = (q * _pow(i + 1.0, log2_decay)).astype(q.dtype)
  o = dot(inner.astype(v.dtype), v, 1, 0)
  from_state = dot(q_w, states_ref[...].astype(q.dtype), 1, 0)
  if start is not None:  # selected after the product: the state may hold an inf
    from_state = jnp.where(_read_state(c, chunk, start, from_state.shape), from_state, 0.0)
  o = o + from_state
  o_ref[...] = (o * scale).astype(o_ref.dtype)


def _dstates_kernel(q_ref, do_ref, dfinal_ref, log2_decay_ref, start_ref, extra_ref,
                    dstates_ref, ds0_ref, *, chunk: int, length: int, n_chunks: int,
                    scale: float):
  """``dS_c`` for c = n-1 .. 0, where ``dstates[c]`` is the gradient of ``S_{c+1}``;
  ``extra_ref`` (packed): more gradient of each ``S_c``, from the sequences' last states."""
  log2_decay = log2_decay_ref[...]
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)

  def body(r, dstate):
    c = n_chunks - 1 - r
    dstates_ref[c] = dstate.astype(dstates_ref.dtype)  # gradient of the state after chunk c
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    q = q_ref[rows, :]
    q_w = (q * _pow(i + 1.0, log2_decay)).astype(q.dtype)
    decay_all = _pow(_chunk_len(c, chunk, length).astype(jnp.float32), log2_decay)
    carried = decay_all * dstate
    if start_ref is not None:
      q_w = jnp.where(_read_state(c, chunk, start_ref[rows][:, None], q_w.shape), q_w, 0.0)
      carried = _carries(c, chunk, start_ref[c * chunk + chunk - 1], carried)
    dstate = carried + scale * dot(q_w, do_ref[rows, :], 0, 0)
    return dstate if extra_ref is None else dstate + extra_ref[c]

  ds0_ref[...] = lax.fori_loop(0, n_chunks, body, dfinal_ref[...])


def _grad_kernel(q_ref, k_ref, v_ref, do_ref, states_ref, dstates_ref, log2_decay_ref,
                 start_ref, dq_ref, dk_ref, dv_ref, *, chunk: int, length: int, scale: float):
  c = pl.program_id(0)
  log2_decay = log2_decay_ref[...]
  q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
  start = None if start_ref is None else start_ref[...][:, None]
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)
  q_w = _pow(i + 1.0, log2_decay)
  k_w = _key_weights(c, chunk, length, log2_decay, (chunk, 1), 0)
  if start is not None:
    (k_w,) = _last_sequence_keys(c, chunk, start_ref[chunk - 1], (k_w,))
  state = states_ref[...].astype(q.dtype)
  dstate = dstates_ref[...].astype(q.dtype)
  # Inside the chunk the masked weights meet rows they do not see (nonfinite.py): the
  # scores come from rows poisoned where a query (q, dO) or key (k, v) is not finite,
  # and multiply those rows cleared.
  bad_q, bad_k = nonfinite_rows(q, do), nonfinite_rows(k, v)
  weigh = lambda x, y: _local_decayed(dot(x, y, 1, 1), log2_decay, c, chunk, start) * scale
  ds = weigh(poison(do, bad_q), poison(v, bad_k))  # [i, j]
  s = weigh(poison(q, bad_q), poison(k, bad_k))
  dq = dot(ds.astype(k.dtype), clear(k, bad_k), 1, 0)
  from_state = scale * q_w * dot(do, state, 1, 1)
  if start is not None:  # selected after the product: the state may hold an inf
    from_state = jnp.where(_read_state(c, chunk, start, from_state.shape), from_state, 0.0)
  dq = dq + from_state
  dk = dot(ds.astype(q.dtype), clear(q, bad_q), 0, 0) + k_w * dot(v, dstate, 1, 1)
  dv = (dot(s.astype(do.dtype), clear(do, bad_q), 0, 0)
        + dot((k * k_w).astype(k.dtype), dstate, 1, 0))
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _state_spec(dk, dv):
  """The state before chunk ``c``, on the grid (chunks, batch, heads)."""
  return pl.BlockSpec((None, None, None, dk, dv), lambda c, b, h: (b, h, c, 0, 0))


def _padded(chunk: int, q, k, v):
  """``((q, k, v) padded to whole chunks and head dims, (dk_p, dv_p))``."""
  length_p = round_up(q.shape[1], chunk)
  dk_p, dv_p = padded_head_dim(q.shape[-1]), padded_head_dim(v.shape[-1])
  return (pad_to(q, length_p, dk_p), pad_to(k, length_p, dk_p), pad_to(v, length_p, dv_p)), (
      dk_p, dv_p)


def _pad_state(s, dk_p, dv_p):
  return jnp.pad(s, ((0, 0), (0, 0), (0, dk_p - s.shape[2]), (0, dv_p - s.shape[3])))


def _scan_chunks(chunk: int, config: ChunkwiseConfig, interpret: bool, kernel, x_dk, x_dv,
                 state, log2_decay, name: str, start=None, per_chunk=()):
  """Runs a sequential kernel over the chunks of each (batch, head, state tile).

  ``x_dk: [batch, seq_p, heads, dk_p]`` and ``x_dv: [batch, seq_p, heads, dv_p]`` are
  read a column tile at a time; ``state: [batch, heads, dk_p, dv_p]`` float32 seeds
  the scan; ``start``: the packed sequences' ``[1, seq_p]`` starts, or None;
  ``per_chunk``: more kernel inputs ``[batch, heads, chunks, dk_p, dv_p]`` (or None),
  a state tile per chunk. Returns the per-chunk states ``[batch, heads, chunks, dk_p,
  dv_p]`` in x_dk's dtype (the matmuls that read them take that dtype) and the last
  one, float32.
  """
  batch, length_p, heads, dk_p = x_dk.shape
  dv_p = x_dv.shape[-1]
  n = length_p // chunk
  bk, bv = min(config.state_block, dk_p), min(config.state_block, dv_p)
  state_spec = pl.BlockSpec((None, None, bk, bv), lambda b, h, i, j: (b, h, i, j))
  states_spec = pl.BlockSpec((None, None, n, bk, bv), lambda b, h, i, j: (b, h, 0, i, j))
  extra_specs = [None if start is None else
                 pl.BlockSpec((None, length_p), lambda b, h, i, j: (0, 0))]
  extra_specs += [None if x is None else states_spec for x in per_chunk]
  return triton_call(
      kernel, grid=(batch, heads, dk_p // bk, dv_p // bv),
      in_specs=[pl.BlockSpec((None, length_p, None, bk), lambda b, h, i, j: (b, 0, h, i)),
                pl.BlockSpec((None, length_p, None, bv), lambda b, h, i, j: (b, 0, h, j)),
                state_spec, pl.BlockSpec((1,), lambda b, h, i, j: (h,)), *extra_specs],
      out_specs=[states_spec, state_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, n, dk_p, dv_p), x_dk.dtype),
                 jax.ShapeDtypeStruct((batch, heads, dk_p, dv_p), jnp.float32)],
      name=name, interpret=interpret, num_warps=config.scan_warps,
      num_stages=config.scan_stages,
  )(x_dk, x_dv, state, log2_decay, start, *per_chunk)


def _packed_start(cu_seqlens, length: int, length_p: int):
  """The ``[1, length_p]`` sequence starts of packed sequences (None unpacked)."""
  if cu_seqlens is None:
    return None
  return padded_bound(sequence_bounds(sequence_ids(cu_seqlens, length))[0], length_p)


def _chunk_start_spec(start, chunk: int):
  """Chunk ``c``'s sequence starts, on the grid (chunks, batch, heads); None unpacked."""
  return None if start is None else pl.BlockSpec((None, chunk), lambda c, b, h: (0, c))


def _states_f32(states, dk: int, dv: int):
  """The stored states ``[1, heads, chunks, dk_p, dv_p]`` as ``final_states`` takes
  them: ``[chunks, heads, dk, dv]`` float32."""
  return jnp.swapaxes(states[0], 0, 1)[..., :dk, :dv].astype(jnp.float32)


def _final_states_grads(k, v, log2_decay, states, cu_seqlens, chunk: int, dfinal):
  """The gradients ``final_states`` sends to ``k``, ``v`` (float32) and to the stored
  states (``[1, heads, chunks, dk_p, dv_p]`` float32: what the reverse scan adds to
  each ``dS_c``) from the sequences' final-state cotangent ``dfinal``."""
  dk, dv = k.shape[-1], v.shape[-1]
  _, pull = jax.vjp(lambda k, v, s: final_states(k, v, log2_decay, s, cu_seqlens, chunk),
                    k.astype(jnp.float32), v.astype(jnp.float32), _states_f32(states, dk, dv))
  dk_final, dv_final, dstates = pull(dfinal.astype(jnp.float32))
  dk_p, dv_p = states.shape[-2:]
  dstates = jnp.pad(dstates, ((0, 0), (0, 0), (0, dk_p - dk), (0, dv_p - dv)))
  return dk_final, dv_final, jnp.swapaxes(dstates, 0, 1)[None]


def retention_chunkwise_forward(q, k, v, initial_state, log2_decay, *, scale: float,
                                config: ChunkwiseConfig, interpret: bool, cu_seqlens=None):
  """Chunkwise retention.

  Args:
    q, k: ``[batch, seq, heads, dk]``; v: ``[batch, seq, heads, dv]``; initial_state
      ``[batch, heads, dk, dv]`` float32; log2_decay ``[heads]`` float32 (log2 γ).
    cu_seqlens: ``[num_seqs + 1]`` int, or None: packed sequences (batch 1, a zero
      initial state), each row seeing its own only.

  Returns:
    ``(o, final_state, states)``: ``o`` like ``v`` in q's dtype, the final state
    float32 (packed: each sequence's, ``[num_seqs, heads, dk, dv]``), and the state
    before every chunk (the backward's residual).
  """
  batch, length, heads, dk = q.shape
  dv = v.shape[-1]
  chunk = config.chunk
  (q_p, k_p, v_p), (dk_p, dv_p) = _padded(chunk, q, k, v)
  n = q_p.shape[1] // chunk
  start = _packed_start(cu_seqlens, length, q_p.shape[1])
  states, final = _scan_chunks(
      chunk, config, interpret,
      functools.partial(_states_kernel, chunk=chunk, length=length, n_chunks=n),
      k_p, v_p, _pad_state(initial_state, dk_p, dv_p), log2_decay, "jattn_retention_chunk_states",
      start)
  o = triton_call(
      functools.partial(_output_kernel, chunk=chunk, scale=scale),
      grid=(n, batch, heads),
      in_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p),
                _state_spec(dk_p, dv_p), HEAD_SCALAR, _chunk_start_spec(start, chunk)],
      out_specs=tile_spec(chunk, dv_p),
      out_shape=jax.ShapeDtypeStruct((batch, q_p.shape[1], heads, dv_p), q.dtype),
      name="jattn_retention_chunk_out", interpret=interpret, num_warps=config.out_warps,
      num_stages=1,
  )(q_p, k_p, v_p, states, log2_decay, start)
  if cu_seqlens is None:
    final = final[:, :, :dk, :dv]
  else:
    final = final_states(k, v, log2_decay, _states_f32(states, dk, dv), cu_seqlens, chunk)
  return o[:, :length, :, :dv], final, states


def retention_chunkwise_backward(q, k, v, states, log2_decay, do, dfinal, *, scale: float,
                                 config: ChunkwiseConfig, interpret: bool, cu_seqlens=None):
  """Gradients ``(dq, dk, dv, d_initial_state)`` given the forward's ``states`` and the
  cotangents of the output ``do`` and of the final state ``dfinal`` (packed: of each
  sequence's, through ``final_states``); ``cu_seqlens`` as the forward's."""
  batch, length, heads, dk = q.shape
  dv = v.shape[-1]
  chunk = config.chunk
  (q_p, k_p, v_p), (dk_p, dv_p) = _padded(chunk, q, k, v)
  n = q_p.shape[1] // chunk
  do_p = pad_to(do.astype(q.dtype), q_p.shape[1], dv_p)
  start = _packed_start(cu_seqlens, length, q_p.shape[1])
  if cu_seqlens is None:
    seed, per_chunk = _pad_state(dfinal.astype(jnp.float32), dk_p, dv_p), ()
  else:  # the sequences' last states enter through the states they are read from
    dk_final, dv_final, dstates_final = _final_states_grads(k, v, log2_decay, states,
                                                            cu_seqlens, chunk, dfinal)
    seed, per_chunk = jnp.zeros((batch, heads, dk_p, dv_p), jnp.float32), (dstates_final,)
  dstates, ds0 = _scan_chunks(
      chunk, config, interpret,
      functools.partial(_dstates_kernel, chunk=chunk, length=length, n_chunks=n, scale=scale),
      q_p, do_p, seed, log2_decay, "jattn_retention_chunk_dstates", start, per_chunk or (None,))
  dq, dk_, dv_ = triton_call(
      functools.partial(_grad_kernel, chunk=chunk, length=length, scale=scale),
      grid=(n, batch, heads),
      in_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p),
                tile_spec(chunk, dv_p), _state_spec(dk_p, dv_p), _state_spec(dk_p, dv_p),
                HEAD_SCALAR, _chunk_start_spec(start, chunk)],
      out_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p)],
      out_shape=[jax.ShapeDtypeStruct(q_p.shape, q.dtype),
                 jax.ShapeDtypeStruct(k_p.shape, k.dtype),
                 jax.ShapeDtypeStruct(v_p.shape, v.dtype)],
      name="jattn_retention_chunk_grads", interpret=interpret, num_warps=config.grad_warps,
      num_stages=1,
  )(q_p, k_p, v_p, do_p, states, dstates, log2_decay, start)
  dk_, dv_ = dk_[:, :length, :, :dk], dv_[:, :length, :, :dv]
  if cu_seqlens is not None:
    dk_, dv_ = dk_ + dk_final, dv_ + dv_final
  return dq[:, :length, :, :dk], dk_, dv_, ds0[:, :, :dk, :dv]

