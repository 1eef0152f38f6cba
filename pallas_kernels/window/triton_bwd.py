"""Window attention gradient kernels (Triton-lowered Pallas): dQ, dK/dV and d(bias),
on the padded inputs and base-2 bias and mask the forward takes (``triton_fwd``).

Grids: dQ ``(query tiles, windows, heads)``; dK/dV ``(key tiles, windows, heads)`` on
transposed tiles; d(bias) ``(query tiles, key tiles, heads, window groups)``: each
program sums one group of windows in a fixed order into its own partial, and the
partials are summed after. No atomics: gradients are reproducible.

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
from jattn.kernels.common.nonfinite import clear_nonfinite_rows, guard_values
from jattn.kernels.common.softmax import backward_probs, dot
from jattn.kernels.window.triton_fwd import bias_rows, logits2, mask_rows

# Programs the d(bias) grid aims for: a few per SM of a large GPU, so the sum over
# windows is spread out instead of run by one program per bias tile.
DBIAS_PROGRAMS = 512


def _logit_grads(s, p, dp, delta):
  """dS = P (dP - delta), 0 where the logit is masked (-inf): a row made NaN by a value it
  sees has a NaN delta, which a masked weight of 0 would carry into other rows' dK and
  the bias's gradient."""
  return jnp.where(jnp.isneginf(s), 0.0, p * (dp - delta))


def _dq_kernel(k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, bias_ref, mask_ref, dq_ref, *,
               scale: float, block_k: int, fast: bool):
  q, do = q_ref[...], do_ref[...]
  lse2 = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]

  def body(j, dq):
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = k_ref[cols, :]
    mask = None if mask_ref is None else mask_ref[:, cols]
    k_scored, v = guard_values(k, v_ref[cols, :])
    s = logits2(dot(q, k_scored, 1, 1, fast), scale, bias_ref[:, cols], mask)
    ds = _logit_grads(s, backward_probs(s - lse2), dot(do, v, 1, 1, fast), delta)
    return dq + dot(ds.astype(k.dtype), clear_nonfinite_rows(k), 1, 0, fast)

  dq = lax.fori_loop(0, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, bias_t_ref, mask_t_ref,
                dk_ref, dv_ref, *, scale: float, block_q: int, fast: bool):
  # Tiles are kept transposed ([keys, queries]) so no operand needs a transpose.
  k, v = guard_values(k_ref[...], v_ref[...])

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    mask = None if mask_t_ref is None else mask_t_ref[:, rows]
    s_t = logits2(dot(k, q, 1, 1, fast), scale, bias_t_ref[:, rows], mask)
    lse2 = lse_ref[rows][None, :]
    p_t = backward_probs(s_t - lse2)
    dv = dv + dot(p_t.astype(do.dtype), do, 1, 0, fast)
    ds_t = _logit_grads(s_t, p_t, dot(v, do, 1, 1, fast), delta_ref[rows][None, :])
    return dk + dot(ds_t.astype(q.dtype), clear_nonfinite_rows(q), 1, 0, fast), dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, body, (zeros, jnp.zeros(v.shape, jnp.float32)))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dbias_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bias_ref, mask_ref, dbias_ref,
                  *, scale: float, mask_windows: int, groups: int, fast: bool):
  bias = bias_ref[...]
  group = pl.program_id(3)

  def body(i, acc):
    w = group + i * groups  # windows strided over the groups
    q, do = q_ref[w], do_ref[w]
    mask = None if mask_ref is None else mask_ref[w % mask_windows]
    k, v = guard_values(k_ref[w], v_ref[w])
    s = logits2(dot(q, k, 1, 1, fast), scale, bias, mask)
    lse2 = lse_ref[w][:, None]
    p = backward_probs(s - lse2)
    return acc + _logit_grads(s, p, dot(do, v, 1, 1, fast), delta_ref[w][:, None])

  per_group = q_ref.shape[0] // groups
  dbias_ref[...] = lax.fori_loop(0, per_group, body, jnp.zeros(bias.shape, jnp.float32))


