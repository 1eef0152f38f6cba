"""Host side of the Hopper (Pallas Mosaic GPU) flash attention: pads inputs to the
tile grid and runs the forward kernel, or the dQ and dK/dV kernels given the saved
``(o, lse)``. The backward takes padded ``head_dim + head_dim_v`` up to
``hopper.budget.MOSAIC_MAX_BWD_WIDTH`` (``mosaic_backward_runs``): wider dK and dV
accumulators do not fit a warpgroup's registers.

FlexAttention's functions come as a ``FlexMods`` whose functions are split for
these kernels (``factored_functions``: the parts computed here, outside) and whose
block mask becomes each kernel's block ranges (``hopper.inputs``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jattn.kernels.common.dropout import backward_rows, hash_arrays
from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.softmax import backward_delta, backward_lse, floor_sinks
from jattn.kernels.common.tiling import pad_rows, pad_to, tile_axis
from jattn.kernels.flash.config import MosaicBlockConfig, mosaic_backward_runs
from jattn.kernels.hopper.budget import MOSAIC_MAX_BWD_WIDTH
from jattn.kernels.flash.mosaic_bwd import mosaic_backward
from jattn.kernels.flash.mosaic_fwd import mosaic_forward
from jattn.kernels.flash.triton import FlexMods
from jattn.kernels.hopper.budget import mosaic_head_dim
from jattn.kernels.hopper.inputs import (DenseBias, PositionInputs, joint_ranges, length_ranges,
                                         mask_ranges, packed_ranges, position_arrays,
                                         segment_ranges)
from jattn.kernels.hopper.pipeline import CONSUMERS, eight_bit_values


def mosaic_layout(config: MosaicBlockConfig, q_len: int, kv_len: int, head_dim: int, *,
                  causal: bool, local_window, segments: bool = False, lengths: bool = False):
  """``(q_len_p, kv_len_p, d_p, spec)``: padded lengths every tile divides (a CTA
  covers ``CONSUMERS`` per-warpgroup blocks; blocks are multiples of 64 but not
  always powers of two, hence the lcm), the padded head dim and the mask."""
  c = config
  _, q_len_p = tile_axis(q_len, (CONSUMERS * c.block_q, CONSUMERS * c.block_q_dq, c.block_q_dkv),
                         clamp=False)
  _, kv_len_p = tile_axis(kv_len, (c.block_kv, c.block_kv_dq, CONSUMERS * c.block_kv_dkv),
                          clamp=False)
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=local_window,
                        kv_padded=kv_len_p != kv_len, segments=segments, lengths=lengths)
  if segments:  # the segment ranges say which tiles need no mask
    spec = dataclasses.replace(spec, segment_tiles=True)
  return q_len_p, kv_len_p, mosaic_head_dim(head_dim), spec


def _positions(q_seg, mods: FlexMods, dropout_rate: float, lengths) -> PositionInputs:
  bias = mods.score if isinstance(mods.score, DenseBias) else None
  return PositionInputs(segments=q_seg is not None, mask=mods.mask,
                        score=None if bias is not None else mods.score,
                        ranges=(q_seg is not None or mods.block_kinds is not None
                                or lengths is not None),
                        dropout=dropout_rate, lengths=lengths is not None, bias=bias)


def _kernel_inputs(positions: PositionInputs, q_seg, kv_seg, mods: FlexMods, tiles, spec,
                   padded, transpose: bool = False, hashes=None, lengths=None,
                   packed=None) -> tuple:
  """One kernel's per-position arrays: segment ids or the functions' parts, dropout's
  ``hashes``, per-row ``lengths``, and the block ranges of its ``tiles = (tile_q,
  tile_kv)`` (``transpose``: per key tile) those give; ``packed``: ``(cu_seqlens,
  max_len)`` of the sequences the segment ids number (``packed_ranges``)."""
  true = (spec.q_len, spec.kv_len)
  segments = ranges = None
  if q_seg is not None:
    segments = (pad_to(q_seg, padded[0]), pad_to(kv_seg, padded[1]))
    rows, cols = segments[::-1] if transpose else segments
    if packed is not None:
      ranges = packed_ranges(*packed, spec, tiles, padded, transpose)
    else:
      ranges = segment_ranges(rows, cols, *(true[::-1] if transpose else true),
                              *(tiles[::-1] if transpose else tiles))
  elif mods.block_kinds is not None:
    ranges = mask_ranges(mods.block_kinds, mods.block, tiles, padded, true, transpose)
  if lengths is not None:
    axis = 0 if transpose else 1  # the axis the ranges count blocks of
    ranges = joint_ranges(ranges, length_ranges(spec, lengths, tiles, padded, transpose),
                          padded[axis] // tiles[axis])
  bias = positions.bias is not None
  return position_arrays(positions, segments, mods.mask_arrays,
                         () if bias else mods.score_arrays, ranges, hashes, lengths,
                         mods.score_arrays if bias else (), padded=padded)


def _hashes(q, dropout_rate: float, dropout_seed, padded):
  """Dropout's row and col hashes at the padded lengths, or None."""
  if not dropout_rate:
    return None
  return hash_arrays(dropout_seed, q.shape[0], q.shape[2], *padded)


