"""The torch bridge: zero-copy DLPack, the torch reference, crosscheck and ``jattn check``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jattn.interop as interop  # noqa: E402
from jattn.interop import torch_crosscheck  # noqa: E402
from jattn.core.op import OPS  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32,
                                   torch.int8])
def test_torch_to_jax_is_zero_copy(dtype):
  t = (torch.randn(3, 5, 7) * 10).to(dtype)
  a = interop.to_jax(t)
  assert a.shape == (3, 5, 7)
  assert interop.same_memory(a, t)
  np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32])
def test_jax_to_torch_is_zero_copy(dtype):
  a = (jax.random.normal(jax.random.PRNGKey(0), (4, 6)) * 10).astype(dtype)
  t = interop.to_torch(a)
  assert tuple(t.shape) == (4, 6)
  assert interop.same_memory(a, t)
  np.testing.assert_array_equal(t.float().numpy(), np.asarray(a.astype(jnp.float32)))


def test_non_contiguous_tensor_round_trips():
  t = torch.randn(6, 4).t()[:, ::2]  # transposed and strided
  a = interop.to_jax(t)
  np.testing.assert_array_equal(np.asarray(a), t.numpy())
  back = interop.to_torch(a)
  assert torch.equal(back, t)


def test_bridge_rejects_wrong_types():
  with pytest.raises(TypeError, match="to_jax expects a torch.Tensor"):
    interop.to_jax(np.ones(3))
  with pytest.raises(TypeError, match="to_torch expects a jax.Array"):
    interop.to_torch(torch.ones(3))


def test_torch_reference_zeroes_rows_without_keys():
  q = torch.randn(1, 6, 2, 8)
  k = torch.randn(1, 3, 1, 8)
  out = interop.flash_attention_torch(q, k, k, causal=True)  # rows 0..2 see no key
  assert torch.isfinite(out).all()
  assert torch.all(out[:, :3] == 0)
  assert torch.any(out[:, 3:] != 0)


@pytest.mark.parametrize("op,case", [
    ("flash_attention", dict(batch=2, q_len=20, kv_len=53, q_heads=4, kv_heads=2, head_dim=30,
                             causal=True, segment_ids=True, sinks=True, dropout_rate=0.25)),
    ("flash_attention", dict(q_len=24, q_heads=2, head_dim=16, softcap=3.0, local_window=(6, 2),
                             value_head_dim=24, sinks=True)),
    ("window_attention", dict(windows=4, tokens=20, heads=2, head_dim=16, mask_windows=2)),
    ("dilated_attention", dict(batch=1, seq=37, heads=4, kv_heads=2, head_dim=16, causal=True,
                               segment_lengths=(8, 64), dilation_rates=(2, 8))),
    ("retention_parallel", dict(q_len=20, kv_len=33, heads=2, dk=16, dv=8,
                                normalize="abs_sum")),
    ("retention_chunkwise", dict(q_len=33, heads=2, dk=16, dv=8, chunk_size=16)),
    ("retention_recurrent", dict(q_len=9, heads=2, dk=8)),
    ("retention_step", dict(heads=2, dk=16, dv=8, initial_state=True)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_every_op_crosschecks_against_torch(op, case):
  # The torch references and the harness, on the jnp backend: the kernels meet the
  # same references in `jattn check` and in the contract tests.
  report = interop.crosscheck(op, dtype="float32", backend="xla", torch_device="cpu", **case)
  names = ["out"] + [f"d{OPS[op].arg_names[i]}" for i in OPS[op].diff_argnums]
  if op in ("retention_chunkwise", "retention_recurrent"):
    names.remove("dinitial_state")  # the torch reference starts from zeros
  assert list(report.errors) == names
  assert report.ok, str(report)


def test_crosscheck_in_bfloat16_and_against_the_jax_reference():
  case = dict(q_len=24, q_heads=2, head_dim=16, causal=True)
  for reference in ("torch", "jax"):
    report = interop.crosscheck("flash_attention", dtype="bfloat16", backend="pallas_triton",
                                reference=reference, **case)
    assert report.ok and report.device == ("jax" if reference == "jax" else "cpu"), str(report)


def test_crosscheck_detects_a_wrong_result(monkeypatch):
  right = torch_crosscheck.TORCH_REFERENCES["flash_attention"]
  monkeypatch.setitem(torch_crosscheck.TORCH_REFERENCES, "flash_attention",
                      lambda p, *t: right(dataclasses.replace(p, scale=0.5), *t))
  report = interop.crosscheck("flash_attention", backend="xla", q_len=16, head_dim=16)
  assert not report.ok
  assert "FAIL" in str(report)


def test_crosscheck_rejects_unknown_op_and_dtype():
  with pytest.raises(ValueError, match="op must be one of"):
    interop.crosscheck("nope")
  with pytest.raises(ValueError, match="dtype must be one of"):
    interop.crosscheck(dtype="int32")


def test_window_attention_torch_reference_takes_boolean_masks():
  import torch

  from jattn.interop.torch_reference import window_attention_torch

  q, k, v = (torch.randn(4, 6, 2, 8) for _ in range(3))
  bias = torch.randn(2, 6, 6)
  allowed = torch.rand(2, 6, 6) < 0.6
  allowed[:, 0] = False  # row 0 sees no key: zeros, not NaN
  additive = torch.zeros(2, 6, 6).masked_fill(~allowed, float("-inf"))
  a = window_attention_torch(q, k, v, bias, mask=allowed)
  torch.testing.assert_close(a, window_attention_torch(q, k, v, bias, mask=additive))
  assert torch.all(a[:, 0] == 0) and torch.isfinite(a).all()
