"""Forward flash attention kernel, lowered through Triton (Ampere and newer).

Grid: (query blocks, batch, query heads). Each program keeps one query tile in
registers and streams key/value tiles with an online softmax. Key blocks are
visited in three runs (masked, unmasked, masked) so that tiles wholly inside
the attention pattern skip the element mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash.common import EMPTY_ROW_LSE, LN2, dot, log2_logits
from pallas_kernels.flash.config import FlashBlockConfig
from pallas_kernels.flash.masking import MaskSpec, apply_mask, kv_block_range


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, *,
                    spec: MaskSpec, scale: float, softcap: float | None,
                    block_q: int, block_k: int):
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  q_seg = q_seg_ref[...][:, None] if spec.segments else None

  def body(masked: bool, j, carry):
    acc, m_prev, l_prev = carry
    k_slice = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = k_ref[k_slice, :]
    v = v_ref[k_slice, :]
    s, c, _ = log2_logits(dot(q, k, 1, 1), scale, softcap)
    if masked:
      k_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
      k_seg = kv_seg_ref[k_slice][None, :] if spec.segments else None
      s = apply_mask(s, -jnp.inf, spec, q_idx, k_idx, q_seg, k_seg)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1) * c)
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s * c - m_next[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, 1, 0)
    return acc, m_next, l_next

  lo, full_lo, full_hi, hi = kv_block_range(spec, q_start, block_q, block_k)
  head_dim = q_ref.shape[-1]
  carry = (jnp.zeros((block_q, head_dim), jnp.float32),
           jnp.full((block_q,), EMPTY_ROW_LSE, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, False), carry)
  acc, m, l = lax.fori_loop(full_hi, hi, functools.partial(body, True), carry)

  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, m * LN2 + jnp.log(l_safe))


def flash_forward(q, k, v, q_seg, kv_seg, *, spec: MaskSpec, scale: float,
                  softcap: float | None, config: FlashBlockConfig, block_q: int,
                  block_k: int, interpret: bool):
  """Runs the forward kernel on padded inputs.

  Args:
    q: ``[batch, q_len_p, q_heads, d_p]`` with ``q_len_p % block_q == 0``.
    k, v: ``[batch, kv_len_p, kv_heads, d_p]`` with ``kv_len_p % block_k == 0``.
    q_seg, kv_seg: ``[batch, q_len_p]`` / ``[batch, kv_len_p]`` int32, or None.

  Returns:
    ``o`` like ``q`` and ``lse: [batch, q_heads, q_len_p]`` float32 (natural log).
  """
  batch, q_len_p, q_heads, d = q.shape
  kv_len_p, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  grid = (q_len_p // block_q, batch, q_heads)
  kv_spec = pl.BlockSpec((None, kv_len_p, None, d), lambda i, b, h: (b, 0, h // group, 0))
  in_specs = [pl.BlockSpec((None, block_q, None, d), lambda i, b, h: (b, i, h, 0)), kv_spec, kv_spec]
  if spec.segments:
    in_specs += [pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, kv_len_p), lambda i, b, h: (b, 0))]
  else:
    in_specs += [None, None]
  kernel = functools.partial(_forward_kernel, spec=spec, scale=scale, softcap=softcap,
                             block_q=block_q, block_k=block_k)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, block_q, None, d), lambda i, b, h: (b, i, h, 0)),
                 pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, q_heads, q_len_p), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="jattn_flash_fwd",
  )(q, k, v, q_seg, kv_seg)
