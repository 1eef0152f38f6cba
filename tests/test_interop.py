"""The torch bridge: zero-copy DLPack, the torch reference, crosscheck and ``jattn check``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import interop  # noqa: E402
from interop import harness  # noqa: E402
from interop.cli import main as cli_main  # noqa: E402


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


@pytest.mark.parametrize("case", [
    dict(causal=True),
    dict(segments=True),
    dict(q_len=20, kv_len=53, causal=True, head_dim=30),
    dict(softcap=3.0, local_window=(6, 2)),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
def test_crosscheck_flash_attention_against_torch(case, dtype, backend):
  report = interop.crosscheck("flash_attention", dtype=dtype, backend=backend, **case)
  assert set(report.errors) == {"out", "dq", "dk", "dv"}
  assert report.ok, str(report)


def test_crosscheck_detects_a_wrong_result(monkeypatch):
  pair = harness.OPS["flash_attention"]
  wrong = harness.OpPair(
      pair.arg_names, pair.make_inputs,
      lambda q, k, v, backend, **kw: pair.jax_fn(q, k, v, backend=backend, scale=0.5, **kw),
      pair.torch_fn)
  monkeypatch.setitem(harness.OPS, "wrong_scale", wrong)
  report = interop.crosscheck("wrong_scale", backend="xla", q_len=16)
  assert not report.ok
  assert "FAIL" in str(report)


def test_crosscheck_rejects_unknown_op_and_dtype():
  with pytest.raises(ValueError, match="op must be one of"):
    interop.crosscheck("nope")
  with pytest.raises(ValueError, match="dtype must be one of"):
    interop.crosscheck(dtype="int32")


def test_jattn_check_cli(capsys):
  # CI runs the whole `jattn check` from the README; here, the command line on one op.
  assert cli_main(["check", "--ops", "dilated_attention", "--backends", "xla",
                   "--dtypes", "float32", "--reps", "1"]) == 0
  out = capsys.readouterr().out
  assert "2/2 checks within tolerance" in out
  assert "FAIL" not in out and "flash_attention" not in out
  with pytest.raises(ValueError, match="unknown ops \\['flash'\\]"):
    cli_main(["check", "--ops", "flash", "--backends", "xla"])


@pytest.mark.parametrize("backend,case", [
    ("xla", dict(q_len=33, mode="recurrent")),
    ("pallas_triton", dict(q_len=40, kv_len=56, mode="parallel", normalize="abs_sum")),
    ("pallas_triton", dict(q_len=50, mode="chunkwise", chunk_size=16)),
], ids=["recurrent-xla", "parallel-abs_sum-pallas", "chunkwise-pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_retention_crosscheck_against_torch(backend, case, dtype, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  report = interop.crosscheck("retention", dtype=dtype, backend=backend, torch_device="cpu", **case)
  assert report.ok, str(report)
  assert set(report.errors) == {"out", "dq", "dk", "dv"}


@pytest.mark.parametrize("backend", ["pallas_triton", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_attention_crosscheck_against_torch(backend, dtype, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  report = interop.crosscheck("window_attention", dtype=dtype, backend=backend,
                              torch_device="cpu", windows=6, tokens=40, mask_windows=4)
  assert report.ok, str(report)
  assert set(report.errors) == {"out", "dq", "dk", "dv", "dbias"}


def test_window_attention_torch_reference_takes_boolean_masks():
  import torch

  from interop.torch_reference import window_attention_torch

  q, k, v = (torch.randn(4, 6, 2, 8) for _ in range(3))
  bias = torch.randn(2, 6, 6)
  allowed = torch.rand(2, 6, 6) < 0.6
  allowed[:, 0] = False  # row 0 sees no key: zeros, not NaN
  additive = torch.zeros(2, 6, 6).masked_fill(~allowed, float("-inf"))
  a = window_attention_torch(q, k, v, bias, mask=allowed)
  torch.testing.assert_close(a, window_attention_torch(q, k, v, bias, mask=additive))
  assert torch.all(a[:, 0] == 0) and torch.isfinite(a).all()
