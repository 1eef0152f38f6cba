"""Triton-lowered flash attention with its custom VJP: pads inputs to the tile
grid, runs the forward kernel, and saves only (q, k, v, o, lse) for backward."""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels.flash.common import backward_delta, pad_rows, pad_to, round_up
from pallas_kernels.flash.config import FlashBlockConfig, clamp_block, padded_head_dim
from pallas_kernels.flash.masking import MaskSpec
from pallas_kernels.flash.triton_bwd import flash_backward
from pallas_kernels.flash.triton_fwd import flash_forward


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  scale: float
  local_window: tuple[int | None, int | None] | None
  softcap: float | None
  config: FlashBlockConfig
  interpret: bool


def _layout(st: _Static, q_len: int, kv_len: int, head_dim: int, segments: bool):
  """Blocks clamped to the lengths, padded lengths that every block divides, mask spec."""
  c = st.config
  bq = [clamp_block(b, q_len) for b in (c.block_q, c.block_q_dkv, c.block_q_dq)]
  bk = [clamp_block(b, kv_len) for b in (c.block_k, c.block_k_dkv, c.block_k_dq)]
  q_len_p, kv_len_p = round_up(q_len, max(bq)), round_up(kv_len, max(bk))
  spec = MaskSpec.build(q_len, kv_len, causal=st.causal, local_window=st.local_window,
                        kv_padded=kv_len_p != kv_len, segments=segments)
  return bq, bk, q_len_p, kv_len_p, padded_head_dim(head_dim), spec


def _forward(st: _Static, q, k, v, q_seg, kv_seg):
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p, d_p, spec = _layout(st, q_len, kv_len, head_dim, segments)
  o, lse = flash_forward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, d_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=spec, scale=st.scale, softcap=st.softcap, config=st.config,
      block_q=bq[0], block_k=bk[0], interpret=st.interpret)
  return o[:, :q_len, :, :head_dim], lse[:, :, :q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, q_seg, kv_seg):
  return _forward(st, q, k, v, q_seg, kv_seg)


def _flash_fwd(st: _Static, q, k, v, q_seg, kv_seg):
  o, lse = _forward(st, q, k, v, q_seg, kv_seg)
  return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)


def _flash_bwd(st: _Static, res, cotangents):
  q, k, v, q_seg, kv_seg, o, lse = res
  do, dlse = cotangents
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p, d_p, spec = _layout(st, q_len, kv_len, head_dim, segments)
  delta = backward_delta(o, do, dlse)
  dq, dk, dv = flash_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, d_p),
      pad_to(do.astype(q.dtype), q_len_p, d_p), pad_rows(lse, q_len_p), pad_rows(delta, q_len_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=spec, scale=st.scale, softcap=st.softcap, config=st.config,
      blocks=(bq[1], bk[1], bq[2], bk[2]), interpret=st.interpret)
  dq = dq[:, :q_len, :, :head_dim]
  dk = dk[:, :kv_len, :, :head_dim]
  dv = dv[:, :kv_len, :, :head_dim]
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_triton(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal: bool,
                           scale: float, local_window=None, softcap=None,
                           config: FlashBlockConfig, interpret: bool = False):
  """Flash attention through the Triton-lowered Pallas kernels.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``.
    q_segment_ids, kv_segment_ids: ``[batch, q_len]`` / ``[batch, kv_len]`` int32, or None.
    Inputs are assumed validated (see ``jattn.flash_attention``).

  Returns:
    ``(o, lse)``: ``o`` like ``q``; ``lse: [batch, q_heads, q_len]`` float32.
  """
  st = _Static(causal=causal, scale=float(scale),
               local_window=None if local_window is None else tuple(local_window),
               softcap=None if softcap is None else float(softcap), config=config,
               interpret=interpret)
  return _flash(st, q, k, v, q_segment_ids, kv_segment_ids)


def backward_triton(q, k, v, o, lse, do, dlse, *, causal: bool, scale: float,
                    local_window=None, softcap=None, config: FlashBlockConfig,
                    interpret: bool = False):
  """The Triton-lowered backward on saved ``(o, lse)`` of any flash forward.

  Shapes as in :func:`flash_attention_triton`; ``do`` like ``o``, ``dlse`` like ``lse``.
  Returns ``(dq, dk, dv)``.
  """
  st = _Static(causal=causal, scale=float(scale), local_window=local_window,
               softcap=softcap, config=config, interpret=interpret)
  return _flash_bwd(st, (q, k, v, None, None, o, lse), (do, dlse))[:3]
