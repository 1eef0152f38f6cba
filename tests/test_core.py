"""The op core on made-up devices: what each device runs, the one ``"auto"`` rule and its
one error text for every op, config resolution (explicit, user cache, shipped table,
heuristic), and that a call really runs the backend it resolves to."""

import dataclasses
import importlib
import itertools
import json
import pathlib
import pkgutil
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import pytest

import jattn
import jattn.gpu as gpu
from conftest import ON_GPU
from jattn.core.device import BACKEND_NAMES
from jattn.core.op import OP_MODULES, OPS
from jattn.flash import FLASH, FlashProblem
from jattn.kernels.common.config import default_block_config
from jattn.core import cache

CC = {"H100": (9, 0), "A100": (8, 0), "L4": (8, 9), "T4": (7, 5), "cpu": None}
FAKES = {(name, interpret): gpu.describe(name, cc, interpret=interpret)
         for (name, cc), interpret in itertools.product(CC.items(), (False, True))}
FAKE_IDS = [f"{n}-interpret{int(i)}" for n, i in FAKES]
CPU_ONLY = pytest.mark.skipif(ON_GPU, reason="asserts what a machine without a GPU reports")


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


@pytest.mark.parametrize("name,interpret,backends", [
    ("H100", False, ("pallas_mosaic", "pallas_triton", "cudnn", "xla")),
    ("A100", False, ("pallas_triton", "cudnn", "xla")),
    ("L4", True, ("pallas_triton", "cudnn", "xla")),
    ("T4", False, ("xla",)), ("T4", True, ("pallas_triton", "xla")),
    ("cpu", False, ("xla",)), ("cpu", True, ("pallas_triton", "xla")),
])
def test_what_each_device_runs(name, interpret, backends):
  assert FAKES[(name, interpret)].backends == backends
  assert jattn.BACKENDS == ("auto",) + BACKEND_NAMES


