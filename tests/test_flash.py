"""Flash attention (Pallas kernels in interpret mode on CPU) against the dense reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jattn
from jattn.reference import flash_attention_reference

# Small tiles so that the short CI sequences still span several blocks and every
# loop phase (masked / unmasked / masked) of the kernels runs.
SMALL = jattn.FlashBlockConfig(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32,
                               block_q_dq=32, block_k_dq=16)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def make_inputs(key, b, sq, sk, hq, hk, d, dtype):
  kq, kk, kv, kdo = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, sq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, sk, hk, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, sk, hk, d), jnp.float32).astype(dtype)
  do = jax.random.normal(kdo, (b, sq, hq, d), jnp.float32).astype(dtype)
  return q, k, v, do


def packed_segments(key, batch, length, n_segments=3):
  """Sorted segment ids (packed sequences) ``[batch, length]``."""
  return jnp.sort(jax.random.randint(key, (batch, length), 0, n_segments), axis=1)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check_against_reference(q, k, v, do, dtype, config=SMALL, **kwargs):
  """Forward output, lse, and dq/dk/dv (with an lse cotangent too) vs the fp32 reference."""

  def ours(q, k, v):
    return jattn.flash_attention(q, k, v, backend="pallas_triton", return_lse=True,
                                 config=config, **kwargs)

  def ref(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return flash_attention_reference(f32(q), f32(k), f32(v), **kwargs)

  (o, lse), pull = jax.vjp(ours, q, k, v)
  (o_ref, lse_ref), pull_ref = jax.vjp(ref, q, k, v)
  chex.assert_shape(o, q.shape)
  chex.assert_shape(lse, (q.shape[0], q.shape[2], q.shape[1]))
  assert o.dtype == q.dtype
  assert np.isfinite(np.asarray(o, np.float32)).all()
  assert np.isfinite(np.asarray(lse)).all()
  tol = TOL[dtype]
  assert rel_err(o, o_ref) < tol, rel_err(o, o_ref)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=tol, atol=tol * 10)
  dlse = jax.random.normal(jax.random.PRNGKey(7), lse.shape, jnp.float32)
  dlse = jnp.where(lse_ref > -1e29, dlse, 0.0)
  grads = pull((do, dlse))
  grads_ref = pull_ref((do.astype(jnp.float32), dlse))
  for name, g, g_ref in zip("qkv", grads, grads_ref):
    assert g.dtype == q.dtype, name
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert rel_err(g, g_ref) < 2 * tol, (name, rel_err(g, g_ref))
  return o, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(causal, dtype):
  q, k, v, do = make_inputs(jax.random.PRNGKey(0), 2, 40, 40, 4, 4, 32, dtype)
  check_against_reference(q, k, v, do, dtype, causal=causal)


@pytest.mark.parametrize("hq,hk", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_grouped_query_heads(hq, hk):
  q, k, v, do = make_inputs(jax.random.PRNGKey(1), 1, 37, 37, hq, hk, 16, jnp.float32)
  check_against_reference(q, k, v, do, jnp.float32, causal=True)


@pytest.mark.parametrize("head_dim", [30, 64, 96, 128])
def test_head_dims(head_dim):
  q, k, v, do = make_inputs(jax.random.PRNGKey(2), 1, 33, 33, 2, 1, head_dim, jnp.float32)
  check_against_reference(q, k, v, do, jnp.float32, causal=head_dim % 64 == 0)


@pytest.mark.parametrize("sq,sk", [(20, 53), (53, 20), (1, 45), (17, 17)])
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_lengths(sq, sk, causal):
  q, k, v, do = make_inputs(jax.random.PRNGKey(3), 1, sq, sk, 2, 2, 16, jnp.float32)
  o, lse = check_against_reference(q, k, v, do, jnp.float32, causal=causal)
  if causal and sq > sk:
    # Bottom-right alignment: the first sq - sk queries see no key at all.
    assert np.all(np.asarray(o[:, : sq - sk]) == 0.0)
    assert np.all(np.asarray(lse[:, :, : sq - sk]) == jattn.EMPTY_ROW_LSE)


def test_segment_ids_with_empty_rows():
  b, s = 2, 45
  q, k, v, do = make_inputs(jax.random.PRNGKey(4), b, s, s, 2, 1, 16, jnp.float32)
  q_seg = packed_segments(jax.random.PRNGKey(5), b, s)
  kv_seg = packed_segments(jax.random.PRNGKey(6), b, s)
  # Segment 9 exists only among the queries: those rows see nothing.
  q_seg = q_seg.at[:, -5:].set(9)
  o, lse = check_against_reference(q, k, v, do, jnp.float32, causal=True,
                                   q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  assert np.all(np.asarray(o[:, -5:]) == 0.0)
  assert np.all(np.asarray(lse[:, :, -5:]) == jattn.EMPTY_ROW_LSE)


def test_segment_ids_bf16():
  b, s = 1, 50
  q, k, v, do = make_inputs(jax.random.PRNGKey(8), b, s, s, 2, 2, 32, jnp.bfloat16)
  seg = packed_segments(jax.random.PRNGKey(9), b, s, 4)
  check_against_reference(q, k, v, do, jnp.bfloat16, q_segment_ids=seg, kv_segment_ids=seg)


@pytest.mark.parametrize("window,causal", [((7, 3), False), ((10, None), True), ((None, 5), False),
                                           ((0, 0), False)])
def test_local_window(window, causal):
  q, k, v, do = make_inputs(jax.random.PRNGKey(10), 1, 48, 61, 2, 2, 16, jnp.float32)
  check_against_reference(q, k, v, do, jnp.float32, causal=causal, local_window=window)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal):
  q, k, v, do = make_inputs(jax.random.PRNGKey(11), 1, 40, 40, 2, 2, 32, jnp.float32)
  q = q * 3.0  # Large logits so the cap matters.
  check_against_reference(q, k, v, do, jnp.float32, causal=causal, softcap=2.0, scale=0.3)


def test_default_config_and_single_block():
  q, k, v, do = make_inputs(jax.random.PRNGKey(12), 1, 24, 24, 2, 2, 16, jnp.bfloat16)
  check_against_reference(q, k, v, do, jnp.bfloat16, config=None, causal=True)


def test_backward_is_bitwise_deterministic():
  q, k, v, do = make_inputs(jax.random.PRNGKey(13), 1, 40, 40, 4, 2, 16, jnp.bfloat16)

  @jax.jit
  def grads(q, k, v):
    f = lambda q, k, v: jattn.flash_attention(q, k, v, causal=True, config=SMALL,
                                              backend="pallas_triton")
    return jax.vjp(f, q, k, v)[1](do)

  first, second = grads(q, k, v), grads(q, k, v)
  for a, b in zip(first, second):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_composes_with_jit_grad_vmap_checkpoint():
  q, k, v, _ = make_inputs(jax.random.PRNGKey(14), 2, 24, 24, 2, 1, 16, jnp.float32)

  def loss(q, k, v, backend):
    f = jax.checkpoint(lambda q, k, v: jattn.flash_attention(
        q, k, v, causal=True, config=SMALL, backend=backend))
    return jnp.sum(jax.vmap(f)(q, k, v) ** 2)  # vmap over an extra leading axis

  stack = lambda x: jnp.stack([x, 2 * x])
  args = tuple(stack(x) for x in (q, k, v))
  ours = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(*args, "pallas_triton")
  ref = jax.grad(loss, argnums=(0, 1, 2))(*args, "xla")
  chex.assert_trees_all_close(ours, ref, atol=1e-4, rtol=1e-4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), group=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([8, 20, 32]), causal=st.booleans(), seed=st.integers(0, 99))
def test_random_shapes(sq, sk, group, head_dim, causal, seed):
  q, k, v, do = make_inputs(jax.random.PRNGKey(seed), 1, sq, sk, 2 * group, 2, head_dim,
                            jnp.float32)
  check_against_reference(q, k, v, do, jnp.float32, causal=causal)


def test_auto_backend_and_xla_agree():
  q, k, v, _ = make_inputs(jax.random.PRNGKey(15), 1, 20, 20, 2, 2, 16, jnp.float32)
  auto = jattn.flash_attention(q, k, v, causal=True)
  xla = jattn.flash_attention(q, k, v, causal=True, backend="xla")
  chex.assert_trees_all_close(auto, xla, atol=1e-5, rtol=1e-5)
