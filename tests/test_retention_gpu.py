"""The retention kernels compiled for a real GPU, against the float32 references."""

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn.reference import retention_recurrent_reference, retention_reference

pytestmark = pytest.mark.gpu

DTYPES = [(jnp.float32, 2e-5), (jnp.float16, 4e-3), (jnp.bfloat16, 3e-2)]


def _inputs(batch, q_len, kv_len, heads, dk, dv, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (batch, q_len, heads, dk), dtype)
  k = jax.random.normal(ks[1], (batch, kv_len, heads, dk), dtype)
  v = jax.random.normal(ks[2], (batch, kv_len, heads, dv), dtype)
  do = jax.random.normal(ks[3], (batch, q_len, heads, dv), jnp.float32)
  state = jax.random.normal(ks[4], (batch, heads, dk, dv), jnp.float32)
  dstate = jax.random.normal(ks[5], (batch, heads, dk, dv), jnp.float32)
  decay = jnp.linspace(0.5, 0.999, heads, dtype=jnp.float32)
  return q, k, v, do, state, dstate, decay


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape,normalize", [
    ((2, 300, 300, 4, 64, 64), None),
    ((1, 700, 1000, 2, 128, 128), None),
    ((2, 333, 333, 2, 96, 40), "abs_sum"),
    ((1, 257, 257, 2, 256, 256), None),
], ids=["s300-d64", "q700-kv1000-d128", "d96-dv40-abs_sum", "d256"])
def test_parallel_kernel(shape, normalize, dtype, tol):
  b, sq, sk, h, dk, dv = shape
  q, k, v, do, *_, decay = _inputs(b, sq, sk, h, dk, dv, dtype)
  kw = dict(decay=decay, normalize=normalize)
  o, pull = jax.vjp(jax.jit(lambda q, k, v: jattn.retention(
      q, k, v, mode="parallel", backend="pallas_triton", **kw)), q, k, v)
  o_ref, pull_ref = jax.vjp(lambda q, k, v: retention_reference(q, k, v, **kw), q, k, v)
  assert o.dtype == dtype and _rel(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do.astype(dtype)), pull_ref(do)):
    assert _rel(g, g_ref) < 2 * tol, name


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape,chunk", [
    ((2, 333, 333, 4, 128, 128), 64),
    ((1, 200, 300, 2, 64, 96), 32),
    ((1, 1000, 1000, 2, 256, 64), 128),
], ids=["s333-c64", "q200-kv300-c32", "d256-c128"])
def test_chunkwise_kernel_with_states(shape, chunk, dtype, tol):
  b, sq, sk, h, dk, dv = shape
  q, k, v, do, state, dstate, decay = _inputs(b, sq, sk, h, dk, dv, dtype)

  def ours(q, k, v, state):
    return jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=chunk,
                           initial_state=state, return_state=True, backend="pallas_triton")

  def ref(q, k, v, state):
    return retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)

  (o, s), pull = jax.vjp(jax.jit(ours), q, k, v, state)
  (o_ref, s_ref), pull_ref = jax.vjp(jax.jit(ref), q, k, v, state)
  assert o.dtype == dtype and _rel(o, o_ref) < tol and _rel(s, s_ref) < tol
  grads = pull((do.astype(dtype), dstate))
  for name, g, g_ref in zip(["q", "k", "v", "initial_state"], grads, pull_ref((do, dstate))):
    assert _rel(g, g_ref) < 2 * tol, name


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_step_kernel(dtype, tol):
  q, k, v, _, state, _, decay = _inputs(3, 5, 5, 4, 128, 96, dtype)
  o_ref, s_ref = retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)
  step = jax.jit(lambda q, k, v, s: jattn.retention_step(q, k, v, s, decay=decay,
                                                         backend="pallas_triton"))
  for t in range(q.shape[1]):
    o, state = step(q[:, t], k[:, t], v[:, t], state)
    assert o.dtype == dtype and _rel(o, o_ref[:, t]) < tol
  assert _rel(state, s_ref) < tol


def test_auto_runs_chunkwise_kernels_for_long_sequences():
  q, k, v, *_ = _inputs(1, 4096, 4096, 2, 64, 64, jnp.bfloat16)
  o = jax.jit(lambda q, k, v: jattn.retention(q, k, v))(q, k, v)
  o_ref = jattn.retention(q, k, v, mode="chunkwise", backend="xla")
  assert _rel(o, o_ref) < 3e-2
