"""The autotuner: keys, cost model, candidates, cache, lookup order, search and CLI (CPU)."""

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

import jattn.autotune as at
from jattn.gpu import describe
from pallas_kernels.flash import (FlashBlockConfig, MosaicBlockConfig, default_config,
                                  default_mosaic_config)

CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="asserts what a machine without a GPU reports")
H100 = "NVIDIA H100 80GB HBM3"
FAKE_H100 = describe(H100, (9, 0), shared_memory_per_block_bytes=232448, interpret=False)
FAKE_99K = describe("NVIDIA GeForce RTX 3090", (8, 6), interpret=False)  # no smem figure
FLASH = at.TUNABLE[("flash_attention", "pallas_triton")]
SMALL = FlashBlockConfig(block_q=32, block_k=32, num_warps=4, num_stages=1, block_q_dkv=32,
                         block_k_dkv=32, block_q_dq=32, block_k_dq=32, bwd_num_warps=4,
                         bwd_num_stages=1)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  """Every test gets an empty cache directory; the real ~/.cache is never touched."""
  path = tmp_path / "cache"
  monkeypatch.setenv(at.CACHE_DIR_ENV, str(path))
  return path


def key(gpu=H100, dtype=jnp.bfloat16, head_dim=128, seq=4096, causal=True):
  return at.make_key(gpu, "flash_attention", "pallas_triton", dtype=dtype, head_dim=head_dim,
                     q_len=seq, kv_len=seq, causal=causal)


def lookup(info=FAKE_H100, dtype=jnp.bfloat16, head_dim=128, seq=4096, causal=True):
  return at.lookup_config("flash_attention", "pallas_triton", dtype=dtype, head_dim=head_dim,
                          q_len=seq, kv_len=seq, causal=causal, info=info)


# ------------------------------------------------------------------------------ keys

@pytest.mark.parametrize("q_len,kv_len,bucket", [
    (1, 1, 128), (128, 100, 128), (129, 1, 256), (4096, 4096, 4096), (4097, 10, 8192),
    (100, 5000, 8192), (10**6, 1, 65536)])
def test_seq_bucket(q_len, kv_len, bucket):
  assert at.seq_bucket(q_len, kv_len) == bucket


def test_key_string_pads_head_dim_and_buckets_the_longer_sequence():
  k = at.make_key(H100, "flash_attention", "pallas_triton", dtype=jnp.float16, head_dim=100,
                  q_len=3000, kv_len=4000, causal=True)
  assert str(k) == "NVIDIA H100 80GB HBM3|flash_attention/pallas_triton|float16|d128|causal|s4096"
  k = at.make_key("NVIDIA H200", "flash_attention", "pallas_triton", dtype="bfloat16",
                  head_dim=64, q_len=5000, kv_len=8, causal=False)
  assert str(k) == "NVIDIA H200|flash_attention/pallas_triton|bfloat16|d64|noncausal|s8192"


# ------------------------------------------------------------------------ cost model

@pytest.mark.parametrize("info,limit", [
    (FAKE_H100, 232448), (describe("H100 without driver figures", (9, 0)), 227 * 1024),
    (describe("NVIDIA A100", (8, 0)), 163 * 1024), (FAKE_99K, 99 * 1024),
    (describe("cpu", None), 99 * 1024)])
def test_shared_memory_limit(info, limit):
  assert at.shared_memory_limit(info) == limit


def test_cost_model_prunes_oversize_tiles_and_keeps_small_ones():
  big = FlashBlockConfig(block_q=128, block_k=128, num_stages=4)
  ok, reason = FLASH.fits(big, at.Problem(q_len=4096, head_dim=256, dtype=jnp.bfloat16,
                                          causal=False), FAKE_99K)
  assert not ok and reason.startswith("forward shared memory: ") and "> 99 KiB" in reason
  ok, reason = FLASH.fits(SMALL, at.Problem(q_len=4096, head_dim=64, dtype=jnp.bfloat16,
                                            causal=False), FAKE_99K)
  assert ok and reason == ""


