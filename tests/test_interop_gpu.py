"""The DLPack bridge between CUDA arrays and CUDA tensors shares device memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jattn.interop as interop  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32])
def test_zero_copy_both_ways_on_gpu(dtype):
  a = (jax.random.normal(jax.random.PRNGKey(0), (64, 48)) * 10).astype(dtype)
  t = interop.to_torch(a)
  assert t.is_cuda and interop.same_memory(a, t)
  back = interop.to_jax(t)
  assert interop.same_memory(back, t)
  np.testing.assert_array_equal(np.asarray(back.astype(jnp.float32)),
                                np.asarray(a.astype(jnp.float32)))


def test_strided_cuda_tensor_is_made_contiguous():
  t = torch.randn(32, 16, device="cuda").t()[::2]
  a = interop.to_jax(t)
  np.testing.assert_array_equal(np.asarray(a), t.cpu().numpy())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_crosscheck_against_torch_on_gpu(dtype):
  report = interop.crosscheck("flash_attention", dtype=dtype, backend="pallas_triton",
                              q_len=300, kv_len=333, head_dim=64, causal=True,
                              segment_ids=True)
  assert report.device == "cuda"
  assert report.ok, str(report)
