"""Serving: per-row lengths in ``flash_attention``, the split-KV decode kernels and
``paged_attention`` / ``write_kv_pages``, against the dense reference.

Kernel cases run in interpret mode on CPU (``kernel``) and compiled on a GPU; the
16-bit Hopper cases are GPU-only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from conftest import ON_GPU, rel_err
from jattn.kernels.flash.decode_config import (MOSAIC_DECODE_BLOCK_K, MOSAIC_DECODE_ROWS,
                                               DecodeConfig, decode_config,
                                               mosaic_decode_config)
from jattn.kernels.flash.mosaic_decode import mosaic_decode_runs
from jattn.kernels.hopper.budget import HOPPER_SMEM_BYTES
from jattn.kernels.hopper.forward import forward_smem_bytes
from jattn.kernels.flash.triton_decode import flash_triton_decode
from jattn.paged import gather_pages
from jattn.reference import flash_attention_reference

pytestmark = pytest.mark.kernel


def _normal(key, shapes, dtype=jnp.float32):
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _lengths(key, batch, q_len, kv_len):
  """``[batch, 2]`` (q_len, kv_len) rows: a full row, an empty cache, one key, the rest
  random (never fewer keys than queries unless the cache is empty)."""
  kq, kk = jax.random.split(key)
  kv = jax.random.randint(kk, (batch,), 1, kv_len + 1).at[0].set(kv_len)
  q = jnp.minimum(jax.random.randint(kq, (batch,), 1, q_len + 1), kv).at[0].set(q_len)
  if batch > 2:
    kv, q = kv.at[1].set(0), q.at[1].set(q_len)
    kv, q = kv.at[2].set(1), q.at[2].set(1)
  return jnp.stack([q, kv], axis=1).astype(jnp.int32)


# (batch, q_len, q_heads, kv_heads, head_dim, head_dim_v, kv_len, causal, window, softcap,
#  sinks, DecodeConfig)
DECODE_CASES = [
    (4, 1, 8, 2, 16, 16, 150, False, None, None, False, DecodeConfig(16, 16, 3)),
    (4, 3, 4, 2, 16, 8, 97, True, None, 5.0, True, DecodeConfig(16, 32, 2)),
    (3, 5, 4, 1, 32, 32, 64, True, (7, None), None, False, DecodeConfig(16, 16, 4)),
    (2, 9, 4, 4, 16, 16, 80, True, None, None, True, DecodeConfig(16, 16, 1)),  # 2 row tiles
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"q{c[1]}-g{c[2] // c[3]}")
def test_decode_kernel_matches_the_reference(case):
  batch, q_len, heads, kv_heads, d, dv, kv_len, causal, window, softcap, with_sinks, cfg = case
  key = jax.random.PRNGKey(q_len)
  q, k, v = _normal(key, [(batch, q_len, heads, d), (batch, kv_len, kv_heads, d),
                          (batch, kv_len, kv_heads, dv)])
  sinks = jax.random.normal(key, (heads,)) if with_sinks else None
  lengths = _lengths(jax.random.PRNGKey(7), batch, q_len, kv_len)
  run = jax.jit(lambda *a: flash_triton_decode(
      *a, causal=causal, scale=0.3, local_window=window, softcap=softcap, config=cfg,
      interpret=not ON_GPU, sinks=sinks))
  o, lse = run(q, k, v, lengths)
  o_ref, lse_ref = flash_attention_reference(q, k, v, causal=causal, scale=0.3,
                                             local_window=window, softcap=softcap, sinks=sinks,
                                             lengths=lengths)
  assert rel_err(o, o_ref) < 1e-5
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)
  padding = np.arange(q_len)[None, :] >= np.asarray(lengths[:, :1])
  assert np.all(np.asarray(o)[padding] == 0.0)


@pytest.mark.parametrize("page_size,block_k", [(1, 16), (8, 16), (32, 16), (16, 16)])
def test_paged_kernel_reads_through_the_block_table(page_size, block_k):
  batch, q_len, heads, kv_heads, d = 3, 2, 4, 2, 16
  per_seq = -(-72 // page_size)
  num_pages = batch * per_seq + 5
  key = jax.random.PRNGKey(page_size)
  q, k_pages, v_pages = _normal(key, [(batch, q_len, heads, d),
                                      (num_pages, page_size, kv_heads, d),
                                      (num_pages, page_size, kv_heads, d)])
  tables = jax.random.permutation(key, num_pages)[:batch * per_seq].reshape(batch, per_seq)
  # entries past a sequence's pages are garbage: they must never be read
  lengths = _lengths(jax.random.PRNGKey(3), batch, q_len, per_seq * page_size)
  used = (np.arange(per_seq)[None] * page_size < np.asarray(lengths[:, 1:]))
  tables = jnp.where(used, tables, 10 ** 6).astype(jnp.int32)
  cfg = DecodeConfig(16, block_k, 2)
  o, lse = jax.jit(lambda *a: flash_triton_decode(
      *a, causal=True, scale=0.25, local_window=None, softcap=None, config=cfg,
      interpret=not ON_GPU, block_tables=tables))(q, k_pages, v_pages, lengths)
  k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
  o_ref, lse_ref = flash_attention_reference(q, k, v, causal=True, scale=0.25, lengths=lengths)
  assert rel_err(o, o_ref) < 1e-5
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def _flash_backends():
  yield pytest.param("pallas_triton", jnp.float32, id="pallas_triton")
  yield pytest.param("pallas_mosaic", jnp.bfloat16, id="pallas_mosaic", marks=pytest.mark.gpu)
  yield pytest.param("pallas_triton", jnp.bfloat16, id="pallas_triton-bf16",
                     marks=pytest.mark.gpu)


# (batch, q_len, kv_len, causal, local_window, with q_lengths): the flash kernels, and
# q_len 2 against 40 keys, the decode kernel (its gradients: the flash backward's)
LENGTH_CASES = [(3, 24, 40, True, None, True), (3, 24, 20, False, (5, 3), True),
                (3, 2, 40, True, None, False)]


@pytest.mark.parametrize("backend,dtype", list(_flash_backends()))
@pytest.mark.parametrize("case", LENGTH_CASES, ids=lambda c: f"q{c[1]}-kv{c[2]}")
def test_flash_lengths_forward_and_gradients(backend, dtype, case):
  batch, q_len, kv_len, causal, window, with_q = case
  if ON_GPU:  # the Hopper tiles: longer sequences
    q_len, kv_len = q_len * 8, kv_len * 8
  q, k, v, do = _normal(jax.random.PRNGKey(kv_len), [
      (batch, q_len, 4, 64), (batch, kv_len, 2, 64), (batch, kv_len, 2, 64),
      (batch, q_len, 4, 64)], dtype)
  lengths = _lengths(jax.random.PRNGKey(1), batch, q_len, kv_len)
  q_lengths = lengths[:, 0] if with_q else None

  def run(backend):
    f = lambda q, k, v: jattn.flash_attention(
        q, k, v, causal=causal, local_window=window, q_lengths=q_lengths,
        kv_lengths=lengths[:, 1], backend=backend)
    o, pull = jax.vjp(f, q, k, v)
    return (o,) + pull(do)

  ours = jax.jit(lambda: run(backend))()
  ref = jax.jit(lambda: run("xla"))()
  tol = 1e-4 if dtype == jnp.float32 else 3e-2
  for a, b in zip(ours, ref):
    assert rel_err(a, b, floor=1e-2) < tol
  if with_q:  # padding rows: zero output, zero gradient
    padding = np.arange(q_len)[None, :] >= np.asarray(q_lengths)[:, None]
    assert np.all(np.asarray(ours[0], np.float32)[padding] == 0)
    assert np.all(np.asarray(ours[1], np.float32)[padding] == 0)


def test_decode_split_follows_the_cost_model():
  """Long caches of few sequences split into many programs; many sequences fill the
  SMs unsplit."""
  h100 = 132
  long = decode_config(1, 1, 32, 8, 131072, 128, 128, 2, h100)
  wide = decode_config(64, 1, 32, 8, 4096, 128, 128, 2, h100)
  assert long.splits * 8 >= h100 and long.block_m == 16
  assert wide.splits <= 2
  assert decode_config(8, 64, 32, 8, 8192, 128, 128, 2, h100).block_m == 128


@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128), (192, 128), (192, 192), (256, 256),
                                   (384, 384)])
def test_hopper_decode_ring_fits_the_shared_memory(dk, dv):
  """The Hopper decode kernel's K/V ring is as deep as the shared memory allows (4
  stages took 240 KB at head dim 192 and 320 KB at 256, past the 227 KB a CTA has)."""
  c = mosaic_decode_config(2, 1, 16, 1, 4096, dk, dv, 2, 132)
  fits = lambda stages: forward_smem_bytes(MOSAIC_DECODE_ROWS, MOSAIC_DECODE_BLOCK_K, stages,
                                           dk, dv, 2, 1, ones_tile=True) <= HOPPER_SMEM_BYTES
  assert fits(c.num_stages) and (c.num_stages == 4 or not fits(c.num_stages + 1))
  assert mosaic_decode_runs(16, 1, (dk, dv))
  assert not mosaic_decode_runs(16, 1, (512, 512))  # not one stage fits: the Triton kernel


def test_write_kv_pages_then_gather_gives_the_cache():
  batch, page, heads, d = 2, 4, 2, 8
  k_new, v_new = _normal(jax.random.PRNGKey(0), [(batch, 6, heads, d), (batch, 6, heads, d)])
  tables = jnp.array([[5, 0, 3], [1, 4, 2]], jnp.int32)
  pages = jnp.zeros((7, page, heads, d))
  positions, num_new = jnp.array([2, 9]), jnp.array([6, 2])
  k_pages, v_pages = jattn.write_kv_pages(pages, pages, k_new, v_new, tables, positions,
                                          num_new)
  k = np.asarray(gather_pages(k_pages, tables))
  np.testing.assert_array_equal(k[0, 2:8], k_new[0])
  np.testing.assert_array_equal(k[1, 9:11], k_new[1, :2])
  assert np.all(k[1, 11:] == 0) and np.all(k[0, :2] == 0)  # past num_new / before positions
  assert np.all(np.asarray(v_pages)[6] == 0)  # a page no table names
  # Past the table, and table entries that are no page of the pool: nothing written.
  unallocated = jnp.array([[2, -1, 3], [1, 9, 5]], jnp.int32)  # -1 and 9: no page of 7
  k_pages, _ = jattn.write_kv_pages(pages, pages, k_new, v_new, unallocated,
                                    jnp.array([2, 2]))
  written = np.flatnonzero(np.any(np.asarray(k_pages) != 0, axis=(1, 2, 3)))
  np.testing.assert_array_equal(written, [1, 2])  # tokens 2-3 of each row; the rest dropped
  # Two tokens aimed at one slot: refused where the tables are known (which would land is
  # unspecified); a shared page is fine where the slots differ.
  shared = jnp.array([[3, 0, 5], [3, 1, 2]], jnp.int32)
  jattn.write_kv_pages(pages, pages, k_new, v_new, shared, jnp.array([0, 2]), jnp.array([2, 2]))
  for tables, positions, message in (
      (shared, jnp.array([0, 1]), r"slot 1 of page 3 \(\(row, position\) \(0, 1\) and \(1, 1\)\)"),
      (jnp.array([[4, 4, 5], [1, 6, 2]], jnp.int32), jnp.array([0, 0]),
       r"slot 0 of page 4 \(\(row, position\) \(0, 0\) and \(0, 4\)\)")):
    with pytest.raises(ValueError, match=message):
      jattn.write_kv_pages(pages, pages, k_new, v_new, tables, positions)


def test_paged_attention_matches_flash_on_the_gathered_cache():
  batch, q_len, page, per_seq = 2, 3, 8, 5
  q, k_pages, v_pages = _normal(jax.random.PRNGKey(4), [
      (batch, q_len, 4, 16), (12, page, 2, 16), (12, page, 2, 16)])
  tables = jax.random.permutation(jax.random.PRNGKey(5), 12)[:10].reshape(batch, per_seq)
  kv_lengths = jnp.array([37, 4])
  ours = jattn.paged_attention(q, k_pages, v_pages, tables, kv_lengths, causal=True)
  ref = jattn.flash_attention(q, gather_pages(k_pages, tables), gather_pages(v_pages, tables),
                              causal=True, kv_lengths=kv_lengths, backend="xla")
  assert rel_err(ours, ref) < 1e-5
  with pytest.raises(NotImplementedError, match="paged_attention has no gradient"):
    jax.grad(lambda q: jattn.paged_attention(q, k_pages, v_pages, tables, kv_lengths).sum())(q)


@pytest.mark.parametrize("change,error,match", [
    (dict(kv_lengths=jnp.ones((2,), jnp.float32)), TypeError, "kv_lengths must be integers"),
    (dict(kv_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"kv_lengths must be \[batch\]"),
    (dict(block_tables=jnp.ones((2, 2), jnp.float32)), TypeError,
     "block_tables must be integers"),
    (dict(k_pages=jnp.ones((4, 8, 3, 16)), v_pages=jnp.ones((4, 8, 3, 16))), ValueError,
     "q.s heads"),
    (dict(v_pages=jnp.ones((4, 4, 2, 16))), ValueError, r"v_pages must be \[num_pages"),
    (dict(kv_lengths=None), ValueError, r"kv_lengths must be \[batch\] integers"),
], ids=["float-lengths", "lengths-shape", "float-tables", "heads", "v-pages", "no-lengths"])
def test_paged_errors_name_the_argument(change, error, match):
  args = dict(q=jnp.ones((2, 1, 4, 16)), k_pages=jnp.ones((4, 8, 2, 16)),
              v_pages=jnp.ones((4, 8, 2, 16)), block_tables=jnp.zeros((2, 2), jnp.int32),
              kv_lengths=jnp.array([3, 5]))
  args.update(change)
  with pytest.raises(error, match=match):
    jattn.paged_attention(**args, backend="xla")


@pytest.mark.parametrize("change,error,match", [
    (dict(q_lengths=jnp.ones((2,), jnp.float32)), TypeError, "q_lengths must be integers"),
    (dict(kv_lengths=jnp.ones((2, 1), jnp.int32)), ValueError, r"kv_lengths must be \[batch\]"),
], ids=["float-q-lengths", "kv-lengths-rank"])
def test_flash_length_errors_name_the_argument(change, error, match):
  q = jnp.ones((2, 4, 2, 16))
  with pytest.raises(error, match=match):
    jattn.flash_attention(q, q, q, backend="xla", **change)


# (q_len, q_heads, kv_heads, head_dim, kv_len, causal, window, softcap, sinks, page_size)
HOPPER_DECODE_CASES = [
    (1, 32, 8, 128, 1000, False, None, None, False, None),
    (16, 16, 4, 64, 700, True, (100, None), 30.0, True, None),
    (64, 8, 4, 128, 1500, True, None, None, False, None),
    (1, 8, 1, 128, 1024, False, None, None, True, 64),
    (5, 4, 2, 64, 900, True, None, None, False, 256),
    (1, 16, 1, 256, 700, False, None, None, False, None),  # head dim 256: a 2-stage ring
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_DECODE_CASES, ids=lambda c: f"q{c[0]}-p{c[-1]}")
def test_hopper_decode_matches_the_reference(case):
  from jattn.kernels.flash.decode_config import mosaic_decode_config
  from jattn.kernels.flash.mosaic_decode import flash_mosaic_decode
  if jax.devices()[0].compute_capability != "9.0":
    pytest.skip("needs a Hopper GPU")
  q_len, heads, kv_heads, d, kv_len, causal, window, softcap, with_sinks, page = case
  batch = 4
  q, k, v = _normal(jax.random.PRNGKey(q_len), [
      (batch, q_len, heads, d), (batch, kv_len, kv_heads, d), (batch, kv_len, kv_heads, d)],
      jnp.bfloat16)
  sinks = jax.random.normal(jax.random.PRNGKey(2), (heads,)) if with_sinks else None
  lengths = _lengths(jax.random.PRNGKey(5), batch, q_len, kv_len)
  config = mosaic_decode_config(batch, q_len, heads, kv_heads, kv_len, d, d, 2, 132)
  tables, k_in, v_in = None, k, v
  if page is not None:  # the cache cut into pages, stored shuffled
    per_seq = -(-kv_len // page)
    k_in, v_in = (jnp.pad(x, [(0, 0), (0, per_seq * page - kv_len), (0, 0), (0, 0)]).reshape(
        batch * per_seq, page, kv_heads, d) for x in (k, v))
    order = jax.random.permutation(jax.random.PRNGKey(9), batch * per_seq)
    k_in, v_in = k_in[jnp.argsort(order)], v_in[jnp.argsort(order)]
    tables = order.reshape(batch, per_seq).astype(jnp.int32)
  o, lse = jax.jit(lambda q, k, v, t: flash_mosaic_decode(
      q, k, v, lengths, causal=causal, scale=d ** -0.5, local_window=window, softcap=softcap,
      config=config, sinks=sinks, block_tables=t))(q, k_in, v_in, tables)
  o_ref, lse_ref = flash_attention_reference(q, k, v, causal=causal, local_window=window,
                                             softcap=softcap, sinks=sinks, lengths=lengths)
  assert rel_err(o, o_ref) < 2e-2
  valid = np.asarray(lse_ref) > -1e29
  np.testing.assert_allclose(np.asarray(lse)[valid], np.asarray(lse_ref)[valid], atol=2e-2)
  padding = np.arange(q_len)[None, :] >= np.asarray(lengths[:, :1])
  assert np.all(np.asarray(o, np.float32)[padding] == 0.0)


def _per_sequence(q, k, v, lq, lk, max_q, max_k, **kwargs):
  """The varlen result as a loop of dense calls, one per sequence, each cut to
  ``max_q`` / ``max_k`` (rows past the cut and past the last sequence: zeros)."""
  out = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
  cq = ck = 0
  for a, b in zip(lq, lk):
    a_cut, b_cut = min(a, max_q), min(b, max_k)
    if a_cut and b_cut:
      o = flash_attention_reference(q[None, cq:cq + a_cut], k[None, ck:ck + b_cut],
                                    v[None, ck:ck + b_cut], **kwargs)[0][0]
      out = out.at[cq:cq + a_cut].set(o)
    cq, ck = cq + a, ck + b
  return out


# (query lengths, key lengths, causal, window, softcap, sinks, max_seqlen (q, k): None for
# the longest, else a cut)
VARLEN_CASES = [([5, 0, 33, 1, 17], [5, 0, 33, 1, 17], True, None, None, False, None),
                ([4, 19, 2, 0], [30, 19, 9, 6], True, (6, None), 3.0, True, None),
                ([12, 7, 1], [3, 40, 1], False, (2, 4), None, False, None),
                ([20, 3, 9], [20, 3, 9], True, None, None, True, (8, 16))]


@pytest.mark.parametrize("backend,dtype", list(_flash_backends())[::2])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["self", "prefill-chunks", "cross", "cut"])
def test_varlen_forward_and_gradients_match_a_loop_over_sequences(backend, dtype, case):
  lq, lk, causal, window, softcap, with_sinks, cut = case
  max_q, max_k = cut or (max(lq), max(lk))
  cu = lambda lengths: jnp.array(np.cumsum([0] + lengths), jnp.int32)
  q, k, v, do = _normal(jax.random.PRNGKey(len(lq)), [
      (sum(lq) + 3, 4, 32), (sum(lk), 2, 32), (sum(lk), 2, 32), (sum(lq) + 3, 4, 32)], dtype)
  sinks = jax.random.normal(jax.random.PRNGKey(1), (4,)) if with_sinks else jnp.zeros(0)
  kwargs = lambda sinks: dict(causal=causal, local_window=window, softcap=softcap,
                              sinks=sinks if with_sinks else None, scale=0.2)
  ours = lambda q, k, v, sinks: jattn.flash_attention_varlen(
      q, k, v, cu(lq), cu(lk), max_seqlen_q=max_q, max_seqlen_k=max_k, backend=backend,
      **kwargs(sinks))
  o, pull = jax.vjp(ours, q, k, v, sinks)
  o_ref, pull_ref = jax.vjp(jax.jit(  # jitted: eagerly its loop compiles op by op
      lambda q, k, v, sinks: _per_sequence(q, k, v, lq, lk, max_q, max_k, **kwargs(sinks))),
      q, k, v, sinks)
  tol = 1e-4 if dtype == jnp.float32 else 3e-2
  assert rel_err(o, o_ref) < tol
  for g, g_ref in zip(pull(do), pull_ref(do)):
    assert rel_err(g, g_ref, floor=1e-2) < tol
  assert np.all(np.asarray(o, np.float32)[sum(lq):] == 0)  # rows past the last sequence


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
@pytest.mark.parametrize("op", ["decode", "varlen"])
def test_garbage_past_the_lengths_reaches_no_gradient(op, backend):
  """A cache's unused tail (past ``kv_lengths``) or the query rows past the last packed
  sequence holding NaN: the gradients are those with zeros there (xla's were NaN)."""
  q, k, v, do = _normal(jax.random.PRNGKey(9), [(1, 3, 2, 16), (1, 12, 1, 16),
                                                (1, 12, 1, 16), (1, 3, 2, 16)])
  if op == "decode":
    fn = lambda q, k, v: jattn.flash_attention(q, k, v, causal=True, backend=backend,
                                               kv_lengths=jnp.array([7], jnp.int32))
    dirty = lambda q, k, v: (q, k.at[:, 7:].set(jnp.nan), v.at[:, 7:].set(jnp.nan))
  else:
    cu_q, cu_k = jnp.array([0, 2], jnp.int32), jnp.array([0, 12], jnp.int32)
    q, k, v, do = q[0], k[0], v[0], do[0]
    fn = lambda q, k, v: jattn.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q=2, max_seqlen_k=12, backend=backend)
    dirty = lambda q, k, v: (q.at[2:].set(jnp.nan), k, v)
  clean = jax.vjp(fn, q, k, v)[1](do)
  grads = jax.vjp(fn, *dirty(q, k, v))[1](do)
  for g, g_clean in zip(grads, clean):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_clean), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,error,match", [
    (dict(cu_seqlens_q=jnp.array([0.0, 4.0])), TypeError, "cu_seqlens_q must be integers"),
    (dict(cu_seqlens_q=jnp.array([1, 4])), ValueError, "cu_seqlens_q must run from 0"),
    (dict(cu_seqlens_k=jnp.array([0, 3, 5])), ValueError, r"cu_seqlens_k must be \[num_seqs"),
    (dict(max_seqlen_q=4.0), ValueError, "max_seqlen_q must be a positive int"),
    (dict(q=jnp.ones((6, 3, 8))), ValueError, "q's heads"),
], ids=["float-cu", "cu-start", "cu-lengths", "max-float", "heads"])
def test_varlen_errors_name_the_argument(change, error, match):
  args = dict(q=jnp.ones((6, 4, 8)), k=jnp.ones((6, 2, 8)), v=jnp.ones((6, 2, 8)),
              cu_seqlens_q=jnp.array([0, 4]), cu_seqlens_k=jnp.array([0, 6]),
              max_seqlen_q=4, max_seqlen_k=6)
  args.update(change)
  with pytest.raises(error, match=match):
    jattn.flash_attention_varlen(**args, backend="xla")


