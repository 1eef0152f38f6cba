"""The Hopper (Pallas Mosaic GPU) kernels on a real H100/H200, against the fp32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.backends import gpu_compute_capability
from jattn.reference import flash_attention_reference
from pallas_kernels.flash import EMPTY_ROW_LSE, MosaicBlockConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    jax.default_backend() != "gpu" or (gpu_compute_capability() or (0, 0))[0] != 9,
    reason="the Mosaic GPU kernels need a Hopper GPU")]

# (batch, q_len, q_heads, kv_heads, head_dim) and features. Lengths that are not
# block multiples, several tiles per CTA range (so consumers skip blocks the
# other one needs), GQA/MQA, windows, q_len != kv_len.
CASES = [
    dict(shape=(2, 512, 4, 4, 128)),
    dict(shape=(2, 512, 4, 4, 128), causal=True),
    dict(shape=(1, 1000, 8, 2, 128), causal=True),
    dict(shape=(2, 300, 4, 1, 64)),
    dict(shape=(1, 777, 4, 2, 64), causal=True),
    dict(shape=(1, 640, 4, 4, 64), local_window=(100, 50)),
    dict(shape=(1, 640, 4, 2, 128), local_window=(130, None)),
    dict(shape=(1, 200, 4, 4, 96), causal=True),
    dict(shape=(1, 256, 2, 2, 256), causal=True),
    dict(shape=(1, 384, 2, 1, 256)),
    dict(shape=(1, 160, 4, 4, 64), kv_len=900, causal=True),
    dict(shape=(1, 700, 4, 4, 64), kv_len=200, causal=True),
    dict(shape=(1, 256, 4, 4, 64), kv_len=1000, local_window=(2, 1)),
    dict(shape=(2, 100, 4, 4, 64), kv_len=50),  # one key block: a one-slot ring
]


def _inputs(case, dtype, seed=0):
  b, s, hq, hk, d = case["shape"]
  kv_len = case.get("kv_len", s)
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, s, hq, d), dtype)
  k = jax.random.normal(keys[1], (b, kv_len, hk, d), dtype)
  v = jax.random.normal(keys[2], (b, kv_len, hk, d), dtype)
  do = jax.random.normal(keys[3], (b, s, hq, d), dtype)
  kwargs = {n: case[n] for n in ("causal", "local_window") if n in case}
  return q, k, v, do, kwargs


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _check(q, k, v, do, kwargs, tol, backend="pallas_mosaic", config=None, dlse_scale=0.0):
  def ours(q, k, v):
    return jattn.flash_attention(q, k, v, backend=backend, return_lse=True, config=config,
                                 **kwargs)

  def ref(q, k, v):
    return flash_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), **kwargs)

  (o, lse), pull = jax.vjp(jax.jit(ours), q, k, v)
  (o_ref, lse_ref), pull_ref = jax.vjp(ref, q, k, v)
  assert not np.isnan(np.asarray(o, np.float32)).any()
  assert _rel_err(o, o_ref) < tol
  live = np.asarray(lse_ref) > -1e29
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(lse_ref)[live], atol=5e-2)
  np.testing.assert_array_equal(np.asarray(lse)[~live], np.float32(EMPTY_ROW_LSE))
  dlse = dlse_scale * jax.random.normal(jax.random.PRNGKey(7), lse.shape, jnp.float32)
  grads = jax.jit(pull)((do, dlse))
  grads_ref = pull_ref((do.astype(jnp.float32), dlse))
  for name, g, gr in zip("qkv", grads, grads_ref):
    assert not np.isnan(np.asarray(g, np.float32)).any(), name
    assert _rel_err(g, gr) < 2 * tol, name


@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 1e-2), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_mosaic_matches_reference(case, dtype, tol):
  _check(*_inputs(case, dtype), tol)


@pytest.mark.parametrize("config", [
    MosaicBlockConfig(block_q=64, block_kv=64, stages=3, block_q_dq=64, block_kv_dq=128,
                      block_q_dkv=128, block_kv_dkv=64, bwd_stages=3),
    MosaicBlockConfig(block_q=128, block_kv=64, stages=2, block_kv_dq=64, bwd_stages=2),
], ids=["small-deep", "wide-q"])
def test_mosaic_other_tiles(config):
  case = dict(shape=(1, 1100, 4, 2, 64), causal=True)
  _check(*_inputs(case, jnp.bfloat16), 2e-2, config=config)


def test_mosaic_lse_cotangent():
  _check(*_inputs(dict(shape=(1, 300, 2, 2, 64), causal=True), jnp.float16), 1e-2, dlse_scale=0.5)


def test_mosaic_backward_is_bitwise_deterministic():
  q, k, v, do, kwargs = _inputs(dict(shape=(2, 1024, 8, 2, 128), causal=True), jnp.bfloat16)
  attend = lambda *a: jattn.flash_attention(*a, causal=True, backend="pallas_mosaic")
  f = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))
  for x, y in zip(f(q, k, v), f(q, k, v)):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def test_auto_picks_mosaic_on_hopper_and_falls_back_where_it_cannot():
  from jattn.gpu import select_backend

  assert select_backend(dtype=jnp.bfloat16, head_dim=128, q_len=4096, kv_len=4096) == "pallas_mosaic"
  # Segment ids are not in the Hopper kernel yet: auto must pick a backend that has them.
  q, k, v, do, _ = _inputs(dict(shape=(1, 256, 4, 4, 64)), jnp.bfloat16)
  seg = jnp.sort(jax.random.randint(jax.random.PRNGKey(3), (1, 256), 0, 3), axis=1)
  kwargs = dict(q_segment_ids=seg, kv_segment_ids=seg, causal=True)
  assert select_backend(dtype=jnp.bfloat16, head_dim=64, q_len=256, kv_len=256,
                        causal=True, segment_ids=True) == "pallas_triton"
  _check(q, k, v, do, kwargs, 2e-2, backend="auto")
  with pytest.raises(ValueError, match="pallas_mosaic.*segment ids"):
    jattn.flash_attention(q, k, v, backend="pallas_mosaic", **kwargs)
