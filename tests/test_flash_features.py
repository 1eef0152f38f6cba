"""flash_attention's features beside the mask: a value head dim of its own, attention
sinks and dropout. Sinks against a formula written without them, dropout's mask
statistically and as one mask for the forward and the backward; on the GPU, the kernels
at larger sizes against the float32 reference. (jit, grad, vmap, x64, empty rows and
determinism with all three: tests/test_contract.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from conftest import rel_err
from jattn.kernels.common.dropout import hash_arrays, keep, keep_mask, seed_of
from jattn.kernels.flash.config import default_mosaic_config


def _inputs(seed, batch, sq, sk, hq, hk, d, dv, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  shapes = [(batch, sq, hq, d), (batch, sk, hk, d), (batch, sk, hk, dv), (batch, sq, hq, dv)]
  arrays = [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(ks, shapes)]
  return (*arrays, jax.random.normal(ks[4], (hq,), jnp.float32))


@pytest.mark.kernel
def test_sinks_scale_each_row_by_the_weight_the_sink_leaves():
  """With a sink the output is the sinkless one times ``1 - exp(sink - lse)``, and the
  log-sum-exp is ``logaddexp(lse, sink)``: both from a call without sinks."""
  q, k, v, _, sinks = _inputs(0, 2, 19, 27, 4, 2, 16, 24)
  call = lambda **kw: jattn.flash_attention(q, k, v, causal=True, return_lse=True,
                                            backend="pallas_triton", **kw)
  (o, lse), (o_sink, lse_sink) = call(), call(sinks=sinks)
  expected_lse = jnp.logaddexp(lse, sinks[None, :, None])
  assert rel_err(lse_sink, expected_lse) < 1e-6
  weight = jnp.exp(lse - expected_lse).transpose(0, 2, 1)[..., None]
  assert rel_err(o_sink, o * weight) < 1e-5


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
@pytest.mark.parametrize("floor", [-jnp.inf, -3e38])
def test_a_sink_below_the_empty_row_lse_is_no_sink(backend, floor):
  """Head 0's sink is -inf or below EMPTY_ROW_LSE: its rows equal a call without sinks
  (rows that see no key: zeros, EMPTY_ROW_LSE), never NaN, and its sink gets a zero
  gradient, on every backend alike."""
  q, k, v, do, sinks = _inputs(10, 1, 6, 4, 2, 2, 16, 8)
  sinks = sinks.at[0].set(floor)
  def run(sinks):
    f = lambda q, sinks: jattn.flash_attention(q, k, v, causal=True, sinks=sinks,
                                               return_lse=True, backend=backend)
    (o, lse), pull = jax.vjp(f, q, sinks)
    return o, lse, pull((do, jnp.ones_like(lse)))[1]
  o, lse, dsinks = run(sinks)
  o_plain, lse_plain = jattn.flash_attention(q, k, v, causal=True, return_lse=True,
                                             backend=backend)
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(lse)))
  assert rel_err(o[:, :, 0], o_plain[:, :, 0]) < 1e-6 and rel_err(lse[:, 0], lse_plain[:, 0]) < 1e-6
  assert float(dsinks[0]) == 0.0 and bool(jnp.isfinite(dsinks[1]))


def test_dropout_mask_keeps_the_rate_independently_of_position():
  """The keep-mask: its keep rate, and neighbouring rows, columns, heads and seeds agree
  no more often than independent draws would."""
  rate, n = 0.3, 256
  seed = seed_of(jax.random.PRNGKey(1))
  b, h, i, j = (jnp.arange(m).reshape(s) for m, s in
                ((2, (-1, 1, 1, 1)), (3, (1, -1, 1, 1)), (n, (1, 1, -1, 1)), (n, (1, 1, 1, -1))))
  kept = np.asarray(keep_mask(seed, rate, b, h, i, j))
  sigma = (rate * (1 - rate) / kept.size) ** 0.5
  assert abs(kept.mean() - (1 - rate)) < 5 * sigma
  agree = (1 - rate) ** 2 + rate ** 2  # of two independent draws
  other_seed = np.asarray(keep_mask(seed_of(jax.random.PRNGKey(2)), rate, b, h, i, j))
  for a, c in ((kept[..., 1:], kept[..., :-1]), (kept[:, :, 1:], kept[:, :, :-1]),
               (kept[:, 1:], kept[:, :-1]), (kept[1:], kept[:-1]), (kept, other_seed)):
    assert abs((a == c).mean() - agree) < 10 * sigma


def test_hopper_hash_arrays_give_the_reference_mask():
  """The hashes the Hopper kernels read (computed on the host, a row array per head and
  a col array) select the reference's mask, weight by weight."""
  seed, rate = seed_of(jax.random.PRNGKey(7)), 0.3
  rows, cols = hash_arrays(seed, 2, 3, 40, 24)
  assert rows.shape == (2, 3, 40) and cols.shape == (2, 24) and rows.dtype == jnp.int32
  b, h, i, j = (jnp.arange(m).reshape(s) for m, s in
                ((2, (-1, 1, 1, 1)), (3, (1, -1, 1, 1)), (40, (1, 1, -1, 1)), (24, (1, 1, 1, -1))))
  np.testing.assert_array_equal(keep(rows[..., None], cols[:, None, None], rate),
                                keep_mask(seed, rate, b, h, i, j))


