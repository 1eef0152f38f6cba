"""The dilated attention kernels compiled for a real GPU, against the float32 reference,
forward and gradients; the backward is deterministic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.reference import dilated_attention_reference

pytestmark = pytest.mark.gpu

DTYPES = [(jnp.float32, 2e-5), (jnp.float16, 4e-3), (jnp.bfloat16, 3e-2)]


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim), dtype)
  k, v = (jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype) for kk in ks[1:3])
  return q, k, v, jax.random.normal(ks[3], q.shape, jnp.float32)


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", [
    dict(shape=(2, 4096, 8, 8, 64), pairs=[(512, 1), (1024, 2), (2048, 4), (4096, 8)], causal=False),
    dict(shape=(1, 3000, 8, 2, 128), pairs=[(256, 1), (1024, 4), (4096, 8)], causal=True),
    dict(shape=(1, 1000, 4, 1, 80), pairs=[(96, 2), (384, 6)], causal=False),
], ids=["longnet-mha", "gqa-partial-causal", "mqa-d80-uncovered"])
def test_kernels(case, dtype, tol):
  batch, seq, heads, kv_heads, head_dim = case["shape"]
  ws, rs = zip(*case["pairs"])
  q, k, v, do = _inputs(batch, seq, heads, kv_heads, head_dim, dtype)
  fn = jax.jit(lambda q, k, v: jattn.dilated_attention(
      q, k, v, segment_lengths=ws, dilation_rates=rs, causal=case["causal"],
      backend="pallas_triton"))
  o, pull = jax.vjp(fn, q, k, v)
  # Jitted: eagerly, every op of the reference would compile on its own.
  o_ref, pull_ref = jax.vjp(jax.jit(lambda q, k, v: dilated_attention_reference(
      q, k, v, segment_lengths=ws, dilation_rates=rs, causal=case["causal"])[0]),
      *(x.astype(jnp.float32) for x in (q, k, v)))
  assert o.dtype == dtype and _rel(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do.astype(dtype)), pull_ref(do)):
    assert _rel(g, g_ref) < 2 * tol, name


def test_backward_is_deterministic():
  q, k, v, do = _inputs(1, 8192, 8, 4, 128, jnp.bfloat16, seed=1)
  grads = jax.jit(lambda *a: jax.vjp(lambda q, k, v: jattn.dilated_attention(
      q, k, v, segment_lengths=(2048, 8192), dilation_rates=(1, 4), causal=True,
      backend="pallas_triton"), *a)[1](do.astype(jnp.bfloat16)))
  first, second = grads(q, k, v), grads(q, k, v)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
