"""Host-side tiling of the Hopper kernels (the kernels themselves run with ``-m gpu``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jattn
import jattn.core.op as op
from jattn.core.device import describe

from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.common.masking import segment_block_ranges as _segment_block_ranges
from jattn.kernels.flash.config import default_mosaic_config, mosaic_costs
from jattn.kernels.hopper.budget import mosaic_head_dim
from jattn.kernels.hopper.forward import forward_cost, forward_q_buffers, forward_smem_bytes
from jattn.kernels.hopper.inputs import PositionInputs, segment_ranges
from jattn.kernels.flash import MosaicBlockConfig
from jattn.kernels.flash.mosaic import mosaic_layout
from jattn.kernels.flash.mosaic_bwd import BIAS_TILES_SUPPORTED, FUSED_DQ_SUPPORTED
from jattn.kernels.flash.mosaic_fwd import SoftmaxRows

# Jitted: eagerly, every primitive compiles anew for each example's shapes.
segment_block_ranges = jax.jit(_segment_block_ranges, static_argnums=(2, 3, 4, 5),
                               static_argnames=("uniform",))

blocks = st.sampled_from([64, 128, 192, 256])


@settings(max_examples=60, deadline=None)
@given(q_len=st.integers(1, 5000), kv_len=st.integers(1, 5000), head_dim=st.integers(1, 256),
       bq=blocks, bkv=blocks, bq_dq=blocks, bkv_dq=blocks, bq_dkv=blocks, bkv_dkv=blocks,
       causal=st.booleans())
def test_padding_fits_every_tile(q_len, kv_len, head_dim, bq, bkv, bq_dq, bkv_dq, bq_dkv,
                                 bkv_dkv, causal):
  config = MosaicBlockConfig(block_q=bq, block_kv=bkv, block_q_dq=bq_dq, block_kv_dq=bkv_dq,
                             block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv)
  q_len_p, kv_len_p, d_p, spec = mosaic_layout(config, q_len, kv_len, head_dim, causal=causal,
                                               local_window=None)
  # Two consumer warpgroups per CTA: query tiles of the forward and dQ kernels and
  # key tiles of the dK/dV kernel cover twice their block.
  for tile in (2 * bq, 2 * bq_dq, bq_dkv):
    assert q_len_p % tile == 0
  for tile in (bkv, bkv_dq, 2 * bkv_dkv):
    assert kv_len_p % tile == 0
  assert q_len <= q_len_p < q_len + max(2 * bq, 2 * bq_dq, bq_dkv) * 4
  assert d_p % 64 == 0 and head_dim <= d_p < head_dim + 64
  assert spec.kv_padded == (kv_len_p != kv_len)
  assert (spec.q_len, spec.kv_len) == (q_len, kv_len)
  assert spec.right == (0 if causal else None)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), row_block=st.sampled_from([16, 64]),
       col_block=st.sampled_from([16, 128]), n_ids=st.integers(1, 6), sorted_ids=st.booleans(),
       seed=st.integers(0, 99))
def test_segment_block_ranges_cover_every_block_that_shares_a_segment(
    rows, cols, row_block, col_block, n_ids, sorted_ids, seed):
  rng = np.random.default_rng(seed)
  rows_p, cols_p = -(-rows // row_block) * row_block, -(-cols // col_block) * col_block
  row_seg = rng.integers(0, n_ids, (2, rows_p)).astype(np.int32)
  col_seg = rng.integers(0, n_ids, (2, cols_p)).astype(np.int32)
  if sorted_ids:
    row_seg.sort(axis=1)
    col_seg.sort(axis=1)
  row_seg[:, rows:] = 99  # padding is ignored
  ranges = np.asarray(segment_block_ranges(jnp.asarray(row_seg), jnp.asarray(col_seg), rows,
                                           cols, row_block, col_block))
  n_col_blocks = cols_p // col_block
  for b in range(2):
    for i in range(rows_p // row_block):
      r = row_seg[b, i * row_block:min((i + 1) * row_block, rows)]
      shares = [j for j in range(n_col_blocks)
                if np.isin(col_seg[b, j * col_block:min((j + 1) * col_block, cols)], r).any()]
      first, end = ranges[b, i]
      if shares:  # every block that shares a segment is visited
        assert first <= shares[0] and shares[-1] < end, (b, i)
      # ... and for sorted ids none whose id range misses the row block's
      lo, hi = r.min(), r.max()
      for j in range(first, end) if sorted_ids else ():
        c = col_seg[b, j * col_block:min((j + 1) * col_block, cols)]
        assert c.size and c.min() <= hi and lo <= c.max(), (b, i, j)
      assert 0 <= first and end <= n_col_blocks


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), row_block=st.sampled_from([16, 64]),
       col_block=st.sampled_from([16, 128]), n_ids=st.integers(1, 4), sorted_ids=st.booleans(),
       seed=st.integers(0, 99))
def test_uniform_segment_blocks_hold_one_id_and_no_padding(rows, cols, row_block, col_block,
                                                           n_ids, sorted_ids, seed):
  """Where the kernels drop the segment mask (``[full_lo, full_hi)``), both blocks hold one
  and the same id and no padding; for sorted ids no such block lies outside the run."""
  rng = np.random.default_rng(seed)
  rows_p, cols_p = -(-rows // row_block) * row_block, -(-cols // col_block) * col_block
  # Long runs of one id, so that uniform blocks occur.
  row_seg = np.repeat(rng.integers(0, n_ids, (2, rows_p // 8 + 1)), 8, axis=1)[:, :rows_p]
  col_seg = np.repeat(rng.integers(0, n_ids, (2, cols_p // 8 + 1)), 8, axis=1)[:, :cols_p]
  if sorted_ids:
    row_seg, col_seg = np.sort(row_seg, axis=1), np.sort(col_seg, axis=1)
  row_seg, col_seg = row_seg.astype(np.int32), col_seg.astype(np.int32)
  ranges = np.asarray(segment_block_ranges(jnp.asarray(row_seg), jnp.asarray(col_seg), rows,
                                           cols, row_block, col_block, uniform=True))
  plain = np.asarray(segment_block_ranges(jnp.asarray(row_seg), jnp.asarray(col_seg), rows,
                                          cols, row_block, col_block))
  np.testing.assert_array_equal(ranges[..., [0, 3]], plain)
  n_col_blocks = cols_p // col_block
  for b in range(2):
    for i in range(rows_p // row_block):
      first, full_lo, full_hi, end = ranges[b, i]
      assert full_lo <= full_hi and (full_lo == full_hi or first <= full_lo and full_hi <= end)
      r = row_seg[b, i * row_block:(i + 1) * row_block]
      one = lambda x, n, j, block: (j + 1) * block <= n and (x == x[0]).all()
      uniform = [j for j in range(n_col_blocks)
                 if one(r, rows, i, row_block)
                 and one(c := col_seg[b, j * col_block:(j + 1) * col_block], cols, j, col_block)
                 and c[0] == r[0]]
      assert set(range(full_lo, full_hi)) <= set(uniform), (b, i)
      if sorted_ids:
        assert set(uniform) == set(range(full_lo, full_hi)), (b, i)


def test_a_documents_interior_runs_without_the_segment_mask():
  ids = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), 256)[None])  # two documents
  ranges = np.asarray(segment_block_ranges(ids, ids, 500, 500, 64, 128, uniform=True))[0]
  # Query blocks 0-3 lie in document 0 (key blocks 0-1), 4-6 in document 1 (key block 2;
  # block 3 holds padding), block 7 holds padding.
  np.testing.assert_array_equal(ranges[:, 1:3], [[0, 2]] * 4 + [[2, 3]] * 3 + [[4, 4]])


def test_retention_keeps_every_segment_block_masked():
  """The retention kernel's decay rule joins its per-row factor at the first masked
  block, so its packed ranges must leave no block unmasked (a run inside one sequence
  would apply the factor twice)."""
  ids = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), 256)[None])
  ranges = np.asarray(segment_ranges(ids, ids, 512, 512, 64, 64, uniform=False))[0, 0]
  np.testing.assert_array_equal(ranges[:, 1], ranges[:, 0])
  np.testing.assert_array_equal(ranges[:, 2], ranges[:, 0])
  assert (ranges[:, 3] > ranges[:, 0]).all()


def test_the_forward_sums_rows_on_the_tensor_cores_only_in_bfloat16_without_dropout():
  """Where the row sums come from the MMA the weights' exponent is one FFMA, whose top
  weight 2^e (|e| up to half an ulp of m * c) float16 cannot hold past |m * c| = 2^28;
  dropout's denominator counts weights V never meets; FP8's recipe sums float32."""
  spec = MaskSpec.build(128, 128, causal=True, local_window=None, kv_padded=False,
                        segments=False)
  rule = SoftmaxRows(spec, 0.1)
  assert rule.mma_row_sums(jnp.bfloat16)
  assert not rule.mma_row_sums(jnp.float16)
  assert not rule.mma_row_sums(jnp.float8_e4m3fn)
  assert not SoftmaxRows(spec, 0.1, positions=PositionInputs(dropout=0.1)).mma_row_sums(
      jnp.bfloat16)
  # The ones tile and its accumulator are counted only where they exist.
  (smem, regs), (smem1, regs1) = (forward_cost(64, 128, 2, 128, 128, 2, ones_tile=o)
                                  for o in (False, True))
  assert (smem1 - smem, regs1 - regs) == (8 * 128 * 2 + 8, 64 * 8 / 128)  # tile, barrier


@pytest.fixture
def mosaic_counts(monkeypatch):
  """Lowering for CUDA here (no GPU) on a stand-in H100: the shared memory Mosaic GPU
  counts for each kernel lowered, in order."""
  from jax.experimental.mosaic.gpu import core as mosaic_core
  counted = []
  count = mosaic_core._smem_tree_size
  monkeypatch.setattr(mosaic_core, "_smem_tree_size",
                      lambda tree: counted.append(count(tree)) or counted[-1])

  class Unlimited:  # lets every kernel lower, so that each one's count is seen
    shared_memory_per_block_optin = 1 << 30

  devices = jax.local_devices
  monkeypatch.setattr(jax, "local_devices",
                      lambda *a, **k: devices(*a, **k) if a or k else [Unlimited()])
  monkeypatch.setattr(op, "current_device", lambda: H100)
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  return counted


H100 = describe("NVIDIA H100 80GB HBM3", (9, 0), shared_memory_per_block_bytes=232448,
                interpret=False)


@pytest.mark.parametrize("dk, dv, dtype, dropout, config", [
    (128, 128, jnp.bfloat16, False, None),
    (192, 128, jnp.float16, True, None),
    pytest.param(64, 64, jnp.bfloat16, True,
                 dataclasses.replace(default_mosaic_config(64), fused_dq=True),
                 marks=pytest.mark.skipif(not FUSED_DQ_SUPPORTED, reason="jax < 0.11")),
])
def test_shared_memory_model_counts_what_mosaic_gpu_counts(mosaic_counts, dk, dv, dtype, dropout,
                                                           config):
  """Lowered for CUDA here (no GPU), each Hopper kernel asks Mosaic GPU for exactly the
  shared memory the cost model counts: ``"auto"`` rules a backend out on that count."""
  config = config or default_mosaic_config(dk, dv)
  drop = dict(dropout_rate=0.1, dropout_key=jax.random.key(0)) if dropout else {}

  def loss(q, k, v):
    o = jattn.flash_attention(q, k, v, backend="pallas_mosaic", config=config,
                              deterministic=not config.fused_dq, **drop)
    return jnp.sum(o.astype(jnp.float32))

  shape = lambda d: jax.ShapeDtypeStruct((1, 256, 2, d), dtype)
  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(shape(dk), shape(dk), shape(dv)).lower(
      lowering_platforms=("cuda",))
  vectors = PositionInputs(dropout=0.1 if dropout else 0.0).vectors
  ones = dtype == jnp.bfloat16 and not dropout
  fwd = (config.block_q, config.block_kv, config.stages, mosaic_head_dim(dk),
         mosaic_head_dim(dv), 2)
  q_buffers = forward_q_buffers(*fwd, ones_tile=ones, vectors=vectors)  # persistent: no mask
  costs = mosaic_costs(config, fwd[3], 2, fwd[4], vectors)
  backward = ("dK/dV+dQ",) if config.fused_dq else ("dQ", "dK/dV")
  assert mosaic_counts == [forward_smem_bytes(*fwd, q_buffers, ones_tile=ones, vectors=vectors),
                           *(costs[name][0] for name in backward)]


@pytest.mark.parametrize("bias_shape, dtype, backend", [
    ((1, 4, 512, 512), jnp.bfloat16, "pallas_mosaic"),  # read tile by tile
    ((1, 4, 512, 512), jnp.float32, "pallas_triton"),   # its tiles are 16-bit
    ((2, 1, 1, 512), jnp.bfloat16, "pallas_mosaic"),    # a part per key (split)
])
def test_where_auto_runs_a_dense_bias_on_hopper(bias_shape, dtype, backend):
  """On Hopper, "auto" reads a 16-bit dense bias over every position tile by tile (on
  jax 0.11 or later, else the Triton kernels take it); one constant along a position
  axis is split into parts as any function."""
  from jattn.flex.attention import FLEX
  x = jax.random.normal(jax.random.key(0), (2, 512, 4, 128), jnp.bfloat16)
  bias = jax.random.normal(jax.random.key(1), bias_shape, dtype)
  problem, _ = FLEX.bind(x, x, x, score_mod=jattn.flex.bias_score(bias))
  tiles = bias_shape[-2] > 1 and backend == "pallas_mosaic"
  expected = "pallas_triton" if tiles and not BIAS_TILES_SUPPORTED else backend
  assert FLEX.select(problem, H100) == expected


def test_a_dense_bias_tile_takes_each_rows_own_shift(monkeypatch):
  """The Hopper kernels' shifted bias (rows of large values) takes each row's own
  shift, one per (batch row, head, query): a shift shared by the heads was 0 where one
  head's row was -1e9 and another's small, and that row lost q·k to the bias."""
  import types
  import jattn.flex.attention as flex_attention
  from jattn.kernels.flash.triton import FlexMods
  from jattn.kernels.common.softmax import shared_row_shift
  monkeypatch.setattr(flex_attention, "BIAS_TILES_SUPPORTED", True)  # (host code only)
  x = jax.random.normal(jax.random.key(0), (2, 64, 4, 64), jnp.bfloat16)
  bias = jax.random.normal(jax.random.key(1), (1, 4, 64, 64), jnp.bfloat16)
  problem, _ = flex_attention.FLEX.bind(x, x, x, score_mod=jattn.flex.bias_score(bias))
  lse = jax.random.normal(jax.random.key(2), (2, 4, 64)).at[0, 1, 3].set(-1e9)
  mods = FlexMods(score=flex_attention.DenseBias(), score_arrays=(bias,))
  _, shifted, lse_shift = flex_attention.MosaicFlex()._shifted_bias(
      types.SimpleNamespace(problem=problem), (bias,), mods, lse)
  shift = shifted.score_arrays[1]
  assert shifted.score.shifted and shift.shape == (2, 4, 64)
  np.testing.assert_array_equal(shift, shared_row_shift(lse))
  assert shift[0, 1, 3] == -1e9 and shift[0, 0, 3] == 0.0  # that row alone
  np.testing.assert_array_equal(lse_shift, shift)


@pytest.mark.skipif(not BIAS_TILES_SUPPORTED, reason="jax < 0.11")
def test_a_per_head_bias_over_one_key_traces(monkeypatch):
  """A per-head bias over a single key (``[heads, q_len, 1]``, kv_len 1), which the
  Hopper kernels read as tiles: its shift is the bias itself, a row vector per head
  (shaping it per batch row only failed every such call while tracing)."""
  monkeypatch.setattr(op, "current_device", lambda: H100)
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  q = jax.random.normal(jax.random.key(0), (2, 256, 4, 64), jnp.bfloat16)
  kv = jax.random.normal(jax.random.key(1), (2, 1, 4, 64), jnp.bfloat16)
  bias = jax.random.normal(jax.random.key(2), (4, 256, 1), jnp.bfloat16)
  loss = lambda q, k, v, b: jnp.sum(jattn.flex_attention(
      q, k, v, score_mod=jattn.flex.bias_score(b)).astype(jnp.float32))
  problem, _ = jattn.flex.attention.FLEX.bind(q, kv, kv, score_mod=jattn.flex.bias_score(bias))
  assert jattn.flex.attention.FLEX.select(problem, H100) == "pallas_mosaic"
  jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, bias)


@pytest.mark.skipif(not BIAS_TILES_SUPPORTED, reason="jax < 0.11")
def test_a_mask_array_runs_the_hopper_kernels(monkeypatch):
  """``dot_product_attention`` with a boolean mask array on Hopper: the mask as an
  additive bias read tile by tile, its empty tiles skipped (lowered for CUDA here)."""
  monkeypatch.setattr(op, "current_device", lambda: H100)
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  x = jax.random.normal(jax.random.key(0), (2, 512, 4, 64), jnp.bfloat16)
  ids = jnp.repeat(jnp.arange(4), 128)[None]
  mask = ids[:, None, :, None] == ids[:, None, None, :]
  loss = lambda q, k, v: jnp.sum(jattn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "triton" not in text


@pytest.mark.skipif(not BIAS_TILES_SUPPORTED, reason="jax < 0.11")
@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (64, jnp.float16)])
def test_a_dense_bias_runs_the_hopper_kernels_within_their_shared_memory(mosaic_counts, head_dim,
                                                                         dtype):
  """A 16-bit dense bias read by the Hopper kernels tile by tile: the forward, dQ and
  dK/dV kernels and their row-shifted twins ask Mosaic GPU for the shared memory the
  cost model counts, the bias tiles and the dS tile included, within the H100's."""
  from jattn.flex.attention import FLEX, MosaicFlex
  x = jax.random.normal(jax.random.key(0), (2, 512, 4, head_dim), dtype)
  bias = jax.random.normal(jax.random.key(1), (1, 4, 512, 512), dtype)
  causal = jattn.flex.causal_mask()
  loss = lambda q, k, v, b: jnp.sum(jattn.flex_attention(
      q, k, v, score_mod=jattn.flex.bias_score(b), mask_mod=causal).astype(jnp.float32))
  problem, _ = FLEX.bind(x, x, x, score_mod=jattn.flex.bias_score(bias), mask_mod=causal)
  jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, x, bias).lower(
      lowering_platforms=("cuda",))
  config = MosaicFlex().heuristic_config(problem, H100)
  # The forward and the backward, each also with the rows' shift (a row vector); the
  # shifted forward twice (the backward recomputes its lse). Causal: one Q buffer.
  fwd = (config.block_q, config.block_kv, config.stages, head_dim, head_dim, 2, 1)
  forward = [forward_smem_bytes(*fwd, ones_tile=dtype == jnp.bfloat16, vectors=(shift, 0),
                                bias_nbytes=2) for shift in (0, 1, 1)]
  costs = [mosaic_costs(config, head_dim, 2, head_dim, (shift, 0), 2) for shift in (0, 1)]
  model = forward + [costs[shift][name][0] for shift in (0, 1) for name in ("dQ", "dK/dV")]
  assert sorted(mosaic_counts) == sorted(model)
  assert max(model) <= H100.shared_memory_per_block_bytes