def test_cost_model_registers():
  problem = at.Problem(q_len=4096, head_dim=128, dtype=jnp.float16, causal=False)
  # 128x128 tiles on 4 warps hold (128*128 + 128*128) / 128 = 256 fp32 per thread.
  ok, reason = FLASH.fits(FlashBlockConfig(block_q=128, block_k=128, num_warps=4, num_stages=1),
                          problem, FAKE_H100)
  assert not ok and reason == f"forward registers: 256 fp32/thread > {at.REGISTER_BUDGET}"
  # The measured H100 winner for d128 (192 per thread) stays in.
  assert FLASH.fits(default_config(128, 2), problem, FAKE_H100) == (True, "")


def test_backward_cost_is_checked_by_the_backward_stages_only():
  problem = at.Problem(q_len=4096, head_dim=128, dtype=jnp.bfloat16, causal=False)
  fwd, dkv, dq = FLASH.stages
  too_big_dkv = dataclasses.replace(default_config(128, 2), block_q_dkv=128, block_k_dkv=128,
                                    bwd_num_stages=4)
  assert fwd.fits(too_big_dkv, problem, FAKE_H100)[0]
  ok, reason = dkv.fits(too_big_dkv, problem, FAKE_H100)
  assert not ok and reason.startswith("dK/dV")
  assert not FLASH.fits(too_big_dkv, problem, FAKE_H100)[0]


# ------------------------------------------------------------------------ candidates

def _stage(cands, name):
  return [c for c in cands if c.stage.name == name]


def test_candidates_are_deduplicated_after_clamping_to_short_sequences():
  cands = at.plan(q_len=20, kv_len=20, head_dim=16, dtype=jnp.float16, causal=False,
                  info=FAKE_H100)
  fwd = _stage(cands, "forward")
  # Every block clamps to 32: only warps x stages remain.
  assert len(fwd) == 2 * 4
  assert len({c.config for c in fwd}) == len(fwd)
  assert {(c.config.block_q, c.config.block_k) for c in fwd} == {(32, 32)}
  assert len(_stage(cands, "dQ")) == 1

  cands = at.plan(q_len=20, kv_len=1000, head_dim=16, dtype=jnp.float16, causal=False,
                  info=FAKE_H100)
  assert len(_stage(cands, "forward")) == 3 * 2 * 4  # block_k still varies
  assert {c.config.block_k_dq for c in _stage(cands, "dQ")} == {32, 64, 128}


def test_plan_starts_from_the_default_and_prunes_with_reasons():
  cands = at.plan(q_len=4096, head_dim=128, dtype=jnp.bfloat16, causal=True, info=FAKE_H100)
  assert [c.stage.name for c in cands[:1]] == ["forward"]
  assert cands[0].config == default_config(128, 2) and cands[0].reason is None
  assert len(_stage(cands, "forward")) == 72 and len(_stage(cands, "dK/dV")) == 72
  pruned = [c for c in cands if c.reason is not None]
  assert pruned and all(c.reason.split(":")[0] in (
      "forward shared memory", "forward registers", "dK/dV shared memory", "dK/dV registers",
      "dQ shared memory", "dQ registers") for c in pruned)
  assert all(FLASH.fits(c.config, at.Problem(q_len=4096, head_dim=128, dtype=jnp.bfloat16,
                                             causal=True), FAKE_H100)[0]
             for c in cands if c.reason is None)


def test_start_config_is_moved_to_fit_a_small_gpu():
  problem = at.Problem(q_len=4096, head_dim=128, dtype=jnp.bfloat16, causal=False)
  assert not FLASH.fits(default_config(128, 2), problem, FAKE_99K)[0]
  start = FLASH.start(problem, FAKE_99K)
  assert FLASH.fits(start, problem, FAKE_99K) == (True, "")


