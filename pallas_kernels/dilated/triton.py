"""Host side of the dilated attention kernels (Triton-lowered Pallas).

Pads the sequence only when its length is not a multiple of ``lcm(r) x tile`` (and
head dims to a power of two), then runs the pairs one after another on free reshapes
of the same buffers (see ``triton_fwd``). The backward takes the mixture's final
``(o, lse)``: no per-pair output is kept, and the same call serves a mixture that
holds more blocks than these pairs (the dilated ring's).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, backward_delta, backward_lse
from jattn.kernels.common.tiling import pad_rows, pad_to, tile_axis
from jattn.kernels.dilated.triton_bwd import pair_backward
from jattn.kernels.dilated.triton_fwd import PairGeometry, pair_forward

_BLOCKS = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")


def _tiles(config: BlockConfig, pairs, seq: int):
  """``({block field: tile}, padded seq)``: every pair's row count ``seq_p / r`` is a
  multiple of every tile, and no tile exceeds the rows a pair has."""
  rates = math.lcm(*(r for _, r in pairs))
  used, seq_p = tile_axis(seq, tuple(getattr(config, f) for f in _BLOCKS), unit=rates)
  return dict(zip(_BLOCKS, used)), seq_p


def _geometry(seq: int, seq_p: int, group: int, w: int, r: int, causal: bool,
              scale: float) -> PairGeometry:
  return PairGeometry(seq=seq, rows=seq_p // r, seg_rows=w // r, rate=r, group=group,
                      causal=causal, scale=scale)


def _view(x, r: int):
  """``[b, s, h, d] -> [b, s / r, r, h, d]`` (a reshape: no copy)."""
  b, s, h, d = x.shape
  return x.reshape(b, s // r, r, h, d)


def _stat_view(x, r: int):
  b, h, s = x.shape
  return x.reshape(b, h, s // r, r)


def dilated_triton_forward(q, k, v, *, pairs, causal: bool, scale: float, config: BlockConfig,
                           interpret: bool):
  """The mixture of the ``pairs`` ``((w, r), ...)`` as ``(o float32 [batch, seq, heads,
  head_dim], lse [batch, heads, seq])``; ``EMPTY_ROW_LSE`` (and zeros) where no pair
  covers a position.

  q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``.
  """
  batch, seq, heads, head_dim = q.shape
  tiles, seq_p = _tiles(config, pairs, seq)
  d_p = padded_head_dim(head_dim)
  q_p, k_p, v_p = (pad_to(x, seq_p, d_p) for x in (q, k, v))
  o_acc = jnp.zeros((batch, seq_p, heads, d_p), jnp.float32)
  lse_acc = jnp.full((batch, heads, seq_p), EMPTY_ROW_LSE, jnp.float32)
  launch = dict(block_q=tiles["block_q"], block_k=tiles["block_k"], num_warps=config.num_warps,
                num_stages=config.num_stages, interpret=interpret)
  for w, r in pairs:
    o5, lse4 = pair_forward(_view(q_p, r), _view(k_p, r), _view(v_p, r), _view(o_acc, r),
                            _stat_view(lse_acc, r),
                            geo=_geometry(seq, seq_p, heads // k.shape[2], w, r, causal, scale),
                            **launch)
    o_acc, lse_acc = o5.reshape(o_acc.shape), lse4.reshape(lse_acc.shape)
  return o_acc[:, :seq, :, :head_dim], lse_acc[:, :, :seq]


def dilated_triton_backward(q, k, v, o, lse, do, dlse, *, pairs, causal: bool, scale: float,
                            config: BlockConfig, interpret: bool):
  """Float32 ``(dq, dk, dv)`` of the pairs' blocks, given the final ``(o, lse)`` of a
  mixture that contains them (possibly with more blocks) and the cotangents ``do``
  and ``dlse``."""
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  tiles, seq_p = _tiles(config, pairs, seq)
  d_p = padded_head_dim(head_dim)
  delta = pad_rows(backward_delta(o, do, dlse), seq_p)
  # Padded query rows are zeros with dO = 0: with lse = 0 there, p = 1 and they add nothing.
  lse_p = backward_lse(lse, seq_p, False)
  q_p, k_p, v_p, do_p = (pad_to(x, seq_p, d_p) for x in (q, k, v, do.astype(q.dtype)))
  dq, dk, dv = (jnp.zeros((batch, seq_p, heads, d_p), jnp.float32) for _ in range(3))
  launch = dict(dq_blocks=(tiles["block_q_dq"], tiles["block_k_dq"]),
                dkv_blocks=(tiles["block_q_dkv"], tiles["block_k_dkv"]),
                num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages,
                interpret=interpret)
  for w, r in pairs:
    grads = pair_backward(_view(q_p, r), _view(k_p, r), _view(v_p, r), _view(do_p, r),
                          _stat_view(lse_p, r), _stat_view(delta, r), _view(dq, r),
                          _view(dk, r), _view(dv, r),
                          geo=_geometry(seq, seq_p, heads // kv_heads, w, r, causal, scale),
                          **launch)
    dq, dk, dv = (g.reshape(dq.shape) for g in grads)
  per_kv_head = lambda x: x.reshape(batch, seq_p, kv_heads, heads // kv_heads, d_p).sum(3)
  unpad = lambda x: x[:, :seq, :, :head_dim]
  return unpad(dq), unpad(per_kv_head(dk)), unpad(per_kv_head(dv))
