"""jattn.dilated_attention: the reference against a loop over segments and heads, the
Pallas kernels against the reference (interpret mode on CPU; compiled, at LongNet-like
sizes and bitwise repeatable, on a GPU), and the (seq, 1) pair against full attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jax.experimental import pallas as pl
from conftest import rel_err
from jattn.reference import dilated_attention_reference, dilated_pair_reference



def _inputs(batch, seq, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (batch, seq, heads, head_dim), jnp.float32)
  return q, k, v, do


def _loop_pair(q, k, v, w, r, causal):
  """One pair by its definition: per batch, head and segment, the positions ≡ h mod r."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, seq, heads, d = q.shape
  group = heads // k.shape[2]
  o, lse = np.zeros(q.shape), np.full((batch, heads, seq), -np.inf)
  for b, h, start in itertools.product(range(batch), range(heads), range(0, seq, w)):
    rows = list(range(start + h % r, min(start + w, seq), r))
    if not rows:
      continue
    logits = q[b, rows, h] @ k[b, rows, h // group].T / np.sqrt(d)
    if causal:
      logits = np.where(np.tril(np.ones_like(logits)) > 0, logits, -np.inf)
    top = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - top)
    o[b, rows, h] = e / e.sum(axis=1, keepdims=True) @ v[b, rows, h // group]
    lse[b, h, rows] = (top + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
  return o, lse


@pytest.mark.parametrize("w,r,causal", [(8, 2, False), (12, 4, True), (64, 8, False),
                                        (5, 5, True)])
def test_reference_pair_is_the_definition(w, r, causal):
  q, k, v, _ = _inputs(2, 37, 4, 2, 8)  # 37: a partial last segment; w=64 > seq
  o, lse = jax.jit(lambda q, k, v: dilated_pair_reference(q, k, v, w, r, causal=causal))(q, k, v)
  o_loop, lse_loop = _loop_pair(q, k, v, w, r, causal)
  np.testing.assert_allclose(o, o_loop, atol=2e-6)
  covered = np.isfinite(lse_loop)
  np.testing.assert_allclose(np.asarray(lse)[covered], lse_loop[covered], atol=2e-5)


def test_mixing_follows_the_pairs_log_sum_exp():
  q, k, v, _ = _inputs(1, 24, 2, 2, 8, seed=1)
  pairs = [(8, 1), (24, 2)]
  o, lse = jax.jit(lambda q, k, v: dilated_attention_reference(
      q, k, v, segment_lengths=[8, 24], dilation_rates=[1, 2]))(q, k, v)
  outs, lses = zip(*(_loop_pair(q, k, v, w, r, False) for w, r in pairs))
  lses = np.stack(lses)
  weights = np.exp(lses - np.logaddexp.reduce(lses, axis=0))  # [pairs, b, h, s]
  expected = np.einsum("pbhs,pbshd->bshd", weights, np.stack(outs))
  np.testing.assert_allclose(o, expected, atol=2e-6)
  np.testing.assert_allclose(lse, np.logaddexp.reduce(lses, axis=0), atol=2e-5)


@pytest.mark.parametrize("backend,causal,w", [("xla", False, 40), ("pallas_triton", True, 40),
                                              ("pallas_triton", False, 2 ** 31),
                                              ("xla", True, 10 ** 12)])
def test_one_full_segment_is_flash_attention(backend, causal, w):
  """Also a segment far past the sequence, under x64: 2^31 keys wrapped in the kernels'
  int32 (zeros out), and the reference padded to 10^12 rows (the process aborted)."""
  q, k, v, _ = _inputs(2, 40, 4, 2, 16, seed=2)
  with jax.enable_x64(w > 2 ** 30):
    o = jax.jit(lambda q, k, v: jattn.dilated_attention(
        q, k, v, segment_lengths=[w], dilation_rates=[1], causal=causal,
        backend=backend))(q, k, v)
  np.testing.assert_allclose(o, jattn.flash_attention(q, k, v, causal=causal, backend="xla"),
                             atol=3e-6)


def test_mixing_weights_get_gradients():
  """The gradient differs from one that treats the mixing weights as constants."""
  q, k, v, _ = _inputs(1, 16, 2, 2, 8, seed=6)
  kw = dict(segment_lengths=[4, 16], dilation_rates=[1, 2])

  def detached(q):
    outs, lses = zip(*(dilated_pair_reference(q, k, v, w, r) for w, r in [(4, 1), (16, 2)]))
    weights = jax.nn.softmax(jax.lax.stop_gradient(jnp.stack(lses)), axis=0)
    return jnp.einsum("pbhs,pbshd->bshd", weights, jnp.stack(outs)).sum()

  exact = jax.jit(jax.grad(lambda q: dilated_attention_reference(q, k, v, **kw)[0].sum()))(q)
  assert rel_err(jax.jit(jax.grad(detached))(q), exact) > 1e-3


def check_against_reference(shape, pairs, causal, dtype, tol, config=None, repeat=False,
                            backend="pallas_triton"):
  """The kernels' output and gradients against the float32 reference (and, with
  ``repeat``, the gradients bitwise equal on a second run)."""
  q, k, v, do = _inputs(*shape, dtype=dtype, seed=shape[1])
  kwargs = dict(segment_lengths=[w for w, _ in pairs], dilation_rates=[r for _, r in pairs],
                causal=causal)
  o, pull = jax.vjp(jax.jit(lambda q, k, v: jattn.dilated_attention(
      q, k, v, backend=backend, config=config, **kwargs)), q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  o_ref, pull_ref = jax.vjp(jax.jit(lambda *a: dilated_attention_reference(*a, **kwargs)[0]),
                            *f32)
  assert o.dtype == dtype and rel_err(o, o_ref) < tol
  grads = pull(do.astype(dtype))
  for name, g, g_ref in zip("qkv", grads, pull_ref(do)):
    assert np.isfinite(np.asarray(g, np.float32)).all() and rel_err(g, g_ref) < 2 * tol, name
  if repeat:
    for a, b in zip(grads, pull(do.astype(dtype))):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  return o


# Small, unequal tiles: several per segment, so both the masked edge tiles and the
# unmasked interior ones run, in all three kernels.
TILES = jattn.BlockConfig(block_q=16, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32,
                          block_k_dkv=16)


@pytest.mark.parametrize("shape,pairs,causal", [  # (batch, seq, heads, kv_heads, head_dim)
    ((2, 37, 4, 2, 16), ((8, 2), (16, 4)), False),   # GQA, partial segments, no r=1
    ((1, 64, 4, 4, 32), ((16, 1), (64, 2)), True),
    ((1, 50, 2, 1, 24), ((12, 4), (50, 1)), True),   # MQA, head dim padded to 32
    ((1, 120, 2, 2, 16), ((40, 1), (120, 2)), False),  # segments of several tiles
])
def test_kernels_match_reference(shape, pairs, causal):
  check_against_reference(shape, pairs, causal, jnp.float32, 1e-5 if shape[1] < 100 else 2e-5,
                          config=TILES)


def test_bf16_kernels_and_uncovered_positions():
  """Without a rate-1 pair some positions are nobody's for some heads: zeros."""
  o = check_against_reference((1, 32, 2, 2, 16), ((8, 2), (32, 4)), False, jnp.bfloat16, 2e-2)
  # head 1 with rates 2 and 4 covers odd positions only
  assert np.all(np.asarray(o[0, 0::2, 1], np.float32) == 0)


# Each shape in one dtype and each dtype once: the GPU suite is compile-bound.
@pytest.mark.gpu
@pytest.mark.parametrize("shape,pairs,causal,dtype,tol", [
    ((2, 4096, 8, 8, 64), ((512, 1), (1024, 2), (2048, 4), (4096, 8)), False, jnp.bfloat16, 3e-2),
    ((1, 3000, 8, 2, 128), ((256, 1), (1024, 4), (4096, 8)), True, jnp.float16, 4e-3),
    ((1, 1000, 4, 1, 80), ((96, 2), (384, 6)), False, jnp.float32, 2e-5),
], ids=["longnet-mha-bf16", "gqa-partial-causal-fp16", "mqa-d80-uncovered-fp32"])
def test_kernels_at_gpu_sizes(shape, pairs, causal, dtype, tol):
  check_against_reference(shape, pairs, causal, dtype, tol, repeat=dtype == jnp.bfloat16)


# The Hopper kernels, forward and backward (on the GPU only; their host code on the CPU
# below): LongNet's pairs, each segment whole and a multiple of the tiles; the last
# shape's second segment is past the sequence (taken as the whole sequence).
@pytest.mark.gpu
@pytest.mark.parametrize("shape,pairs,causal,dtype,tol", [
    ((2, 4096, 8, 8, 64), ((512, 1), (1024, 2), (2048, 4), (4096, 8)), False, jnp.bfloat16, 3e-2),
    ((1, 4096, 8, 2, 128), ((1024, 1), (2048, 2), (4096, 4)), True, jnp.float16, 4e-3),
    ((1, 4096, 4, 1, 80), ((1024, 2), (16384, 8)), False, jnp.bfloat16, 3e-2),
], ids=["longnet-mha-bf16", "gqa-causal-fp16", "mqa-d80-rate-over-heads-segment-past-seq-bf16"])
def test_hopper_kernels_at_gpu_sizes(shape, pairs, causal, dtype, tol):
  if jax.devices()[0].platform != "gpu" or jax.devices()[0].compute_capability != "9.0":
    pytest.skip("needs a Hopper GPU")
  check_against_reference(shape, pairs, causal, dtype, tol, repeat=dtype == jnp.bfloat16,
                          backend="pallas_mosaic")


def _dilated_rows(x, w: int, r: int, heads: int):
  """``x [batch, seq, heads or kv_heads, d]`` at each query head's dilated rows: ``[batch *
  seq / w, w / r, heads, d]``, row ``m`` of segment ``s`` for head ``h`` being position
  ``s * w + m * r + h % r`` (of KV head ``h // group``)."""
  batch, seq, x_heads, _ = x.shape
  s, m, h = np.meshgrid(np.arange(seq // w), np.arange(w // r), np.arange(heads), indexing="ij")
  rows = np.asarray(x)[:, s * w + m * r + h % r, h // (heads // x_heads)]
  return rows.reshape(batch * (seq // w), w // r, heads, x.shape[-1])


@pytest.mark.parametrize("heads,kv_heads,w,r", [(4, 2, 16, 2), (8, 2, 32, 4), (2, 1, 32, 2),
                                                (2, 2, 8, 1)])
def test_hopper_items_and_addressing_read_each_heads_dilated_rows(heads, kv_heads, w, r):
  """The Hopper forward's reads of one pair (``DilatedTiles`` for Q and the output,
  ``DilatedKV`` for K and V), made by an interpret-mode kernel through the same calls:
  query head ``h`` reads the positions ``≡ h (mod r)`` of each segment, of its own KV
  head, and writes them compactly."""
  from jattn.kernels.dilated.mosaic import pair_views
  from jattn.kernels.hopper.addressing import DilatedKV
  from jattn.kernels.hopper.work import DilatedTiles
  batch, seq, d, block = 2, 32, 8, 4
  q, k, _, _ = _inputs(batch, seq, heads, kv_heads, d, seed=w + r)
  segments, rows = batch * seq // w, w // r
  items = DilatedTiles(rows // (2 * block), heads, segments, block, 2, tiles_fastest=False,
                       heavy_first=True, rate=r)
  addressing = DilatedKV(r, kv_heads, heads // kv_heads)

  def kernel(q_ref, k_ref, o_ref, k_out_ref):
    bound = items.bind()
    for i in range(items.count):
      item = bound.at(jnp.int32(i))
      for consumer in range(items.consumers):
        q_start = bound.q_start(item, consumer)
        o_ref[bound.out_rows(item, q_start)] = q_ref[bound.q_rows(item, q_start)]
    for seg, head, j in itertools.product(range(segments), range(heads), range(rows // block)):
      k_out_ref[seg, pl.ds(j * block, block), head] = addressing.tile(
          k_ref, jnp.int32(seg), jnp.int32(head), jnp.int32(j * block), block)[...]

  out = jax.ShapeDtypeStruct((segments, rows, heads, d), q.dtype)
  o_shape = items.out_shapes(segments, rows, r * heads, d, q.dtype)[0]
  assert o_shape == out
  o, k_rows = pl.pallas_call(kernel, out_shape=(out, out), interpret=True)(
      pair_views(q, w, r), pair_views(k, w, r))
  np.testing.assert_array_equal(o, _dilated_rows(q, w, r, heads))
  np.testing.assert_array_equal(k_rows, _dilated_rows(k, w, r, heads))


def _emulated_rows_forward(q, k, v, inputs=(), *, rule, spec, block_q, block_kv, stages,
                           persistent=None, items=None, addressing=None, group=None):
  """``hopper.forward.rows_forward``'s contract in an interpret-mode kernel: the same
  work-item, addressing and ``group`` calls, plain attention per consumer's rows."""
  del inputs, stages, persistent
  batch, q_len_p, q_heads, _ = q.shape
  n_kv = addressing.kv_len(k) // block_kv
  assert q_len_p % (2 * block_q) == 0 and n_kv * block_kv == k.shape[1]

  def kernel(q_ref, k_ref, v_ref, o_ref, stat_ref):
    bound = items.bind()
    for w in range(items.count):
      item = bound.at(jnp.int32(w))
      kv_head = item.head // group
      for consumer in range(items.consumers):
        q_start = bound.q_start(item, consumer)
        rows = q_ref[bound.q_rows(item, q_start)].astype(jnp.float32)
        keys, values = (jnp.concatenate([tile(ref, item.batch, kv_head, jnp.int32(j * block_kv),
                                                   block_kv)[...] for j in range(n_kv)])
                        for tile, ref in ((addressing.tile, k_ref), (addressing.v_tile, v_ref)))
        s = rows @ keys.astype(jnp.float32).T * rule.scale
        if spec.right is not None:  # causal within the segment
          s = jnp.where(jnp.arange(s.shape[1])[None] <= q_start + jnp.arange(block_q)[:, None],
                        s, -jnp.inf)
        top = s.max(axis=1, keepdims=True)
        e = jnp.exp(s - top)
        total = e.sum(axis=1, keepdims=True)
        o_ref[bound.out_rows(item, q_start)] = (e @ values.astype(jnp.float32)
                                                / total).astype(o_ref.dtype)
        stat_ref[bound.stat_rows(item, q_start)] = (top + jnp.log(total))[:, 0]

  out_shapes = items.out_shapes(batch, q_len_p, q_heads, v.shape[-1], q.dtype)
  return pl.pallas_call(kernel, out_shape=out_shapes, interpret=True)(q, k, v)


@pytest.mark.parametrize("kv_heads,causal,persistent,pairs", [
    (1, True, None, ((128, 1), (256, 2), (512, 4))),
    (2, False, True, ((256, 2), (512, 4))),  # no rate 1: uncovered positions
    (4, True, False, ((512, 4), (128, 1)))])
def test_hopper_forward_host_code_with_an_emulated_kernel(monkeypatch, kv_heads, causal,
                                                          persistent, pairs):
  """``dilated_mosaic_forward`` (padding, views, work items, addressing, spread, mix) with
  the Hopper kernel replaced by an emulation of its contract equals the reference."""
  from jattn.kernels.dilated import mosaic
  monkeypatch.setattr(mosaic, "rows_forward", _emulated_rows_forward)
  q, k, v, _ = _inputs(1, 512, 4, kv_heads, 40, dtype=jnp.bfloat16, seed=kv_heads)
  config = jattn.MosaicBlockConfig(block_q=64, block_kv=64, persistent=persistent)
  o, lse = mosaic.dilated_mosaic_forward(q, k, v, pairs=pairs, causal=causal,
                                         scale=40 ** -0.5, config=config)
  o_ref, lse_ref = dilated_attention_reference(
      *(x.astype(jnp.float32) for x in (q, k, v)), segment_lengths=[w for w, _ in pairs],
      dilation_rates=[r for _, r in pairs], causal=causal)
  assert rel_err(o, o_ref) < 1e-2
  np.testing.assert_allclose(lse, lse_ref, atol=1e-4)


def _emulated_mosaic_backward(q, k, v, do, lse2, delta, dq_inputs=(), dkv_inputs=(), *, spec,
                              scale, blocks, stages, fused_dq=False, softcap=None,
                              positions=None, layout):
  """``flash.mosaic_bwd.mosaic_backward``'s contract in an interpret-mode kernel: each
  kernel head's rows read through the same layout calls (Q and dO by
  ``layout.q_layout``, K and V by ``layout.kv_addressing`` with ``layout.group``),
  plain gradients of one block of a merged softmax written per kernel head."""
  del dq_inputs, dkv_inputs, stages, softcap, positions
  assert not fused_dq
  segments, rows, _, d = q.shape
  bq_dq, bkv_dq, bq_dkv, bkv_dkv = blocks  # the kernels' grids cover whole CTAs only
  assert rows % (2 * bq_dq) == 0 and rows % bkv_dq == 0, blocks
  assert rows % bq_dkv == 0 and rows % (2 * bkv_dkv) == 0, blocks
  heads = layout.q_layout.n_heads(q)
  group = layout.group_of(heads, k)

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref):
    dk, dv = {}, {}
    for h in range(heads):
      at = layout.q_layout.head(jnp.int32(h))
      qh, doh = (ref[:, :, at].astype(jnp.float32) for ref in (q_ref, do_ref))
      kh, vh = (jnp.stack([tile(ref, b, jnp.int32(h // group), jnp.int32(0), rows)[...]
                           for b in range(segments)]).astype(jnp.float32)
                for tile, ref in ((layout.kv_addressing.tile, k_ref),
                                  (layout.kv_addressing.v_tile, v_ref)))
      s = jnp.einsum("bqd,bkd->bqk", qh, kh) * scale
      if spec.right is not None:
        s = jnp.where(jnp.arange(rows)[None, None] <= jnp.arange(rows)[None, :, None], s,
                      -jnp.inf)
      p = jnp.exp2(s * 1.4426950408889634 - lse_ref[:, h][..., None])
      ds = p * (jnp.einsum("bqd,bkd->bqk", doh, vh) - delta_ref[:, h][..., None])
      dq_ref[:, :, h] = (jnp.einsum("bqk,bkd->bqd", ds, kh) * scale).astype(dq_ref.dtype)
      dk[h // group] = dk.get(h // group, 0.0) + jnp.einsum("bqk,bqd->bkd", ds, qh) * scale
      dv[h // group] = dv.get(h // group, 0.0) + jnp.einsum("bqk,bqd->bkd", p, doh)
    for j in dk:
      dk_ref[:, :, j] = dk[j].astype(dk_ref.dtype)
      dv_ref[:, :, j] = dv[j].astype(dv_ref.dtype)

  out = lambda n: jax.ShapeDtypeStruct((segments, rows, n, d), q.dtype)
  return pl.pallas_call(kernel, out_shape=(out(heads), out(heads // group), out(heads // group)),
                        interpret=True)(q, k, v, do, lse2, delta)


@pytest.mark.parametrize("kv_heads,causal,pairs,backward_tiles", [
    (1, True, ((128, 1), (256, 2), (512, 4)), {}),
    (2, False, ((256, 2), (512, 4)), {}),  # no rate 1: uncovered positions
    (4, True, ((256, 2), (512, 2)), dict(block_q_dq=128, block_kv_dkv=128))])
def test_hopper_backward_host_code_with_an_emulated_kernel(monkeypatch, kv_heads, causal, pairs,
                                                          backward_tiles):
  """``dilated_mosaic_backward`` (padding, in-place views, layout, row statistics,
  spread, sums over the KV groups; backward tiles that do not divide a pair's 128 rows
  replaced by 64-row ones) with the Hopper kernels replaced by an emulation of their
  contract gives the reference's gradients."""
  from jattn.kernels.dilated import mosaic
  monkeypatch.setattr(mosaic, "mosaic_backward", _emulated_mosaic_backward)
  q, k, v, do = _inputs(1, 512, 4, kv_heads, 40, seed=kv_heads)
  kw = dict(segment_lengths=[w for w, _ in pairs], dilation_rates=[r for _, r in pairs],
            causal=causal)
  (o, lse), pull = jax.vjp(jax.jit(lambda q, k, v: dilated_attention_reference(q, k, v, **kw)),
                           q, k, v)
  grads = mosaic.dilated_mosaic_backward(
      q, k, v, o, lse, do, pairs=pairs, causal=causal, scale=40 ** -0.5,
      config=jattn.MosaicBlockConfig(block_q=64, block_kv=64, **backward_tiles))
  for name, g, g_ref in zip("qkv", grads, pull((do, jnp.zeros_like(lse)))):
    assert rel_err(g, g_ref) < 1e-4, name


def test_hopper_pairs_spread_and_mix_as_the_reference():
  """The Hopper path's compact per-pair results, spread back to their positions
  (``spread_pair``), are the reference's pair results, and mixed (``mix_pairs``) the
  reference's mixture, with positions no pair covers (no rate-1 pair)."""
  from jattn.kernels.dilated.mosaic import mix_pairs, spread_pair
  batch, seq, heads = 2, 32, 4
  q, k, v, _ = _inputs(batch, seq, heads, 2, 8, seed=3)
  pairs = ((8, 2), (16, 4), (32, 2))
  parts = []
  for w, r in pairs:
    o_full, lse_full = dilated_pair_reference(q, k, v, w, r, causal=True)
    lse_rows = _dilated_rows(jnp.moveaxis(lse_full, 1, 2)[..., None], w, r, heads)[..., 0]
    o, lse = spread_pair(jnp.asarray(_dilated_rows(o_full, w, r, heads)),
                         jnp.moveaxis(jnp.asarray(lse_rows), 2, 1), batch=batch, r=r)
    np.testing.assert_array_equal(o, o_full)
    np.testing.assert_array_equal(lse, lse_full)
    parts.append((o, lse))
  o, lse = mix_pairs(parts)
  o_ref, lse_ref = dilated_attention_reference(q, k, v, segment_lengths=[w for w, _ in pairs],
                                               dilation_rates=[r for _, r in pairs], causal=True)
  np.testing.assert_allclose(o, o_ref, atol=1e-6)
  assert not np.asarray(o[:, 0::2, 1]).any()  # head 1 (rates 2 and 4): odd positions only
  covered = np.asarray(lse_ref) > -1e29
  np.testing.assert_allclose(np.asarray(lse)[covered], np.asarray(lse_ref)[covered], atol=1e-5)


@pytest.mark.parametrize("backend,kv_heads,causal", [("xla", 2, True), ("xla", 4, False),
                                                    ("pallas_triton", 1, True)])
def test_flash_pairs_backward_gives_the_reference_gradients(backend, kv_heads, causal):
  """The Hopper path's backward (each pair as a flash block on its gathered rows, given
  the mixture's ``(o, lse)``; here on the XLA and Triton flash backends) equals the
  reference's gradients, uncovered positions included (no rate-1 pair)."""
  from jattn.dilated import DilatedProblem, flash_pairs_backward
  q, k, v, do = _inputs(2, 64, 4, kv_heads, 16, seed=kv_heads)
  kw = dict(segment_lengths=[16, 64], dilation_rates=[2, 4], causal=causal)
  p = DilatedProblem(batch=2, seq=64, heads=4, kv_heads=kv_heads, head_dim=16,
                     dtype=jnp.float32, scale=0.25, **kw)
  (o, lse), pull = jax.vjp(jax.jit(lambda q, k, v: dilated_attention_reference(q, k, v, **kw)),
                           q, k, v)
  grads = jax.jit(lambda q, k, v, o, lse, do: flash_pairs_backward(
      p, ((q, k, v), o, lse), do, backend))(q, k, v, o, lse, do)
  for name, g, g_ref in zip("qkv", grads, pull((do, jnp.zeros_like(lse)))):
    assert rel_err(g, g_ref) < 1e-5, name


def test_hopper_forward_takes_whole_tile_aligned_segments_only():
  from jattn.dilated import DilatedProblem, MosaicDilated
  gaps = MosaicDilated().gaps(DilatedProblem(seq=3000, heads=8, head_dim=128,
                                             dtype=jnp.bfloat16, segment_lengths=(1024, 4096),
                                             dilation_rates=(1, 2)))
  assert gaps == ("segment length 1024 not dividing the sequence length 3000",
                  "segment length 4096 not dividing the sequence length 3000")
  gaps = MosaicDilated().gaps(DilatedProblem(seq=4096, heads=8, head_dim=64, dtype=jnp.float32,
                                             segment_lengths=(512, 4096), dilation_rates=(4, 2)))
  assert gaps == ("float32 inputs", "w / r = 128 rows per segment not a multiple of 256")


def test_errors_particular_to_the_pairs():
  q, k, v, _ = _inputs(1, 16, 4, 2, 8)
  call = lambda *a, **kw: jattn.dilated_attention(*a, **{**dict(
      segment_lengths=[8], dilation_rates=[2]), **kw})
  with pytest.raises(ValueError, match="multiple of the dilation rate"):
    call(q, k, v, segment_lengths=[6], dilation_rates=[4])
  with pytest.raises(ValueError, match="same length"):
    call(q, k, v, segment_lengths=[8, 16], dilation_rates=[2])
  with pytest.raises(TypeError, match="segment_lengths must be a sequence of ints"):
    call(q, k, v, segment_lengths=8, dilation_rates=2)
  with pytest.raises(ValueError, match=r"positive integers .* got \(w=True, r=2\)"):
    call(q, k, v, segment_lengths=[True])
  with pytest.raises(TypeError, match="segment_lengths must be Python ints, not traced"):
    jax.jit(lambda w: call(q, k, v, segment_lengths=[w]))(8)
  with pytest.raises(ValueError, match=r"q's heads \(4\) must be a multiple of k's heads \(3\)"):
    three = jnp.concatenate([k, k[:, :, :1]], axis=2)
    call(q, three, three)