# ----------------------------------------------------------------------------- cache

def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
  assert at.cache_path() == str(tmp_path / "cache" / "autotune.json")
  monkeypatch.delenv(at.CACHE_DIR_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert at.cache_path() == str(tmp_path / "xdg" / "jattn" / "autotune.json")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert at.cache_path() == str(tmp_path / "home" / ".cache" / "jattn" / "autotune.json")


def test_cache_round_trip(cache_dir):
  k = key(seq=100_000)  # a bucket the shipped table lacks
  assert at.load_cache() == {}
  path = at.save_config(k, SMALL, ms=1.5, mode="fwd+bwd")
  assert path == str(cache_dir / "autotune.json")
  data = json.loads((cache_dir / "autotune.json").read_text())
  assert data["version"] == 1 and set(data["entries"]) == {str(k)}
  entry = data["entries"][str(k)]
  assert entry["config"] == dataclasses.asdict(SMALL) and entry["ms"] == 1.5
  assert entry["mode"] == "fwd+bwd" and entry["jax"] and entry["tuned_at"]
  assert at.load_cache()[str(k)]["config"] == dataclasses.asdict(SMALL)
  assert lookup(seq=100_000) == SMALL
  assert [p for p in os.listdir(cache_dir) if p != "autotune.json"] == []  # no temp files left


def test_cache_is_reread_only_when_the_file_changes(cache_dir):
  k = key(seq=100_000)
  path = at.save_config(k, SMALL, ms=1.5, mode="fwd")
  st = os.stat(path)
  text = open(path).read()
  assert '"ms": 1.5' in text
  # Same size, same mtime: the in-process copy is used.
  with open(path, "w") as f:
    f.write(text.replace('"ms": 1.5', '"ms": 2.5'))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert at.load_cache()[str(k)]["ms"] == 1.5
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
  assert at.load_cache()[str(k)]["ms"] == 2.5


def test_corrupt_cache_warns_once_and_counts_as_empty(cache_dir):
  cache_dir.mkdir()
  (cache_dir / "autotune.json").write_text("{not json")
  with pytest.warns(RuntimeWarning, match="ignoring the autotune cache"):
    assert at.load_cache() == {}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert at.load_cache() == {}
    assert lookup() == default_config(128, 2)  # the shipped table still answers
  at.save_config(key(), SMALL, ms=1.0, mode="fwd+bwd")  # replaces the corrupt file
  assert lookup() == SMALL


@pytest.mark.parametrize("content", [
    '{"version": 2, "entries": {}}', '{"version": 1, "entries": []}', "[1, 2]"])
def test_cache_of_the_wrong_shape_is_ignored(cache_dir, content):
  cache_dir.mkdir()
  (cache_dir / "autotune.json").write_text(content)
  with pytest.warns(RuntimeWarning, match="ignoring the autotune cache"):
    assert at.load_cache() == {}


@pytest.mark.parametrize("edit", [
    lambda c: {**c, "block_kv": 64},  # a field this config class does not have
    lambda c: {k: v for k, v in c.items() if k != "num_warps"},  # a field missing
    lambda c: {**c, "block_q": 48},  # rejected by FlashBlockConfig itself
])
def test_entries_that_do_not_match_the_config_class_are_ignored(cache_dir, edit):
  cache_dir.mkdir()
  entry = {"config": edit(dataclasses.asdict(SMALL)), "ms": 1.0, "mode": "fwd+bwd",
           "jax": "0", "tuned_at": "2026-01-01"}
  (cache_dir / "autotune.json").write_text(
      json.dumps({"version": 1, "entries": {str(key()): entry}}))
  assert lookup() == default_config(128, 2)  # falls through to the shipped table


# ---------------------------------------------------------------------------- lookup

def test_lookup_order_user_cache_then_shipped_table_then_none():
  shipped = lookup()
  assert shipped == default_config(128, 2)
  at.save_config(key(), SMALL, ms=1.0, mode="fwd+bwd")
  assert lookup() == SMALL
  assert lookup(causal=False) == shipped  # only that key was overridden
  assert lookup(dtype=jnp.float32) is None
  assert lookup(seq=100_000) is None


@CPU_ONLY
def test_lookup_is_none_off_gpu():
  cpu = describe("cpu (cpu)", None, interpret=True)
  at.save_config(key(gpu=cpu.name), SMALL, ms=1.0, mode="fwd+bwd")
  assert lookup(info=cpu) is None
  assert lookup(info=None) is None  # this test machine has no GPU
  assert at.lookup_config("flash_attention", "no_such_backend", dtype=jnp.float16,
                          head_dim=64, q_len=64, kv_len=64, causal=False, info=FAKE_H100) is None


def test_shipped_table_parses_and_fits_the_cost_model():
  text = (at.importlib.resources.files("jattn") / "autotune_defaults.json").read_text()
  data = json.loads(text)
  assert "bench/results/flash_sweep" in data["source"]
  entries = at.shipped_entries()
  # GPUs x backends x dtypes x head dims x causal x buckets
  assert len(entries) == 2 * 2 * 2 * 2 * 2 * 4
  expected = {"flash_attention/pallas_triton": (FlashBlockConfig, lambda d: default_config(d, 2)),
              "flash_attention/pallas_mosaic": (MosaicBlockConfig, default_mosaic_config)}
  for name, entry in entries.items():
    gpu, opb, dtype, d, causal, bucket = name.split("|")
    assert gpu in (H100, "NVIDIA H200") and opb in expected, name
    assert dtype in ("float16", "bfloat16") and causal in ("causal", "noncausal"), name
    assert int(bucket[1:]) in (2048, 4096, 8192, 16384), name
    tunable = at.TUNABLE[tuple(opb.split("/"))]
    config_cls, default = expected[opb]
    config = at._config_from_entry(tunable, entry)
    assert isinstance(config, config_cls), name
    assert config == default(int(d[1:])), name
    problem = at.Problem(q_len=int(bucket[1:]), head_dim=int(d[1:]), dtype=dtype,
                         causal=causal == "causal")
    assert tunable.fits(config, problem, FAKE_H100) == (True, ""), name


def test_mosaic_cost_model_matches_what_failed_or_spilled_on_the_h100():
  """Tiles the H100 sweep saw exceed shared memory (or spill) are pruned; winners kept."""
  mosaic = at.TUNABLE[("flash_attention", "pallas_mosaic")]
  p128 = at.Problem(q_len=4096, head_dim=128, dtype="float16", causal=False)
  p64 = at.Problem(q_len=2048, head_dim=64, dtype="float16", causal=False)
  ok = lambda c, p: mosaic.fits(c, p, FAKE_H100)
  assert ok(default_mosaic_config(128), p128) == (True, "")
  assert ok(default_mosaic_config(64), p64) == (True, "")
  # 232536 > 232448 bytes on the device: K/V ring too deep or too wide.
  fits, why = ok(MosaicBlockConfig(block_q=64, block_kv=192, stages=2), p128)
  assert not fits and "forward shared memory" in why
  fits, why = ok(MosaicBlockConfig(block_q=64, block_kv=128, stages=3), p128)
  assert not fits and "forward shared memory" in why
  # 128x128 logits next to a 128x128 accumulator spilled (270 vs 527 TFLOP/s).
  fits, why = ok(MosaicBlockConfig(block_q=128, block_kv=128, stages=2), p128)
  assert not fits and "forward registers" in why
  fits, why = ok(MosaicBlockConfig(block_q_dkv=128, block_kv_dkv=64), p128)
  assert not fits and "dK/dV registers" in why


# ---------------------------------------------------------------------------- search

@dataclasses.dataclass(frozen=True)
class Toy:
  a: int = 1
  b: int = 1


def toy_tunable(calls):
  """a=3 would be fastest but is pruned; b=3 would be fastest but fails to run."""

  def time(config, problem, mode, reps):
    calls.append((config, mode))
    if mode == "fwd+bwd" and config.b == 3:
      raise RuntimeError("out of resources")
    return 10.0 - config.a - (config.b if mode == "fwd+bwd" else 0)

  return at.Tunable(
      config_cls=Toy, default_config=lambda p: Toy(), normalize=lambda c, p: c,
      fits=lambda c, p, i: (True, ""), time=time,
      stages=(at.SearchStage("A", "fwd", {"a": (1, 2, 3)},
                             lambda c, p, i: (c.a != 3, "too big: a")),
              at.SearchStage("B", "fwd+bwd", {"b": (1, 2, 3)}, lambda c, p, i: (True, ""))))


@pytest.fixture
def toy(monkeypatch):
  calls = []
  monkeypatch.setitem(at.TUNABLE, ("toy", "fake"), toy_tunable(calls))
  info = dataclasses.replace(FAKE_H100, backends=FAKE_H100.backends + ("fake",))
  return calls, info


def toy_tune(info, **kwargs):
  return at.tune("toy", "fake", batch=1, q_len=256, q_heads=1, head_dim=64,
                 dtype=jnp.float16, causal=False, info=info, **kwargs)


def test_search_takes_the_fastest_fitting_candidate_that_runs(toy, capsys):
  calls, info = toy
  assert toy_tune(info) == Toy(a=2, b=2)
  # Stage B varies b with stage A's winner fixed; nothing is timed twice.
  assert [c for c, m in calls if m == "fwd+bwd"] == [Toy(2, 1), Toy(2, 2), Toy(2, 3)]
  assert len(calls) == len(set(calls)) == 5
  err = capsys.readouterr().err
  assert "pruned 1 (too big: 1)" in err
  assert "failed 1 (first: b=3: RuntimeError: out of resources)" in err
  assert "[####################] 3/3 best 6.000 ms" in err
  entry = at.load_cache()[str(at.make_key(H100, "toy", "fake", dtype=jnp.float16, head_dim=64,
                                          q_len=256, kv_len=256, causal=False))]
  assert entry["ms"] == 6.0 and entry["mode"] == "fwd+bwd"
  # The generic (de)serialisation brings the toy config back.
  assert at.lookup_config("toy", "fake", dtype=jnp.float16, head_dim=64, q_len=200,
                          kv_len=200, causal=False, info=info) == Toy(a=2, b=2)


def test_search_limits_and_errors(toy, capsys):
  calls, info = toy
  assert toy_tune(info, max_candidates=1, save=False, progress=False) == Toy()
  assert calls == [(Toy(), "fwd"), (Toy(), "fwd+bwd")]
  assert capsys.readouterr().err == "" and at.load_cache() == {}
  with pytest.raises(ValueError, match="reps must be a positive int"):
    toy_tune(info, reps=0)
  with pytest.raises(ValueError, match="max_candidates must be a positive int"):
    toy_tune(info, max_candidates=0)
  with pytest.raises(ValueError, match="backend 'fake' is not usable"):
    toy_tune(FAKE_H100)
  with pytest.raises(ValueError, match=r"\(op, backend\) must be one of"):
    at.tune("flash_attention", "cudnn", batch=1, q_len=8, q_heads=1, head_dim=8,
            dtype=jnp.float16, causal=False, info=info)


def test_search_raises_when_nothing_runs(monkeypatch, toy):
  _, info = toy
  broken = dataclasses.replace(at.TUNABLE[("toy", "fake")],
                               time=lambda *a: (_ for _ in ()).throw(OSError("no device")))
  monkeypatch.setitem(at.TUNABLE, ("toy", "fake"), broken)
  with pytest.raises(RuntimeError, match="no candidate ran .* OSError: no device"):
    toy_tune(info, progress=False)


def test_search_stage_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match=r"SearchStage.mode must be one of \('fwd', 'fwd\+bwd'\)"):
    at.SearchStage("A", "bwd", {"a": (1,)}, lambda c, p, i: (True, ""))


