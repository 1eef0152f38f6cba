"""Dilated attention over several (w, r) pairs (Triton-lowered Pallas) and its VJP.

Pads the sequence only when its length is not a multiple of ``lcm(r) x tile`` (and
head dims to a power of two), then runs the pairs one after another on free reshapes
of the same buffers (see ``kernels``). The backward reuses the mixture's ``(o, lse)``:
no per-pair output is kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.dilated.kernels import PairGeometry, pair_backward, pair_forward
from pallas_kernels.flash.common import EMPTY_ROW_LSE, pad_to, round_up
from pallas_kernels.flash.config import (MIN_BLOCK, FlashBlockConfig, default_config,
                                         next_power_of_two, padded_head_dim)


_BLOCKS = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")


@dataclasses.dataclass(frozen=True)
class _Static:
  pairs: tuple[tuple[int, int], ...]
  causal: bool
  scale: float
  config: FlashBlockConfig
  interpret: bool


def _layout(st: _Static, seq: int, head_dim: int):
  """``(tiles, padded seq, padded head dim)``: ``tiles`` maps each of the config's
  block fields to the tile used (at most the rows a pair has), and every pair's row
  count ``seq_p / r`` is a multiple of all of them."""
  rates = math.lcm(*(r for _, r in st.pairs))
  fit = lambda b: max(MIN_BLOCK, min(b, next_power_of_two(-(-seq // rates))))
  tiles = {f: fit(getattr(st.config, f)) for f in _BLOCKS}
  return tiles, round_up(seq, rates * max(tiles.values())), padded_head_dim(head_dim)


def _geometry(st: _Static, seq: int, seq_p: int, group: int, w: int, r: int) -> PairGeometry:
  return PairGeometry(seq=seq, rows=seq_p // r, seg_rows=w // r, rate=r, group=group,
                      causal=st.causal, scale=st.scale)


def _view(x, r: int):
  """``[b, s, h, d] -> [b, s / r, r, h, d]`` (a reshape: no copy)."""
  b, s, h, d = x.shape
  return x.reshape(b, s // r, r, h, d)


def _stat_view(x, r: int):
  b, h, s = x.shape
  return x.reshape(b, h, s // r, r)


def _forward(st: _Static, q, k, v):
  """``(o float32 [b, s, h, d], lse [b, h, s])`` of the pairs' mixture."""
  batch, seq, heads, head_dim = q.shape
  tiles, seq_p, d_p = _layout(st, seq, head_dim)
  q_p, k_p, v_p = (pad_to(x, seq_p, d_p) for x in (q, k, v))
  o_acc = jnp.zeros((batch, seq_p, heads, d_p), jnp.float32)
  lse_acc = jnp.full((batch, heads, seq_p), EMPTY_ROW_LSE, jnp.float32)
  launch = dict(block_q=tiles["block_q"], block_k=tiles["block_k"], num_warps=st.config.num_warps,
                num_stages=st.config.num_stages, interpret=st.interpret)
  for w, r in st.pairs:
    o5, lse4 = pair_forward(_view(q_p, r), _view(k_p, r), _view(v_p, r), _view(o_acc, r),
                            _stat_view(lse_acc, r),
                            geo=_geometry(st, seq, seq_p, heads // k.shape[2], w, r), **launch)
    o_acc, lse_acc = o5.reshape(o_acc.shape), lse4.reshape(lse_acc.shape)
  return o_acc[:, :seq, :, :head_dim], lse_acc[:, :, :seq]


def _backward(st: _Static, q, k, v, o, lse, do):
  """Float32 ``(dq, dk, dv)`` of the pairs' blocks, given the final ``(o, lse)`` of a
  mixture that contains them (possibly with more pairs)."""
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  tiles, seq_p, d_p = _layout(st, seq, head_dim)
  pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, seq_p - seq)))
  delta = pad_rows(jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32)))
  # Padded query rows are zeros with dO = 0: with lse = 0 there, p = 1 and they add nothing.
  lse_p = pad_rows(lse)
  q_p, k_p, v_p, do_p = (pad_to(x, seq_p, d_p) for x in (q, k, v, do.astype(q.dtype)))
  dq, dk, dv = (jnp.zeros((batch, seq_p, heads, d_p), jnp.float32) for _ in range(3))
  launch = dict(dq_blocks=(tiles["block_q_dq"], tiles["block_k_dq"]),
                dkv_blocks=(tiles["block_q_dkv"], tiles["block_k_dkv"]),
                num_warps=st.config.bwd_num_warps,
                num_stages=st.config.bwd_num_stages, interpret=st.interpret)
  for w, r in st.pairs:
    grads = pair_backward(_view(q_p, r), _view(k_p, r), _view(v_p, r), _view(do_p, r),
                          _stat_view(lse_p, r), _stat_view(delta, r), _view(dq, r),
                          _view(dk, r), _view(dv, r),
                          geo=_geometry(st, seq, seq_p, heads // kv_heads, w, r), **launch)
    dq, dk, dv = (g.reshape(dq.shape) for g in grads)
  per_kv_head = lambda x: x.reshape(batch, seq_p, kv_heads, heads // kv_heads, d_p).sum(3)
  unpad = lambda x: x[:, :seq, :, :head_dim]
  return unpad(dq), unpad(per_kv_head(dk)), unpad(per_kv_head(dv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dilated(st: _Static, q, k, v):
  return _forward(st, q, k, v)[0].astype(q.dtype)


def _dilated_fwd(st: _Static, q, k, v):
  o, lse = _forward(st, q, k, v)
  o = o.astype(q.dtype)
  return o, (q, k, v, o, lse)


def _dilated_bwd(st: _Static, res, do):
  q, k, v, o, lse = res
  dq, dk, dv = _backward(st, q, k, v, o, lse, do)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_dilated.defvjp(_dilated_fwd, _dilated_bwd)


def _static(segment_lengths, dilation_rates, causal, scale, config, interpret, q) -> _Static:
  config = config or default_config(q.shape[-1], jnp.dtype(q.dtype).itemsize)
  return _Static(pairs=tuple(zip(map(int, segment_lengths), map(int, dilation_rates))),
                 causal=bool(causal), scale=float(scale), config=config, interpret=interpret)


def dilated_pairs_forward(q, k, v, *, segment_lengths, dilation_rates, causal: bool,
                          scale: float, config: FlashBlockConfig | None = None,
                          interpret: bool = False):
  """The pairs' mixture as partial results, for callers that merge in more (the
  dilated ring): ``(o float32 [batch, seq, heads, head_dim], lse [batch, heads, seq])``,
  ``EMPTY_ROW_LSE`` where no pair covers a position. Not differentiable by itself:
  pair it with ``dilated_pairs_backward``."""
  return _forward(_static(segment_lengths, dilation_rates, causal, scale, config, interpret, q),
                  q, k, v)


def dilated_pairs_backward(q, k, v, o, lse, do, *, segment_lengths, dilation_rates,
                           causal: bool, scale: float, config: FlashBlockConfig | None = None,
                           interpret: bool = False):
  """Float32 ``(dq, dk, dv)`` of these pairs' attention blocks given the final output
  ``o`` and ``lse`` of a mixture that contains them (and perhaps other blocks)."""
  return _backward(_static(segment_lengths, dilation_rates, causal, scale, config, interpret, q),
                   q, k, v, o, lse, do)


def dilated_attention_triton(q, k, v, *, segment_lengths, dilation_rates, causal: bool,
                             scale: float, config: FlashBlockConfig | None = None,
                             interpret: bool = False):
  """Dilated attention through the Triton-lowered Pallas kernels.

  Args:
    q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``;
      pairs ``(w_i, r_i)`` with ``w_i % r_i == 0``. Inputs assumed validated (see
      ``jattn.dilated_attention``).
    config: tiles and launch parameters (default: flash attention's
      ``default_config``; the forward takes ``block_q`` / ``block_k``, the backward
      the ``_dq`` and ``_dkv`` tiles).

  Returns:
    ``[batch, seq, heads, head_dim]`` in q's dtype.
  """
  return _dilated(_static(segment_lengths, dilation_rates, causal, scale, config, interpret, q),
                  q, k, v)
