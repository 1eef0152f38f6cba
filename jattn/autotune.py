"""Block-size search for the Pallas kernels, with an on-disk cache of the winners.

A tuned config is stored under a key of (GPU name, op/backend, dtype, padded head
dim, causal, sequence bucket), e.g.
``"NVIDIA H100 80GB HBM3|flash_attention/pallas_triton|float16|d128|causal|s4096"``;
the bucket is the next power of two of ``max(q_len, kv_len)``, clamped to
``[128, 65536]``. ``lookup_config`` answers from the user cache, then from the table
shipped with the package (``autotune_defaults.json``), else None.

Search (``tune``): each op/backend pair registered in ``TUNABLE`` lists stages; a
stage varies some config fields over a small grid, keeps the others at the previous
stage's winner, and is timed in its mode (``"fwd"`` or ``"fwd+bwd"``). For the
Triton flash kernels: forward tiles on forward time, then the dK/dV tiles with the
backward launch parameters, then the dQ tiles, both on forward+backward time.

Cost model (prunes candidates before anything is compiled; ``d`` is the padded
head dim, ``bytes`` the element size, ``S`` the software-pipelining stages):

- shared memory per kernel must fit ``shared_memory_limit(info)``:
  forward ``(block_q*d + S*2*block_k*d)*bytes`` (Q resident, K and V streamed);
  dK/dV ``(2*block_k_dkv*d + S*2*block_q_dkv*d)*bytes`` (K, V resident; Q, dO
  streamed); dQ ``(2*block_q_dq*d + S*2*block_k_dq*d)*bytes`` (Q, dO resident).
- fp32 accumulators per thread must stay within ``REGISTER_BUDGET``:
  forward ``(block_q*d + block_q*block_k) / (32*num_warps)`` (O and the logits);
  dK/dV ``(2*block_k_dkv*d + block_q_dkv*block_k_dkv) / (32*bwd_num_warps)``;
  dQ ``(block_q_dq*d + block_q_dq*block_k_dq) / (32*bwd_num_warps)``.

For the Hopper (Mosaic GPU) kernels, with ``W = 2`` consumer warpgroups of 128
threads each owning ``block`` rows, and 4 KiB for barriers and 1 KiB alignment:

- forward smem ``(W*block_q*d + S*2*block_kv*d)*bytes``; registers per consumer
  thread ``(block_q*d + block_q*block_kv) / 128`` (O and the logits);
- dQ smem ``(2*W*block_q_dq*d + S*2*block_kv_dq*d)*bytes``; registers
  ``(block_q_dq*d + 2*block_q_dq*block_kv_dq) / 128`` (dQ, S and dP);
- dK/dV smem ``(2*W*block_kv_dkv*d + S*2*block_q_dkv*d)*bytes``; registers
  ``(2*block_kv_dkv*d + 2*block_q_dkv*block_kv_dkv) / 128`` (dK, dV, Sᵀ, dPᵀ);
  each within ``MOSAIC_REGISTER_BUDGET`` (consumers get 232 registers by setmaxnreg).

Cache file: ``$JATTN_CACHE_DIR/autotune.json``, else
``$XDG_CACHE_HOME/jattn/autotune.json``, else ``~/.cache/jattn/autotune.json``:
``{"version": 1, "entries": {key: {"config": {...}, "ms": ..., "mode": ...,
"jax": ..., "tuned_at": ...}}}``.

    python -m jattn.autotune --op flash --batch 4 --seq 4096 --heads 16 \\
        --head-dim 128 --dtype bfloat16 --causal [--dry-run] [--show-cache]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.resources
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from jattn.gpu import GPUInfo, gpu_info, shared_memory_limit
from pallas_kernels.flash.config import (FlashBlockConfig, MosaicBlockConfig, clamp_block,
                                         default_config, default_mosaic_config,
                                         mosaic_head_dim, next_power_of_two, padded_head_dim)

CACHE_VERSION = 1
CACHE_DIR_ENV = "JATTN_CACHE_DIR"
MIN_BUCKET, MAX_BUCKET = 128, 65536
MODES = ("fwd", "fwd+bwd")

# Hopper and Ampere cap a thread at 255 registers; ~30 go to addresses, indices and
# the softmax row statistics. 224 rather than less: on the H100 sweep
# (bench/results/flash_sweep_fwd.json, d128) the forward winner holds 192 floats per
# thread (128x64 tiles, 4 warps), while 256 (128x128, 4 warps) ran at 60% of it.
REGISTER_BUDGET = 224


# ----------------------------------------------------------------------------- keys

@dataclasses.dataclass(frozen=True)
class TuningKey:
  """Where a tuned config applies; ``str(key)`` is its name in the cache file."""

  gpu: str
  op: str
  backend: str
  dtype: str
  head_dim: int  # padded
  causal: bool
  seq_bucket: int

  def __str__(self) -> str:
    return "|".join((self.gpu, f"{self.op}/{self.backend}", self.dtype, f"d{self.head_dim}",
                     "causal" if self.causal else "noncausal", f"s{self.seq_bucket}"))


def seq_bucket(q_len: int, kv_len: int) -> int:
  """Next power of two of the longer sequence, clamped to [128, 65536]."""
  return min(MAX_BUCKET, max(MIN_BUCKET, next_power_of_two(max(q_len, kv_len))))


def make_key(gpu: str, op: str, backend: str, *, dtype, head_dim: int, q_len: int,
             kv_len: int, causal: bool) -> TuningKey:
  return TuningKey(gpu=gpu, op=op, backend=backend, dtype=jnp.dtype(dtype).name,
                   head_dim=padded_head_dim(head_dim), causal=bool(causal),
                   seq_bucket=seq_bucket(q_len, kv_len))


# -------------------------------------------------------------------------- problem

@dataclasses.dataclass(frozen=True)
class Problem:
  """One attention call to tune for: inputs ``[batch, seq, heads, head_dim]``."""

  q_len: int
  head_dim: int
  dtype: Any
  causal: bool
  kv_len: int | None = None  # default: q_len
  batch: int = 1
  q_heads: int = 1
  kv_heads: int | None = None  # default: q_heads

  def __post_init__(self):
    for name in ("q_len", "head_dim", "batch", "q_heads", "kv_len", "kv_heads"):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    # Frozen: normalise the defaults in place once.
    object.__setattr__(self, "kv_len", self.q_len if self.kv_len is None else self.kv_len)
    object.__setattr__(self, "kv_heads", self.q_heads if self.kv_heads is None else self.kv_heads)
    if self.q_heads % self.kv_heads:
      raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
    dtype = jnp.dtype(self.dtype)
    if dtype.name not in ("float16", "bfloat16", "float32"):
      raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype.name}")
    object.__setattr__(self, "dtype", dtype)


# ------------------------------------------------------------------------- registry

@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: ``space`` is a dict
class SearchStage:
  """Fields varied together over ``space``; the rest stay at the previous winner.

  ``fits`` is the part of the cost model that reads these fields, so a stage is
  not pruned empty by another stage's fields.
  """

  name: str
  mode: str  # what the stage is timed on: "fwd" or "fwd+bwd"
  space: Mapping[str, tuple]
  fits: Callable[[Any, Problem, GPUInfo], tuple[bool, str]]

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"SearchStage.mode must be one of {MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class Tunable:
  """What the autotuner needs to know about one (op, backend) pair.

  ``config_cls`` is a dataclass built by ``config_cls(**fields)``. ``normalize``
  returns the config the kernel actually runs for a problem (e.g. blocks clamped
  to the lengths), so duplicates can be dropped. ``fits`` is the whole cost
  model: ``(ok, reason)``. ``time`` returns the median milliseconds of ``reps`` calls.
  """

  config_cls: type
  default_config: Callable[[Problem], Any]
  stages: tuple[SearchStage, ...]
  normalize: Callable[[Any, Problem], Any]
  fits: Callable[[Any, Problem, GPUInfo], tuple[bool, str]]
  time: Callable[[Any, Problem, str, int], float]

  def candidates(self, problem: Problem, stage: SearchStage, base) -> list:
    """``base`` first, then the stage's grid around it, normalised, without duplicates."""
    names = list(stage.space)
    grid = (dataclasses.replace(base, **dict(zip(names, values)))
            for values in itertools.product(*stage.space.values()))
    return list(dict.fromkeys(self.normalize(c, problem) for c in itertools.chain([base], grid)))

  def start(self, problem: Problem, info: GPUInfo):
    """The default config, with any stage that does not fit ``info`` moved to its
    first candidate that does (e.g. the d128 tiles on a 99 KiB GPU)."""
    base = self.normalize(self.default_config(problem), problem)
    for stage in self.stages:
      if not stage.fits(base, problem, info)[0]:
        base = next((c for c in self.candidates(problem, stage, base)
                     if stage.fits(c, problem, info)[0]), base)
    return base