def flash_mosaic_forward(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, local_window,
                         softcap: float | None, config: MosaicBlockConfig,
                         mods: FlexMods = FlexMods(), sinks=None, dropout_rate: float = 0.0,
                         dropout_seed=None, lengths=None, packed=None):
  """Flash attention forward on Hopper (a ``DenseBias`` as ``mods.score`` adds a dense
  bias, read per tile).

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, head_dim_v]``; float16 or bfloat16, head dims
      ``<= 256``, ``scale > 0``.
    q_seg, kv_seg: ``[batch, q_len]`` / ``[batch, kv_len]`` int32 segment ids, or None.
    softcap: logits become ``softcap * tanh(logits / softcap)``, or None.
    mods: FlexAttention's functions (``FactoredFunction``s and their part arrays, or
      as the score a ``DenseBias`` with its arrays: the bias ``[B', H', q_len,
      kv_len]``, 16-bit, and where shifted its row shift ``[B', q_len]``) and block
      mask; none with segment ids or a soft-cap.
    sinks: ``[q_heads]`` float32 logits joining every row's denominator, or None.
    dropout_rate, dropout_seed: dropout of the weights (rate > 0) and its ``[2]``
      int32 seed (``dropout.seed_of``).
    lengths: ``[batch, 2]`` int32 per-row ``(q_len, kv_len)``, or None (as
      ``flash_triton_forward``'s).
    packed: ``(cu_seqlens, max_len)`` where the segment ids number sequences packed in
      one batch row (the same for queries and keys): tiles inside one sequence run
      unmasked (``inputs.packed_ranges``).

  Returns:
    ``(o, lse)``: ``o: [batch, q_len, q_heads, head_dim_v]`` in q's dtype; ``lse:
    [batch, q_heads, q_len]`` float32.
  """
  q_len, kv_len, head_dim = q.shape[1], k.shape[1], q.shape[-1]
  q_len_p, kv_len_p, d_p, spec = mosaic_layout(config, q_len, kv_len, head_dim, causal=causal,
                                               local_window=local_window,
                                               segments=q_seg is not None,
                                               lengths=lengths is not None)
  positions = _positions(q_seg, mods, dropout_rate, lengths)
  padded = (q_len_p, kv_len_p)
  inputs = _kernel_inputs(positions, q_seg, kv_seg, mods, (config.block_q, config.block_kv),
                          spec, padded, hashes=_hashes(q, dropout_rate, dropout_seed, padded),
                          lengths=lengths, packed=packed)
  dv = v.shape[-1]
  o, lse = mosaic_forward(pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p),
                          pad_to(v, kv_len_p, mosaic_head_dim(dv)), inputs, spec=spec,
                          scale=scale, block_q=config.block_q, block_kv=config.block_kv,
                          stages=config.stages, softcap=softcap,
                          persistent=config.persistent, positions=positions,
                          sinks=None if sinks is None else floor_sinks(sinks))
  return o[:, :q_len, :, :dv], lse[:, :, :q_len]


def flash_mosaic_forward_fp8(q, k, v, q_descale, k_descale, v_descale, q_seg=None,
                             kv_seg=None, *, causal: bool, scale: float, local_window,
                             config: MosaicBlockConfig, out_dtype):
  """FP8 flash attention forward on Hopper: QKᵀ and PV on 8-bit wgmma, the softmax in
  float32, the weights cast to E4M3 for PV (FlashAttention-3's recipe).

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``; k: ``[batch, kv_len, kv_heads, head_dim]``;
      v: ``[batch, kv_len, kv_heads, head_dim_v]``; ``float8_e4m3fn``, head dims
      ``<= 256``, ``scale > 0``.
    q_descale, k_descale, v_descale: ``[kv_heads]`` float32, positive: the inputs are
      ``x8 * descale``.
    q_seg, kv_seg: ``[batch, q_len]`` / ``[batch, kv_len]`` int32 segment ids, or None.
    out_dtype: the output's dtype (16- or 32-bit float).

  Returns:
    ``o: [batch, q_len, q_heads, head_dim_v]`` in ``out_dtype``. V is transposed to
    ``[batch, kv_heads, head_dim_v, kv_len]`` on the way in, its keys reordered within
    groups of 16 (``pipeline.eight_bit_values``): one pass over V.
  """
  q_len, kv_len, head_dim, dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
  group = q.shape[2] // k.shape[2]
  q_len_p, kv_len_p, d_p, spec = mosaic_layout(config, q_len, kv_len, head_dim, causal=causal,
                                               local_window=local_window,
                                               segments=q_seg is not None)
  positions = _positions(q_seg, FlexMods(), 0.0, None)
  inputs = _kernel_inputs(positions, q_seg, kv_seg, FlexMods(),
                          (config.block_q, config.block_kv), spec, (q_len_p, kv_len_p))
  v_t = eight_bit_values(pad_to(v, kv_len_p, mosaic_head_dim(dv)))
  per_q_head = lambda x: jnp.repeat(x.astype(jnp.float32), group)
  o, _ = mosaic_forward(pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), v_t, inputs,
                        spec=spec, scale=scale, block_q=config.block_q,
                        block_kv=config.block_kv, stages=config.stages,
                        persistent=config.persistent, positions=positions,
                        descales=(per_q_head(q_descale * k_descale), per_q_head(v_descale)),
                        out_dtype=out_dtype)
  return o[:, :q_len, :, :dv]


