"""jattn.dilated_attention: the reference against a loop over segments and heads, the
Pallas kernels (interpret mode) against the reference, forward and gradients, and
the (seq, 1) pair against full attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn.reference import dilated_attention_reference, dilated_pair_reference
from pallas_kernels.flash import FlashBlockConfig


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim), dtype)
  do = jax.random.normal(ks[3], (batch, seq, heads, head_dim), jnp.float32)
  return q, k, v, do


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


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


@pytest.mark.parametrize("w,r,causal", [(8, 2, False), (12, 4, True), (16, 1, True),
                                        (64, 8, False), (5, 5, True)])
def test_reference_pair_is_the_definition(w, r, causal):
  q, k, v, _ = _inputs(2, 37, 4, 2, 8)  # 37: a partial last segment; w=64 > seq
  o, lse = dilated_pair_reference(q, k, v, w, r, causal=causal)
  o_loop, lse_loop = _loop_pair(q, k, v, w, r, causal)
  np.testing.assert_allclose(o, o_loop, atol=2e-6)
  covered = np.isfinite(lse_loop)
  np.testing.assert_allclose(np.asarray(lse)[covered], lse_loop[covered], atol=2e-5)
  assert np.all(np.asarray(lse)[~covered] == jattn.EMPTY_ROW_LSE)


def test_mixing_follows_the_pairs_log_sum_exp():
  q, k, v, _ = _inputs(1, 24, 2, 2, 8, seed=1)
  pairs = [(8, 1), (24, 2)]
  o, lse = dilated_attention_reference(q, k, v, segment_lengths=[8, 24], dilation_rates=[1, 2])
  outs, lses = zip(*(_loop_pair(q, k, v, w, r, False) for w, r in pairs))
  lses = np.stack(lses)
  weights = np.exp(lses - np.logaddexp.reduce(lses, axis=0))  # [pairs, b, h, s]
  expected = np.einsum("pbhs,pbshd->bshd", weights, np.stack(outs))
  np.testing.assert_allclose(o, expected, atol=2e-6)
  np.testing.assert_allclose(lse, np.logaddexp.reduce(lses, axis=0), atol=2e-5)


@pytest.mark.parametrize("backend,causal", [("xla", False), ("pallas_triton", True)])
def test_one_full_segment_is_flash_attention(backend, causal):
  q, k, v, _ = _inputs(2, 40, 4, 2, 16, seed=2)
  o = jattn.dilated_attention(q, k, v, segment_lengths=[40], dilation_rates=[1],
                              causal=causal, backend=backend)
  np.testing.assert_allclose(o, jattn.flash_attention(q, k, v, causal=causal, backend="xla"),
                             atol=3e-6)


CASES = [  # (batch, seq, heads, kv_heads, head_dim), pairs, causal
    ((2, 37, 4, 2, 16), ((8, 2), (16, 4)), False),   # GQA, partial segments, no r=1
    ((1, 64, 4, 4, 32), ((16, 1), (64, 2)), True),
    ((1, 50, 2, 1, 24), ((12, 4), (50, 1)), True),   # MQA, head dim padded to 32
    ((1, 120, 2, 2, 16), ((40, 1), (120, 2)), False),  # segments of several tiles
]
# Small, unequal tiles: several per segment, so both the masked edge tiles and the
# unmasked interior ones run, in all three kernels.
TILES = FlashBlockConfig(block_q=16, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32,
                         block_k_dkv=16)


@pytest.mark.parametrize("shape,pairs,causal", CASES)
def test_kernels_match_reference(shape, pairs, causal):
  q, k, v, do = _inputs(*shape, seed=shape[1])
  kwargs = dict(segment_lengths=[w for w, _ in pairs], dilation_rates=[r for _, r in pairs],
                causal=causal)
  ours = lambda q, k, v: jattn.dilated_attention(q, k, v, backend="pallas_triton",
                                                 config=TILES, **kwargs)
  ref = lambda q, k, v: dilated_attention_reference(q, k, v, **kwargs)[0]
  o, pull = jax.vjp(jax.jit(ours), q, k, v)
  o_ref, pull_ref = jax.vjp(jax.jit(ref), q, k, v)
  assert _rel(o, o_ref) < 1e-5
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert _rel(g, g_ref) < 1e-5, name


def test_bf16_kernels_and_uncovered_positions():
  """Without a rate-1 pair some positions are nobody's for some heads: zeros, finite
  gradients."""
  q, k, v, do = _inputs(1, 32, 2, 2, 16, dtype=jnp.bfloat16, seed=5)
  kwargs = dict(segment_lengths=[8, 32], dilation_rates=[2, 4])
  fn = lambda q, k, v: jattn.dilated_attention(q, k, v, backend="pallas_triton", **kwargs)
  o, pull = jax.vjp(fn, q, k, v)
  grads = pull(do.astype(jnp.bfloat16))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  o_ref, pull_ref = jax.vjp(lambda *a: dilated_attention_reference(*a, **kwargs)[0], *f32)
  assert o.dtype == jnp.bfloat16 and _rel(o, o_ref) < 2e-2
  for g, g_ref in zip(grads, pull_ref(do)):
    assert np.all(np.isfinite(np.asarray(g, np.float32))) and _rel(g, g_ref) < 3e-2
  # head 1 with rates 2 and 4 covers odd positions only
  assert np.all(np.asarray(o[0, 0::2, 1], np.float32) == 0)


def test_mixing_weights_get_gradients():
  """The gradient differs from one that treats the mixing weights as constants."""
  q, k, v, _ = _inputs(1, 16, 2, 2, 8, seed=6)
  kw = dict(segment_lengths=[4, 16], dilation_rates=[1, 2])

  def detached(q):
    outs, lses = zip(*(dilated_pair_reference(q, k, v, w, r) for w, r in [(4, 1), (16, 2)]))
    weights = jax.nn.softmax(jax.lax.stop_gradient(jnp.stack(lses)), axis=0)
    return jnp.einsum("pbhs,pbshd->bshd", weights, jnp.stack(outs)).sum()

  exact = jax.grad(lambda q: dilated_attention_reference(q, k, v, **kw)[0].sum())(q)
  assert _rel(jax.grad(detached)(q), exact) > 1e-3


def test_errors_name_the_argument():
  q, k, v, _ = _inputs(1, 16, 4, 2, 8)
  call = lambda *a, **kw: jattn.dilated_attention(*a, **{**dict(
      segment_lengths=[8], dilation_rates=[2]), **kw})
  with pytest.raises(ValueError, match="q must have rank 4"):
    call(q[0], k, v)
  with pytest.raises(ValueError, match="multiple of the dilation rate"):
    call(q, k, v, segment_lengths=[6], dilation_rates=[4])
  with pytest.raises(ValueError, match="same length"):
    call(q, k, v, segment_lengths=[8, 16], dilation_rates=[2])
  with pytest.raises(ValueError, match="multiple of k/v's 3 heads"):
    three = jnp.concatenate([k, k[:, :, :1]], axis=2)
    call(q, three, three)
  with pytest.raises(TypeError, match="dtype int32"):
    call(q.astype(jnp.int32), k, v)
  with pytest.raises(ValueError, match="backend must be one of"):
    call(q, k, v, backend="cuda")