def _flash_costs(c: FlashBlockConfig, d: int) -> dict[str, tuple[int, int, int]]:
  """Per kernel: shared-memory elements, fp32 accumulators, warps (``d``: padded head dim)."""
  return {
      "forward": (c.block_q * d + c.num_stages * 2 * c.block_k * d,
                  c.block_q * d + c.block_q * c.block_k, c.num_warps),
      "dK/dV": (2 * c.block_k_dkv * d + c.bwd_num_stages * 2 * c.block_q_dkv * d,
                2 * c.block_k_dkv * d + c.block_q_dkv * c.block_k_dkv, c.bwd_num_warps),
      "dQ": (2 * c.block_q_dq * d + c.bwd_num_stages * 2 * c.block_k_dq * d,
             c.block_q_dq * d + c.block_q_dq * c.block_k_dq, c.bwd_num_warps),
  }


def _flash_fits_kernels(*kernels: str):
  """The cost model restricted to ``kernels`` (all three when none are named)."""

  def fits(c: FlashBlockConfig, problem: Problem, info: GPUInfo) -> tuple[bool, str]:
    limit = shared_memory_limit(info)
    costs = _flash_costs(c, padded_head_dim(problem.head_dim))
    for name in kernels or tuple(costs):
      smem_elems, acc_floats, warps = costs[name]
      smem = smem_elems * problem.dtype.itemsize
      if smem > limit:
        return False, f"{name} shared memory: {smem // 1024} KiB > {limit // 1024} KiB"
      per_thread = acc_floats / (32 * warps)
      if per_thread > REGISTER_BUDGET:
        return False, f"{name} registers: {per_thread:.0f} fp32/thread > {REGISTER_BUDGET}"
    return True, ""

  return fits


