"""Host side of the window attention kernels (Triton-lowered Pallas).

Pads tokens to the tile grid and head dims to a power of two, moves the bias and
mask into base-2 units with ``-inf`` over padded keys, and runs the forward kernel,
or the dQ, dK/dV and d(bias) kernels given the saved ``(o, lse)``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.softmax import LOG2E, backward_delta, backward_lse
from jattn.kernels.common.tiling import pad_rows, pad_to, tile_axis
from jattn.kernels.window.triton_bwd import window_backward
from jattn.kernels.window.triton_fwd import window_forward


def _tiles(config: BlockConfig, tokens: int):
  c = config
  return tile_axis(tokens, (c.block_q, c.block_k, c.block_q_dkv, c.block_k_dkv, c.block_q_dq,
                            c.block_k_dq))


def _base2_terms(bias, mask, tokens_p: int):
  """Bias ``[heads, t, t]`` and mask ``[m, t, t]`` times log2 e, padded to ``tokens_p``:
  bias columns of padded keys are ``-inf`` so no query attends to them."""
  tokens = bias.shape[-1]
  pad = ((0, 0), (0, tokens_p - tokens), (0, tokens_p - tokens))
  bias2 = jnp.pad(bias.astype(jnp.float32) * LOG2E, pad)
  if tokens_p != tokens:
    bias2 = bias2.at[:, :, tokens:].set(-jnp.inf)
  mask2 = None if mask is None else jnp.pad(mask.astype(jnp.float32) * LOG2E, pad)
  return bias2, mask2


def window_triton_forward(q, k, v, bias, mask, *, scale: float, config: BlockConfig,
                          interpret: bool):
  """Window attention forward.

  Args:
    q, k, v: ``[windows, tokens, heads, head_dim]``; bias ``[heads, tokens, tokens]``;
      mask ``[mask_windows, tokens, tokens]`` additive float or None (window ``w``
      takes ``mask[w % mask_windows]``).

  Returns:
    ``(o, lse)``: ``o`` like ``q``; ``lse: [windows, heads, tokens]`` float32.
  """
  tokens, head_dim = q.shape[1], q.shape[-1]
  blocks, tokens_p = _tiles(config, tokens)
  d_p = padded_head_dim(head_dim)
  bias2, mask2 = _base2_terms(bias, mask, tokens_p)
  o, lse = window_forward(
      pad_to(q, tokens_p, d_p), pad_to(k, tokens_p, d_p), pad_to(v, tokens_p, d_p),
      bias2, mask2, scale=scale, block_q=blocks[0], block_k=blocks[1],
      num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret)
  return o[:, :tokens, :, :head_dim], lse[:, :, :tokens]


def window_triton_backward(q, k, v, bias, mask, o, lse, do, *, scale: float,
                           config: BlockConfig, interpret: bool):
  """Gradients ``(dq, dk, dv, dbias)`` given the saved ``o``, ``lse`` and the output's
  cotangent ``do``; ``dbias`` in the bias's dtype. Shapes as ``window_triton_forward``."""
  tokens, head_dim = q.shape[1], q.shape[-1]
  blocks, tokens_p = _tiles(config, tokens)
  d_p = padded_head_dim(head_dim)
  bias2, mask2 = _base2_terms(bias, mask, tokens_p)
  delta = backward_delta(o, do, jnp.zeros_like(lse))
  dq, dk, dv, dbias = window_backward(
      *(pad_to(x, tokens_p, d_p) for x in (q, k, v, do.astype(q.dtype))),
      backward_lse(lse, tokens_p, False), pad_rows(delta, tokens_p), bias2, mask2, scale=scale,
      blocks=tuple(blocks[2:]), num_warps=config.bwd_num_warps,
      num_stages=config.bwd_num_stages, interpret=interpret)
  unpad = lambda x: x[:, :tokens, :, :head_dim]
  return unpad(dq), unpad(dk), unpad(dv), dbias[:, :tokens, :tokens].astype(bias.dtype)
