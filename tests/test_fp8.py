"""FP8 quantisation, the Hadamard rotation and the FP8 recipe's float32 reference
(``jattn.fp8``) against the float32 attention of the same values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.fp8 import (E4M3, E4M3_MAX, fp8_attention_reference, hadamard_rotation,
                       quantize_attention_inputs, quantize_fp8)
from jattn.reference import flash_attention_reference


def attention(q, k, v, **options):
  return flash_attention_reference(q, k, v, **options)[0]  # the output, not its lse


def qkv(seed=0, batch=2, q_len=24, kv_len=40, q_heads=4, kv_heads=2, d=32, dv=16, outliers=0.0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (batch, q_len, q_heads, d))
  k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, d))
  v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, dv))
  if outliers:  # a few entries ten times larger, as FlashAttention-3's error study
    q, k, v = (jnp.where(jax.random.bernoulli(jax.random.fold_in(ks[3], i), outliers, x.shape),
                         10 * x, x) for i, x in enumerate((q, k, v)))
  return q, k, v


def test_hadamard_rotation_is_orthonormal_and_checks_its_size():
  for key in (None, jax.random.key(3)):
    r = hadamard_rotation(64, key)
    np.testing.assert_allclose(np.asarray(r @ r.T), np.eye(64), atol=1e-6)
  with pytest.raises(ValueError, match="head_dim must be a power of two"):
    hadamard_rotation(96)


def test_quantize_fp8_scales_each_kv_head_to_the_format_range():
  q = qkv()[0] * jnp.array([1.0, 1.0, 5.0, 5.0])[None, None, :, None]
  q8, descale = quantize_fp8(q, group=2)
  assert q8.dtype == E4M3 and descale.shape == (2,)
  np.testing.assert_allclose(np.asarray(descale) * E4M3_MAX,
                             np.abs(np.asarray(q)).reshape(2, 24, 2, 2, 32).max(axis=(0, 1, 3, 4)),
                             rtol=1e-6)
  back = q8.astype(jnp.float32) * jnp.repeat(descale, 2)[None, None, :, None]
  assert np.abs(np.asarray(back - q)).max() <= 0.07 * np.abs(np.asarray(q)).max()
  q8, descale = quantize_fp8(jnp.zeros((1, 2, 2, 4)), per_head=False)
  assert descale.shape == () and float(descale) == 1.0


@pytest.mark.parametrize("causal, window, segments", [
    (False, None, False), (True, None, False), (True, (7, 0), False), (False, None, True)])
def test_the_reference_is_the_dequantised_attention_without_rounding_the_probabilities(
    causal, window, segments):
  q, k, v = qkv(1)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  deq = lambda x8, s, group=1: x8.astype(jnp.float32) * jnp.repeat(s, group)[None, None, :, None]
  options = dict(causal=causal, local_window=window)
  if segments:  # packed rows; the last queries' segment has no key
    options.update(q_segment_ids=jnp.broadcast_to(jnp.arange(24) // 7, (2, 24)),
                   kv_segment_ids=jnp.broadcast_to(jnp.arange(40) // 14, (2, 40)))
  expected = attention(deq(q8, qd, 2), deq(k8, kd), deq(v8, vd), **options)
  exact = fp8_attention_reference(q8, k8, v8, qd, kd, vd, out_dtype=jnp.float32,
                                  quantize_probs=False, **options)
  np.testing.assert_allclose(np.asarray(exact), np.asarray(expected), atol=2e-6)
  rounded = fp8_attention_reference(q8, k8, v8, qd, kd, vd, out_dtype=jnp.float32, **options)
  error = np.abs(np.asarray(rounded - expected)).max() / np.abs(np.asarray(expected)).max()
  assert 0 < error < 0.1  # FP8 probabilities: 3 mantissa bits


def test_rotation_leaves_attention_unchanged_and_cuts_the_error_of_outliers():
  q, k, v = qkv(2, q_len=64, kv_len=64, d=64, dv=64, outliers=0.001)
  exact = attention(q, k, v, causal=True)
  r = hadamard_rotation(64, jax.random.key(4))
  rotated = attention(q @ r, k @ r, v, causal=True)
  np.testing.assert_allclose(np.asarray(rotated), np.asarray(exact), atol=2e-5)
  rmse = lambda rotation: float(jnp.sqrt(jnp.mean((fp8_attention_reference(
      *quantize_attention_inputs(q, k, v, rotation=rotation), causal=True,
      out_dtype=jnp.float32) - exact) ** 2)))
  assert rmse(r) < rmse(None)


def test_fully_masked_rows_give_zeros_and_bad_inputs_are_named():
  q, k, v = qkv(3, q_len=8, kv_len=4)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  out = fp8_attention_reference(q8, k8, v8, qd, kd, vd, causal=True)  # rows 0-3 see nothing
  assert np.all(np.asarray(out[:, :4]) == 0) and np.isfinite(np.asarray(out)).all()
  with pytest.raises(ValueError, match="q must be a 4-d float8_e4m3fn"):
    fp8_attention_reference(q, k8, v8)
  with pytest.raises(ValueError, match=r"k_descale must be a float32 scalar or \[kv_heads\]"):
    fp8_attention_reference(q8, k8, v8, qd, jnp.ones(3), vd)


def test_flash_attention_takes_fp8_inputs_forward_only():
  import jattn

  q, k, v = qkv(4)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  out = jattn.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                              causal=True, local_window=(9, 0), out_dtype=jnp.float32)
  expected = fp8_attention_reference(q8, k8, v8, qd, kd, vd, causal=True, local_window=(9, 0),
                                     out_dtype=jnp.float32)
  assert out.dtype == jnp.float32
  # (compiled apart, exp may differ in its last bit, which moves an FP8 probability by
  # an eighth: jattn.interop.harness.TOLERANCE)
  scale = np.abs(np.asarray(expected)).max()
  assert np.abs(np.asarray(out - expected)).max() <= 3e-2 * scale
  assert jattn.flash_attention(q8, k8, v8).dtype == jnp.bfloat16  # descales default to 1
  with pytest.raises(NotImplementedError, match="FP8 inputs have no backward"):
    jax.grad(lambda q: jattn.flash_attention(q, k8, v8).astype(jnp.float32).sum())(q8)
  with pytest.raises(ValueError, match="FP8 attention takes causal, scale, local_window, "
                                       "segment ids and config, not sinks"):
    jattn.flash_attention(q8, k8, v8, sinks=jnp.zeros(4))
  with pytest.raises(ValueError, match=r"v_descale must be a float32 scalar or \[kv_heads\]"):
    jattn.flash_attention(q8, k8, v8, v_descale=jnp.ones(3))
  with pytest.raises(ValueError, match="out_dtype must be one of"):
    jattn.flash_attention(q8, k8, v8, out_dtype=jnp.int8)
  with pytest.raises(TypeError, match="q has dtype float32; FP8 attention takes"):
    jattn.flash_attention(q, k, v, q_descale=qd)


def test_fp8_forward_with_the_16_bit_backward():
  import jattn
  from flax import nnx
  from jattn.fp8_training import fp8_attention
  from jattn.nn import MultiHeadAttention

  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(5))
  rotation = hadamard_rotation(32, jax.random.key(6))
  out = jax.jit(lambda *a: fp8_attention(*a, causal=True, rotation=rotation))(q, k, v)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v, rotation=rotation)
  expected = jattn.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   causal=True)
  assert out.dtype == jnp.bfloat16
  assert rel(out, expected) < 3e-2
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
  grads = jax.jit(jax.grad(loss(lambda *a: fp8_attention(*a, causal=True)), argnums=(0, 1, 2)))(
      q, k, v)
  exact = jax.jit(jax.grad(loss(lambda *a: jattn.flash_attention(*a, causal=True)),
                           argnums=(0, 1, 2)))(q, k, v)
  for g, g_ref in zip(grads, exact):  # the cotangents differ by the FP8 outputs' error only
    assert g.dtype == jnp.bfloat16 and rel(g, g_ref) < 0.1
  layer = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, fp8=True, fp8_rotation=True,
                             rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(7), (2, 12, 32))
  assert layer(x).shape == (2, 12, 32)
  ids = jnp.broadcast_to(jnp.arange(12) // 5, (2, 12))  # three packed sequences a row
  packed = layer(x, segment_ids=ids)
  layer.fp8 = False  # the same layer in 16 bits
  assert rel(packed, layer(x, segment_ids=ids)) < 5e-2 < rel(packed, layer(x))
  with pytest.raises(ValueError, match="fp8=True runs the attention without softcap"):
    MultiHeadAttention(32, 4, fp8=True, softcap=5.0, rngs=nnx.Rngs(0))


def rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.abs(a - b).max() / np.abs(b).max()


def test_a_non_finite_value_reaches_only_the_rows_that_see_it():
  """A NaN in the values of key 5 (causal): rows before it stay finite, the others are
  NaN; a NaN query spoils its own row only."""
  q, k, v = qkv(8, q_len=12, kv_len=12)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  v8 = v8.at[:, 5].set(jnp.nan)
  q8 = q8.at[:, 1, 0].set(jnp.nan)
  out = np.asarray(fp8_attention_reference(q8, k8, v8, qd, kd, vd, causal=True,
                                           out_dtype=jnp.float32))
  assert np.isfinite(out[:, :5]).sum() == out[:, :5].size - 2 * out.shape[-1]  # row 1 head 0
  assert np.isnan(out[:, 1, 0]).all() and np.isnan(out[:, 5:]).all()


def test_values_are_laid_out_keys_fastest_in_the_8_bit_operand_order():
  """The Hopper FP8 kernel's V: ``[batch, heads, d, keys]``, keys in
  ``EIGHT_BIT_KEY_ORDER`` within each group of 16 (the order in which the weights'
  registers serve as the wgmma operand)."""
  from jattn.kernels.hopper.pipeline import EIGHT_BIT_KEY_ORDER, eight_bit_values

  v = np.random.default_rng(0).normal(size=(2, 48, 3, 5)).astype(np.float32)
  order = (np.arange(0, 48, 16)[:, None] + np.asarray(EIGHT_BIT_KEY_ORDER)).reshape(-1)
  assert sorted(EIGHT_BIT_KEY_ORDER) == list(range(16))
  np.testing.assert_array_equal(np.asarray(eight_bit_values(jnp.asarray(v))),
                                v[:, order].transpose(0, 2, 3, 1))


def rmse(a, b):
  return float(np.sqrt(np.mean((np.asarray(a, np.float32) - np.asarray(b, np.float32)) ** 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal, window, out_dtype, segments", [
    # (batch, q_len, kv_len, q_heads, kv_heads, d, dv)
    ((2, 300, 333, 4, 2, 128, 128), False, None, jnp.bfloat16, False),
    ((2, 300, 333, 4, 2, 128, 128), True, None, jnp.float32, False),
    ((1, 520, 520, 4, 1, 128, 128), True, (100, 0), jnp.float16, False),
    ((2, 200, 200, 2, 2, 64, 64), False, None, jnp.bfloat16, False),
    ((1, 260, 300, 2, 2, 256, 256), True, None, jnp.bfloat16, False),
    ((1, 256, 256, 4, 2, 128, 64), False, None, jnp.bfloat16, False),
    ((2, 300, 333, 4, 2, 128, 128), False, None, jnp.bfloat16, True),
    ((2, 520, 520, 4, 4, 128, 128), True, None, jnp.bfloat16, True),
])
def test_the_hopper_fp8_kernel_computes_the_recipe(shape, causal, window, out_dtype,
                                                   segments):
  """The 8-bit wgmma kernel against the recipe's float32 reference, and no less exact
  than it against the float32 attention of the inputs it quantised (its weights are
  rounded against the running row max, the reference's against the final one)."""
  import jattn

  batch, q_len, kv_len, q_heads, kv_heads, d, dv = shape
  q, k, v = qkv(11, batch, q_len, kv_len, q_heads, kv_heads, d, dv, outliers=1e-3)
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  options = dict(causal=causal, local_window=window)
  if segments:  # packed rows of uneven sequences; the last queries' segment has no key
    ids = lambda n, count: jnp.broadcast_to(jnp.arange(n) * count // n, (batch, n))
    options.update(q_segment_ids=ids(q_len, 5), kv_segment_ids=ids(kv_len, 4))
  out = jattn.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                              backend="pallas_mosaic", out_dtype=out_dtype, **options)
  recipe = fp8_attention_reference(q8, k8, v8, qd, kd, vd, out_dtype=out_dtype, **options)
  exact = attention(q, k, v, **options)
  assert out.dtype == out_dtype and out.shape == (batch, q_len, q_heads, dv)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rmse(out, recipe) < 2e-2 * rmse(recipe, 0)
  assert rmse(out, exact) < 1.25 * rmse(recipe, exact) + 1e-3