def _flash_normalize(c: FlashBlockConfig, problem: Problem) -> FlashBlockConfig:
  q_side = ("block_q", "block_q_dkv", "block_q_dq")
  k_side = ("block_k", "block_k_dkv", "block_k_dq")
  return dataclasses.replace(
      c, **{f: clamp_block(getattr(c, f), problem.q_len) for f in q_side},
      **{f: clamp_block(getattr(c, f), problem.kv_len) for f in k_side})


def _median_ms(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples) * 1e3


def time_flash_attention(config, problem: Problem, mode: str, reps: int, *, backend: str) -> float:
  """Median ms of ``jattn.flash_attention`` with ``config`` (``"fwd+bwd"``: grad of the sum)."""
  from jattn.flash import flash_attention  # jattn.flash may import this module

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  p = problem
  q = jax.random.normal(keys[0], (p.batch, p.q_len, p.q_heads, p.head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
  args = tuple(x.astype(p.dtype) for x in (q, k, v))
  attend = functools.partial(flash_attention, causal=p.causal, backend=backend, config=config)
  if mode == "fwd":
    fn = jax.jit(attend)
  else:
    fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                          argnums=(0, 1, 2)))
  return _median_ms(fn, args, reps)


_BLOCKS, _WARPS, _PIPELINE = (32, 64, 128), (4, 8), (1, 2, 3, 4)

