"""Dilated attention on the Hopper kernels (``hopper.forward`` and the flash backward
kernels), reading the dilated rows in place.

Where ``seq`` is a multiple of a pair's segment length ``w``, ``[batch, seq, heads, d]``
is, without a copy, ``[batch * seq / w, w / r, r * heads, d]``: each segment a batch
row, and "head" ``o * heads + h`` the positions ``≡ o (mod r)`` of head ``h``. Head ``h``
reads offset ``h mod r`` (LongNet's head offsets), so a pair is one Hopper forward over
that view whose work items (``work.DilatedTiles``) read query head ``h`` at "head"
``(h mod r) * heads + h`` and write it compactly, and whose K/V addressing
(``addressing.DilatedKV``) does the same for its KV head. The pairs' outputs are then
spread back to their positions and mixed by their log-sum-exp in one elementwise pass.
The backward runs the flash backward kernels on the same views (``BackwardLayout`` of
``addressing.DilatedQ`` and ``DilatedKV``), each pair as one block of the mixture's
softmax, and spreads its compact gradients back the same way.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import (EMPTY_ROW_LSE, backward_delta, backward_lse,
                                          merge_partials)
from jattn.kernels.common.tiling import pad_to
from jattn.kernels.flash.config import MosaicBlockConfig
from jattn.kernels.flash.mosaic_bwd import BackwardLayout, mosaic_backward
from jattn.kernels.flash.mosaic_fwd import SoftmaxRows
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import DilatedKV, DilatedQ
from jattn.kernels.hopper.budget import mosaic_head_dim
from jattn.kernels.hopper.forward import rows_forward
from jattn.kernels.hopper.work import DilatedTiles


def pair_views(x, w: int, r: int):
  """``[batch, seq, heads, d] -> [batch * seq / w, w / r, r * heads, d]`` (a reshape:
  ``seq`` must be a multiple of ``w``)."""
  batch, seq, heads, d = x.shape
  return x.reshape(batch * seq // w, w // r, r * heads, d)


def pair_rows(x, w: int, r: int, heads: int):
  """``x [batch, seq, heads or kv_heads, d]`` at each query head's dilated rows, as the
  Hopper forward reads them: ``[batch * seq / w, w / r, heads, d]``, row ``m`` of
  segment ``s`` for head ``h`` being position ``s * w + m * r + h mod r`` (of KV head
  ``h // group``). A copy (the forward reads them in place), but none for ``r = 1``
  with as many heads as ``heads``."""
  x_heads = x.shape[2]
  group = heads // x_heads
  if r == 1 and group == 1:
    return pair_views(x, w, r)
  # Static slices stacked (one fused copy) rather than a gather on the head axis, which
  # XLA runs at a fraction of the memory bandwidth.
  slots = pair_views(x, w, r).reshape(-1, w // r, r, x_heads, x.shape[-1])
  return jnp.stack([slots[:, :, h % r, h // group] for h in range(heads)], axis=2)


def spread_rows(x, *, batch: int, r: int, fill=0.0):
  """The inverse of ``pair_rows`` for query heads: ``x [segments, w / r, heads, d]`` at
  its positions, ``[batch, seq, heads, d]``, ``fill`` where head ``h`` has none (the
  positions ``≢ h (mod r)``)."""
  segments, rows, heads, d = x.shape
  per_row = segments * rows // batch  # seq / r
  covers = jnp.arange(r)[:, None] == jnp.arange(heads)[None, :] % r  # [slot, head]
  x = jnp.where(covers[:, :, None], x.reshape(batch, per_row, 1, heads, d), fill)
  return x.reshape(batch, per_row * r, heads, d)


def pair_tile(config: MosaicBlockConfig) -> int:
  """The rows every tile of ``config``'s forward divides (a CTA covers ``CONSUMERS``
  per-warpgroup blocks): a pair's ``w / r`` must be a multiple. At least 128."""
  return math.lcm(mp.CONSUMERS * config.block_q, config.block_kv)