def dbias_groups(windows: int, bias_tiles: int) -> int:
  """How many groups the d(bias) kernel splits the windows into: the largest divisor
  of ``windows`` that keeps ``bias_tiles * groups`` within ``DBIAS_PROGRAMS``."""
  target = max(1, DBIAS_PROGRAMS // bias_tiles)
  return max(g for g in range(1, min(windows, target) + 1) if windows % g == 0)


def window_backward(q, k, v, do, lse, delta, bias2, mask2, *, scale: float, blocks,
                    num_warps: int, num_stages: int, interpret: bool):
  """dQ, dK, dV and d(bias) on padded inputs.

  Args:
    q, k, v, do: ``[windows, tokens_p, heads, d_p]``; lse, delta: ``[windows, heads,
      tokens_p]`` float32 (lse as ``softmax.backward_lse`` gives it, delta =
      rowsum(o * do)); bias2, mask2 as in ``triton_fwd.window_forward``.
    blocks: ``(block_q_dkv, block_k_dkv, block_q_dq, block_k_dq)``; d(bias) uses the dQ pair.

  Returns:
    ``(dq, dk, dv, dbias)``; dbias ``[heads, tokens_p, tokens_p]`` float32 (natural units).
  """
  windows, tokens, heads, d = q.shape
  bq_dkv, bk_dkv, bq_dq, bk_dq = blocks
  mask_windows = None if mask2 is None else mask2.shape[0]
  launch = dict(interpret=interpret, num_warps=num_warps, num_stages=num_stages)
  whole_stat = pl.BlockSpec((None, None, tokens), lambda i, w, h: (w, h, 0))

  dq = triton_call(
      functools.partial(_dq_kernel, scale=scale, block_k=bk_dq, fast=not interpret),
      grid=(tokens // bq_dq, windows, heads),
      in_specs=[whole_sequence_spec(tokens, d), whole_sequence_spec(tokens, d), tile_spec(bq_dq, d), tile_spec(bq_dq, d),
                row_stat_spec(bq_dq), row_stat_spec(bq_dq), bias_rows(bq_dq, tokens),
                None if mask2 is None else mask_rows(bq_dq, tokens, mask_windows)],
      out_specs=tile_spec(bq_dq, d), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name="jattn_window_dq", **launch,
  )(k, v, q, do, lse, delta, bias2, mask2)

  mask2_t = None if mask2 is None else jnp.swapaxes(mask2, 1, 2)
  dk, dv = triton_call(
      functools.partial(_dkv_kernel, scale=scale, block_q=bq_dkv, fast=not interpret),
      grid=(tokens // bk_dkv, windows, heads),
      in_specs=[whole_sequence_spec(tokens, d), whole_sequence_spec(tokens, d), whole_stat, whole_stat,
                tile_spec(bk_dkv, d), tile_spec(bk_dkv, d), bias_rows(bk_dkv, tokens),
                None if mask2 is None else mask_rows(bk_dkv, tokens, mask_windows)],
      out_specs=[tile_spec(bk_dkv, d), tile_spec(bk_dkv, d)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      name="jattn_window_dkv", **launch,
  )(q, do, lse, delta, k, v, jnp.swapaxes(bias2, 1, 2), mask2_t)

  groups = dbias_groups(windows, (tokens // bq_dq) * (tokens // bk_dq) * heads)
  every_window = lambda block: pl.BlockSpec((windows, block, None, d),
                                            lambda i, j, h, g: (0, i, h, 0))
  every_window_k = pl.BlockSpec((windows, bk_dq, None, d), lambda i, j, h, g: (0, j, h, 0))
  stat = pl.BlockSpec((windows, None, bq_dq), lambda i, j, h, g: (0, h, i))
  partials = triton_call(
      functools.partial(_dbias_kernel, scale=scale, mask_windows=mask_windows, groups=groups,
                        fast=not interpret),
      grid=(tokens // bq_dq, tokens // bk_dq, heads, groups),
      in_specs=[every_window(bq_dq), every_window_k, every_window_k, every_window(bq_dq),
                stat, stat, pl.BlockSpec((None, bq_dq, bk_dq), lambda i, j, h, g: (h, i, j)),
                None if mask2 is None else pl.BlockSpec((mask_windows, bq_dq, bk_dq),
                                                        lambda i, j, h, g: (0, i, j))],
      out_specs=pl.BlockSpec((None, None, bq_dq, bk_dq), lambda i, j, h, g: (g, h, i, j)),
      out_shape=jax.ShapeDtypeStruct((groups, heads, tokens, tokens), jnp.float32),
      name="jattn_window_dbias", **launch,
  )(q, k, v, do, lse, delta, bias2, mask2)
  return dq, dk, dv, partials.sum(axis=0)