# Consumer warpgroups hold 232 registers; ~30 go to addresses and row statistics.
# Measured on the H100 sweep (bench/results/flash_sweep_mosaic.json): 192 fp32 per
# thread ran at full speed, 256 spilled (d128 128x128 tiles: 270 vs 527 TFLOP/s).
MOSAIC_REGISTER_BUDGET = 200
_MOSAIC_SMEM_OVERHEAD = 4 * 1024


def _mosaic_costs(c: MosaicBlockConfig, d: int, nbytes: int) -> dict[str, tuple[int, float]]:
  """Per kernel: shared-memory bytes and fp32 accumulators per consumer thread."""
  w, o = 2, _MOSAIC_SMEM_OVERHEAD
  return {
      "forward": ((w * c.block_q * d + c.stages * 2 * c.block_kv * d) * nbytes + o,
                  (c.block_q * d + c.block_q * c.block_kv) / 128),
      "dQ": ((2 * w * c.block_q_dq * d + c.bwd_stages * 2 * c.block_kv_dq * d) * nbytes + o,
             (c.block_q_dq * d + 2 * c.block_q_dq * c.block_kv_dq) / 128),
      "dK/dV": ((2 * w * c.block_kv_dkv * d + c.bwd_stages * 2 * c.block_q_dkv * d) * nbytes
                + c.bwd_stages * 2 * c.block_q_dkv * 4 + o,
                (2 * c.block_kv_dkv * d + 2 * c.block_q_dkv * c.block_kv_dkv) / 128),
  }


def _mosaic_fits_kernels(*kernels: str):
  """The Hopper cost model restricted to ``kernels`` (all three when none are named)."""

  def fits(c: MosaicBlockConfig, problem: Problem, info: GPUInfo) -> tuple[bool, str]:
    limit = shared_memory_limit(info)
    costs = _mosaic_costs(c, mosaic_head_dim(problem.head_dim), problem.dtype.itemsize)
    for name in kernels or tuple(costs):
      smem, per_thread = costs[name]
      if smem > limit:
        return False, f"{name} shared memory: {smem // 1024} KiB > {limit // 1024} KiB"
      if per_thread > MOSAIC_REGISTER_BUDGET:
        return False, (f"{name} registers: {per_thread:.0f} fp32/thread > "
                       f"{MOSAIC_REGISTER_BUDGET}")
    return True, ""

  return fits

