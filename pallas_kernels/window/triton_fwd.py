"""Window attention forward kernel (Triton-lowered Pallas), and the tile specs and
logits it shares with the gradient kernels (``triton_bwd``).

Every window is a tiny attention problem ``[tokens, head_dim]`` per head, with an
additive bias ``[heads, tokens, tokens]`` shared by all windows and an optional
additive mask ``[mask_windows, tokens, tokens]`` (window ``w`` takes mask
``w % mask_windows``). The wrapper hands the kernels padded inputs with the bias
and mask already in base-2 units (times log2 e) and ``-inf`` in the bias columns of
padded keys, so the kernels add them to the logits and need no element masks.

Grid: ``(query tiles, windows, heads)``.

Compiled kernels take fp32 products as three TF32 ones (``dot``'s ``fast_fp32``); the
interpreter, on XLA's CPU, takes them in IEEE fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jattn.kernels.common.launch import (row_stat_spec, tile_spec, triton_call,
                                         whole_sequence_spec)
from jattn.kernels.common.nonfinite import guard_values
from jattn.kernels.common.softmax import (LOG2E, dot, online_softmax_finish,
                                          online_softmax_init, online_softmax_step)


def bias_rows(block: int, tokens: int):
  """Rows of head ``h``'s ``[tokens, tokens]`` bias (or of its transpose)."""
  return pl.BlockSpec((None, block, tokens), lambda i, w, h: (h, i, 0))


def mask_rows(block: int, tokens: int, mask_windows: int):
  return pl.BlockSpec((None, block, tokens), lambda i, w, h: (w % mask_windows, i, 0))


def logits2(qk, scale: float, bias, mask):
  """Logits in base-2 units from raw ``q·k`` and the (base-2) bias and mask tiles: -inf
  where the bias or the mask is (a NaN or infinite product there never reaches the
  row)."""
  terms = bias if mask is None else bias + mask
  masked = jnp.isneginf(bias) if mask is None else jnp.isneginf(bias) | jnp.isneginf(mask)
  return jnp.where(masked, -jnp.inf, qk * (scale * LOG2E) + terms)


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, o_ref, lse_ref, *, scale: float,
                    block_k: int, fast: bool):
  q = q_ref[...]

  def body(j, carry):
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    mask = None if mask_ref is None else mask_ref[:, cols]
    # Any tile may hold masked keys: guarded, every one (nonfinite.py).
    k, v = guard_values(k_ref[cols, :], v_ref[cols, :])
    s = logits2(dot(q, k, 1, 1, fast), scale, bias_ref[:, cols], mask)
    return online_softmax_step(carry, s, 1.0, v, fast)

  carry = online_softmax_init(q.shape[0], v_ref.shape[-1])
  o, lse = online_softmax_finish(lax.fori_loop(0, k_ref.shape[0] // block_k, body, carry))
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def window_forward(q, k, v, bias2, mask2, *, scale: float, block_q: int, block_k: int,
                   num_warps: int, num_stages: int, interpret: bool):
  """Forward on padded inputs.

  Args:
    q, k, v: ``[windows, tokens_p, heads, d_p]``; bias2: ``[heads, tokens_p, tokens_p]``
      float32 in base-2 units; mask2: ``[mask_windows, tokens_p, tokens_p]`` or None.

  Returns:
    ``o`` like ``q`` and ``lse: [windows, heads, tokens_p]`` float32 (natural log).
  """
  windows, tokens, heads, d = q.shape
  mask_spec = None if mask2 is None else mask_rows(block_q, tokens, mask2.shape[0])
  return triton_call(
      functools.partial(_forward_kernel, scale=scale, block_k=block_k, fast=not interpret),
      grid=(tokens // block_q, windows, heads),
      in_specs=[tile_spec(block_q, d), whole_sequence_spec(tokens, d), whole_sequence_spec(tokens, d),
                bias_rows(block_q, tokens), mask_spec],
      out_specs=[tile_spec(block_q, d), row_stat_spec(block_q)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((windows, heads, tokens), jnp.float32)],
      name="jattn_window_fwd", interpret=interpret, num_warps=num_warps, num_stages=num_stages,
  )(q, k, v, bias2, mask2)
