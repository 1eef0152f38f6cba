"""jattn.window_attention: the Pallas kernels against the float32 reference, forward
and gradients for q, k, v and the bias, with and without masks (interpret mode on
CPU; compiled, at DAT's sizes and bitwise repeatable, on a GPU)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jattn
from jattn.reference import window_attention_reference



def _inputs(windows=4, tokens=20, heads=2, head_dim=30, mask_windows=None, dtype=jnp.float32,
            seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q, k, v = (jax.random.normal(key, (windows, tokens, heads, head_dim), jnp.float32).astype(dtype)
             for key in ks[:3])
  bias = jax.random.normal(ks[3], (heads, tokens, tokens), jnp.float32)
  mask = None
  if mask_windows:  # Swin-style: 0 where a pair shares a region, -100 elsewhere
    region = jax.random.randint(ks[4], (mask_windows, tokens), 0, 3)
    mask = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
  do = jax.random.normal(ks[5], q.shape, jnp.float32)
  return q, k, v, bias, mask, do


def _rel(a, b):
  """Error relative to the reference's norm, floored at an RMS of 0.1 (a tenth of the
  inputs' scale): a softmax that a mask leaves with one key has exactly zero dq, dk."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 0.1 * b.size ** 0.5)


def check_against_reference(q, k, v, bias, mask, do, tol, repeat=False, **kw):
  """Output and the four gradients against the float32 reference (and, with ``repeat``,
  the gradients bitwise equal on a second run)."""
  ours = jax.jit(lambda *a: jattn.window_attention(*a, mask=mask, backend="pallas_triton", **kw))
  ref = jax.jit(lambda *a: window_attention_reference(*a, mask=mask, scale=kw.get("scale")))
  o, pull = jax.vjp(ours, q, k, v, bias)
  grads = pull(do.astype(q.dtype))
  o_ref, pull_ref = jax.vjp(ref, q.astype(jnp.float32), k.astype(jnp.float32),
                            v.astype(jnp.float32), bias)
  assert o.dtype == q.dtype and o.shape == q.shape
  assert _rel(o, o_ref) < tol
  for name, g, g_ref in zip(["q", "k", "v", "bias"], grads, pull_ref(do)):
    assert g.shape == g_ref.shape and bool(jnp.all(jnp.isfinite(g))), name
    assert _rel(g, g_ref) < 2 * tol, name
  if repeat:
    again = pull(do.astype(q.dtype))
    for a, b in zip(grads, again):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_reference_matches_an_explicit_loop():
  q, k, v, bias, mask, _ = _inputs(windows=4, tokens=5, heads=2, head_dim=4, mask_windows=2)
  o = window_attention_reference(q, k, v, bias, mask=mask, scale=0.7)
  qn, kn, vn, bn, mn = (np.asarray(x, np.float64) for x in (q, k, v, bias, mask))
  expected = np.zeros(o.shape)
  for w in range(4):
    for h in range(2):
      logits = 0.7 * qn[w, :, h] @ kn[w, :, h].T + bn[h] + mn[w % 2]
      p = np.exp(logits - logits.max(-1, keepdims=True))
      expected[w, :, h] = (p / p.sum(-1, keepdims=True)) @ vn[w, :, h]
  np.testing.assert_allclose(o, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,dtype,tol", [
    (dict(windows=4, tokens=20, heads=2, head_dim=30, mask_windows=None), jnp.float32, 1e-5),
    (dict(windows=6, tokens=16, heads=3, head_dim=16, mask_windows=3), jnp.float32, 1e-5),
    (dict(windows=6, tokens=16, heads=3, head_dim=16, mask_windows=3), jnp.bfloat16, 2e-2),
    (dict(windows=2, tokens=49, heads=1, head_dim=8, mask_windows=2), jnp.float32, 1e-5),  # 7x7
], ids=["plain-d30", "mask3-of-6", "mask3-of-6-bf16", "t49-mask"])
def test_kernel_matches_reference(case, dtype, tol):
  check_against_reference(*_inputs(dtype=dtype, **case), tol)


def test_kernel_with_many_tiles_and_a_scale():
  # 128 tokens (DAT's 8x16 windows) in 32-token tiles: every kernel walks several tiles.
  tiles = jattn.BlockConfig(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                            block_q_dq=32, block_k_dq=32)
  check_against_reference(*_inputs(windows=2, tokens=128, heads=1, head_dim=30, mask_windows=2),
                          1e-5, scale=0.3, config=tiles)


@settings(max_examples=3, deadline=None)
@given(windows=st.sampled_from([1, 2, 4]), tokens=st.integers(2, 40), heads=st.integers(1, 2),
       head_dim=st.sampled_from([4, 17, 32]), mask_windows=st.sampled_from([None, 1, 2]))
def test_kernel_matches_reference_on_random_shapes(windows, tokens, heads, head_dim,
                                                   mask_windows):
  if mask_windows and windows % mask_windows:
    mask_windows = 1
  check_against_reference(*_inputs(windows, tokens, heads, head_dim, mask_windows,
                                   seed=windows * 100 + tokens), 1e-5)


