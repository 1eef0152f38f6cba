"""Bad inputs to flash_attention raise errors that name the argument and what was expected."""

import jax.numpy as jnp
import pytest

import jattn

Q = jnp.ones((2, 8, 4, 16), jnp.float32)
KV = jnp.ones((2, 8, 2, 16), jnp.float32)


def call(q=Q, k=KV, v=KV, backend="xla", **kwargs):
  return jattn.flash_attention(q, k, v, backend=backend, **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=jnp.ones((8, 4, 16))), ValueError, r"q must have rank 4 \[batch, seq, heads, head_dim\]"),
    (dict(k=jnp.ones((2, 8, 2, 16, 1))), ValueError, "k must have rank 4"),
    (dict(q=Q.astype(jnp.int32)), TypeError, "q has dtype int32; supported"),
    (dict(q=Q.astype(jnp.float16)), TypeError, "q, k, v must share one dtype"),
    (dict(v=jnp.ones((2, 9, 2, 16))), ValueError, "k and v must have the same shape"),
    (dict(k=jnp.ones((3, 8, 2, 16)), v=jnp.ones((3, 8, 2, 16))), ValueError, "same batch size"),
    (dict(k=jnp.ones((2, 8, 2, 8)), v=jnp.ones((2, 8, 2, 8))), ValueError, "same head_dim"),
    (dict(k=jnp.ones((2, 8, 3, 16)), v=jnp.ones((2, 8, 3, 16))), ValueError,
     r"q_heads \(4\) must be a multiple of kv_heads \(3\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "pass both"),
    (dict(q_segment_ids=jnp.zeros((2, 7), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)),
     ValueError, r"q_segment_ids must have shape \[batch, seq\] = \(2, 8\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 8))), TypeError,
     "q_segment_ids must be integers"),
    (dict(local_window=(3,)), ValueError, r"local_window must be \(left, right\)"),
    (dict(local_window=(-1, 2)), ValueError, "local_window"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive number"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(scale=-0.5), ValueError, "scale must be a finite number > 0"),
    (dict(backend="tpu"), ValueError, "backend must be one of"),
    (dict(q=jnp.ones((2, 0, 4, 16))), ValueError, "q has an empty dimension"),
])
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    call(**kwargs)


def test_head_dim_above_pallas_limit():
  q = jnp.ones((1, 4, 1, 272), jnp.float32)
  with pytest.raises(ValueError, match="head_dim 272 is above 256"):
    jattn.flash_attention(q, q, q, backend="pallas_triton")


def test_bad_block_config():
  with pytest.raises(ValueError, match="FlashBlockConfig.block_q must be a power of two"):
    jattn.FlashBlockConfig(block_q=48)


@pytest.mark.parametrize("field,value", [("block_q", 32), ("block_kv_dkv", 96), ("stages", 1),
                                         ("bwd_stages", 0)])
def test_bad_mosaic_config(field, value):
  with pytest.raises(ValueError, match=f"MosaicBlockConfig.{field} must be"):
    jattn.MosaicBlockConfig(**{field: value})


def test_config_of_the_other_kernel_family_is_rejected(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  with pytest.raises(TypeError, match="config for backend='pallas_triton' must be a "
                                      "FlashBlockConfig, got MosaicBlockConfig"):
    call(backend="pallas_triton", config=jattn.MosaicBlockConfig())


def test_mosaic_needs_hopper_or_rejects_unsupported_features():
  q = Q.astype(jnp.bfloat16)
  kv = KV.astype(jnp.bfloat16)
  if "pallas_mosaic" not in jattn.usable_backends():
    with pytest.raises(ValueError, match="backend='pallas_mosaic' needs a Hopper GPU"):
      call(q, kv, kv, backend="pallas_mosaic")
  else:
    with pytest.raises(ValueError, match="'pallas_mosaic' does not support: softcap"):
      call(q, kv, kv, backend="pallas_mosaic", softcap=5.0)


def test_cudnn_rejects_unsupported_features():
  if "cudnn" not in jattn.usable_backends():
    with pytest.raises(ValueError, match="backend='cudnn' needs a CUDA GPU"):
      call(backend="cudnn")
  else:
    with pytest.raises(ValueError, match="backend='cudnn' does not support: .*float32 inputs"):
      call(backend="cudnn")