@pytest.mark.parametrize("kwargs,match", [
    (dict(q_len=0), "q_len must be a positive int"),
    (dict(q_heads=3, kv_heads=2), r"q_heads \(3\) must be a multiple of kv_heads \(2\)"),
    (dict(dtype=jnp.int32), "dtype must be float16, bfloat16 or float32, got int32"),
])
def test_problem_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    at.Problem(**{**dict(q_len=8, head_dim=8, dtype=jnp.float16, causal=False), **kwargs})


@CPU_ONLY
def test_tiny_real_tune_in_interpret_mode(monkeypatch, capsys):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  config = at.tune(batch=1, q_len=32, q_heads=1, head_dim=16, dtype=jnp.float32, causal=True,
                   reps=1, max_candidates=2)
  assert isinstance(config, FlashBlockConfig)
  assert {config.block_q, config.block_k, config.block_q_dkv, config.block_k_dkv,
          config.block_q_dq, config.block_k_dq} == {32}  # clamped to the sequence
  entries = at.load_cache()
  assert len(entries) == 1
  (name, entry), = entries.items()
  assert name.endswith("|flash_attention/pallas_triton|float32|d16|causal|s128")
  assert entry["ms"] > 0 and entry["mode"] == "fwd+bwd"
  assert at._config_from_entry(FLASH, entry) == config
  assert "2/2 best" in capsys.readouterr().err


