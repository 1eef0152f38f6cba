"""Tuning: cache keys, the cost models, candidates, the user cache and the shipped table,
the generic search over any implementation, and ``python -m jattn.autotune`` (CPU)."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax.numpy as jnp
import pytest

import jattn.autotune as cli
from conftest import ON_GPU
from jattn.core.device import Backend, describe, shared_memory_limit
from jattn.core.op import OPS, Impl, Op
from jattn.core import cache
from jattn.flash import FLASH, FlashProblem
from jattn.kernels.common.config import (BLOCK_SEARCH, REGISTER_BUDGET, BlockConfig,
                                         SearchGrid, default_block_config)
from jattn.kernels.flash import MosaicBlockConfig, default_mosaic_config
from jattn.kernels.flash.config import BACKWARD_SEARCH, FORWARD_SEARCH
from jattn.kernels.flash.mosaic_bwd import FUSED_DQ_SUPPORTED
from jattn.kernels.hopper.forward import output_view_rows
from jattn.tuning import search

CPU_ONLY = pytest.mark.skipif(ON_GPU, reason="asserts what a machine without a GPU reports")
H100 = "NVIDIA H100 80GB HBM3"
FAKE_H100 = describe(H100, (9, 0), shared_memory_per_block_bytes=232448, interpret=False)
FAKE_99K = describe("NVIDIA GeForce RTX 3090", (8, 6), interpret=False)  # no smem figure
TRITON = FLASH.impl("pallas_triton")
MOSAIC = FLASH.impl("pallas_mosaic")
SMALL = BlockConfig(block_q=32, block_k=32, num_warps=4, num_stages=1, block_q_dkv=32,
                    block_k_dkv=32, block_q_dq=32, block_k_dq=32, bwd_num_warps=4,
                    bwd_num_stages=1)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  """Every test gets an empty cache directory; the real ~/.cache is never touched."""
  path = tmp_path / "cache"
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(path))
  return path


def problem(dtype=jnp.bfloat16, head_dim=128, seq=4096, causal=True, **kw):
  return FlashProblem(q_len=seq, head_dim=head_dim, dtype=dtype, causal=causal, **kw)


def key(gpu=H100, **kw):
  return cache.TuningKey(gpu, "flash_attention", "pallas_triton", TRITON.cache_key(problem(**kw)))


def lookup(info=FAKE_H100, **kw):
  return FLASH.config_for(TRITON, problem(**kw), info)


# ------------------------------------------------------------------------------ keys

@pytest.mark.parametrize("length,bucket", [(1, 128), (128, 128), (129, 256), (4096, 4096),
                                           (4097, 8192), (10**6, 65536)])
def test_buckets(length, bucket):
  assert cache.bucket(length) == bucket


def test_key_pads_the_head_dim_and_buckets_the_longer_sequence():
  k = key(dtype=jnp.float16, head_dim=100, seq=3000, kv_len=4000)
  assert str(k) == "NVIDIA H100 80GB HBM3|flash_attention/pallas_triton|float16|d128|causal|s4096"


# ------------------------------------------------------------------------ cost model

@pytest.mark.parametrize("info,limit", [
    (FAKE_H100, 232448), (describe("H100 without driver figures", (9, 0)), 227 * 1024),
    (describe("NVIDIA A100", (8, 0)), 163 * 1024), (FAKE_99K, 99 * 1024),
    (describe("cpu", None), 99 * 1024)])
def test_shared_memory_limit(info, limit):
  assert shared_memory_limit(info) == limit


def test_cost_model_prunes_oversize_tiles_and_keeps_small_ones():
  big = BlockConfig(block_q=128, block_k=128, num_stages=4)
  reason = TRITON.fits(big, problem(head_dim=256), FAKE_99K)
  assert reason.startswith("forward shared memory: ") and reason.endswith("> 101,376 B")
  assert TRITON.fits(SMALL, problem(head_dim=64), FAKE_99K) is None


def test_cost_model_registers():
  # 128x128 tiles on 4 warps hold (128*128 + 128*128) / 128 = 256 fp32 per thread.
  reason = TRITON.fits(BlockConfig(block_q=128, block_k=128, num_warps=4, num_stages=1),
                       problem(dtype=jnp.float16), FAKE_H100)
  assert reason == f"forward registers: 256 fp32/thread > {REGISTER_BUDGET}"
  # The measured H100 winner for d128 (192 per thread) stays in.
  assert TRITON.fits(default_block_config(128, 2), problem(dtype=jnp.float16), FAKE_H100) is None


def test_backward_cost_is_checked_by_the_backward_stages_only():
  fwd, dkv, _ = BLOCK_SEARCH
  too_big_dkv = dataclasses.replace(default_block_config(128, 2), block_q_dkv=128,
                                    block_k_dkv=128, bwd_num_stages=4)
  assert TRITON.fits(too_big_dkv, problem(), FAKE_H100, fwd.kernels) is None
  assert TRITON.fits(too_big_dkv, problem(), FAKE_H100, dkv.kernels).startswith("dK/dV")
  assert TRITON.fits(too_big_dkv, problem(), FAKE_H100) is not None


def test_mosaic_cost_model_matches_what_failed_or_spilled_on_the_h100():
  """Tiles the H100 sweep saw exceed shared memory (or spill) are pruned; winners kept."""
  fits = lambda c, p: MOSAIC.fits(c, p, FAKE_H100)
  p128, p64 = problem(dtype=jnp.float16, causal=False), problem(jnp.float16, 64, 2048, False)
  assert fits(default_mosaic_config(128), p128) is None
  assert fits(default_mosaic_config(64), p64) is None
  # 232536 > 232448 bytes on the device: K/V ring too deep or too wide.
  assert "forward shared memory" in fits(MosaicBlockConfig(block_q=64, block_kv=192), p128)
  assert "forward shared memory" in fits(MosaicBlockConfig(block_kv=128, stages=3), p128)
  # 128x128 logits next to a 128x128 accumulator spilled (270 vs 527 TFLOP/s).
  assert "forward registers" in fits(MosaicBlockConfig(block_q=128, block_kv=128), p128)
  assert "dK/dV registers" in fits(MosaicBlockConfig(block_q_dkv=128, block_kv_dkv=64), p128)


@pytest.mark.parametrize("dk, dv, block_kv", [(192, 128, 128), (160, 96, 128), (192, 192, 64),
                                              (256, 128, 64), (128, 256, 64)])
def test_wide_heads_take_128_key_forward_tiles_where_the_shared_memory_allows(dk, dv, block_kv):
  """The H100 ran dk = 192, dv = 128 forwards on 128-key tiles (the output in a view of
  the Q tile: 208 KiB); wider pairs would need 240 KiB or more and keep 64-key tiles."""
  config = default_mosaic_config(dk, dv)
  assert config.block_kv == block_kv
  wide = problem(head_dim=dk, value_head_dim=dv, causal=False)
  assert MOSAIC.fits(config, wide, FAKE_H100, ("forward",)) is None
  if block_kv == 64:
    assert "forward shared memory" in MOSAIC.fits(
        dataclasses.replace(config, block_kv=128), wide, FAKE_H100, ("forward",))


def test_auto_passes_over_hopper_kernels_the_compiler_would_refuse():
  """Padded head dims (192, 256) ask 233,568 B of a CTA's 232,448 (Mosaic GPU's own count
  on the CPU lowering): "auto" takes the Triton kernels; a named backend says why."""
  wide = problem(head_dim=192, value_head_dim=256, causal=False)
  assert dict(FLASH.choices(wide, FAKE_H100))["pallas_mosaic"] == (
      "needs more than the device has with its config (forward shared memory: 233,568 B > "
      "232,448 B)")
  assert FLASH.prepare(wide, info=FAKE_H100).impl is TRITON
  with pytest.raises(ValueError, match="forward shared memory: 233,568 B > 232,448 B"):
    FLASH.prepare(wide, "pallas_mosaic", info=FAKE_H100)
  assert FLASH.prepare(problem(head_dim=192, causal=False), info=FAKE_H100).impl is MOSAIC
  # A decoding step's forward is the decode kernel's, which fits: only the backward counts.
  step = problem(head_dim=192, value_head_dim=256, seq=1, kv_len=4096, q_heads=32,
                 kv_heads=2, causal=False)
  assert FLASH.prepare(step, info=FAKE_H100).impl is MOSAIC
  # A ring's blocks are vetted with V's head dim (128 + 256: the Triton backward).
  from jattn.parallel.blocks import block_problem
  q, v = (jnp.zeros((1, 8, 2, d), jnp.bfloat16) for d in (128, 256))
  assert block_problem(q, q, v, causal=False, scale=0.1).head_dims == (128, 256)


def test_a_tuned_config_that_does_not_fit_a_call_with_more_inputs_gives_way_to_the_heuristic():
  """Tuned configs are kept per shape, not per segment ids or dropout, whose vectors need
  shared memory: where the tuned one would overflow, the heuristic's runs."""
  tuned = MosaicBlockConfig(block_q=64, block_kv=128, stages=2, block_q_dq=128, block_kv_dq=64,
                            bwd_stages=3)
  plain = problem(causal=False)
  cache.save_config(cache.TuningKey(H100, "flash_attention", "pallas_mosaic",
                                    MOSAIC.cache_key(plain)), tuned, ms=1.0, mode="fwd+bwd")
  assert FLASH.prepare(plain, "pallas_mosaic", info=FAKE_H100).config == tuned
  packed = dataclasses.replace(plain, segment_ids=True, dropout_rate=0.1)
  assert MOSAIC.compile_misfit(tuned, packed, FAKE_H100) == (
      "dQ shared memory: 235,632 B > 232,448 B")
  assert FLASH.prepare(packed, "pallas_mosaic", info=FAKE_H100).config == (
      MOSAIC.heuristic_config(packed, FAKE_H100))


