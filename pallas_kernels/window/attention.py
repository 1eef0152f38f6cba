"""Window attention with a learned bias (Triton-lowered Pallas) and its custom VJP.

Pads tokens to the tile grid and head dims to a power of two, moves the bias and
mask into base-2 units with ``-inf`` over padded keys, and saves (q, k, v, bias,
mask, o, lse) for the backward, which returns gradients for q, k, v and the bias.
The mask is a constant (no gradient), as the shifted-window masks it stands for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash.common import LOG2E, backward_delta, pad_to, round_up
from pallas_kernels.flash.config import FlashBlockConfig, clamp_block, padded_head_dim
from pallas_kernels.window.kernels import window_backward, window_forward


def default_window_config(head_dim: int, dtype_bytes: int) -> FlashBlockConfig:
  """Tiles for windows of up to a few hundred tokens: 64-sided everywhere (a starting
  point to tune on the GPU; fp32 halves the key tiles for shared memory)."""
  del head_dim  # small head dims (DAT: 30-60) all pad to <= 64
  block_k = 32 if dtype_bytes >= 4 else 64
  return FlashBlockConfig(block_q=64, block_k=block_k, num_warps=4, num_stages=2,
                          block_q_dkv=block_k, block_k_dkv=64, block_q_dq=64, block_k_dq=block_k,
                          bwd_num_warps=4, bwd_num_stages=2)


@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  config: FlashBlockConfig
  interpret: bool


def _layout(st: _Static, tokens: int, head_dim: int):
  c = st.config
  blocks = [clamp_block(b, tokens) for b in (c.block_q, c.block_k, c.block_q_dkv, c.block_k_dkv,
                                              c.block_q_dq, c.block_k_dq)]
  return blocks, round_up(tokens, max(blocks)), padded_head_dim(head_dim)


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


def _forward(st: _Static, q, k, v, bias, mask):
  windows, tokens, heads, head_dim = q.shape
  blocks, tokens_p, d_p = _layout(st, tokens, head_dim)
  bias2, mask2 = _base2_terms(bias, mask, tokens_p)
  o, lse = window_forward(
      pad_to(q, tokens_p, d_p), pad_to(k, tokens_p, d_p), pad_to(v, tokens_p, d_p),
      bias2, mask2, scale=st.scale, block_q=blocks[0], block_k=blocks[1],
      num_warps=st.config.num_warps, num_stages=st.config.num_stages, interpret=st.interpret)
  return o[:, :tokens, :, :head_dim], lse[:, :, :tokens]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _window(st: _Static, q, k, v, bias, mask):
  return _forward(st, q, k, v, bias, mask)[0]


def _window_fwd(st: _Static, q, k, v, bias, mask):
  o, lse = _forward(st, q, k, v, bias, mask)
  return o, (q, k, v, bias, mask, o, lse)


def _window_bwd(st: _Static, res, do):
  q, k, v, bias, mask, o, lse = res
  windows, tokens, heads, head_dim = q.shape
  blocks, tokens_p, d_p = _layout(st, tokens, head_dim)
  bias2, mask2 = _base2_terms(bias, mask, tokens_p)
  delta = backward_delta(o, do, jnp.zeros_like(lse))
  row_pad = ((0, 0), (0, 0), (0, tokens_p - tokens))
  dq, dk, dv, dbias = window_backward(
      *(pad_to(x, tokens_p, d_p) for x in (q, k, v, do.astype(q.dtype))),
      jnp.pad(lse, row_pad), jnp.pad(delta, row_pad), bias2, mask2, scale=st.scale,
      blocks=tuple(blocks[2:]), num_warps=st.config.bwd_num_warps,
      num_stages=st.config.bwd_num_stages, interpret=st.interpret)
  unpad = lambda x: x[:, :tokens, :, :head_dim]
  dmask = None if mask is None else jnp.zeros_like(mask)
  return (unpad(dq), unpad(dk), unpad(dv),
          dbias[:, :tokens, :tokens].astype(bias.dtype), dmask)


_window.defvjp(_window_fwd, _window_bwd)


def window_attention_triton(q, k, v, bias, mask=None, *, scale: float,
                            config: FlashBlockConfig | None = None, interpret: bool = False):
  """Window attention through the Triton-lowered Pallas kernels.

  Args:
    q, k, v: ``[windows, tokens, heads, head_dim]``; bias ``[heads, tokens, tokens]``
      (any float dtype; gets a gradient); mask ``[mask_windows, tokens, tokens]``
      additive float or None (window ``w`` takes ``mask[w % mask_windows]``; no
      gradient). Inputs assumed validated (see ``jattn.window_attention``).
    config: tiles (default ``default_window_config``).

  Returns:
    ``[windows, tokens, heads, head_dim]`` in q's dtype.
  """
  config = config or default_window_config(q.shape[-1], jnp.dtype(q.dtype).itemsize)
  return _window(_Static(scale=float(scale), config=config, interpret=interpret),
                 q, k, v, bias, mask)