@pytest.mark.kernel
def test_dropout_one_mask_forward_and_backward_and_the_expected_output():
  """The kernels' dropout against the dense reference given the same mask (outputs and
  every gradient: a backward with another mask would differ), the same key bitwise
  alike, another key not; averaged over the rows, values of ones keep their sum 1."""
  q, k, v, do, _ = _inputs(3, 1, 64, 64, 2, 2, 16, 16)
  rate, key = 0.2, jax.random.PRNGKey(4)

  def run(backend, key, v=v):
    f = lambda q, k, v: jattn.flash_attention(q, k, v, dropout_rate=rate, dropout_key=key,
                                              backend=backend)
    return jax.vjp(jax.jit(f), q, k, v)

  (o, pull), (o_ref, pull_ref) = run("pallas_triton", key), run("xla", key)
  assert rel_err(o, o_ref) < 1e-5
  for g, g_ref in zip(pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < 1e-5
  assert (np.asarray(run("pallas_triton", key)[0]) == np.asarray(o)).all()
  assert rel_err(run("pallas_triton", jax.random.PRNGKey(5))[0], o) > 0.1
  no_dropout = jattn.flash_attention(q, k, v, backend="pallas_triton")
  assert rel_err(o, no_dropout) > 0.1
  ones_out = run("pallas_triton", key, jnp.ones_like(v))[0]
  assert abs(float(ones_out.mean()) - 1.0) < 0.02


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=0.1), ValueError, "needs dropout_key"),
    (dict(dropout_rate=1.0, dropout_key=jax.random.PRNGKey(0)), ValueError, r"in \[0, 1\)"),
    (dict(dropout_rate=0.1, dropout_key="seed"), TypeError, "dropout_key must be a jax"),
    (dict(sinks=jnp.zeros(3)), ValueError, r"^sinks must be \[q_heads\] = \[4\], got \(3,\)"),
    (dict(sinks=jnp.zeros(4, jnp.int32)), TypeError, "sinks must be floats"),
])
def test_feature_errors_name_the_argument(kwargs, error, match):
  q, k, v, _, _ = _inputs(6, 1, 8, 8, 4, 2, 16, 8)
  jattn.flash_attention(q, k, v, backend="xla", dropout_rate=np.float32(0.1),
                        dropout_key=jax.random.PRNGKey(0))  # numpy rates are rates
  with pytest.raises(error, match=match):
    jattn.flash_attention(q, k, v, backend="xla", **kwargs)
  with pytest.raises(ValueError, match=r"^v must be \[1, 8, 2, head_dim_v\]|^v must be"):
    jattn.flash_attention(q, k, v[:, :7], backend="xla")


