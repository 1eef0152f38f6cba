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


def _local_decayed(s, log2_decay):
  """``s[i, j] · γ^(i-j)`` for ``i >= j`` inside a chunk, else 0: selected, not
  multiplied by a 0/1 mask, as a score past the diagonal may be non-finite."""
  i = lax.broadcasted_iota(jnp.int32, s.shape, 0)
  j = lax.broadcasted_iota(jnp.int32, s.shape, 1)
  return jnp.where(i >= j, s * _pow(jnp.maximum(i - j, 0).astype(jnp.float32), log2_decay),
                   0.0)


def _states_kernel(k_ref, v_ref, s0_ref, log2_decay_ref, states_ref, final_ref, *,
                   chunk: int, length: int, n_chunks: int):
  log2_decay = log2_decay_ref[...]

  def body(c, state):
    states_ref[c] = state.astype(states_ref.dtype)
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    k = k_ref[rows, :]
    w = _key_weights(c, chunk, length, log2_decay, (chunk, 1), 0)
    decay_all = _pow(_chunk_len(c, chunk, length).astype(jnp.float32), log2_decay)
    return decay_all * state + dot((k * w).astype(k.dtype), v_ref[rows, :], 0, 0)

  final_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...])


def _output_kernel(q_ref, k_ref, v_ref, states_ref, log2_decay_ref, o_ref, *, chunk: int,
                   scale: float):
  log2_decay = log2_decay_ref[...]
  q = q_ref[...]
  k, v = guard_rows(k_ref[...], v_ref[...])  # every chunk straddles the mask
  inner = _local_decayed(dot(q, k, 1, 1), log2_decay)
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)
  q_w = (q * _pow(i + 1.0, log2_decay)).astype(q.dtype)
  o = dot(inner.astype(v.dtype), v, 1, 0) + dot(q_w, states_ref[...].astype(q.dtype), 1, 0)
  o_ref[...] = (o * scale).astype(o_ref.dtype)


def _dstates_kernel(q_ref, do_ref, dfinal_ref, log2_decay_ref, dstates_ref, ds0_ref, *,
                    chunk: int, length: int, n_chunks: int, scale: float):
  """``dS_c`` for c = n-1 .. 0, where ``dstates[c]`` is the gradient of ``S_{c+1}``."""
  log2_decay = log2_decay_ref[...]
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)

  def body(r, dstate):
    c = n_chunks - 1 - r
    dstates_ref[c] = dstate.astype(dstates_ref.dtype)  # gradient of the state after chunk c
    rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    q = q_ref[rows, :]
    q_w = (q * _pow(i + 1.0, log2_decay)).astype(q.dtype)
    decay_all = _pow(_chunk_len(c, chunk, length).astype(jnp.float32), log2_decay)
    return decay_all * dstate + scale * dot(q_w, do_ref[rows, :], 0, 0)

  ds0_ref[...] = lax.fori_loop(0, n_chunks, body, dfinal_ref[...])


def _grad_kernel(q_ref, k_ref, v_ref, do_ref, states_ref, dstates_ref, log2_decay_ref,
                 dq_ref, dk_ref, dv_ref, *, chunk: int, length: int, scale: float):
  c = pl.program_id(0)
  log2_decay = log2_decay_ref[...]
  q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
  i = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)
  q_w = _pow(i + 1.0, log2_decay)
  k_w = _key_weights(c, chunk, length, log2_decay, (chunk, 1), 0)
  state = states_ref[...].astype(q.dtype)
  dstate = dstates_ref[...].astype(q.dtype)
  # Inside the chunk the masked weights meet rows they do not see (nonfinite.py): the
  # scores come from rows poisoned where a query (q, dO) or key (k, v) is not finite,
  # and multiply those rows cleared.
  bad_q, bad_k = nonfinite_rows(q, do), nonfinite_rows(k, v)
  weigh = lambda x, y: _local_decayed(dot(x, y, 1, 1), log2_decay) * scale  # [i, j]
  ds = weigh(poison(do, bad_q), poison(v, bad_k))
  s = weigh(poison(q, bad_q), poison(k, bad_k))
  dq = dot(ds.astype(k.dtype), clear(k, bad_k), 1, 0) + scale * q_w * dot(do, state, 1, 1)
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
                 state, log2_decay, name: str):
  """Runs a sequential kernel over the chunks of each (batch, head, state tile).

  ``x_dk: [batch, seq_p, heads, dk_p]`` and ``x_dv: [batch, seq_p, heads, dv_p]`` are
  read a column tile at a time; ``state: [batch, heads, dk_p, dv_p]`` float32 seeds
  the scan. Returns the per-chunk states ``[batch, heads, chunks, dk_p, dv_p]`` in
  x_dk's dtype (the matmuls that read them take that dtype) and the last one, float32.
  """
  batch, length_p, heads, dk_p = x_dk.shape
  dv_p = x_dv.shape[-1]
  n = length_p // chunk
  bk, bv = min(config.state_block, dk_p), min(config.state_block, dv_p)
  state_spec = pl.BlockSpec((None, None, bk, bv), lambda b, h, i, j: (b, h, i, j))
  return triton_call(
      kernel, grid=(batch, heads, dk_p // bk, dv_p // bv),
      in_specs=[pl.BlockSpec((None, length_p, None, bk), lambda b, h, i, j: (b, 0, h, i)),
                pl.BlockSpec((None, length_p, None, bv), lambda b, h, i, j: (b, 0, h, j)),
                state_spec, pl.BlockSpec((1,), lambda b, h, i, j: (h,))],
      out_specs=[pl.BlockSpec((None, None, n, bk, bv), lambda b, h, i, j: (b, h, 0, i, j)),
                 state_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, n, dk_p, dv_p), x_dk.dtype),
                 jax.ShapeDtypeStruct((batch, heads, dk_p, dv_p), jnp.float32)],
      name=name, interpret=interpret, num_warps=config.scan_warps,
      num_stages=config.scan_stages,
  )(x_dk, x_dv, state, log2_decay)