def _allowed(cu, total_p, max_len, left, right):
  """Dense ``[rows, keys]`` mask of sequences packed alike in queries and keys."""
  cu, r = np.asarray(cu), np.arange(total_p)
  seq = np.minimum(np.searchsorted(cu[1:], r, side="right"), len(cu) - 2)
  real = (r >= cu[0]) & (r < np.minimum(cu[seq + 1], cu[seq] + max_len))
  m = (seq[:, None] == seq[None]) & real[:, None] & real[None]
  if right is not None:
    m &= r[None] <= r[:, None] + right
  if left is not None:
    m &= r[None] >= r[:, None] - left
  return m


@pytest.mark.parametrize("seed", range(3))
def test_packed_ranges_visit_every_allowed_block_and_call_full_only_full_ones(seed):
  """The Hopper varlen kernels' block ranges (``inputs.packed_ranges``) against the dense
  mask: no block with an allowed pair left out, no block called unmasked that is not
  wholly allowed, and (causal, sequences inside the rows) every wholly allowed one."""
  from jattn.kernels.common.masking import MaskSpec
  from jattn.kernels.hopper.inputs import packed_ranges
  rng = np.random.default_rng(seed)
  for causal, window, max_len in [(True, None, 1000), (False, (5, None), 30), (True, (3, 4), 25)]:
    lens = rng.integers(0, 60, 5)
    cu = np.concatenate([[0], np.cumsum(lens)])
    total_p = -(-(int(cu[-1]) + 3) // 16) * 16
    spec = MaskSpec.build(total_p, total_p, causal=causal, local_window=window, kv_padded=False,
                          segments=True)
    allowed = _allowed(cu, total_p, max_len, spec.left, spec.right)
    for tiles, transpose in [((8, 16), False), ((16, 8), True)]:
      ranges = np.asarray(packed_ranges(jnp.asarray(cu), max_len, spec, tiles,
                                        (total_p, total_p), transpose))[0, 0]
      m = allowed.T if transpose else allowed
      rows, cols = (tiles[1], tiles[0]) if transpose else tiles
      for i, (lo, full_lo, full_hi, hi) in enumerate(ranges):
        for j in range(total_p // cols):
          block = m[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
          full = full_lo <= j < full_hi
          assert not block.any() or lo <= j < hi
          assert block.all() or not full
          if causal and window is None and not transpose:
            assert full or not block.all()


# (query lengths, key lengths, causal, window, softcap, sinks, max_seqlen (q, k), head dim,
# extra query rows): queries and keys packed alike (one cu_seqlens array, as many rows:
# one batch row) first, then VARLEN_CASES' packings scaled up (the gathered batch)
_SAME = [300, 0, 65, 1, 700, 128]
HOPPER_VARLEN_CASES = [
    (_SAME, _SAME, True, None, None, False, (700, 700), 128, 0),
    (_SAME, _SAME, False, None, None, False, (700, 700), 128, 0),
    (_SAME, _SAME, False, (96, 40), 20.0, True, (256, 256), 128, 0),
] + [([9 * n for n in lq], [9 * n for n in lk], causal,
      None if window is None else tuple(None if w is None else 9 * w for w in window),
      softcap, sinks, (9 * cut[0], 9 * cut[1]) if cut else (9 * max(lq), 9 * max(lk)), 64, 5)
     for lq, lk, causal, window, softcap, sinks, cut in VARLEN_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_VARLEN_CASES, ids=[
    "one-row-causal", "one-row-full", "one-row-window-cut", "gathered-self",
    "gathered-prefill-chunks", "gathered-cross", "gathered-cut"])
def test_hopper_varlen_matches_a_loop_over_sequences(case):
  if jax.devices()[0].compute_capability != "9.0":
    pytest.skip("needs a Hopper GPU")
  lq, lk, causal, window, softcap, with_sinks, (max_q, max_k), d, extra = case
  cu_q = jnp.array(np.cumsum([0] + lq), jnp.int32)
  cu_k = cu_q if lq is lk else jnp.array(np.cumsum([0] + lk), jnp.int32)
  rows_k = sum(lk) + (7 if lq is lk else 0)
  rows_q = rows_k if lq is lk else sum(lq) + extra
  q, k, v, do = _normal(jax.random.PRNGKey(3 if lq is lk else 7),
                        [(rows_q, 8, d), (rows_k, 4, d), (rows_k, 4, d), (rows_q, 8, d)],
                        jnp.bfloat16)
  sinks = jax.random.normal(jax.random.PRNGKey(1), (8,)) if with_sinks else jnp.zeros(0)
  kwargs = lambda sinks: dict(causal=causal, local_window=window, softcap=softcap,
                              sinks=sinks if with_sinks else None)
  ours = lambda q, k, v, sinks: jattn.flash_attention_varlen(
      q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, backend="pallas_mosaic",
      **kwargs(sinks))
  o, pull = jax.vjp(ours, q, k, v, sinks)
  o_ref, pull_ref = jax.vjp(jax.jit(lambda q, k, v, sinks: _per_sequence(
      q, k, v, lq, lk, max_q, max_k, **kwargs(sinks))), q, k, v, sinks)
  assert rel_err(o, o_ref) < 2e-2
  for g, g_ref in zip(pull(do), pull_ref(do)):
    assert rel_err(g, g_ref, floor=1e-2) < 3e-2
  assert np.all(np.asarray(o, np.float32)[sum(lq):] == 0)



@pytest.mark.gpu
@pytest.mark.parametrize("alike", [True, False], ids=["one-row", "gathered"])
def test_hopper_varlen_lse_and_its_cotangent_match_the_reference(alike):
  """``return_lse=True`` on both Hopper varlen routes: the lse of the rows sequences hold,
  and the gradients with a cotangent on the lse too, against the xla reference."""
  if jax.devices()[0].compute_capability != "9.0":
    pytest.skip("needs a Hopper GPU")
  lq = [130, 0, 257, 64]
  lk = lq if alike else [200, 5, 257, 300]
  cu_q = jnp.array(np.cumsum([0] + lq), jnp.int32)
  cu_k = cu_q if alike else jnp.array(np.cumsum([0] + lk), jnp.int32)
  rows_q, rows_k = sum(lq) + 9, sum(lk) + (9 if alike else 0)
  q, k, v, do = _normal(jax.random.PRNGKey(4), [(rows_q, 4, 64), (rows_k, 2, 64), (rows_k, 2, 64),
                                                (rows_q, 4, 64)], jnp.bfloat16)
  dlse = jax.random.normal(jax.random.PRNGKey(5), (4, rows_q))
  valid = jattn.kernels.common.tiling.packed_positions(cu_q, rows_q, max(lq))[2]

  def attend(backend):
    return lambda q, k, v: jattn.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=True,
        return_lse=True, backend=backend)

  (o, lse), pull = jax.vjp(attend("pallas_mosaic"), q, k, v)
  (o_ref, lse_ref), pull_ref = jax.vjp(jax.jit(attend("xla")),
                                       *(x.astype(jnp.float32) for x in (q, k, v)))
  assert rel_err(o, o_ref) < 2e-2
  np.testing.assert_allclose(np.where(valid[None], lse, 0), np.where(valid[None], lse_ref, 0),
                             atol=2e-2)
  for g, g_ref in zip(pull((do, dlse)), pull_ref((do.astype(jnp.float32), dlse))):
    assert rel_err(g, g_ref, floor=1e-2) < 3e-2

@pytest.mark.parametrize("seed", range(3))
def test_decode_block_ranges_visit_every_allowed_block_and_unmask_only_full_ones(seed):
  """Both decode kernels' key ranges (``masking.packed_rows_block_range`` split by
  ``split_block_range``) against the dense mask of packed rows, for the Triton kernel's
  row tiles and the Hopper consumers' half tiles (some of packing rows only), with and
  without per-row lengths: ranges ordered, every block a real row needs visited by
  exactly one split, no block left unmasked where a real row (one below its row's
  query length) does not see all of it, and a tile of one real position with no
  window runs its whole blocks unmasked."""
  from jattn.kernels.common.masking import (MaskSpec, packed_rows_block_range,
                                            split_block_range)
  rng = np.random.default_rng(seed)
  block_k, split_blocks, kv_cap = 8, 3, 80
  n_blocks = kv_cap // block_k
  for causal, window, q_len, group, rows in [(True, None, 1, 1, 16), (True, None, 3, 4, 8),
                                             (False, (20, 5), 4, 2, 16), (True, (9, 0), 2, 8, 8),
                                             (True, (0, None), 1, 1, 16)]:
    rows_p = -(-q_len * group // rows) * rows + rows  # a tile of packing rows only, too
    pos = np.arange(rows_p) // group
    real, keys = pos < q_len, np.arange(kv_cap)
    specs = [(MaskSpec.build(q_len, kv_cap, causal=causal, local_window=window, kv_padded=False,
                             segments=False), q_len, kv_cap)]
    per_row = MaskSpec.build(q_len, kv_cap, causal=causal, local_window=window, kv_padded=True,
                             segments=False, lengths=True)
    for _ in range(4):
      lq, lk = int(rng.integers(0, q_len + 1)), int(rng.integers(0, kv_cap + 1))
      specs.append((per_row.with_lengths(jnp.int32(lq), jnp.int32(lk)), lq, lk))
    for spec, lq, lk in specs:
      needed = (pos < lq)[:, None] & (keys < lk)[None]
      at = pos[:, None] + lk - lq  # bottom-right alignment
      if spec.right is not None:
        needed &= keys[None] <= at + spec.right
      if spec.left is not None:
        needed &= keys[None] >= at - spec.left
      for tile in (rows, rows // 2):
        for start in range(0, rows_p, tile):
          whole = packed_rows_block_range(spec, jnp.int32(start), tile, group=group,
                                          q_len=q_len, block_k=block_k)
          visits = np.zeros(n_blocks, int)
          for split in range(-(-n_blocks // split_blocks)):
            lo, full_lo, full_hi, hi = map(int, split_block_range(whole, jnp.int32(split),
                                                                  split_blocks))
            assert lo <= full_lo <= full_hi <= hi
            visits[lo:hi] += 1
            for j in range(full_lo, full_hi):
              block = needed[start:start + tile, j * block_k:(j + 1) * block_k]
              assert block[real[start:start + tile]].all(), (lq, lk, start, j)
          need = needed[start:start + tile].reshape(tile, n_blocks, block_k).any(axis=(0, 2))
          assert np.all(visits[need] == 1) and visits.max() <= 1
          lo, full_lo, full_hi, hi = map(int, whole)
          assert lo <= full_lo <= full_hi <= hi
          if q_len == 1 and window is None and lq == 1 and lk >= block_k and start == 0:
            assert (full_lo, full_hi) == (0, lk // block_k)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=["self", "prefill-chunks", "cross", "cut"])
def test_varlen_as_a_batch_with_lengths_is_the_varlen_result(case):
  """The Hopper varlen route for packings that differ (``varlen.to_batch`` into a batch
  with per-row lengths, ``to_packed`` back) checked through the dense reference with
  lengths: the same outputs and lse as the varlen reference, rows past every sequence
  zero."""
  from jattn.kernels.common.tiling import packed_positions
  from jattn.reference import flash_attention_reference, flash_attention_varlen_reference
  from jattn.varlen import to_batch, to_packed
  lq, lk, causal, window, softcap, with_sinks, cut = case
  max_q, max_k = cut or (max(lq), max(lk))
  cu_q, cu_k = (jnp.array(np.cumsum([0] + lengths), jnp.int32) for lengths in (lq, lk))
  q, k, v = _normal(jax.random.PRNGKey(5), [(sum(lq) + 3, 4, 16), (sum(lk), 2, 16),
                                            (sum(lk), 2, 16)], jnp.float32)
  sinks = jax.random.normal(jax.random.PRNGKey(1), (4,)) if with_sinks else None
  kwargs = dict(causal=causal, local_window=window, softcap=softcap, sinks=sinks, scale=0.3)
  lengths = jnp.stack([jnp.minimum(jnp.diff(cu_q), max_q), jnp.minimum(jnp.diff(cu_k), max_k)], 1)

  @jax.jit  # eagerly, every op compiles on its own
  def both(q, k, v, cu_q, cu_k, lengths):
    o_b, lse_b = flash_attention_reference(to_batch(q, cu_q, max_q), to_batch(k, cu_k, max_k),
                                           to_batch(v, cu_k, max_k), lengths=lengths, **kwargs)
    o, lse = flash_attention_varlen_reference(
        q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **kwargs)
    lse_p = to_packed(jnp.swapaxes(lse_b, 1, 2), cu_q, q.shape[0], max_q).T
    return to_packed(o_b, cu_q, q.shape[0], max_q), o, lse_p, lse

  o_p, o, lse_p, lse = both(q, k, v, cu_q, cu_k, lengths)
  valid = packed_positions(cu_q, q.shape[0], max_q)[2]
  np.testing.assert_allclose(o_p, o, atol=1e-5)
  np.testing.assert_allclose(jnp.where(valid[None], lse_p, 0), jnp.where(valid[None], lse, 0),
                             atol=1e-5)
  assert np.all(np.asarray(o_p)[sum(lq):] == 0)
