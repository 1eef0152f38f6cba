"""Host side of the Triton-lowered flash attention: pads inputs to the tile grid, runs
the forward kernel, or the dK/dV and dQ kernels given the saved ``(o, lse)``.

The backward takes any ``(o, lse)`` of the rows, not only this forward's: given the
final statistics of a larger softmax (a ring's, a mixture's), it returns this block's
share of the gradients.
"""

from __future__ import annotations

import dataclasses

from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import ScoreFunction, Softcap, backward_delta
from jattn.kernels.common.tiling import pad_rows, pad_to, tile_axis
from jattn.kernels.flash.triton_bwd import flash_backward
from jattn.kernels.flash.triton_fwd import flash_forward


def _tiles(config: BlockConfig, q_len: int, kv_len: int):
  """``(q tiles (fwd, dkv, dq), k tiles (fwd, dkv, dq), q_len_p, kv_len_p)``."""
  bq, q_len_p = tile_axis(q_len, (config.block_q, config.block_q_dkv, config.block_q_dq))
  bk, kv_len_p = tile_axis(kv_len, (config.block_k, config.block_k_dkv, config.block_k_dq))
  return bq, bk, q_len_p, kv_len_p


def _mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mask_fn):
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=kv_len_p != kv_len, segments=segments)
  return dataclasses.replace(spec, element_fn=mask_fn)


def _score(softcap, score_fn):
  if softcap is not None:
    return Softcap(softcap)
  return None if score_fn is None else ScoreFunction(score_fn)


def flash_triton_forward(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, local_window,
                         softcap, config: BlockConfig, interpret: bool, score_fn=None,
                         mask_fn=None):
  """Flash attention forward.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k, v: ``[batch, kv_len, kv_heads, head_dim]``;
    q_seg, kv_seg: ``[batch, q_len]`` / ``[batch, kv_len]`` int32, or None.
    score_fn, mask_fn: FlexAttention's scalar ``score_mod`` / ``mask_mod`` (closing
      over no array), applied elementwise in the tiles; ``score_fn`` excludes ``softcap``.

  Returns:
    ``(o, lse)``: ``o`` like ``q``; ``lse: [batch, q_heads, q_len]`` float32.
  """
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p = _tiles(config, q_len, kv_len)
  d_p = padded_head_dim(head_dim)
  o, lse = flash_forward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, d_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=_mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mask_fn), scale=scale,
      score=_score(softcap, score_fn), config=config, block_q=bq[0], block_k=bk[0],
      interpret=interpret)
  return o[:, :q_len, :, :head_dim], lse[:, :, :q_len]


def flash_triton_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, *, causal: bool, scale: float,
                          local_window, softcap, config: BlockConfig, interpret: bool,
                          score_fn=None, mask_fn=None):
  """Gradients ``(dq, dk, dv)`` (like q, k, v) given the rows' ``o`` and ``lse``, the
  output's cotangent ``do`` and the lse's ``dlse``. Shapes as ``flash_triton_forward``."""
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  segments = q_seg is not None
  bq, bk, q_len_p, kv_len_p = _tiles(config, q_len, kv_len)
  d_p = padded_head_dim(head_dim)
  delta = backward_delta(o, do, dlse)
  dq, dk, dv = flash_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, d_p),
      pad_to(do.astype(q.dtype), q_len_p, d_p), pad_rows(lse, q_len_p), pad_rows(delta, q_len_p),
      pad_to(q_seg, q_len_p) if segments else None, pad_to(kv_seg, kv_len_p) if segments else None,
      spec=_mask(q_len, kv_len, kv_len_p, causal, local_window, segments, mask_fn), scale=scale,
      score=_score(softcap, score_fn), config=config, blocks=(bq[1], bk[1], bq[2], bk[2]),
      interpret=interpret)
  return dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim], dv[:, :kv_len, :, :head_dim]