def retention_chunkwise_forward(q, k, v, initial_state, log2_decay, *, scale: float,
                                config: ChunkwiseConfig, interpret: bool):
  """Chunkwise retention.

  Args:
    q, k: ``[batch, seq, heads, dk]``; v: ``[batch, seq, heads, dv]``; initial_state
      ``[batch, heads, dk, dv]`` float32; log2_decay ``[heads]`` float32 (log2 γ).

  Returns:
    ``(o, final_state, states)``: ``o`` like ``v`` in q's dtype, the final state
    float32, and the state before every chunk (the backward's residual).
  """
  batch, length, heads, dk = q.shape
  dv = v.shape[-1]
  chunk = config.chunk
  (q_p, k_p, v_p), (dk_p, dv_p) = _padded(chunk, q, k, v)
  n = q_p.shape[1] // chunk
  states, final = _scan_chunks(
      chunk, config, interpret,
      functools.partial(_states_kernel, chunk=chunk, length=length, n_chunks=n),
      k_p, v_p, _pad_state(initial_state, dk_p, dv_p), log2_decay, "jattn_retention_chunk_states")
  o = triton_call(
      functools.partial(_output_kernel, chunk=chunk, scale=scale),
      grid=(n, batch, heads),
      in_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p),
                _state_spec(dk_p, dv_p), HEAD_SCALAR],
      out_specs=tile_spec(chunk, dv_p),
      out_shape=jax.ShapeDtypeStruct((batch, q_p.shape[1], heads, dv_p), q.dtype),
      name="jattn_retention_chunk_out", interpret=interpret, num_warps=config.out_warps,
      num_stages=1,
  )(q_p, k_p, v_p, states, log2_decay)
  return o[:, :length, :, :dv], final[:, :, :dk, :dv], states


def retention_chunkwise_backward(q, k, v, states, log2_decay, do, dfinal, *, scale: float,
                                 config: ChunkwiseConfig, interpret: bool):
  """Gradients ``(dq, dk, dv, d_initial_state)`` given the forward's ``states`` and the
  cotangents of the output ``do`` and of the final state ``dfinal``."""
  batch, length, heads, dk = q.shape
  dv = v.shape[-1]
  chunk = config.chunk
  (q_p, k_p, v_p), (dk_p, dv_p) = _padded(chunk, q, k, v)
  n = q_p.shape[1] // chunk
  do_p = pad_to(do.astype(q.dtype), q_p.shape[1], dv_p)
  dstates, ds0 = _scan_chunks(
      chunk, config, interpret,
      functools.partial(_dstates_kernel, chunk=chunk, length=length, n_chunks=n, scale=scale),
      q_p, do_p, _pad_state(dfinal.astype(jnp.float32), dk_p, dv_p), log2_decay,
      "jattn_retention_chunk_dstates")
  dq, dk_, dv_ = triton_call(
      functools.partial(_grad_kernel, chunk=chunk, length=length, scale=scale),
      grid=(n, batch, heads),
      in_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p),
                tile_spec(chunk, dv_p), _state_spec(dk_p, dv_p), _state_spec(dk_p, dv_p),
                HEAD_SCALAR],
      out_specs=[tile_spec(chunk, dk_p), tile_spec(chunk, dk_p), tile_spec(chunk, dv_p)],
      out_shape=[jax.ShapeDtypeStruct(q_p.shape, q.dtype),
                 jax.ShapeDtypeStruct(k_p.shape, k.dtype),
                 jax.ShapeDtypeStruct(v_p.shape, v.dtype)],
      name="jattn_retention_chunk_grads", interpret=interpret, num_warps=config.grad_warps,
      num_stages=1,
  )(q_p, k_p, v_p, do_p, states, dstates, log2_decay)
  return (dq[:, :length, :, :dk], dk_[:, :length, :, :dk], dv_[:, :length, :, :dv],
          ds0[:, :, :dk, :dv])

