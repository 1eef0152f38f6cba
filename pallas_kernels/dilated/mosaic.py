"""Dilated attention's forward on the Hopper kernels (``hopper.forward``), reading the
dilated rows in place.

Where ``seq`` is a multiple of a pair's segment length ``w``, ``[batch, seq, heads, d]``
is, without a copy, ``[batch * seq / w, w / r, r * heads, d]``: each segment a batch
row, and "head" ``o * heads + h`` the positions ``≡ o (mod r)`` of head ``h``. Head ``h``
reads offset ``h mod r`` (LongNet's head offsets), so a pair is one Hopper forward over
that view whose work items (``work.DilatedTiles``) read query head ``h`` at "head"
``(h mod r) * heads + h`` and write it compactly, and whose K/V addressing
(``addressing.DilatedKV``) does the same for its KV head. The pairs' outputs are then
spread back to their positions and mixed by their log-sum-exp in one elementwise pass.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, merge_partials
from jattn.kernels.common.tiling import pad_to
from jattn.kernels.flash.config import MosaicBlockConfig
from jattn.kernels.flash.mosaic_fwd import SoftmaxRows
from jattn.kernels.hopper import pipeline as mp
from jattn.kernels.hopper.addressing import DilatedKV
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
  per-warpgroup blocks): a pair's ``w / r`` must be a multiple."""
  return math.lcm(mp.CONSUMERS * config.block_q, config.block_kv)


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
  tile = pair_tile(config)
  for w, r in pairs:
    why = unsupported_pair(seq, w, r, tile)
    if why is not None:
      raise ValueError(f"dilated attention's Hopper forward cannot run the pair (w={w}, "
                       f"r={r}) with tiles of {tile} rows: {why}")
  d_p = mosaic_head_dim(head_dim)
  q_p, k_p, v_p = (pad_to(x, seq, d_p) for x in (q, k, v))
  o, lse = mix_pairs([spread_pair(*_pair_forward(q_p, k_p, v_p, w=w, r=r, causal=causal,
                                                 scale=scale, config=config),
                                  batch=batch, r=r) for w, r in pairs])
  return o[..., :head_dim], lse
