"""jattn.gpu on made-up devices: architecture, features, usable backends, "auto" (CPU)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import jattn.gpu as gpu
from jattn.backends import BACKENDS, usable_backends_for

CC = {"H100": (9, 0), "A100": (8, 0), "L4": (8, 9), "T4": (7, 5), "cpu": None}
CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="asserts what a machine without a GPU reports")
FAKES = {(name, interpret): gpu.describe(name, cc, interpret=interpret)
         for (name, cc), interpret in itertools.product(CC.items(), (False, True))}


@pytest.mark.parametrize("name,arch,bf16,fp8,dtype", [
    ("H100", "hopper", True, True, jnp.bfloat16),
    ("A100", "ampere", True, False, jnp.bfloat16),
    ("L4", "ada", True, True, jnp.bfloat16),
    ("T4", "turing", False, False, jnp.float16),
    ("cpu", "cpu", False, False, jnp.float32),
])
def test_fake_devices(name, arch, bf16, fp8, dtype):
  info = FAKES[(name, False)]
  assert info.architecture == arch and info.compute_capability == CC[name]
  assert info.platform == ("cpu" if name == "cpu" else "gpu") and info.is_gpu == (name != "cpu")
  assert (info.supports_bf16, info.supports_fp8) == (bf16, fp8)
  assert gpu.recommended_dtype(info) == dtype


@pytest.mark.parametrize("key", FAKES, ids=[f"{n}-interpret{int(i)}" for n, i in FAKES])
def test_backends_of_fakes(key):
  name, interpret = key
  info = FAKES[key]
  assert info.interpret == interpret
  assert info.backends == usable_backends_for(CC[name], interpret)
  assert set(info.backends) <= set(BACKENDS) - {"auto"}
  assert info.backends[-1] == "xla" and len(set(info.backends)) == len(info.backends)
  if name in ("H100", "A100", "L4"):  # Ampere and newer run both kernels and cuDNN
    assert {"pallas_triton", "cudnn", "xla"} <= set(info.backends)
  if CC[name] != (9, 0):  # the Mosaic GPU kernel is Hopper-only
    assert "pallas_mosaic" not in info.backends


@pytest.mark.parametrize("name", ["T4", "cpu"])
def test_backends_without_an_ampere_gpu(name):
  assert FAKES[(name, False)].backends == ("xla",)
  assert FAKES[(name, True)].backends == ("pallas_triton", "xla")


@CPU_ONLY
def test_gpu_info_on_this_machine(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  info = gpu.gpu_info()
  assert info.platform == "cpu" and info.architecture == "cpu" and info.name.startswith("cpu (")
  assert info.compute_capability is None and info.backends == ("xla",)
  monkeypatch.setenv("JATTN_INTERPRET", "1")  # read on every call, not cached
  assert gpu.gpu_info().backends == ("pallas_triton", "xla")


PROBLEMS = [dict(dtype=dtype, head_dim=d, q_len=128, kv_len=kv, causal=causal, segment_ids=seg,
                 softcap=cap, return_lse=lse, local_window=win)
            for dtype, d, kv, causal, seg, cap, lse, win in itertools.product(
                (jnp.float16, jnp.bfloat16, jnp.float32), (32, 64, 128, 256, 320), (128, 200),
                (False, True), (False, True), (False, True), (False, True), (False, True))]


@pytest.mark.parametrize("key", FAKES, ids=[f"{n}-interpret{int(i)}" for n, i in FAKES])
def test_auto_never_selects_an_unusable_backend(key):
  info = FAKES[key]
  for problem in PROBLEMS:
    chosen = gpu.select_backend(info=info, **problem)
    assert chosen in info.backends, problem
    assert gpu.flash_backend_supports(chosen, **problem), (chosen, problem)
    # The rule: the first usable backend that supports the problem.
    assert chosen == next(b for b in info.backends if gpu.flash_backend_supports(b, **problem))
    if chosen == "cudnn":
      assert problem["dtype"] != jnp.float32 and not problem["segment_ids"], problem
      assert not problem["softcap"] and not problem["return_lse"], problem
      assert not (problem["causal"] and problem["q_len"] != problem["kv_len"]), problem


def test_cudnn_is_never_chosen_for_what_it_cannot_do():
  base = dict(dtype=jnp.bfloat16, head_dim=128, q_len=256, kv_len=256, causal=True)
  for extra in (dict(dtype=jnp.float32), dict(segment_ids=True), dict(softcap=True),
                dict(return_lse=True), dict(kv_len=512), dict(head_dim=320), dict(head_dim=36)):
    assert not gpu.flash_backend_supports("cudnn", **{**base, **extra}), extra
  assert gpu.flash_backend_supports("cudnn", **base)
  # With the Pallas kernel gone (not usable), only cuDNN and the reference remain.
  cudnn_or_xla = dataclasses.replace(FAKES[("A100", False)], backends=("cudnn", "xla"))
  assert gpu.select_backend(info=cudnn_or_xla, **base) == "cudnn"
  assert gpu.select_backend(info=cudnn_or_xla, **{**base, "segment_ids": True}) == "xla"


def test_large_head_dims_fall_back_to_xla():
  for info in FAKES.values():
    assert gpu.select_backend(info=info, dtype=jnp.float16, head_dim=320) == "xla"


def test_select_backend_for_dilated_attention():
  for info in FAKES.values():
    pallas = "pallas_triton" if "pallas_triton" in info.backends else "xla"
    assert gpu.select_backend("dilated_attention", info=info, head_dim=128) == pallas
    assert gpu.select_backend("dilated_attention", info=info, head_dim=320) == "xla"


def test_select_backend_rejects_other_ops():
  with pytest.raises(ValueError, match="op must be one of .*got 'retention'"):
    gpu.select_backend("retention", info=FAKES[("H100", False)])
  with pytest.raises(ValueError, match="op must be 'flash_attention'"):
    gpu.benchmark_backends("retention")


@CPU_ONLY
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_benchmark_backends_on_cpu(monkeypatch, mode):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  info = gpu.gpu_info()
  rows = gpu.benchmark_backends(batch=1, q_len=32, q_heads=2, head_dim=16, reps=2, mode=mode,
                                info=info)
  assert {r["backend"] for r in rows} == {"pallas_triton", "xla"}
  ms = [r["ms"] for r in rows]
  assert all(m > 0 for m in ms) and ms == sorted(ms)
  assert all(r["speedup"] >= 1 for r in rows)
  assert rows[-1]["speedup"] == 1.0
  assert rows[0]["speedup"] == pytest.approx(ms[-1] / ms[0])


def test_benchmark_backends_rejects_a_bad_mode():
  with pytest.raises(ValueError, match="mode must be 'fwd' or 'fwd\\+bwd', got 'bwd'"):
    gpu.benchmark_backends(mode="bwd", info=FAKES[("cpu", False)])
