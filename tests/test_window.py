"""jattn.window_attention: the Pallas kernels (interpret mode) against the float32
reference, forward and gradients for q, k, v and the bias, with and without masks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jattn
from jattn.reference import window_attention_reference
from pallas_kernels.flash import FlashBlockConfig


def _inputs(windows=4, tokens=20, heads=2, head_dim=30, mask_windows=None, dtype=jnp.float32,
            seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q, k, v = (jax.random.normal(key, (windows, tokens, heads, head_dim), dtype) for key in ks[:3])
  bias = jax.random.normal(ks[3], (heads, tokens, tokens), jnp.float32)
  mask = None
  if mask_windows:  # Swin-style: 0 where a pair shares a region, -100 elsewhere
    mask = jnp.where(jax.random.uniform(ks[4], (mask_windows, tokens, tokens)) < 0.4, -100.0, 0.0)
  do = jax.random.normal(ks[5], q.shape, jnp.float32)
  return q, k, v, bias, mask, do


def _rel(a, b):
  """Error relative to the reference's norm, floored at an RMS of 0.1 (a tenth of the
  inputs' scale): a softmax that a mask leaves with one key has exactly zero dq, dk."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b)) / max(float(jnp.linalg.norm(b)), 0.1 * b.size ** 0.5)


def _check_against_reference(q, k, v, bias, mask, do, tol, **kw):
  def ours(q, k, v, bias):
    return jattn.window_attention(q, k, v, bias, mask=mask, backend="pallas_triton", **kw)

  def ref(q, k, v, bias):
    scale = kw.get("scale")
    return window_attention_reference(q, k, v, bias, mask=mask, scale=scale)

  o, pull = jax.vjp(ours, q, k, v, bias)
  o_ref, pull_ref = jax.vjp(ref, q.astype(jnp.float32), k.astype(jnp.float32),
                           v.astype(jnp.float32), bias)
  assert o.dtype == q.dtype and o.shape == q.shape
  assert _rel(o, o_ref) < tol
  grads = pull(do.astype(q.dtype))
  for name, g, g_ref in zip(["q", "k", "v", "bias"], grads, pull_ref(do)):
    assert g.shape == g_ref.shape and bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, g_ref) < 2 * tol, name