TUNABLE: dict[tuple[str, str], Tunable] = {
    ("flash_attention", "pallas_triton"): Tunable(
        config_cls=FlashBlockConfig,
        default_config=lambda p: default_config(p.head_dim, p.dtype.itemsize),
        # Three small grids (72 + 72 + 9) instead of one of all ten fields.
        stages=(
            SearchStage("forward", "fwd", {"block_q": _BLOCKS, "block_k": _BLOCKS,
                                           "num_warps": _WARPS, "num_stages": _PIPELINE},
                        _flash_fits_kernels("forward")),
            # The dQ kernel shares the backward warps and stages.
            SearchStage("dK/dV", "fwd+bwd", {"block_q_dkv": _BLOCKS, "block_k_dkv": _BLOCKS,
                                             "bwd_num_warps": _WARPS,
                                             "bwd_num_stages": _PIPELINE},
                        _flash_fits_kernels("dK/dV", "dQ")),
            SearchStage("dQ", "fwd+bwd", {"block_q_dq": _BLOCKS, "block_k_dq": _BLOCKS},
                        _flash_fits_kernels("dQ")),
        ),
        normalize=_flash_normalize,
        fits=_flash_fits_kernels(),
        time=functools.partial(time_flash_attention, backend="pallas_triton"),
    ),
    ("flash_attention", "pallas_mosaic"): Tunable(
        config_cls=MosaicBlockConfig,
        default_config=lambda p: default_mosaic_config(p.head_dim),
        stages=(
            SearchStage("forward", "fwd", {"block_q": (64, 128),
                                           "block_kv": (64, 128, 192, 256),
                                           "stages": (2, 3, 4)},
                        _mosaic_fits_kernels("forward")),
            # The dK/dV kernel shares the backward ring depth.
            SearchStage("dQ", "fwd+bwd", {"block_q_dq": (64, 128), "block_kv_dq": (64, 128),
                                          "bwd_stages": (2, 3)},
                        _mosaic_fits_kernels("dQ", "dK/dV")),
            SearchStage("dK/dV", "fwd+bwd", {"block_q_dkv": (64, 128),
                                             "block_kv_dkv": (64, 128)},
                        _mosaic_fits_kernels("dK/dV")),
        ),
        normalize=lambda c, p: c,  # the wrapper pads lengths to the tiles
        fits=_mosaic_fits_kernels(),
        time=functools.partial(time_flash_attention, backend="pallas_mosaic"),
    ),
}


def _tunable(op: str, backend: str) -> Tunable:
  if (op, backend) not in TUNABLE:
    raise ValueError(f"(op, backend) must be one of {sorted(TUNABLE)}, got {(op, backend)!r}")
  return TUNABLE[(op, backend)]


# ---------------------------------------------------------------------------- cache

def cache_path() -> str:
  """The user cache file (see the module docstring for the environment variables)."""
  if os.environ.get(CACHE_DIR_ENV):
    return os.path.join(os.environ[CACHE_DIR_ENV], "autotune.json")
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jattn", "autotune.json")


_LOADED: dict[str, tuple[tuple[int, int], dict]] = {}  # path -> ((mtime_ns, size), entries)


def _parse_entries(text: str) -> dict:
  data = json.loads(text)
  if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
    raise ValueError(f"expected an object with version {CACHE_VERSION}")
  entries = data.get("entries")
  if not isinstance(entries, dict):
    raise ValueError("expected an 'entries' object")
  return entries


def load_cache(path: str | None = None) -> dict:
  """Entries of the user cache, read once per change of the file (``{}`` if absent).

  An unreadable or corrupt file warns once and counts as empty.
  """
  path = cache_path() if path is None else path
  try:
    st = os.stat(path)
  except OSError:
    return {}
  stamp = (st.st_mtime_ns, st.st_size)
  cached = _LOADED.get(path)
  if cached is not None and cached[0] == stamp:
    return cached[1]
  try:
    with open(path, encoding="utf-8") as f:
      entries = _parse_entries(f.read())
  except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
    # Remembered below as empty: the warning comes once per version of the file.
    warnings.warn(f"ignoring the autotune cache {path}: {e}", RuntimeWarning, stacklevel=2)
    entries = {}
  _LOADED[path] = (stamp, entries)
  return entries


@functools.lru_cache(maxsize=None)
def shipped_entries() -> dict:
  """Entries of the table shipped with jattn (measured on the GPUs it names)."""
  text = importlib.resources.files("jattn").joinpath("autotune_defaults.json").read_text("utf-8")
  return _parse_entries(text)