def test_the_other_hopper_ops_route_by_the_compilers_count():
  """Retention's Hopper forward at (dk, dv) = (192, 256) with the abs-sum denominator (a
  row reduction's scratch) or packed sequences (segment ids); FP8 at head dim 256 with a
  float32 output tile; FP8 at a padded 192 for q and k, which its 8-bit tiles cannot
  split (V's, transposed, can)."""
  from jattn.fp8 import FP8_FLASH
  from jattn.retention import RETENTION_PARALLEL
  retention = lambda **kw: RETENTION_PARALLEL.prepare(RETENTION_PARALLEL.problem(
      q_len=512, dk=192, dv=256, dtype=jnp.bfloat16, heads=2, **kw),
      info=FAKE_H100).impl.backend.name
  assert retention() == "pallas_mosaic"
  assert retention(normalize="abs_sum") == retention(sequences=3) == "pallas_triton"
  fp8 = lambda d, out: FP8_FLASH.prepare(FP8_FLASH.problem(q_len=4096, head_dim=d,
                                                           out_dtype=out), info=FAKE_H100)
  assert fp8(256, jnp.bfloat16).impl.backend.name == "pallas_mosaic"
  assert fp8(256, jnp.float32).impl.backend.name == "xla"
  assert fp8(128, jnp.float32).config.block_kv == 256
  assert "a head dim that pads to 192" in dict(FP8_FLASH.choices(
      FP8_FLASH.problem(q_len=4096, head_dim=160), FAKE_H100))["pallas_mosaic"]
  assert fp8(128, jnp.bfloat16).impl.backend.name == FP8_FLASH.prepare(FP8_FLASH.problem(
      q_len=4096, head_dim=128, value_head_dim=192), info=FAKE_H100).impl.backend.name


