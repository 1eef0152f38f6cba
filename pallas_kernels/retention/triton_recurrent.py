"""One recurrent retention step (decoding), Triton-lowered Pallas, and its gradients.

``S' = γ S + kᵀ v`` and ``o = scale · q S'`` per (batch, head). Each program owns a
``[dk, block_dv]`` column tile of the state; the products are vector outer/inner
products, so the step is elementwise work bound by reading and writing the state.
The new state is written over the old one's buffer (``input_output_aliases``).

A serving loop keeps one state per slot (batch row); ``reset`` marks the slots whose
sequence starts at this step: their old state is taken as zeros (selected away, so a
non-finite leftover does not reach the new sequence) and gets no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn.kernels.common.config import padded_head_dim
from jattn.kernels.common.launch import triton_call
from jattn.kernels.common.tiling import pad_last

STATE_BLOCK = 64


def _step_kernel(q_ref, k_ref, v_ref, state_ref, log2_decay_ref, reset_ref, o_ref,
                 new_state_ref, *, scale: float):
  q = q_ref[...].astype(jnp.float32)
  k = k_ref[...].astype(jnp.float32)
  v = v_ref[...].astype(jnp.float32)
  state = jnp.exp2(log2_decay_ref[...]) * state_ref[...]
  if reset_ref is not None:
    state = jnp.where(reset_ref[...] != 0, 0.0, state)
  state = state + k[:, None] * v[None, :]
  new_state_ref[...] = state
  o_ref[...] = (scale * jnp.sum(q[:, None] * state, axis=0)).astype(o_ref.dtype)


def retention_step_forward(q, k, v, state, log2_decay, *, scale: float, interpret: bool,
                           reset=None):
  """One step.

  Args:
    q, k: ``[batch, heads, dk]``; v: ``[batch, heads, dv]``; state ``[batch, heads, dk, dv]``
      float32; log2_decay ``[heads]`` float32 (log2 γ).
    reset: ``[batch]`` bool, or None: the slots whose old state is taken as zeros.

  Returns:
    ``(o, new_state)``: ``o: [batch, heads, dv]`` in q's dtype, the state float32.
  """
  batch, heads, dk = q.shape
  dv = v.shape[-1]
  dk_p, dv_p = padded_head_dim(dk), padded_head_dim(dv)
  bv = min(STATE_BLOCK, dv_p)
  state_p = jnp.pad(state, ((0, 0), (0, 0), (0, dk_p - dk), (0, dv_p - dv)))
  vec = lambda d: pl.BlockSpec((None, None, d), lambda b, h, j: (b, h, 0))
  state_spec = pl.BlockSpec((None, None, dk_p, bv), lambda b, h, j: (b, h, 0, j))
  reset_spec = None if reset is None else pl.BlockSpec((1,), lambda b, h, j: (b,))
  o, new_state = triton_call(
      functools.partial(_step_kernel, scale=scale), grid=(batch, heads, dv_p // bv),
      in_specs=[vec(dk_p), vec(dk_p), pl.BlockSpec((None, None, bv), lambda b, h, j: (b, h, j)),
                state_spec, pl.BlockSpec((1,), lambda b, h, j: (h,)), reset_spec],
      out_specs=[pl.BlockSpec((None, None, bv), lambda b, h, j: (b, h, j)), state_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, dv_p), q.dtype),
                 jax.ShapeDtypeStruct(state_p.shape, jnp.float32)],
      name="jattn_retention_step", interpret=interpret, num_warps=4, num_stages=1,
      input_output_aliases={3: 1},
  )(pad_last(q, dk_p), pad_last(k, dk_p), pad_last(v, dv_p), state_p, log2_decay,
    None if reset is None else reset.astype(jnp.int32))
  return o[..., :dv], new_state[:, :, :dk, :dv]


def retention_step_backward(q, k, v, new_state, log2_decay, do, dnew, *, scale: float,
                            reset=None):
  """Gradients ``(dq, dk, dv, dstate)`` of one step given its new state and the
  cotangents ``do``, ``dnew``: a few outer products, cheap elementwise jnp work. The
  ``reset`` slots' old state gets a zero gradient."""
  do, dnew = do.astype(jnp.float32), dnew.astype(jnp.float32)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  dnew = dnew + scale * q32[..., :, None] * do[..., None, :]
  dq = scale * jnp.einsum("bhkv,bhv->bhk", new_state, do, precision="highest")
  dk = jnp.einsum("bhkv,bhv->bhk", dnew, v32, precision="highest")
  dv = jnp.einsum("bhkv,bhk->bhv", dnew, k32, precision="highest")
  dstate = jnp.exp2(log2_decay)[None, :, None, None] * dnew
  if reset is not None:
    dstate = jnp.where(reset[:, None, None, None], 0.0, dstate)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dstate