# ------------------------------------------------------------------------------- CLI

def test_cli_dry_run_lists_candidates_and_pruned_ones(monkeypatch, capsys):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  argv = ["--op", "flash", "--batch", "4", "--seq", "4096", "--heads", "16", "--head-dim",
          "128", "--dtype", "bfloat16", "--causal", "--dry-run"]
  assert at.main(argv) == 0
  out = capsys.readouterr().out
  assert "|flash_attention/pallas_triton|bfloat16|d128|causal|s4096" in out.splitlines()[0]
  assert "stage forward (fwd): 72 candidates" in out
  assert "  keep  block_q=128 block_k=64 num_warps=4 num_stages=2" in out
  assert "  prune block_q=128 block_k=128 num_warps=4 num_stages=4  [forward shared memory" in out
  listed = [line for line in out.splitlines() if line.startswith(("  keep", "  prune"))]
  assert len(listed) == len(at.plan(q_len=4096, head_dim=128, dtype=jnp.bfloat16, causal=True))
  assert at.load_cache() == {}  # nothing timed, nothing saved


@CPU_ONLY
def test_cli_exits_2_for_an_unusable_backend(monkeypatch, capsys):
  monkeypatch.delenv("JATTN_INTERPRET", raising=False)
  argv = ["--seq", "64", "--heads", "1", "--head-dim", "16", "--dry-run"]
  assert at.main(argv + ["--backend", "pallas_triton"]) == 2
  err = capsys.readouterr().err
  assert "backend 'pallas_triton' is not usable" in err and "JATTN_INTERPRET=1" in err
  assert at.main(argv + ["--backend", "cudnn"]) == 2
  assert "nothing to tune for --op flash_attention --backend cudnn" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    at.main(["--heads", "1"])
  assert exit_info.value.code == 2
  assert "--seq, --head-dim required" in capsys.readouterr().err


def test_cli_show_cache(capsys, cache_dir):
  at.save_config(key(), SMALL, ms=1.25, mode="fwd+bwd")
  assert at.main(["--show-cache"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f"{cache_dir / 'autotune.json'}: 1 entries\n")
  assert f"{key()} 1.250 ms (fwd+bwd)" in out and '"block_q": 32' in out