@pytest.mark.parametrize("dk, dv, rows", [(192, 128, 96), (128, 64, 128), (256, 128, 128),
                                          (128, 128, 64), (256, 192, None), (128, 192, None)])
def test_the_forward_output_takes_a_view_of_the_q_tile_of_exactly_its_bytes(dk, dv, rows):
  assert output_view_rows(64, dk, dv) == rows


def test_fused_dq_is_costed_and_tuned_only_for_calls_that_allow_any_order():
  """fused_dq adds dS and fp32 dQ tiles to the dK/dV kernel; deterministic calls never run
  it, so neither its cost nor a fused candidate applies to them."""
  det = problem(dtype=jnp.float16, causal=False)
  any_order = dataclasses.replace(det, deterministic=False)
  fused = dataclasses.replace(default_mosaic_config(128), fused_dq=True, bwd_stages=4,
                              block_kv_dq=64)
  assert MOSAIC.fits(fused, det, FAKE_H100) is None  # runs the two kernels
  # (jax before 0.11 runs no fused dQ: FUSED_DQ_SUPPORTED)
  reason = MOSAIC.fits(fused, any_order, FAKE_H100)
  assert "dK/dV+dQ shared memory" in reason if FUSED_DQ_SUPPORTED else reason is None
  for p, expected in ((det, {False}), (any_order, {False, FUSED_DQ_SUPPORTED})):
    cands = _stage(search.plan("flash_attention", "pallas_mosaic", p, info=FAKE_H100),
                   "fused dQ")
    assert {c.config.fused_dq for c in cands if c.reason is None} == expected