GPU_FEATURE_CASES = [
    pytest.param("pallas_mosaic", dict(shape=(2, 384, 8, 2, 64, 128), causal=True, sinks=True),
                 id="mosaic-dv128-dk64-sinks-gqa-causal"),
    pytest.param("pallas_mosaic", dict(shape=(1, 300, 4, 4, 192, 128), sinks=True),
                 id="mosaic-dk192-dv128-padded"),
    pytest.param("pallas_mosaic", dict(shape=(1, 256, 4, 2, 64, 256), causal=True, sinks=True),
                 id="mosaic-dk64-dv256"),
    pytest.param("pallas_triton", dict(shape=(2, 320, 4, 2, 64, 96), causal=True, sinks=True,
                                       dropout=0.1), id="triton-dv96-sinks-dropout"),
    pytest.param("pallas_mosaic", dict(shape=(2, 384, 8, 2, 128, 128), causal=True, sinks=True,
                                       dropout=0.1), id="mosaic-dropout-sinks-gqa-causal"),
    pytest.param("pallas_mosaic", dict(shape=(2, 300, 4, 4, 64, 128), dropout=0.2,
                                       segments=True), id="mosaic-dropout-segments-padded"),
    pytest.param("pallas_mosaic", dict(shape=(1, 256, 4, 2, 192, 128), causal=True, dropout=0.1),
                 id="mosaic-dropout-dk192"),
    # dk + dv > 256: the dK/dV kernel without a producer warpgroup, under segment ranges,
    # GQA (its first consumer issues the copies of every query head's blocks) and padding
    pytest.param("pallas_mosaic", dict(shape=(2, 330, 8, 2, 192, 128), causal=True,
                                       segments=True), id="mosaic-dk192-segments-gqa-causal"),
    # dk + dv beyond the Hopper backward: the Mosaic forward's mask, the Triton backward's
    pytest.param("pallas_mosaic", dict(shape=(1, 256, 4, 2, 256, 256), causal=True, dropout=0.1),
                 id="mosaic-dropout-d256-triton-backward"),
    pytest.param("pallas_mosaic", dict(shape=(2, 512, 4, 2, 128, 128), causal=True, dropout=0.1,
                                       fused_dq=True), id="mosaic-dropout-fused-dq"),
    # Padded (192, 256) asks more shared memory of the Hopper forward than a CTA has:
    # "auto" runs the Triton kernels (on a Hopper GPU), which must give the same values.
    pytest.param("auto", dict(shape=(1, 256, 4, 2, 160, 256), causal=True, segments=True),
                 id="auto-dk160-dv256-past-the-hopper-shared-memory"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend,case", GPU_FEATURE_CASES)
def test_features_on_the_gpu(backend, case):
  """The kernels with bf16 inputs against the float32 reference on the same values: o,
  lse and the gradients of q, k, v and the sinks."""
  batch, s, hq, hk, d, dv = case["shape"]
  q, k, v, do, sinks = _inputs(8, batch, s, s, hq, hk, d, dv, jnp.bfloat16)
  sinks = sinks if case.get("sinks") else None
  kwargs = dict(causal=case.get("causal", False))
  if case.get("dropout"):
    kwargs.update(dropout_rate=case["dropout"], dropout_key=jax.random.PRNGKey(9))
  if case.get("segments"):  # three packed documents per row
    ids = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) * 3 // s, (batch, s))
    kwargs.update(q_segment_ids=ids, kv_segment_ids=ids)
  config = None
  if case.get("fused_dq"):  # dQ added atomically inside the dK/dV kernel
    config = dataclasses.replace(default_mosaic_config(d), fused_dq=True)
    kwargs.update(deterministic=False)

  def run(backend, *arrays):
    f = lambda q, k, v, sinks: jattn.flash_attention(
        q, k, v, sinks=sinks, return_lse=True, backend=backend,
        config=config if backend == "pallas_mosaic" else None, **kwargs)
    (o, lse), pull = jax.vjp(jax.jit(f), *arrays)
    return o, lse, pull((do.astype(o.dtype), jnp.zeros_like(lse)))

  o, lse, grads = run(backend, q, k, v, sinks)
  o_ref, lse_ref, grads_ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)), sinks)
  assert o.shape == (batch, s, hq, dv)
  assert rel_err(o, o_ref) < 1e-2 and rel_err(lse, lse_ref) < 1e-3
  for g, g_ref in zip(grads, grads_ref):
    if g_ref is not None:  # (no sinks: no sink gradient)
      assert rel_err(g, g_ref) < 2e-2
  if config is not None:  # the fused kernel's vmap rule folds the mapped axis into the batch
    grads_of = jax.jit(lambda q, k, v: run(backend, q, k, v, sinks)[2][:3])
    mapped = jax.jit(jax.vmap(grads_of))(*(jnp.stack([x, x[::-1]]) for x in (q, k, v)))
    for i, arrays in enumerate(((q, k, v), (q[::-1], k[::-1], v[::-1]))):
      for g_map, g in zip(mapped, grads_of(*arrays)):
        assert rel_err(g_map[i], g) < 1e-3
