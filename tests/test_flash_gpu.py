"""The Triton-lowered kernels compiled for a real GPU, against the fp32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.reference import flash_attention_reference

pytestmark = pytest.mark.gpu

CASES = [
    dict(shape=(2, 256, 4, 4, 128)),
    dict(shape=(2, 256, 4, 4, 128), causal=True),
    dict(shape=(1, 300, 8, 2, 64), causal=True),
    dict(shape=(2, 200, 4, 1, 30)),
    dict(shape=(1, 257, 4, 2, 96), local_window=(40, 17)),
    dict(shape=(1, 128, 2, 2, 256), causal=True),
    dict(shape=(2, 192, 4, 2, 64), softcap=5.0, causal=True),
    dict(shape=(2, 160, 4, 4, 64), segments=True),
    dict(shape=(1, 160, 4, 4, 64), kv_len=333, causal=True),
    dict(shape=(1, 333, 4, 4, 64), kv_len=100, causal=True),
]


def _case_inputs(case, dtype, seed=0):
  b, s, hq, hk, d = case["shape"]
  kv_len = case.get("kv_len", s)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(keys[0], (b, s, hq, d), dtype)
  k = jax.random.normal(keys[1], (b, kv_len, hk, d), dtype)
  v = jax.random.normal(keys[2], (b, kv_len, hk, d), dtype)
  do = jax.random.normal(keys[3], (b, s, hq, d), dtype)
  kwargs = {n: case[n] for n in ("causal", "local_window", "softcap") if n in case}
  if case.get("segments"):
    seg = jnp.sort(jax.random.randint(keys[4], (b, s), 0, 4), axis=1)
    kwargs.update(q_segment_ids=seg, kv_segment_ids=seg)
  return q, k, v, do, kwargs


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 1e-2), (jnp.bfloat16, 2e-2), (jnp.float32, 1e-4)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_kernel_matches_reference_on_gpu(case, dtype, tol):
  q, k, v, do, kwargs = _case_inputs(case, dtype)

  def ours(q, k, v):
    return jattn.flash_attention(q, k, v, backend="pallas_triton", return_lse=True, **kwargs)

  def ref(q, k, v):
    return flash_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), **kwargs)

  (o, lse), pull = jax.vjp(jax.jit(ours), q, k, v)
  (o_ref, lse_ref), pull_ref = jax.vjp(ref, q, k, v)
  assert not np.isnan(np.asarray(o, np.float32)).any()
  assert _rel_err(o, o_ref) < tol
  live = np.asarray(lse_ref) > -1e29
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(lse_ref)[live], atol=5e-2 if dtype != jnp.float32 else 1e-4)
  grads = pull((do, jnp.zeros_like(lse)))
  grads_ref = pull_ref((do.astype(jnp.float32), jnp.zeros_like(lse_ref)))
  for name, g, gr in zip("qkv", grads, grads_ref):
    assert _rel_err(g, gr) < 2 * tol, name


def test_backward_is_bitwise_deterministic_on_gpu():
  q, k, v, do, kwargs = _case_inputs(dict(shape=(2, 512, 8, 2, 64), causal=True), jnp.bfloat16)
  f = jax.jit(lambda q, k, v: jax.vjp(lambda *a: jattn.flash_attention(*a, causal=True, backend="pallas_triton"), q, k, v)[1](do))
  a, b = f(q, k, v), f(q, k, v)
  for x, y in zip(a, b):
    assert np.array_equal(np.asarray(x), np.asarray(y))
