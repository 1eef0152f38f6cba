"""Hopper flash attention (Pallas Mosaic GPU) with its custom VJP.

Pads inputs to the tile grid, runs the forward kernel and saves (q, k, v, o, lse).
The backward runs the Mosaic dQ and dK/dV kernels for head dims up to 128 and
the Triton-lowered backward above that (the wider dK/dV accumulators do not fit
a warpgroup's registers); both consume the same saved ``(o, lse)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.flash.common import LOG2E, backward_delta, pad_rows, pad_to, round_up
from pallas_kernels.flash.config import (MOSAIC_MAX_BWD_HEAD_DIM, MosaicBlockConfig,
                                         default_config, mosaic_head_dim)
from pallas_kernels.flash.masking import MaskSpec
from pallas_kernels.flash.mosaic_bwd import mosaic_backward
from pallas_kernels.flash.mosaic_fwd import mosaic_forward
from pallas_kernels.flash.mosaic_pipeline import CONSUMERS
from pallas_kernels.flash.triton import backward_triton

MOSAIC_DTYPES = (jnp.float16, jnp.bfloat16)
MOSAIC_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  scale: float
  local_window: tuple[int | None, int | None] | None
  config: MosaicBlockConfig


def _layout(st: _Static, q_len: int, kv_len: int, head_dim: int):
  """Padded lengths that every block divides, padded head dim, mask spec."""
  c = st.config
  # lcm, not max: blocks are multiples of 64 but not always powers of two (192).
  q_len_p = round_up(q_len, math.lcm(CONSUMERS * c.block_q, CONSUMERS * c.block_q_dq,
                                     c.block_q_dkv))
  kv_len_p = round_up(kv_len, math.lcm(c.block_kv, c.block_kv_dq, CONSUMERS * c.block_kv_dkv))
  spec = MaskSpec.build(q_len, kv_len, causal=st.causal, local_window=st.local_window,
                        kv_padded=kv_len_p != kv_len, segments=False)
  return q_len_p, kv_len_p, mosaic_head_dim(head_dim), spec


def _forward(st: _Static, q, k, v):
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  q_len_p, kv_len_p, d_p, spec = _layout(st, q_len, kv_len, head_dim)
  o, lse = mosaic_forward(pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p),
                          pad_to(v, kv_len_p, d_p), spec=spec, scale=st.scale,
                          block_q=st.config.block_q, block_kv=st.config.block_kv,
                          stages=st.config.stages)
  return o[:, :q_len, :, :head_dim], lse[:, :, :q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v):
  return _forward(st, q, k, v)


def _flash_fwd(st: _Static, q, k, v):
  o, lse = _forward(st, q, k, v)
  return (o, lse), (q, k, v, o, lse)


def _flash_bwd(st: _Static, res, cotangents):
  q, k, v, o, lse = res
  do, dlse = cotangents
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  do = do.astype(q.dtype)
  if mosaic_head_dim(head_dim) > MOSAIC_MAX_BWD_HEAD_DIM:
    return backward_triton(q, k, v, o, lse, do, dlse, causal=st.causal, scale=st.scale,
                           local_window=st.local_window,
                           config=default_config(head_dim, q.dtype.itemsize))
  q_len_p, kv_len_p, d_p, spec = _layout(st, q_len, kv_len, head_dim)
  c = st.config
  dq, dk, dv = mosaic_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, d_p),
      pad_to(do, q_len_p, d_p), pad_rows(lse * LOG2E, q_len_p),
      pad_rows(backward_delta(o, do, dlse), q_len_p), spec=spec, scale=st.scale,
      blocks=(c.block_q_dq, c.block_kv_dq, c.block_q_dkv, c.block_kv_dkv),
      stages=c.bwd_stages)
  return (dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim],
          dv[:, :kv_len, :, :head_dim])


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_mosaic(q, k, v, *, causal: bool, scale: float, local_window=None,
                           config: MosaicBlockConfig):
  """Flash attention through the Hopper (Pallas Mosaic GPU) kernels.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``,
      float16 or bfloat16, ``head_dim <= 256``, ``scale > 0``. Inputs are assumed
      validated (see ``jattn.flash_attention``).

  Returns:
    ``(o, lse)``: ``o`` like ``q``; ``lse: [batch, q_heads, q_len]`` float32.
  """
  if q.dtype not in MOSAIC_DTYPES:
    raise ValueError(f"the Mosaic GPU kernels take float16 or bfloat16, got {q.dtype}")
  if q.shape[-1] > MOSAIC_MAX_HEAD_DIM:
    raise ValueError(f"the Mosaic GPU kernels take head_dim <= {MOSAIC_MAX_HEAD_DIM}, "
                     f"got {q.shape[-1]}")
  if not scale > 0:
    raise ValueError(f"the Mosaic GPU kernels need scale > 0, got {scale}")
  st = _Static(causal=causal, scale=float(scale),
               local_window=None if local_window is None else tuple(local_window),
               config=config)
  return _flash(st, q, k, v)
