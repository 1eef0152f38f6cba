"""The Hopper pipeline's two extension points, K/V addressing and work items, with
implementations beside the first: a paged K/V cache whose pages are permuted (a block
table, ``PagedKV``), split-KV decoding's items (``DecodeItems``), and work items in
another order (here only). On the CPU a small interpret-mode kernel reads through each
(the same ``tile`` / ``at`` / ``q_rows`` calls the Hopper kernel makes); on a Hopper
GPU the forward kernel itself runs with them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from conftest import rel_err
from jattn.kernels.common.masking import MaskSpec
from jattn.kernels.flash.mosaic_fwd import SoftmaxRows
from jattn.kernels.hopper.addressing import ContiguousKV, PagedKV
from jattn.kernels.hopper.work import DecodeItems, QueryTile, QueryTiles
from jattn.reference import flash_attention_reference


@dataclasses.dataclass(frozen=True)
class BatchFastestTiles(QueryTiles):
  """``QueryTiles`` visited batch row fastest, then head, then tile from the last."""

  def order(self, w, n_tiles, n_heads, n_batch):
    batch, rest = lax.rem(w, n_batch), lax.div(w, n_batch)
    head, tile = lax.rem(rest, n_heads), lax.div(rest, n_heads)
    return QueryTile(batch, head, n_tiles - 1 - tile)


def paged(k, v, page: int, seed: int):
  """``(k_pages, v_pages, table)``: every sequence's keys cut into pages, stored in a
  random order."""
  batch, kv_len, heads, _ = k.shape
  per_seq = kv_len // page
  table = np.random.default_rng(seed).permutation(batch * per_seq).astype(np.int32)
  stored = jnp.asarray(np.argsort(table))  # the slot table[j] holds page j

  def pages(x):
    return x.reshape(batch * per_seq, page, heads, x.shape[-1])[stored]
  return pages(k), pages(v), jnp.asarray(table.reshape(batch, per_seq))


def _read_tiles(addressing, k, extra, batch: int, kv_heads: int, n_blocks: int, block: int):
  """Every ``[block, d]`` key tile, read through ``addressing`` in an interpret-mode
  kernel: ``[batch, kv_heads, n_blocks, block, d]``."""
  def kernel(k_ref, *refs):
    *in_refs, out_ref = refs
    bound = addressing.bind(in_refs)
    for b in range(batch):
      for h in range(kv_heads):
        for j in range(n_blocks):
          out_ref[b, h, j] = bound.tile(k_ref, jnp.int32(b), jnp.int32(h),
                                        jnp.int32(j * block), block)[...]
  out = jax.ShapeDtypeStruct((batch, kv_heads, n_blocks, block, k.shape[-1]), k.dtype)
  return pl.pallas_call(kernel, out_shape=out, interpret=True)(k, *extra)


def test_paged_addressing_reads_the_tiles_of_contiguous_keys():
  batch, kv_len, heads, d, page, block = 2, 64, 2, 8, 32, 16  # 4 pages, 2 tiles each
  k = jax.random.normal(jax.random.PRNGKey(0), (batch, kv_len, heads, d))
  k_pages, _, table = paged(k, k, page, seed=3)
  assert not np.array_equal(np.asarray(table).reshape(-1), np.arange(table.size))
  n_blocks = kv_len // block
  want = _read_tiles(ContiguousKV(), k, (), batch, heads, n_blocks, block)
  got = _read_tiles(PagedKV(page, kv_len // page, k_pages.shape[0]), k_pages, (table,), batch, heads, n_blocks,
                    block)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(want[1, 0, 3], k[1, 3 * block:4 * block, 0])


@pytest.mark.parametrize("items", [
    QueryTiles(3, 2, 2, 4, 2, tiles_fastest=True, heavy_first=False),
    QueryTiles(3, 2, 2, 4, 2, tiles_fastest=False, heavy_first=True),
    BatchFastestTiles(3, 2, 2, 4, 2, tiles_fastest=False, heavy_first=False),
    DecodeItems(n_tiles=2, n_heads=3, n_batch=2, n_splits=3, split_blocks=2, block_q=4,
                consumers=2, group=2, q_len=3),
], ids=["tiles-fastest", "heads-fastest-heavy-first", "batch-fastest", "decode-splits"])
def test_work_items_cover_every_output_row_once(items):
  """Each consumer of each item copies its rows of Q to its output rows: a kind of work
  item is right when the output is Q again (every row written once, none twice), for
  split-KV items Q again in every split."""
  q = jax.random.normal(jax.random.PRNGKey(0), (items.n_batch, items.n_tiles * items.rows,
                                                 items.n_heads, 8))

  def kernel(q_ref, o_ref, count_ref):
    bound = items.bind()
    count_ref[...] = jnp.zeros_like(count_ref)
    for w in range(items.count):
      item = bound.at(jnp.int32(w))
      for consumer in range(items.consumers):
        q_start = bound.q_start(item, consumer)
        o_ref[bound.out_rows(item, q_start)] = q_ref[bound.q_rows(item, q_start)]
        stat = bound.stat_rows(item, q_start)
        count_ref[stat] = count_ref[stat] + 1

  out_shapes = items.out_shapes(q.shape[0], q.shape[1], q.shape[2], q.shape[3], q.dtype)
  o, count = pl.pallas_call(kernel, interpret=True, out_shape=out_shapes)(q)
  np.testing.assert_array_equal(o, q if o.ndim == q.ndim else
                                jnp.broadcast_to(q[:, None], o.shape))
  np.testing.assert_array_equal(count, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_the_hopper_forward_runs_on_a_paged_cache_and_other_work_items(causal):
  from jattn.kernels.hopper import pipeline as mp
  from jattn.kernels.hopper.forward import rows_forward
  if jax.devices()[0].compute_capability != "9.0":
    pytest.skip("needs a Hopper GPU")
  batch, q_len, kv_len, heads, kv_heads, d, page = 2, 256, 1024, 4, 2, 128, 256
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (batch, q_len, heads, d), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, kv_len, kv_heads, d), jnp.bfloat16) for key in keys[1:])
  spec = MaskSpec.build(q_len, kv_len, causal=causal, local_window=None, kv_padded=False,
                        segments=False)
  rule, scale = SoftmaxRows(spec, d ** -0.5), d ** -0.5
  k_pages, v_pages, table = paged(k, v, page, seed=2)
  want = flash_attention_reference(q, k, v, causal=causal, scale=scale)[0]
  items = BatchFastestTiles(q_len // (mp.CONSUMERS * 64), heads, batch, 64, mp.CONSUMERS,
                            tiles_fastest=False, heavy_first=False)
  runs = {
      "paged": jax.jit(lambda q, kp, vp, t: rows_forward(
          q, kp, vp, (t,), rule=rule, spec=spec, block_q=64, block_kv=128, stages=2,
          addressing=PagedKV(page, kv_len // page, k_pages.shape[0]))[0])(q, k_pages, v_pages, table),
      "items": jax.jit(lambda q, k, v: rows_forward(
          q, k, v, rule=rule, spec=spec, block_q=64, block_kv=128, stages=2,
          persistent=False, items=items)[0])(q, k, v),
  }
  for name, got in runs.items():
    assert rel_err(got, want) < 1e-2, name