def save_config(key: TuningKey, config, *, ms: float | None, mode: str,
                path: str | None = None) -> str:
  """Adds or replaces one entry of the user cache (atomically); returns the file's path."""
  path = cache_path() if path is None else path
  entries = dict(load_cache(path))
  entries[str(key)] = {
      "config": dataclasses.asdict(config), "ms": ms, "mode": mode, "jax": jax.__version__,
      "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  # A reader (another process) sees either the old file or the new one, never half.
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autotune.", suffix=".json")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
  st = os.stat(path)
  _LOADED[path] = ((st.st_mtime_ns, st.st_size), entries)
  return path


def _config_from_entry(tunable: Tunable, entry) -> Any | None:
  """The entry's config, or None if it does not match the config class exactly."""
  fields = {f.name for f in dataclasses.fields(tunable.config_cls)}
  config = entry.get("config") if isinstance(entry, dict) else None
  if not isinstance(config, dict) or set(config) != fields:
    return None
  try:
    return tunable.config_cls(**config)
  except (TypeError, ValueError):
    return None


def lookup_config(op: str, backend: str, *, dtype, head_dim: int, q_len: int, kv_len: int,
                  causal: bool, info: GPUInfo | None = None):
  """The tuned config for this problem: user cache, then the shipped table, else None.

  None too off GPU (tiles do not matter in interpret mode) and for pairs with
  nothing registered in ``TUNABLE``.
  """
  if info is None:
    device = jax.devices()[0]
    gpu = device.device_kind if device.platform == "gpu" else None
  else:
    gpu = info.name if info.is_gpu else None
  tunable = TUNABLE.get((op, backend))
  if gpu is None or tunable is None:
    return None
  key = str(make_key(gpu, op, backend, dtype=dtype, head_dim=head_dim, q_len=q_len,
                     kv_len=kv_len, causal=causal))
  for entries in (load_cache(), shipped_entries()):
    if key in entries:
      config = _config_from_entry(tunable, entries[key])
      if config is not None:
        return config
  return None


# --------------------------------------------------------------------------- search

@dataclasses.dataclass(frozen=True)
class Candidate:
  """One config of one stage; ``reason`` says why the cost model pruned it (None: kept)."""

  stage: SearchStage
  config: Any
  reason: str | None


def _split(tunable: Tunable, problem: Problem, stage: SearchStage, base, info) -> list[Candidate]:
  out = []
  for config in tunable.candidates(problem, stage, base):
    ok, reason = stage.fits(config, problem, info)
    out.append(Candidate(stage, config, None if ok else reason))
  return out


def plan(op: str = "flash_attention", backend: str = "pallas_triton", *, q_len: int,
         head_dim: int, dtype, causal: bool, kv_len: int | None = None,
         info: GPUInfo | None = None) -> list[Candidate]:
  """Every stage's candidates, pruned or kept, without timing anything.

  Every stage is shown around the start config (``tune`` centres later stages on
  the previous stage's winner).
  """
  tunable = _tunable(op, backend)
  info = gpu_info() if info is None else info
  problem = Problem(q_len=q_len, kv_len=kv_len, head_dim=head_dim, dtype=dtype, causal=causal)
  base = tunable.start(problem, info)
  return [c for stage in tunable.stages for c in _split(tunable, problem, stage, base, info)]


class _Progress:
  """``[#####.....] 12/40 best 1.234 ms``, redrawn in place on ``stream``."""

  def __init__(self, total: int, stream, width: int = 20):
    self.total, self.stream, self.width = total, stream, width

  def update(self, done: int, best_ms: float | None):
    filled = round(self.width * done / max(self.total, 1))
    best = "-" if best_ms is None else f"{best_ms:.3f} ms"
    self.stream.write(f"\r  [{'#' * filled}{'.' * (self.width - filled)}] "
                      f"{done}/{self.total} best {best}")
    self.stream.flush()

  def close(self):
    self.stream.write("\n")


def _fields(config, names) -> str:
  return " ".join(f"{n}={getattr(config, n)}" for n in names)


def _reason_counts(pruned: list[Candidate]) -> str:
  counts = collections.Counter(c.reason.split(":")[0] for c in pruned)
  return ", ".join(f"{reason}: {n}" for reason, n in counts.most_common())


def tune(op: str = "flash_attention", backend: str = "pallas_triton", *, batch: int,
         q_len: int, kv_len: int | None = None, q_heads: int, kv_heads: int | None = None,
         head_dim: int, dtype, causal: bool, reps: int = 10, info: GPUInfo | None = None,
         progress: bool = True, save: bool = True, max_candidates: int | None = None):
  """Times the candidates stage by stage on this device and returns the fastest config.

  Each timing is the median of ``reps`` calls. Candidates that fail to compile or
  run are skipped. ``max_candidates`` caps how many are timed per stage (the
  current best comes first). With ``save``, the winner goes to the user cache.
  """
  tunable = _tunable(op, backend)
  if not (isinstance(reps, int) and reps >= 1):
    raise ValueError(f"reps must be a positive int, got {reps!r}")
  if max_candidates is not None and not (isinstance(max_candidates, int) and max_candidates >= 1):
    raise ValueError(f"max_candidates must be a positive int or None, got {max_candidates!r}")
  info = gpu_info() if info is None else info
  if backend not in info.backends:
    raise ValueError(f"backend {backend!r} is not usable on {info.name} "
                     f"(usable: {info.backends})")
  problem = Problem(batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads,
                    kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal)
  out = sys.stderr if progress else None
  best = tunable.start(problem, info)
  best_ms, best_mode = None, None
  timed: dict[tuple[Any, str], float | None] = {}  # (config, mode) -> ms, None if it failed
  errors = []
  for n, stage in enumerate(tunable.stages, 1):
    cands = _split(tunable, problem, stage, best, info)
    kept = [c.config for c in cands if c.reason is None][:max_candidates]
    pruned = [c for c in cands if c.reason is not None]
    if out:
      out.write(f"stage {n}/{len(tunable.stages)} {stage.name} ({stage.mode}; "
                f"{', '.join(stage.space)}): {len(cands)} candidates, timing {len(kept)}, "
                f"pruned {len(pruned)}" + (f" ({_reason_counts(pruned)})" if pruned else "") + "\n")
    bar = _Progress(len(kept), out) if out else None
    stage_best, stage_errors = None, []
    for i, config in enumerate(kept, 1):
      if (config, stage.mode) not in timed:
        try:
          timed[(config, stage.mode)] = tunable.time(config, problem, stage.mode, reps)
        except Exception as e:  # tiles the compiler rejects, out of resources, ...
          timed[(config, stage.mode)] = None
          first_line = str(e).splitlines()[0][:200] if str(e) else ""
          stage_errors.append(f"{_fields(config, stage.space)}: {type(e).__name__}: {first_line}")
      ms = timed[(config, stage.mode)]
      if ms is not None and (stage_best is None or ms < stage_best[1]):
        stage_best = (config, ms)
      if bar:
        bar.update(i, stage_best and stage_best[1])
    if bar:
      bar.close()
    errors += stage_errors
    failed = sum(timed[(c, stage.mode)] is None for c in kept)
    if stage_best is not None:
      best, best_ms, best_mode = stage_best[0], stage_best[1], stage.mode
    if out:
      winner = "none timed; keeping the previous" if stage_best is None else (
          f"best {stage_best[1]:.3f} ms: {_fields(best, stage.space)}")
      first = f" (first: {stage_errors[0]})" if stage_errors else ""
      out.write(f"  failed {failed}{first}; {winner}\n")
  if best_ms is None:
    raise RuntimeError(f"no candidate ran for {op}/{backend} on {problem}; errors: "
                       + "; ".join(errors[:3]))
  if save:
    key = make_key(info.name, op, backend, dtype=problem.dtype, head_dim=head_dim,
                   q_len=problem.q_len, kv_len=problem.kv_len, causal=causal)
    path = save_config(key, best, ms=best_ms, mode=best_mode)
    if out:
      out.write(f"saved {key} -> {path}\n")
  return best


# ------------------------------------------------------------------------------ CLI

def _show_cache(stream) -> int:
  path = cache_path()
  entries = load_cache(path)
  stream.write(f"{path}: {len(entries)} entries\n")
  for key, entry in sorted(entries.items()):
    ms = entry.get("ms")
    timing = "" if ms is None else f" {ms:.3f} ms ({entry.get('mode')})"
    stream.write(f"{key}{timing} jax {entry.get('jax')} {entry.get('tuned_at')}\n"
                 f"  {json.dumps(entry.get('config'), sort_keys=True)}\n")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jattn.autotune", description=(
      "Search block sizes for a kernel on this GPU and store the fastest in the cache."))
  parser.add_argument("--op", default="flash_attention", help="flash (= flash_attention)")
  parser.add_argument("--backend", default="pallas_triton")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--seq", type=int, help="query length")
  parser.add_argument("--kv-seq", type=int, help="key length (default: --seq)")
  parser.add_argument("--heads", type=int, help="query heads")
  parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
  parser.add_argument("--head-dim", type=int)
  parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--reps", type=int, default=10, help="timed calls per candidate")
  parser.add_argument("--max-candidates", type=int, help="time at most this many per stage")
  parser.add_argument("--dry-run", action="store_true",
                      help="list the candidates and the pruned ones, time nothing")
  parser.add_argument("--show-cache", action="store_true", help="print the cache and exit")
  args = parser.parse_args(argv)
  if args.show_cache:
    return _show_cache(sys.stdout)
  missing = [f"--{n}" for n in ("seq", "heads", "head-dim") if getattr(args, n.replace("-", "_")) is None]
  if missing:
    parser.error(f"{', '.join(missing)} required (unless --show-cache)")
  op = "flash_attention" if args.op == "flash" else args.op
  if (op, args.backend) not in TUNABLE:
    print(f"nothing to tune for --op {args.op} --backend {args.backend}; tunable: "
          + ", ".join(f"{o}/{b}" for o, b in sorted(TUNABLE)), file=sys.stderr)
    return 2
  info = gpu_info()
  if args.backend not in info.backends:
    print(f"backend {args.backend!r} is not usable on {info.name} (usable: "
          f"{', '.join(info.backends)}); the Pallas kernels need a CUDA GPU (pallas_triton: "
          "compute capability >= 8.0), or JATTN_INTERPRET=1 to run them in interpret mode",
          file=sys.stderr)
    return 2
  problem = dict(q_len=args.seq, kv_len=args.kv_seq, head_dim=args.head_dim,
                 dtype=args.dtype, causal=args.causal)
  if args.dry_run:
    key = make_key(info.name, op, args.backend, **{**problem, "kv_len": args.kv_seq or args.seq})
    print(f"{key} (shared memory limit {shared_memory_limit(info) // 1024} KiB)")
    cands = plan(op, args.backend, info=info, **problem)
    for stage in dict.fromkeys(c.stage for c in cands):
      mine = [c for c in cands if c.stage == stage]
      pruned = [c for c in mine if c.reason is not None]
      print(f"stage {stage.name} ({stage.mode}): {len(mine)} candidates, "
            f"{len(mine) - len(pruned)} kept, {len(pruned)} pruned")
      for c in mine:
        verdict = "keep " if c.reason is None else "prune"
        print(f"  {verdict} {_fields(c.config, stage.space)}"
              + ("" if c.reason is None else f"  [{c.reason}]"))
    return 0
  best = tune(op, args.backend, batch=args.batch, q_heads=args.heads, kv_heads=args.kv_heads,
              reps=args.reps, info=info, max_candidates=args.max_candidates, **problem)
  print(json.dumps(dataclasses.asdict(best)))
  return 0


if __name__ == "__main__":
  # Run the importable module's main, so the registry is the one other modules extend.
  from jattn import autotune

  sys.exit(autotune.main())