# ------------------------------------------------------------------------ candidates

def _stage(cands, name):
  return [c for c in cands if c.stage.name == name]


def test_candidates_are_deduplicated_after_clamping_to_short_sequences():
  cands = search.plan("flash_attention", "pallas_triton", problem(jnp.float16, 16, 20, False),
                      info=FAKE_H100)
  fwd = _stage(cands, "forward")
  # Every block clamps to 32: only warps x stages remain.
  assert len(fwd) == 2 * 4 and len({c.config for c in fwd}) == len(fwd)
  assert {(c.config.block_q, c.config.block_k) for c in fwd} == {(32, 32)}
  assert len(_stage(cands, "dQ")) == 1
  cands = search.plan("flash_attention", "pallas_triton",
                      problem(jnp.float16, 16, 20, False, kv_len=1000), info=FAKE_H100)
  assert len(_stage(cands, "forward")) == 3 * 2 * 4  # block_k still varies
  assert {c.config.block_k_dq for c in _stage(cands, "dQ")} == {32, 64, 128}


def test_plan_starts_from_the_heuristic_and_prunes_with_reasons():
  cands = search.plan("flash_attention", "pallas_triton", problem(), info=FAKE_H100)
  assert cands[0].stage.name == "forward" and cands[0].reason is None
  assert cands[0].config == default_block_config(128, 2)
  assert len(_stage(cands, "forward")) == 72 and len(_stage(cands, "dK/dV")) == 72
  pruned = [c for c in cands if c.reason is not None]
  assert pruned and all(c.reason.split(":")[0] in (
      "forward shared memory", "forward registers", "dK/dV shared memory", "dK/dV registers",
      "dQ shared memory", "dQ registers") for c in pruned)
  assert all(TRITON.fits(c.config, problem(), FAKE_H100) is None for c in cands if not c.reason)


def test_every_triton_implementation_and_the_hopper_ones_are_tunable():
  tunable = {(op.name, impl.backend.name) for op in OPS.values() for impl in op.impls
             if impl.tuning_stages()}
  assert tunable == {("flash_attention", "pallas_triton"), ("flash_attention", "pallas_mosaic"),
                     ("window_attention", "pallas_triton"), ("dilated_attention", "pallas_triton"),
                     ("retention_parallel", "pallas_triton"),
                     ("retention_parallel", "pallas_mosaic"),
                     ("retention_chunkwise", "pallas_triton"),
                     ("flash_attention_varlen", "pallas_triton")}
  assert FLASH.impl("pallas_mosaic").tuning_stages() == FORWARD_SEARCH + BACKWARD_SEARCH
  for op_name, backend in tunable:  # every one plans on the H100 from its own heuristic
    op = OPS[op_name]
    cands = search.plan(op_name, backend, op.problem(dtype=jnp.bfloat16), info=FAKE_H100)
    assert cands and cands[0].reason is None


# ----------------------------------------------------------------------------- cache