# Backward tiles every pair the forward takes divides (its rows a multiple of 128).
_SMALL_BACKWARD_TILES = (64, 64, 64, 64)


def _backward_tiles(config: MosaicBlockConfig, rows: int) -> tuple[int, int, int, int]:
  """``config``'s backward tiles ``(block_q_dq, block_kv_dq, block_q_dkv,
  block_kv_dkv)`` where they divide a pair's ``rows`` (a dQ CTA covers ``CONSUMERS``
  query blocks, a dK/dV CTA as many key blocks), else 64-row ones."""
  c, n = config, mp.CONSUMERS
  tiles = (c.block_q_dq, c.block_kv_dq, c.block_q_dkv, c.block_kv_dkv)
  fits = rows % math.lcm(n * c.block_q_dq, c.block_kv_dq, c.block_q_dkv, n * c.block_kv_dkv)
  return _SMALL_BACKWARD_TILES if fits else tiles


def unsupported_pair(seq: int, w: int, r: int, rows_multiple: int) -> str | None:
  """Why the pair ``(w, r)`` cannot run on the Hopper forward at ``seq`` (None: it
  can): every segment whole, and each of its ``w / r`` rows a whole number of tiles."""
  if seq % w:
    return f"segment length {w} not dividing the sequence length {seq}"
  if (w // r) % rows_multiple:
    return f"w / r = {w // r} rows per segment not a multiple of {rows_multiple}"
  return None


def _pair_forward(q, k, v, *, w: int, r: int, causal: bool, scale: float,
                  config: MosaicBlockConfig):
  """One pair's ``(o [segments, w / r, heads, d], lse [segments, heads, w / r])``."""
  heads, kv_heads = q.shape[2], k.shape[2]
  rows = w // r
  spec = MaskSpec.build(rows, rows, causal=causal, local_window=None, kv_padded=False,
                        segments=False)
  persistent = not causal if config.persistent is None else config.persistent
  items = DilatedTiles(rows // (mp.CONSUMERS * config.block_q), heads,
                       q.shape[0] * q.shape[1] // w, config.block_q, mp.CONSUMERS,
                       tiles_fastest=persistent, heavy_first=causal, rate=r)
  return rows_forward(*(pair_views(x, w, r) for x in (q, k, v)), rule=SoftmaxRows(spec, scale),
                      spec=spec, block_q=config.block_q, block_kv=config.block_kv,
                      stages=config.stages, persistent=persistent, items=items,
                      addressing=DilatedKV(r, kv_heads, heads // kv_heads), group=1)


def spread_pair(o, lse, *, batch: int, r: int):
  """A pair's compact ``(o [segments, w / r, heads, d], lse [segments, heads, w / r])``
  at the positions it covers: ``(o float32 [batch, seq, heads, d], lse [batch, heads,
  seq])``, zeros and ``EMPTY_ROW_LSE`` where it covers none (head ``h`` covers the
  positions ``≡ h (mod r)``)."""
  o = spread_rows(o.astype(jnp.float32), batch=batch, r=r)
  lse = spread_rows(jnp.moveaxis(lse, 1, 2)[..., None], batch=batch, r=r, fill=EMPTY_ROW_LSE)
  return o, jnp.moveaxis(lse[..., 0], 1, 2)


def mix_pairs(parts):
  """The pairs' ``(o, lse)`` (``spread_pair``'s) mixed by their log-sum-exp."""
  merge = lambda a, b: merge_partials(*a, *b, expand=lambda x: jnp.moveaxis(x, 1, 2)[..., None])
  return functools.reduce(merge, parts)


def dilated_mosaic_forward(q, k, v, *, pairs, causal: bool, scale: float,
                           config: MosaicBlockConfig):
  """The mixture of the ``pairs`` ``((w, r), ...)`` as ``(o float32 [batch, seq, heads,
  head_dim], lse [batch, heads, seq])``, as ``dilated_triton_forward`` gives it (each
  pair's output rounded to the inputs' 16 bits before the mix).

  q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``;
  16-bit. Every pair as ``unsupported_pair`` allows with ``pair_tile(config)`` rows
  (else a ValueError)."""
  batch, seq, _, head_dim = q.shape
  _check_pairs(seq, pairs, config)
  d_p = mosaic_head_dim(head_dim)
  q_p, k_p, v_p = (pad_to(x, seq, d_p) for x in (q, k, v))
  o, lse = mix_pairs([spread_pair(*_pair_forward(q_p, k_p, v_p, w=w, r=r, causal=causal,
                                                 scale=scale, config=config),
                                  batch=batch, r=r) for w, r in pairs])
  return o[..., :head_dim], lse


def _check_pairs(seq: int, pairs, config: MosaicBlockConfig) -> None:
  tile = pair_tile(config)
  for w, r in pairs:
    why = unsupported_pair(seq, w, r, tile)
    if why is not None:
      raise ValueError(f"dilated attention's Hopper kernels cannot run the pair (w={w}, "
                       f"r={r}) with tiles of {tile} rows: {why}")


def pair_stats(x, w: int, r: int, heads: int):
  """A row statistic ``[batch, heads, seq]`` (lse, delta) at each query head's rows of
  the pair: ``[batch * seq / w, heads, w / r]`` (``pair_rows``' order)."""
  return jnp.moveaxis(pair_rows(jnp.moveaxis(x, 1, 2)[..., None], w, r, heads)[..., 0], 1, 2)


def dilated_mosaic_backward(q, k, v, o, lse, do, *, pairs, causal: bool, scale: float,
                            config: MosaicBlockConfig):
  """Float32 ``(dq, dk, dv)`` of the pairs' mixture, given its ``o`` and ``lse``
  (``dilated_mosaic_forward``'s) and the cotangent ``do`` ``[batch, seq, heads, d]``:
  each pair is the Hopper flash backward on the in-place views (one block of the
  mixture's softmax: its probabilities against the mixture's ``lse``, and the
  mixture's ``rowsum(o * do)``), its compact gradients spread back and, for K and V,
  summed over each KV head's query heads. Shapes, dtypes and pairs as
  ``dilated_mosaic_forward``; head dims the Hopper backward takes
  (``mosaic_backward_runs``)."""
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  _check_pairs(seq, pairs, config)
  d_p = mosaic_head_dim(head_dim)
  do = do.astype(q.dtype)
  delta = backward_delta(o, do, jnp.zeros((), jnp.float32))  # the mixture's, once
  q_p, k_p, v_p, do_p = (pad_to(x, seq, d_p) for x in (q, k, v, do))
  c = config
  grads = [jnp.zeros((batch, seq, h, head_dim), jnp.float32) for h in (heads, kv_heads, kv_heads)]
  for w, r in pairs:
    rows = w // r
    spec = MaskSpec.build(rows, rows, causal=causal, local_window=None, kv_padded=False,
                          segments=False)
    pair = mosaic_backward(
        *(pair_views(x, w, r) for x in (q_p, k_p, v_p, do_p)),
        backward_lse(pair_stats(lse, w, r, heads), rows, False),
        pair_stats(delta, w, r, heads), spec=spec, scale=scale,
        blocks=_backward_tiles(c, rows), stages=c.bwd_stages,
        layout=BackwardLayout(DilatedQ(r, heads), DilatedKV(r, kv_heads, group), group=1))
    for i, g in enumerate(pair):
      g = spread_rows(g[..., :head_dim].astype(jnp.float32), batch=batch, r=r)
      if i:  # per query head: summed over each KV head's group
        g = g.reshape(*g.shape[:2], kv_heads, group, head_dim).sum(3)
      grads[i] = grads[i] + g
  return tuple(grads)