@CPU_ONLY
def test_gpu_info_on_this_machine(monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  info = gpu.gpu_info()
  assert info.platform == "cpu" and info.architecture == "cpu" and info.name.startswith("cpu (")
  assert info.compute_capability is None and info.backends == ("xla",)
  monkeypatch.setenv("JATTN_INTERPRET", "1")  # read on every call, not cached
  assert gpu.gpu_info().backends == ("pallas_triton", "xla")
  assert gpu.usable_backends() == ("pallas_triton", "xla")


def test_every_op_is_known():
  assert set(gpu.ops()) == {"flash_attention", "flex_attention", "window_attention",
                            "dilated_attention",
                            "retention_parallel", "retention_chunkwise", "retention_recurrent",
                            "retention_step", "paged_attention",
                            "flash_attention_varlen", "flash_attention_fp8"}
  for op in OPS.values():
    assert op.backends[0] == "auto" and op.backends[-1] == "xla"
    assert op.backends[1:] == tuple(b for b in BACKEND_NAMES if b in op.backends)


def test_imports_are_lazy_and_the_registry_loads_every_op():
  """``import jattn`` and the tools' modules load neither JAX nor torch (a tool checks
  its options first); reading ``OPS`` imports every module that defines an op."""
  code = ("import sys, jattn, jattn.interop, jattn.interop.cli, jattn.interop.upscale_cli\n"
          "heavy = {'jax', 'flax', 'torch'} & set(sys.modules)\n"
          "assert not heavy, heavy\n"
          "from jattn.core.op import OPS\n"
          "print(*sorted(OPS))")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  for module in pkgutil.walk_packages(jattn.__path__, "jattn."):
    importlib.import_module(module.name)  # every op there is, to compare with
  assert all(type(op).__module__ in OP_MODULES for op in OPS.values())
  assert done.stdout.split() == sorted(OPS)
  assert set(jattn.__all__) <= set(dir(jattn))
  for name in jattn.__all__:
    getattr(jattn, name)
  # the op, though its module jattn/retention.py has loaded by now
  assert jattn.retention.__name__ == "retention" and callable(jattn.retention)


FLASH_PROBLEMS = [dict(dtype=dtype, head_dim=d, q_len=128, kv_len=kv, causal=causal,
                       segment_ids=seg, softcap=cap, return_lse=lse)
                  for dtype, d, kv, causal, seg, cap, lse in itertools.product(
                      (jnp.float16, jnp.float32), (64, 100, 320), (128, 200), (False, True),
                      (False, True), (False, True), (False, True))]


@pytest.mark.parametrize("key", FAKES, ids=FAKE_IDS)
def test_auto_takes_the_first_backend_that_can(key):
  info = FAKES[key]
  for op in OPS.values():
    problems = (FLASH_PROBLEMS if op.name == "flash_attention" else [{}, {"dtype": jnp.float32}]
                if jnp.dtype(jnp.float32) in op.problem_cls.input_dtypes else [{}])
    for keywords in problems:
      choices = gpu.backend_choices(op.name, info=info, **keywords)
      chosen = gpu.select_backend(op.name, info=info, **keywords)
      assert chosen == next(name for name, why in choices if why is None)
      assert chosen in info.backends
      for name, why in choices:
        if name not in info.backends:
          assert why is not None


def test_what_cudnn_and_the_hopper_kernels_cannot_do():
  h100 = FAKES[("H100", False)]
  base = dict(dtype=jnp.bfloat16, head_dim=128, q_len=256, kv_len=256, causal=True)
  assert gpu.select_backend(info=h100, **base) == "pallas_mosaic"
  for extra, cudnn_gap in ((dict(dtype=jnp.float32), "float32 inputs"),
                           (dict(segment_ids=True), "segment ids"),
                           (dict(softcap=True), "softcap"), (dict(return_lse=True), "return_lse"),
                           (dict(kv_len=512), "causal with q_len != kv_len"),
                           (dict(head_dim=36), "not a multiple of 8")):
    why = dict(gpu.backend_choices(info=h100, **{**base, **extra}))["cudnn"]
    assert why is not None and cudnn_gap in why, extra
  assert gpu.select_backend(info=h100, **{**base, "segment_ids": True}) == "pallas_mosaic"
  assert gpu.select_backend(info=h100, **{**base, "softcap": True}) == "pallas_mosaic"
  assert gpu.select_backend(info=h100, **{**base, "dtype": jnp.float32}) == "pallas_triton"
  # Head dims above 256 only the reference takes.
  assert gpu.select_backend(info=FAKES[("A100", False)], **{**base, "head_dim": 320}) == "xla"


def test_one_error_text_names_every_backend_and_why():
  q = jnp.ones((1, 4, 2, 16), jnp.float32)
  with pytest.raises(ValueError) as e:
    jattn.flash_attention(q, q, q, backend="cudnn", softcap=3.0)
  text = str(e.value)
  assert text.startswith("backend='cudnn' cannot run this flash_attention call on ")
  for name in BACKEND_NAMES:
    assert f"{name}: " in text
  assert "xla: can run it" in text


def test_a_config_goes_with_its_backend():
  q = jnp.ones((1, 4, 2, 16), jnp.float32)
  with pytest.raises(TypeError, match="config for backend='pallas_triton' must be a "
                                      "BlockConfig, got MosaicBlockConfig"):
    jattn.flash_attention(q, q, q, backend="pallas_triton", config=jattn.MosaicBlockConfig())
  with pytest.raises(TypeError, match="backend='xla' takes no config"):
    jattn.flash_attention(q, q, q, backend="xla", config=jattn.BlockConfig())
  # With "auto", only the backends that take the config's class are considered.
  choices = dict(FLASH.choices(FlashProblem(head_dim=16), info=FAKES[("H100", False)],
                               config=jattn.BlockConfig()))
  assert choices["pallas_triton"] is None and "does not take a BlockConfig" in choices["xla"]


def test_configs_come_from_the_user_cache_then_the_shipped_table_then_the_heuristic(
    tmp_path, monkeypatch):
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
  h100 = FAKES[("H100", False)]
  problem = FlashProblem(q_len=4096, head_dim=128, dtype=jnp.float16, causal=True)
  triton = FLASH.impl("pallas_triton")
  key = cache.TuningKey(h100.name, "flash_attention", "pallas_triton", triton.cache_key(problem))
  assert str(key) == "H100|flash_attention/pallas_triton|float16|d128|causal|s4096"
  # No entry for a GPU called "H100": the heuristic.
  assert FLASH.config_for(triton, problem, h100) == default_block_config(128, 2)
  # The shipped table answers for the GPU it names.
  shipped = dataclasses.replace(h100, name="NVIDIA H100 80GB HBM3")
  shipped_key = str(dataclasses.replace(key, gpu=shipped.name))
  assert shipped_key in cache.shipped_entries()
  assert FLASH.config_for(triton, problem, shipped) == cache.config_from_entry(
      jattn.BlockConfig, cache.shipped_entries()[shipped_key])
  # The user's cache comes first; an explicit config before everything.
  mine = jattn.BlockConfig(block_q=32, block_k=32)
  cache.save_config(dataclasses.replace(key, gpu=shipped.name), mine, ms=1.0, mode="fwd")
  assert FLASH.config_for(triton, problem, shipped) == mine
  explicit = jattn.BlockConfig(block_q=16)
  assert FLASH.config_for(triton, problem, shipped, explicit) == explicit
  # Off GPU (interpret mode) tiles change speed only: no cache is read.
  assert FLASH.config_for(triton, problem, FAKES[("cpu", True)]) == default_block_config(128, 2)


def test_a_corrupt_cache_warns_once_and_counts_as_empty(tmp_path, monkeypatch):
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
  (tmp_path / "autotune.json").write_text("{not json")
  with pytest.warns(RuntimeWarning, match="ignoring the autotune cache"):
    assert cache.load_cache() == {}
  (tmp_path / "autotune.json").write_text(json.dumps({"version": 99, "entries": {}}))
  with pytest.warns(RuntimeWarning, match="version 1"):
    assert cache.load_cache() == {}


def test_auto_takes_the_measured_fastest_backend_that_can_run_the_call(tmp_path, monkeypatch):
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
  h100 = FAKES[("H100", False)]
  base = dict(dtype=jnp.float16, head_dim=128, q_len=4096, causal=False)
  key = FLASH.speed_tuning_key(FLASH.problem(**base), h100)
  assert str(key) == "H100|flash_attention/auto|float16|d128|noncausal|s4096"
  # Nothing measured: the op's order.
  assert gpu.select_backend(info=h100, **base) == "pallas_mosaic"
  cache.save_backend_times(key, {"pallas_mosaic": 4.5, "pallas_triton": 5.1, "cudnn": 3.9},
                           mode="fwd+bwd")
  # cuDNN's backward is not bitwise repeatable: only a call that allows that takes it.
  assert gpu.select_backend(info=h100, **base) == "pallas_mosaic"
  chosen, why = gpu.select_backend(info=h100, deterministic=False, explain=True, **base)
  assert chosen == "cudnn" and FLASH.prepare(
      FLASH.problem(deterministic=False, **base), info=h100).impl.backend.name == "cudnn"
  assert why.splitlines()[0] == (
      "cudnn: the fastest measured of those that can run it (fwd+bwd: cudnn 3.900 ms, "
      "pallas_mosaic 4.500 ms, pallas_triton 5.100 ms; user cache, "
      "H100|flash_attention/auto|float16|d128|noncausal|s4096)")
  assert "  xla: can run it" in why.splitlines()
  # A backend the call rules out is passed over for the next fastest that can run it.
  assert gpu.select_backend(info=h100, deterministic=False, return_lse=True,
                            **base) == "pallas_mosaic"
  cache.save_backend_times(key, {"pallas_mosaic": 4.5, "pallas_triton": 4.0}, mode="fwd+bwd")
  assert gpu.select_backend(info=h100, **base) == "pallas_triton"
  # Times that leave out the first backend that can run the call do not override it.
  cache.save_backend_times(key, {"pallas_triton": 4.0, "xla": 1.0}, mode="fwd+bwd")
  chosen, why = gpu.select_backend(info=h100, explain=True, **base)
  assert chosen == "pallas_mosaic" and "first in the op's order" in why
  # Another length bucket has no times.
  assert gpu.select_backend(info=h100, **{**base, "q_len": 9000}) == "pallas_mosaic"
  with pytest.raises(ValueError, match="backend times go under backend 'auto'"):
    cache.save_backend_times(dataclasses.replace(key, backend="cudnn"), {}, mode="fwd")


def test_the_shipped_table_ranks_backends_on_the_gpus_it_measured():
  ranked = [k for k in cache.shipped_entries() if "|flash_attention/auto|" in k]
  gpus = {k.split("|")[0] for k in ranked}
  assert gpus == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
  for name in ranked:
    hopper = dataclasses.replace(FAKES[("H100", False)], name=name.split("|")[0])
    fields = name.split("|")[2:]
    dtype, head_dim, causal, seq = fields[0], int(fields[1][1:]), fields[2] == "causal", int(
        fields[3][1:])
    problem = dict(dtype=jnp.dtype(dtype), head_dim=head_dim, q_len=seq, causal=causal,
                   deterministic=False)
    times = cache.shipped_entries()[name]["backend_ms"]
    assert gpu.select_backend(info=hopper, **problem) == min(times, key=times.get)


@CPU_ONLY
def test_benchmark_backends_can_store_the_times_auto_ranks_by(tmp_path, monkeypatch):
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  problem = dict(batch=1, q_len=32, q_heads=2, head_dim=16, dtype=jnp.float32)
  t4 = FAKES[("T4", True)]  # a GPU whose backends this CPU runs: Triton interpreted, xla
  with pytest.raises(ValueError, match="save=True stores times for a GPU"):
    gpu.benchmark_backends(info=FAKES[("cpu", True)], save=True, **problem)
  rows = gpu.benchmark_backends(info=t4, save=True, reps=2, mode="fwd", **problem)
  stored, mode, source = cache.backend_times(FLASH.speed_tuning_key(FLASH.problem(**problem), t4))
  assert stored == {r["backend"]: r["ms"] for r in rows} and (mode, source) == ("fwd", "user cache")
  assert gpu.select_backend(info=t4, **problem) == rows[0]["backend"]


def _primitives(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      found.add(eqn.primitive.name)
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else [value]:
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)

  walk(jaxpr.jaxpr)
  return found


@CPU_ONLY
@pytest.mark.parametrize("interpret,ran", [("1", True), ("0", False)])
def test_auto_runs_the_kernel_it_picks(monkeypatch, interpret, ran):
  """With JATTN_INTERPRET=1 "auto" picks the Pallas kernels on CPU, and the traced
  program holds a ``pallas_call``; without it, only the reference's jnp ops."""
  monkeypatch.setenv("JATTN_INTERPRET", interpret)
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  bias = jnp.ones((2, 8, 8), jnp.float32)
  calls = [lambda q: jattn.flash_attention(q, q, q),
           lambda q: jattn.window_attention(q, q, q, bias),
           lambda q: jattn.dilated_attention(q, q, q, segment_lengths=(4,), dilation_rates=(2,)),
           lambda q: jattn.retention(q, q, q),
           lambda q: jattn.retention(q, q, q, mode="chunkwise"),
           lambda q: jattn.retention_step(q[:, 0], q[:, 0], q[:, 0], jnp.zeros((1, 2, 16, 16)))]
  for call in calls:
    grad = jax.grad(lambda q: jnp.sum(jax.tree.leaves(call(q))[0]))
    assert ("pallas_call" in _primitives(grad, q)) == ran


@CPU_ONLY
@pytest.mark.parametrize("op,problem", [
    ("flash_attention", dict(batch=1, q_len=32, q_heads=2, head_dim=16)),
    ("retention_chunkwise", dict(batch=1, q_len=32, heads=2, dk=16, chunk_size=16)),
])
def test_benchmark_backends_times_every_backend_that_can(monkeypatch, op, problem):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  rows = gpu.benchmark_backends(op, reps=2, mode="fwd+bwd", **problem)
  assert {r["backend"] for r in rows} == {"pallas_triton", "xla"}
  ms = [r["ms"] for r in rows]
  assert all(m > 0 for m in ms) and ms == sorted(ms)
  assert rows[-1]["speedup"] == 1.0 and rows[0]["speedup"] == pytest.approx(ms[-1] / ms[0])


def test_the_choosing_functions_reject_what_is_not_an_op_or_a_mode():
  with pytest.raises(ValueError, match="op must be one of .*got 'retention'"):
    gpu.select_backend("retention")
  with pytest.raises(ValueError, match=r"mode must be one of \('fwd', 'fwd\+bwd'\), got 'bwd'"):
    gpu.benchmark_backends(mode="bwd", info=FAKES[("cpu", False)])
  with pytest.raises(TypeError, match="unexpected keyword argument 'q_lenn'"):
    gpu.select_backend(q_lenn=3)


def test_every_package_folder_is_installed():
  """pyproject lists packages one by one (three folders map into one name): a new
  folder left out would import here, from the checkout, and be missing from a wheel."""
  root = pathlib.Path(__file__).resolve().parent.parent
  tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
  listed = set(tool["packages"])
  for name, folder in tool["package-dir"].items():
    for init in (root / folder).rglob("__init__.py"):
      parts = init.parent.relative_to(root / folder).parts
      assert ".".join((name,) + parts) in listed, f"{init.parent} is not in pyproject's packages"


@pytest.mark.parametrize("op,fields,match", [
    ("flash_attention", dict(causal="maybe"), "causal must be True or False, got 'maybe'"),
    ("flash_attention", dict(dtype="int8"), "dtype must be one of float32, float16, bfloat16"),
    ("flash_attention", dict(q_len=0), "q_len must be a positive int, got 0"),
    ("retention_chunkwise", dict(chunk_size=0), "chunk_size must be a positive int"),
    ("dilated_attention", dict(segment_lengths=(0, 4), dilation_rates=(1, 2)),
     r"segment_lengths must be positive ints, got \(0, 4\)"),
])
def test_problems_from_keywords_check_their_fields(op, fields, match):
  """What jattn.gpu and `python -m jattn.autotune --set` build problems from is checked
  like arrays would be: sizes positive ints, flags bools, a dtype the kernels take."""
  with pytest.raises(ValueError, match=match):
    OPS[op].problem(**fields)


def test_auto_passes_over_an_implementation_only_while_another_can_run_it():
  """``Impl.auto_passes_over``: Hopper varlen gathers packings that differ into a batch
  only while that holds at most twice the packed rows; past it ``"auto"`` goes to the
  next backend and says why, unless nothing else can run the call (a Hopper config
  given). The packed-alike call runs as one row."""
  from jattn.varlen import VARLEN, VarlenProblem
  h100 = FAKES[("H100", False)]
  base = dict(batch=3, q_len=128, kv_len=128, q_heads=4, kv_heads=4, head_dim=64,
              dtype=jnp.bfloat16, total_q=200, total_k=200, causal=True)
  skewed = dict(base, total_q=180, total_k=180)  # 3 x 128 rows gathered: 2.1x
  for fields, packed_alike, backend in ((base, True, "pallas_mosaic"),
                                        (base, False, "pallas_mosaic"),
                                        (skewed, True, "pallas_mosaic"),
                                        (skewed, False, "pallas_triton")):
    problem = VarlenProblem(**fields, same_packing=packed_alike)
    assert VARLEN.prepare(problem, info=h100).impl.backend.name == backend, fields
  problem = VarlenProblem(**skewed, same_packing=False)
  assert "pallas_mosaic passed over: not one packing of queries and keys, and gathering " \
         "the sequences would hold 2.1x" in VARLEN.explain(problem, info=h100)
  # Few query positions against long keys: the gathered queries' 128-row tiles count.
  short = VarlenProblem(**dict(base, q_len=4, total_q=12), same_packing=False)
  assert VARLEN.prepare(short, info=h100).impl.backend.name == "pallas_triton"
  given = VARLEN.prepare(problem, info=h100, config=jattn.MosaicBlockConfig())
  assert given.impl.backend.name == "pallas_mosaic"
  choices = dict(VARLEN.choices(problem, info=h100))
  assert choices["pallas_mosaic"].startswith("auto passes it over while another backend")
  assert choices["pallas_triton"] is None
  assert dict(VARLEN.choices(problem, info=h100, config=jattn.MosaicBlockConfig()))[
      "pallas_mosaic"] is None


def test_only_flags_jaxlib_defines_are_taken(tmp_path, monkeypatch):
  """A flag counts as defined where a jaxlib library holds its name as a C string, not
  where only a protobuf descriptor keeps it (jaxlib 0.11.2 keeps a removed flag's name
  so, and XLA aborts on unknown flags)."""
  import importlib.machinery
  import importlib.util

  from jattn.core import device
  (tmp_path / "libfake.so").write_bytes(b"\x00xla_defined\x00 ... \x1bxla_removedR\x00")
  spec = importlib.machinery.ModuleSpec("jaxlib", None, is_package=True)
  spec.submodule_search_locations = [str(tmp_path)]
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
  assert device._flags_defined_by_jaxlib(["xla_defined", "xla_removed"]) == {"xla_defined"}


@pytest.mark.parametrize("platform, call_s, calls", [
    ("cpu", 1 / 512, 1 + 3),  # the compile call, then one per sample
    ("gpu", 1 / 512, 1 + 64 + 3 * 5),  # warm-up calls for 0.125 s, then 5 queued per sample
    ("gpu", 1 / 32, 1 + 4 + 3),  # calls of 10 ms or more: warm-up, then one per sample
])
def test_median_ms_warms_a_gpu_up_and_queues_short_calls(monkeypatch, platform, call_s, calls):
  from jattn.core import timing
  clock, made = [0.0], []
  done = jnp.zeros(())

  def fn():
    made.append(None)
    clock[0] += call_s
    return done

  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
  monkeypatch.setattr(timing.jax, "default_backend", lambda: platform)
  assert timing.median_ms(fn, (), 3, warmup_s=0.125) == pytest.approx(call_s * 1e3)
  assert len(made) == calls
