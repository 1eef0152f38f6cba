"""The window attention kernels compiled for a real GPU, against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.reference import window_attention_reference

pytestmark = pytest.mark.gpu

DTYPES = [(jnp.float32, 2e-5), (jnp.float16, 4e-3), (jnp.bfloat16, 3e-2)]


def _inputs(windows, tokens, heads, head_dim, mask_windows, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q, k, v = (jax.random.normal(key, (windows, tokens, heads, head_dim), dtype) for key in ks[:3])
  bias = jax.random.normal(ks[3], (heads, tokens, tokens), jnp.float32)
  region = jax.random.randint(ks[4], (mask_windows, tokens), 0, 4)
  mask = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
  do = jax.random.normal(ks[5], q.shape, jnp.float32)
  return q, k, v, bias, mask, do


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [
    (64, 256, 3, 30, 16),   # DAT-2, 8x32 windows
    (32, 128, 2, 60, 8),    # 8x16 windows, wider heads
    (10, 49, 4, 32, 4),     # 7x7 windows: padded tokens, 10 % 4 mask reuse
], ids=["dat-8x32", "8x16-d60", "7x7"])
def test_kernels(shape, dtype, tol):
  windows, tokens, heads, head_dim, mask_windows = shape
  q, k, v, bias, mask, do = _inputs(windows, tokens, heads, head_dim, mask_windows, dtype)
  fn = jax.jit(lambda q, k, v, b: jattn.window_attention(q, k, v, b, mask=mask,
                                                         backend="pallas_triton"))
  o, pull = jax.vjp(fn, q, k, v, bias)
  o_ref, pull_ref = jax.vjp(lambda q, k, v, b: window_attention_reference(
      q, k, v, b, mask=mask), *(x.astype(jnp.float32) for x in (q, k, v)), bias)
  assert o.dtype == dtype and _rel(o, o_ref) < tol
  for name, g, g_ref in zip(["q", "k", "v", "bias"], pull(do.astype(dtype)), pull_ref(do)):
    assert _rel(g, g_ref) < 2 * tol, name


def test_backward_is_deterministic():
  q, k, v, bias, mask, do = _inputs(64, 256, 3, 30, 16, jnp.bfloat16)
  grads = jax.jit(lambda *a: jax.vjp(lambda q, k, v, b: jattn.window_attention(
      q, k, v, b, mask=mask, backend="pallas_triton"), *a)[1](do.astype(jnp.bfloat16)))
  first, second = grads(q, k, v, bias), grads(q, k, v, bias)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