def flash_mosaic_backward(q, k, v, q_seg, kv_seg, o, lse, do, dlse, *, causal: bool,
                          scale: float, local_window, softcap: float | None,
                          config: MosaicBlockConfig, mods: FlexMods = FlexMods(),
                          dropout_rate: float = 0.0, dropout_seed=None, lengths=None,
                          packed=None, ds_dtype=None):
  """Gradients ``(dq, dk, dv)`` given the rows' ``o`` and ``lse`` and the cotangents
  ``do``, ``dlse``. Shapes, dropout, lengths and packing as ``flash_mosaic_forward``,
  head dims that ``mosaic_backward_runs`` takes. ``config.fused_dq`` computes dQ inside the dK/dV
  kernel (atomic adds: not bitwise repeatable; not with ``mods``). ``ds_dtype`` (with a
  ``DenseBias``: its bias's dtype): also return dS, the gradient of the scores,
  ``[batch, q_heads, q_len, kv_len]``, which the dQ kernel writes."""
  q_len, kv_len, head_dim, dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
  if not mosaic_backward_runs(head_dim, dv):
    raise ValueError(f"the Hopper backward takes head dims whose padded sum is at most "
                     f"{MOSAIC_MAX_BWD_WIDTH}, got {head_dim} and {dv}")
  do = do.astype(q.dtype)
  q_len_p, kv_len_p, d_p, spec = mosaic_layout(config, q_len, kv_len, head_dim, causal=causal,
                                               local_window=local_window,
                                               segments=q_seg is not None,
                                               lengths=lengths is not None)
  c = config
  positions = _positions(q_seg, mods, dropout_rate, lengths)
  padded = (q_len_p, kv_len_p)
  hashes = _hashes(q, dropout_rate, dropout_seed, padded)
  dq_inputs = _kernel_inputs(positions, q_seg, kv_seg, mods, (c.block_q_dq, c.block_kv_dq),
                             spec, padded, hashes=hashes, lengths=lengths, packed=packed)
  dkv_inputs = _kernel_inputs(positions, q_seg, kv_seg, mods, (c.block_q_dkv, c.block_kv_dkv),
                              spec, padded, transpose=True, hashes=hashes, lengths=lengths,
                              packed=packed)
  lse, delta = backward_rows(lse, backward_delta(o, do, dlse), dropout_rate)
  lse2 = backward_lse(lse, q_len_p, mods.score is not None)
  dv_p = mosaic_head_dim(dv)
  writes_ds = ds_dtype is not None
  if writes_ds and (positions.bias is None
                    or jnp.dtype(ds_dtype) != positions.bias_dtype(dq_inputs)):
    raise ValueError("dS is written for a dense bias, in the bias's dtype")
  grads = mosaic_backward(
      pad_to(q, q_len_p, d_p), pad_to(k, kv_len_p, d_p), pad_to(v, kv_len_p, dv_p),
      pad_to(do, q_len_p, dv_p), lse2, pad_rows(delta, q_len_p),
      dq_inputs, dkv_inputs, spec=spec, scale=scale,
      blocks=(c.block_q_dq, c.block_kv_dq, c.block_q_dkv, c.block_kv_dkv),
      stages=c.bwd_stages, fused_dq=c.fused_dq, softcap=softcap, positions=positions,
      writes_ds=writes_ds)
  dq, dk, dv_grad = grads[:3]
  return (dq[:, :q_len, :, :head_dim], dk[:, :kv_len, :, :head_dim],
          dv_grad[:, :kv_len, :, :dv]) + ((grads[3][:, :, :q_len, :kv_len],) if writes_ds else ())