def test_boolean_and_additive_masks_agree():
  q, k, v, bias, _, _ = _inputs(windows=4, tokens=10, heads=1, head_dim=8)
  allowed = jax.random.uniform(jax.random.PRNGKey(9), (2, 10, 10)) < 0.7
  allowed = allowed.at[:, :, 0].set(True)
  additive = jnp.where(allowed, 0.0, -jnp.inf)
  run = jax.jit(lambda mask: jattn.window_attention(q, k, v, bias, mask=mask,
                                                    backend="pallas_triton"))
  chex.assert_trees_all_close(run(allowed), run(additive), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
def test_rows_of_large_bias_keep_their_gradients(backend):
  """Bias rows of ``-1e9`` (a padding row) or near ``+5e3``: as the reference on the bias
  less each row's maximum (the same softmax, without float32's rounding of the large
  values), the bias's gradient included. Unshifted, the kernels' float32 lse lost its
  log(sum) there, and their gradients were off by up to ``tokens``-fold."""
  q, k, v, bias, _, do = _inputs(windows=2, tokens=8, heads=2, head_dim=8)
  bias = bias.at[0, 3].add(-1e9).at[1, 5].add(5e3)
  exact = bias - bias.max(axis=-1, keepdims=True)
  ours = jax.vjp(jax.jit(lambda *a: jattn.window_attention(*a, backend=backend)), q, k, v, bias)
  ref = jax.vjp(jax.jit(window_attention_reference), q, k, v, exact)
  assert _rel(ours[0], ref[0]) < 1e-5
  for g, g_ref in zip(ours[1](do), ref[1](do)):
    assert _rel(g, g_ref) < 1e-5


@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
def test_large_bias_at_a_key_a_mask_hides(backend):
  """A bias's large value at a key that a boolean mask hides from a row (in one of two
  windows) is no shift for that row: each row had been shifted by its bias row's
  maximum, and in the window that hides the key the row lost its other values to it."""
  q, k, v, bias, _, do = _inputs(windows=2, tokens=8, heads=2, head_dim=8)
  bias = bias.at[:, 3, 5].set(1e9)
  allowed = jnp.ones((2, 8, 8), bool).at[0, 3, 5].set(False)
  ours = jax.vjp(jax.jit(lambda *a: jattn.window_attention(*a, mask=allowed, backend=backend)),
                 q, k, v, bias)
  ref = jax.vjp(jax.jit(lambda *a: window_attention_reference(*a, mask=allowed)), q, k, v, bias)
  assert _rel(ours[0], ref[0]) < 1e-5
  for g, g_ref in zip(ours[1](do), ref[1](do)):
    assert _rel(g, g_ref) < 1e-5


@pytest.mark.parametrize("masked", [-1e9, float(np.finfo(np.float32).min)])
def test_huge_negative_mask_values_mask(masked):
  """Torch-style masks (-1e9, the dtype's lowest): a row masked everywhere gives zeros
  on both backends, and the kernels' gradients follow their forward (a finite -1e9 row
  had lse = -1e9 in float32, without the log of its weights' sum)."""
  q, k, v, bias, _, do = _inputs(windows=2, tokens=6, heads=1, head_dim=8)
  allowed = jax.random.uniform(jax.random.PRNGKey(3), (1, 6, 6)) < 0.6
  allowed = allowed.at[:, 0, :].set(False).at[:, 1:, 1].set(True)  # row 0: no key
  mask = jnp.where(allowed, 0.0, masked)
  check_against_reference(q, k, v, bias, mask, do, 1e-5)
  for backend in ("pallas_triton", "xla"):
    o = jattn.window_attention(q, k, v, bias, mask=mask, backend=backend)
    assert not np.asarray(o[:, 0]).any() and np.asarray(o[:, 1:]).all()


@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
def test_the_mask_gets_no_gradient(backend):
  q, k, v, bias, mask, _ = _inputs(windows=2, tokens=8, heads=1, head_dim=8, mask_windows=2)
  g = jax.jit(jax.grad(lambda m: jattn.window_attention(q, k, v, bias, mask=m,
                                                        backend=backend).sum()))(mask)
  np.testing.assert_array_equal(g, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.float16, 4e-3),
                                       (jnp.bfloat16, 3e-2)], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", [
    (64, 256, 3, 30, 16),   # DAT-2, 8x32 windows
    (32, 128, 2, 60, 8),    # 8x16 windows, wider heads
    (12, 49, 4, 32, 4),     # 7x7 windows: padded tokens
], ids=["dat-8x32", "8x16-d60", "7x7"])
def test_kernels_at_gpu_sizes(shape, dtype, tol):
  windows, tokens, heads, head_dim, mask_windows = shape
  check_against_reference(*_inputs(windows, tokens, heads, head_dim, mask_windows, dtype), tol,
                          repeat=dtype == jnp.bfloat16)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bias=jnp.ones((3, 4, 5))), ValueError, r"bias must be \[heads, tokens, tokens\]"),
    (dict(bias=jnp.ones((3, 4, 4), jnp.int32)), TypeError, "bias has dtype int32"),
    (dict(mask=jnp.ones((4, 4))), ValueError, r"mask must be \[mask_windows, tokens, tokens\]"),
    (dict(mask=jnp.ones((2, 4, 4), jnp.int32)), TypeError, "mask has dtype int32"),
    (dict(mask=jnp.ones((3, 4, 4))), ValueError, "mask has 3 windows, which must divide the 2"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
])
def test_bad_inputs(kwargs, error, match):
  args = dict(q=jnp.ones((2, 4, 3, 8)), k=jnp.ones((2, 4, 3, 8)), v=jnp.ones((2, 4, 3, 8)),
              bias=jnp.ones((3, 4, 4)))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jattn.window_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("bias"), **args)