def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
  assert cache.cache_path() == str(tmp_path / "cache" / "autotune.json")
  monkeypatch.delenv(cache.CACHE_DIR_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache.cache_path() == str(tmp_path / "xdg" / "jattn" / "autotune.json")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cache.cache_path() == str(tmp_path / "home" / ".cache" / "jattn" / "autotune.json")


def test_cache_round_trip(cache_dir):
  k = key(seq=100_000)  # a bucket the shipped table lacks
  assert cache.load_cache() == {}
  path = cache.save_config(k, SMALL, ms=1.5, mode="fwd+bwd")
  assert path == str(cache_dir / "autotune.json")
  data = json.loads((cache_dir / "autotune.json").read_text())
  assert data["version"] == 1 and set(data["entries"]) == {str(k)}
  entry = data["entries"][str(k)]
  assert entry["config"] == dataclasses.asdict(SMALL) and entry["ms"] == 1.5
  assert entry["mode"] == "fwd+bwd" and entry["jax"] and entry["tuned_at"]
  assert lookup(seq=100_000) == SMALL
  assert set(os.listdir(cache_dir)) <= {"autotune.json", "autotune.json.lock"}  # no temp files


def test_cache_is_reread_only_when_the_file_changes():
  k = key(seq=100_000)
  path = cache.save_config(k, SMALL, ms=1.5, mode="fwd")
  st = os.stat(path)
  text = open(path).read()
  # Same size, same mtime: the in-process copy is used.
  with open(path, "w") as f:
    f.write(text.replace('"ms": 1.5', '"ms": 2.5'))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert cache.load_cache()[str(k)]["ms"] == 1.5
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
  assert cache.load_cache()[str(k)]["ms"] == 2.5


@pytest.mark.parametrize("content", ["{not json", '{"version": 2, "entries": {}}',
                                     '{"version": 1, "entries": []}', "[1, 2]",
                                     "[" * 100_000])  # nested past Python's recursion limit
def test_a_bad_cache_warns_once_and_counts_as_empty(cache_dir, content):
  cache_dir.mkdir()
  (cache_dir / "autotune.json").write_text(content)
  with pytest.warns(RuntimeWarning, match="ignoring the autotune cache"):
    assert cache.load_cache() == {}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert cache.load_cache() == {}
    assert lookup(info=dataclasses.replace(FAKE_H100, name=H100)) == default_block_config(128, 2)


@pytest.mark.parametrize("edit", [
    lambda c: {**c, "block_kv": 64},  # a field this config class does not have
    lambda c: {k: v for k, v in c.items() if k != "num_warps"},  # a field missing
    lambda c: {**c, "block_q": 48},  # rejected by BlockConfig itself
    lambda c: {**c, "num_warps": 4.0},  # a float where an int goes
    lambda c: {**c, "num_stages": 2.5},
    lambda c: {**c, "num_stages": -3},
    lambda c: {**c, "block_q": True},
])
def test_entries_that_do_not_match_the_config_class_are_ignored(cache_dir, edit):
  cache_dir.mkdir()
  entry = {"config": edit(dataclasses.asdict(SMALL)), "ms": 1.0, "mode": "fwd+bwd",
           "jax": "0", "tuned_at": "2026-01-01"}
  (cache_dir / "autotune.json").write_text(
      json.dumps({"version": 1, "entries": {str(key()): entry}}))
  assert lookup() == default_block_config(128, 2)  # falls through to the shipped table


def test_shipped_table_parses_and_fits_the_cost_model():
  entries = cache.shipped_entries()
  assert len(entries) >= 2 * 2 * 2 * 2 * 2 * 4  # the flash entries, and what was added
  for name, entry in entries.items():
    gpu, opb, *fields = name.split("|")
    op_name, backend = opb.split("/")
    assert gpu in (H100, "NVIDIA H200"), name
    op = OPS[op_name]
    if backend == cache.RANKING:  # measured times of the op's backends
      assert set(entry["backend_ms"]) <= set(op.backends) and entry["mode"] == "fwd+bwd"
      assert cache.backend_times(cache.TuningKey(gpu, op_name, backend, tuple(fields)))
      continue
    impl = op.impl(backend)
    config = cache.config_from_entry(impl.config_cls, entry)
    assert isinstance(config, impl.config_cls), name
    if op_name == "flash_attention":
      dtype, d, causal, bucket = fields
      p = FlashProblem(q_len=int(bucket[1:]), head_dim=int(d[1:]), dtype=dtype,
                       causal=causal == "causal")
      assert tuple(fields) == impl.cache_key(p)
      assert impl.fits(config, p, FAKE_H100) is None, name


# ---------------------------------------------------------------------------- search

@dataclasses.dataclass(frozen=True)
class Toy:
  a: int = 1
  b: int = 1


class ToyImpl(Impl):
  """a=3 would be fastest but is pruned; b=3 would be fastest but fails to run."""

  backend = Backend("fake", lambda info: None)
  config_cls = Toy

  def heuristic_config(self, p, info):
    return Toy()

  def cache_key(self, p):
    return ("toy",)

  def tuning_stages(self):
    return (SearchGrid("A", "fwd", {"a": (1, 2, 3)}, ("A",)),
            SearchGrid("B", "fwd+bwd", {"b": (1, 2, 3)}, ("B",)))

  def fits(self, c, p, info, kernels=()):
    return "too big: a" if c.a == 3 and "B" not in kernels else None


class ToyOp(Op):
  name = "toy"
  problem_cls = FlashProblem


@pytest.fixture
def toy(monkeypatch):
  op = ToyOp(ToyImpl())
  OPS.pop("toy")  # registered by its constructor: only for this test
  monkeypatch.setitem(OPS, "toy", op)
  calls = []

  def time_op(op, problem, backend, *, config, mode, reps):
    calls.append((config, mode))
    if mode == "fwd+bwd" and config.b == 3:
      raise RuntimeError("out of resources")
    return 10.0 - config.a - (config.b if mode == "fwd+bwd" else 0)

  monkeypatch.setattr(search, "time_op", time_op)
  return calls


def test_search_takes_the_fastest_fitting_candidate_that_runs(toy, capsys):
  assert search.tune("toy", "fake", FlashProblem(), info=FAKE_H100) == Toy(a=2, b=2)
  # Stage B varies b with stage A's winner fixed; nothing is timed twice.
  assert [c for c, m in toy if m == "fwd+bwd"] == [Toy(2, 1), Toy(2, 2), Toy(2, 3)]
  assert len(toy) == len(set(toy)) == 5
  err = capsys.readouterr().err
  assert "pruned 1 (too big: 1)" in err
  assert "failed 1 (first: b=3: RuntimeError: out of resources)" in err
  assert "[####################] 3/3 best 6.000 ms" in err
  entry = cache.load_cache()[f"{H100}|toy/fake|toy"]
  assert entry["ms"] == 6.0 and entry["mode"] == "fwd+bwd"


def test_cli_writes_every_candidates_time(toy, tmp_path, capsys):
  path = tmp_path / "out" / "timings.json"
  assert cli.main(["--op", "toy", "--backend", "fake", "--dtype", "bfloat16",
                   "--timings", str(path)]) == 0
  record = json.loads(path.read_text())
  assert record["key"].endswith("|toy/fake|toy") and record["best"] == {"a": 2, "b": 2}
  assert [(t["stage"], t["config"], t["ms"]) for t in record["timings"]] == [
      ("A", {"a": 1, "b": 1}, 9.0), ("A", {"a": 2, "b": 1}, 8.0),
      ("B", {"a": 2, "b": 1}, 7.0), ("B", {"a": 2, "b": 2}, 6.0), ("B", {"a": 2, "b": 3}, None)]
  assert record["problem"]["dtype"] == "bfloat16"
  toy.clear()
  assert cli.main(["--op", "toy", "--backend", "fake", "--timings", str(tmp_path)]) == 2
  assert "error: --timings" in capsys.readouterr().err and toy == []  # refused before timing


def test_search_limits_and_errors(toy, capsys):
  tune = lambda **kw: search.tune("toy", "fake", FlashProblem(), info=FAKE_H100, **kw)
  assert tune(max_candidates=1, save=False, progress=False) == Toy()
  assert toy == [(Toy(), "fwd"), (Toy(), "fwd+bwd")]
  assert capsys.readouterr().err == "" and cache.load_cache() == {}
  with pytest.raises(ValueError, match="reps must be a positive int"):
    tune(reps=0)
  with pytest.raises(ValueError, match="max_candidates must be a positive int"):
    tune(max_candidates=0)
  with pytest.raises(ValueError, match="nothing to tune for op 'flash_attention' on backend "
                                       "'cudnn'; tunable: .*toy/fake"):
    search.tune("flash_attention", "cudnn", FlashProblem(), info=FAKE_H100)


@pytest.mark.parametrize("where", ["/proc", "a file", "a folder named as the file"])
def test_an_unwritable_cache_is_refused_before_the_search(toy, tmp_path, monkeypatch, capsys,
                                                          where):
  """Issue 37, item 12: the result of a long search is not lost at its end."""
  location = {"/proc": "/proc/jattn-cache", "a file": tmp_path / "file",
              "a folder named as the file": tmp_path / "cache"}[where]
  (tmp_path / "file").write_text("not a folder")
  (tmp_path / "cache/autotune.json").mkdir(parents=True)
  monkeypatch.setenv(cache.CACHE_DIR_ENV, str(location))
  with pytest.raises(ValueError, match="cannot write the autotune cache"):
    search.tune("toy", "fake", FlashProblem(), info=FAKE_H100, progress=False)
  assert cli.main(["--op", "toy", "--backend", "fake"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "error: cannot write the autotune cache" in err, err
  assert toy == []  # nothing was timed


def test_an_empty_cache_dir_is_not_the_home_cache(toy, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  monkeypatch.setenv(cache.CACHE_DIR_ENV, "")
  with pytest.raises(ValueError, match="JATTN_CACHE_DIR is set but empty"):
    search.tune("toy", "fake", FlashProblem(), info=FAKE_H100, progress=False)
  with pytest.warns(RuntimeWarning, match="no autotune cache: JATTN_CACHE_DIR is set but empty"):
    assert cache.load_cache() == {}
  assert cli.main(["--show-cache"]) == 2
  assert "JATTN_CACHE_DIR is set but empty" in capsys.readouterr().err
  assert toy == [] and not (tmp_path / "home").exists()


def test_search_raises_when_nothing_runs(toy, monkeypatch):
  monkeypatch.setattr(search, "time_op", lambda *a, **k: (_ for _ in ()).throw(OSError("gone")))
  with pytest.raises(RuntimeError, match="no candidate ran .* OSError: gone"):
    search.tune("toy", "fake", FlashProblem(), info=FAKE_H100, progress=False)


def test_search_grid_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match=r"SearchGrid.mode must be one of \('fwd', 'fwd\+bwd'\)"):
    SearchGrid("A", "bwd", {"a": (1,)})


@CPU_ONLY
@pytest.mark.parametrize("op_name,keywords,expect", [
    ("flash_attention", dict(q_len=32, head_dim=16, dtype=jnp.float32, causal=True),
     "|flash_attention/pallas_triton|float32|d16|causal|s128"),
    ("retention_chunkwise", dict(q_len=32, dk=16, dtype=jnp.float32),
     "|retention_chunkwise/pallas_triton|float32|dk16|dv16|s128|b1"),
])
def test_tiny_real_tune_in_interpret_mode(monkeypatch, capsys, op_name, keywords, expect):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  op = OPS[op_name]
  config = search.tune(op_name, "pallas_triton", op.problem(**keywords), reps=1,
                       max_candidates=2)
  assert isinstance(config, op.impl("pallas_triton").config_cls)
  (name, entry), = cache.load_cache().items()
  assert name.endswith(expect) and entry["ms"] > 0
  assert cache.config_from_entry(type(config), entry) == config
  assert "2/2 best" in capsys.readouterr().err


# ------------------------------------------------------------------------------- CLI

def test_cli_dry_run_lists_candidates_and_pruned_ones(monkeypatch, capsys):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  argv = ["--op", "flash", "--batch", "4", "--seq", "4096", "--heads", "16", "--head-dim",
          "128", "--dtype", "bfloat16", "--causal", "--dry-run"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "|flash_attention/pallas_triton|bfloat16|d128|causal|s4096" in out.splitlines()[0]
  assert "stage forward (fwd): 72 candidates" in out
  assert "  prune block_q=128 block_k=128 num_warps=4 num_stages=4  [forward shared memory" in out
  assert cache.load_cache() == {}  # nothing timed, nothing saved


def test_cli_lists_every_tunable_implementation(capsys):
  assert cli.main(["--list"]) == 0
  out = capsys.readouterr().out
  for name in ("flash_attention --backend pallas_triton", "flash_attention --backend "
               "pallas_mosaic", "window_attention", "dilated_attention", "retention_parallel",
               "retention_chunkwise"):
    assert name in out


@CPU_ONLY
@pytest.mark.parametrize("argv,message", [
    (["--seq", "64", "--dry-run"], "backend 'pallas_triton' is not usable on cpu"),
    (["--backend", "cudnn"], "nothing to tune for op 'flash_attention' on backend 'cudnn'"),
    (["--windows", "3"], "--windows does not apply to flash_attention"),
    (["--heads", "0"], "q_heads must be a positive int, got 0"),
    (["--set", "nope=1"], "--set takes FIELD=VALUE with FIELD one of"),
    (["--reps", "0", "--dry-run"], "--reps must be >= 1"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_cli_mistakes_exit_2_with_one_line(argv, message):
  env = {k: v for k, v in os.environ.items() if k != "JATTN_INTERPRET"}
  done = subprocess.run([sys.executable, "-m", "jattn.autotune", *argv], capture_output=True,
                        text=True, env=env, timeout=120)
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], done.stderr


def test_cli_show_cache(capsys, cache_dir):
  cache.save_config(key(), SMALL, ms=1.25, mode="fwd+bwd")
  assert cli.main(["--show-cache"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{cache_dir / 'autotune.json'}: 1 entries\n")
  assert f"{key()} 1.250 ms (fwd+bwd)" in out and '"block_q": 32' in out


def test_writers_in_several_processes_keep_every_entry(cache_dir):
  """Each of 4 processes saves 10 entries at once: all 40 are in the file (writers
  take the cache's lock for their read, change and replace)."""
  script = ("import sys; from jattn.core import cache; from jattn.kernels.common.config "
            "import BlockConfig\nfor i in range(10):\n  cache.save_config(cache.TuningKey("
            "'gpu', 'op', 'b', (sys.argv[1], str(i))), BlockConfig(), ms=1.0, mode='fwd')")
  writers = [subprocess.Popen([sys.executable, "-c", script, str(n)]) for n in range(4)]
  assert all(w.wait(timeout=120) == 0 for w in writers)
  assert len(cache.load_cache()) == 40


def test_cli_warns_in_one_line_and_ends_quietly_when_its_reader_goes(cache_dir):
  """A corrupt cache is a one-line warning (not Python's two); a closed output pipe
  (`... | head -1`) ends the tool without a traceback."""
  cache_dir.mkdir()
  (cache_dir / "autotune.json").write_text("{corrupt")
  command = [sys.executable, "-m", "jattn.autotune", "--show-cache"]
  done = subprocess.run(command, capture_output=True, text=True, timeout=120)
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 0 and len(lines) == 1, done.stderr
  assert lines[0].startswith("python -m jattn.autotune: warning: ignoring the autotune cache")
  read, write = os.pipe()
  os.close(read)  # a reader that has gone: every write fails
  try:
    done = subprocess.run([*command[:3], "--list"], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=120)
  finally:
    os.close(write)
  assert done.returncode == 1 and done.stderr == "", done.stderr


def test_ship_backend_times_writes_rankings_auto_reads(tmp_path, monkeypatch):
  """bench/ship_backend_times.py, run as a maintainer runs it on a results file: its
  default table is the one jattn ships, and what it writes is the ranking ``auto``
  reads back."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  try:
    from bench import ship_backend_times
  finally:
    sys.path.remove(root)
  assert os.path.samefile(ship_backend_times.SHIPPED,
                          os.path.join(os.path.dirname(cache.__file__), "shipped.json"))
  table = tmp_path / "table.json"
  table.write_text(json.dumps({"version": cache.CACHE_VERSION, "entries": {}}))
  results = os.path.join(root, "bench", "results", "flash_issue41_h100_fwd_bwd.json")
  subprocess.run([sys.executable, os.path.join(root, "bench", "ship_backend_times.py"),
                  results, "--table", str(table)], check=True, capture_output=True)
  entries = cache._parse_entries(table.read_text())
  assert len(entries) == 8  # the run's d128 rows: 2 dtypes x causal or not x 2 lengths
  monkeypatch.setattr(cache, "shipped_entries", lambda: entries)
  for name in entries:
    gpu, opb, *fields = name.split("|")
    times, mode, source = cache.backend_times(cache.TuningKey(gpu, "flash_attention",
                                                              cache.RANKING, tuple(fields)))
    assert set(times) == {"pallas_mosaic", "pallas_triton", "cudnn"}
    assert (mode, source, opb) == ("fwd+bwd", "shipped table", "flash_attention/auto")