def test_reference_matches_an_explicit_loop():
  q, k, v, bias, mask, _ = _inputs(windows=3, tokens=5, heads=2, head_dim=4, mask_windows=2)
  o = window_attention_reference(q, k, v, bias, mask=mask, scale=0.7)
  qn, kn, vn, bn, mn = (np.asarray(x, np.float64) for x in (q, k, v, bias, mask))
  expected = np.zeros(o.shape)
  for w in range(3):
    for h in range(2):
      logits = 0.7 * qn[w, :, h] @ kn[w, :, h].T + bn[h] + mn[w % 2]
      p = np.exp(logits - logits.max(-1, keepdims=True))
      expected[w, :, h] = (p / p.sum(-1, keepdims=True)) @ vn[w, :, h]
  np.testing.assert_allclose(o, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [
    dict(windows=4, tokens=20, heads=2, head_dim=30, mask_windows=None),
    dict(windows=6, tokens=16, heads=3, head_dim=16, mask_windows=4),  # 6 % 4: uneven reuse
    dict(windows=2, tokens=49, heads=1, head_dim=8, mask_windows=2),   # 7x7 windows
], ids=["plain-d30", "mask4-of-6", "t49-mask"])
def test_kernel_matches_reference(case, dtype, tol, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, mask, do = _inputs(dtype=dtype, **case)
  _check_against_reference(q, k, v, bias, mask, do, tol)


def test_kernel_with_many_tiles_and_a_scale(monkeypatch):
  # 128 tokens (DAT's 8x16 windows) in 32-token tiles: every kernel walks several tiles.
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, mask, do = _inputs(windows=2, tokens=128, heads=1, head_dim=30, mask_windows=2)
  tiles = FlashBlockConfig(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                           block_q_dq=32, block_k_dq=32)
  _check_against_reference(q, k, v, bias, mask, do, 1e-5, scale=0.3, config=tiles)


@settings(max_examples=4, deadline=None)
@given(windows=st.integers(1, 5), tokens=st.integers(2, 40), heads=st.integers(1, 2),
       head_dim=st.sampled_from([4, 17, 32]), mask_windows=st.sampled_from([None, 1, 2]))
def test_kernel_matches_reference_on_random_shapes(windows, tokens, heads, head_dim,
                                                   mask_windows):
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("JATTN_INTERPRET", "1")
    q, k, v, bias, mask, do = _inputs(windows, tokens, heads, head_dim, mask_windows,
                                      seed=windows * 100 + tokens)
    _check_against_reference(q, k, v, bias, mask, do, 1e-5)


def test_one_token_windows(monkeypatch):
  # Softmax over a single key is 1: o = v, and q, k and the bias get no gradient.
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, _, do = _inputs(windows=3, tokens=1, heads=2, head_dim=5)
  o, pull = jax.vjp(lambda q, k, v, b: jattn.window_attention(q, k, v, b, backend="pallas_triton"),
                    q, k, v, bias)
  chex.assert_trees_all_close(o, v, atol=1e-6)
  dq, dk, dv, dbias = pull(do)
  chex.assert_trees_all_close((dq, dk, dbias), (jnp.zeros_like(q), jnp.zeros_like(k),
                                                jnp.zeros_like(bias)), atol=1e-5)
  chex.assert_trees_all_close(dv, do, atol=1e-6)


@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
def test_rows_that_see_no_key_give_zeros(backend, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, _, do = _inputs(windows=2, tokens=12, heads=2, head_dim=8)
  allowed = jnp.ones((2, 12, 12), bool).at[1, 3].set(False)  # row 3 of odd windows sees nothing

  def f(q, k, v, bias):
    return jattn.window_attention(q, k, v, bias, mask=allowed, backend=backend)

  o, pull = jax.vjp(f, q, k, v, bias)
  np.testing.assert_array_equal(o[1::2, 3], 0.0)
  assert float(jnp.abs(o[0::2, 3]).max()) > 0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in pull(do))


def test_boolean_and_additive_masks_agree(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, _, _ = _inputs(windows=4, tokens=10, heads=1, head_dim=8)
  allowed = jax.random.uniform(jax.random.PRNGKey(9), (2, 10, 10)) < 0.7
  allowed = allowed.at[:, :, 0].set(True)
  additive = jnp.where(allowed, 0.0, -jnp.inf)
  a = jattn.window_attention(q, k, v, bias, mask=allowed, backend="pallas_triton")
  b = jattn.window_attention(q, k, v, bias, mask=additive, backend="pallas_triton")
  chex.assert_trees_all_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_mask_gets_no_gradient(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, mask, _ = _inputs(windows=2, tokens=8, heads=1, head_dim=8, mask_windows=2)
  for backend in ("pallas_triton", "xla"):
    g = jax.grad(lambda m: jattn.window_attention(q, k, v, bias, mask=m,
                                                  backend=backend).sum())(mask)
    np.testing.assert_array_equal(g, 0.0)


def test_auto_uses_the_kernel_under_interpret_and_jit(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, bias, mask, _ = _inputs(windows=2, tokens=16, heads=2, head_dim=16, mask_windows=1)
  o = jax.jit(lambda q, k, v, b: jattn.window_attention(q, k, v, b, mask=mask))(q, k, v, bias)
  chex.assert_trees_all_close(o, window_attention_reference(q, k, v, bias, mask=mask),
                              atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=jnp.ones((2, 4, 3))), ValueError, "q must have rank 4"),
    (dict(k=jnp.ones((2, 4, 3, 9))), ValueError, "k and v must have q's shape"),
    (dict(v=jnp.ones((2, 4, 3, 8), jnp.bfloat16)), TypeError, "q, k, v must share a dtype"),
    (dict(q=jnp.ones((2, 4, 3, 8), jnp.int32)), TypeError, "q has dtype int32"),
    (dict(bias=jnp.ones((3, 4, 5))), ValueError, r"bias must be \[heads, tokens, tokens\]"),
    (dict(bias=jnp.ones((3, 4, 4), jnp.int32)), TypeError, "bias has dtype int32"),
    (dict(mask=jnp.ones((4, 4))), ValueError, r"mask must be \[mask_windows, tokens, tokens\]"),
    (dict(mask=jnp.ones((2, 4, 4), jnp.int32)), TypeError, "mask has dtype int32"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
])
def test_bad_inputs(kwargs, error, match):
  args = dict(q=jnp.ones((2, 4, 3, 8)), k=jnp.ones((2, 4, 3, 8)), v=jnp.ones((2, 4, 3, 8)),
              bias=jnp.ones((3, 4, 4)))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jattn.window_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("bias"), **args)
