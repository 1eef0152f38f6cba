"""The Hopper flash kernels' config: ``MosaicBlockConfig``, its heuristic by head dim,
its search space and its cost model (shared memory and registers per kernel).

Cost model (prunes configs before anything compiles; ``d`` / ``dv`` are the padded
head dims of q, k and of v, ``W`` the consumer warpgroups, each owning ``block`` rows;
registers count fp32 accumulator values per consumer thread; shared memory is counted
from each kernel's own buffer list as Mosaic GPU counts it, ``pipeline.smem_bytes``,
with a vector per tile for each per-position input):

- forward: ``hopper.forward.forward_cost`` (Q tiles, ``stages`` K and V slots, the
  row sums' ones tile; O, the logits and the row sums in registers);
- dQ: Q and dO tiles per consumer, ``bwd_stages`` K and V slots; dQ and two logit tiles;
- dK/dV: K and V tiles per consumer, ``bwd_stages`` Q and dO slots with their row
  statistics; dK, dV and two logit tiles;
- dK/dV+dQ (``fused_dq``): the dK/dV kernel's, plus double-buffered dS tiles and an
  fp32 dQ tile per consumer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jattn.kernels.common.config import SearchGrid, over_budget
from jattn.kernels.flash.mosaic_bwd import dkv_scratch, dq_scratch
from jattn.kernels.hopper.budget import (HOPPER_SMEM_BYTES, MOSAIC_BLOCK,
                                         MOSAIC_MAX_BWD_WIDTH, MOSAIC_MODELLED_BWD_WIDTH,
                                         MOSAIC_REGISTER_BUDGET, THREADS_PER_WARPGROUP,
                                         fused_dq_columns, mosaic_head_dim)
from jattn.kernels.hopper.forward import forward_cost, forward_smem_bytes
from jattn.kernels.hopper.pipeline import smem_bytes, stand_in_dtype


@dataclasses.dataclass(frozen=True)
class MosaicBlockConfig:
  """Tile sizes of the Hopper (Mosaic GPU) kernels.

  ``block_q`` / ``block_q_dq`` / ``block_kv_dkv`` are per consumer warpgroup: a CTA
  covers twice as many rows. Every block is a multiple of 64. ``stages`` is the
  depth of the shared-memory ring the producer warpgroup fills (at least 2).

  ``fused_dq``: the backward computes dQ inside the dK/dV kernel and adds it into an
  fp32 buffer with TMA reduce-adds (5 matmuls per block pair instead of 7, but the
  sum order varies from run to run: ``deterministic=True`` calls, the default, run the
  two kernels whatever this says; head dims up to 128). Off by default; the autotuner
  tries it.

  ``persistent``: the forward runs one CTA per SM, each walking its share of the
  (query tile, head, batch) work items, with K/V streaming on across items and the
  next item's Q tile loaded during the current one (where two Q buffers fit the
  shared memory). False: one CTA per work item. None (default): persistent exactly
  when every item has the same work (no causal mask, window or segment ids): uneven
  items balance better under the hardware's dynamic CTA scheduling than under a
  static split. The autotuner tries both.
  """

  block_q: int = 64
  block_kv: int = 128
  stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  bwd_stages: int = 2
  fused_dq: bool = False
  persistent: bool | None = None

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                  "block_kv_dkv"):
      value = getattr(self, field)
      if value < MOSAIC_BLOCK or value % MOSAIC_BLOCK:
        raise ValueError(f"MosaicBlockConfig.{field} must be a positive multiple of "
                         f"{MOSAIC_BLOCK}, got {value}")
    for field in ("stages", "bwd_stages"):
      if getattr(self, field) < 2:
        raise ValueError(f"MosaicBlockConfig.{field} must be >= 2, got {getattr(self, field)}")


def mosaic_backward_runs(head_dim: int, value_head_dim: int) -> bool:
  """Whether the Hopper backward kernels take these head dims (else: Triton's)."""
  return mosaic_head_dim(head_dim) + mosaic_head_dim(value_head_dim) <= MOSAIC_MAX_BWD_WIDTH


def backward_modelled(head_dim: int, value_head_dim: int) -> bool:
  """Whether the cost model's register counts hold for the Hopper backward at these
  head dims (beyond, it runs the wide heads' 64-row tiles, or the Triton backward)."""
  width = mosaic_head_dim(head_dim) + mosaic_head_dim(value_head_dim)
  return mosaic_backward_runs(head_dim, value_head_dim) and width <= MOSAIC_MODELLED_BWD_WIDTH


def default_mosaic_config(head_dim: int, value_head_dim: int | None = None) -> MosaicBlockConfig:
  """Hopper tiles by padded head dims (``value_head_dim``: V's, default ``head_dim``):
  the winners of ``bench/flash.py --sweep-mosaic`` on an H100, within 227 KB of shared
  memory. Heads wider than 128 take 128-key forward tiles where those fit the shared
  memory (dk = 192 with dv = 128, whose output takes a view of the Q tile), else 64."""
  dk = mosaic_head_dim(head_dim)
  dv = mosaic_head_dim(head_dim if value_head_dim is None else value_head_dim)
  d = max(dk, dv)
  if d <= 64:  # small accumulators: 128 rows per warpgroup fit in registers
    return MosaicBlockConfig(block_q=128, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=3)
  if d <= 128:
    return MosaicBlockConfig(block_q=64, block_kv=128, stages=2, block_q_dq=64,
                             block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64, bwd_stages=2)
  wide_tiles = forward_smem_bytes(64, 128, 2, dk, dv, 2, 1, ones_tile=True) <= HOPPER_SMEM_BYTES
  return MosaicBlockConfig(block_q=64, block_kv=128 if wide_tiles else 64, stages=2)


# FP8 key tiles: an 8-bit wgmma reduces over whole swizzle widths (128 keys, or 64).
FP8_BLOCK_KV = (64, 128, 256)


def default_fp8_config(head_dim: int, value_head_dim: int | None = None,
                       out_nbytes: int = 2, masked: bool = False,
                       kv_len: int = 0) -> MosaicBlockConfig:
  """Hopper FP8 forward tiles, the winners of ``bench/fp8.py``'s sweep on an H100: for
  heads up to 64, 128 query rows per consumer and 128-key tiles; wider, 64 rows and
  the widest key tile that fits the shared memory, up to 256 keys (128 under a causal
  mask or a window below 8192 keys, where the diagonal tiles' waste outweighs a wide
  tile's gain). The backward fields keep their defaults (the forward alone runs)."""
  dk = mosaic_head_dim(head_dim)
  dv = mosaic_head_dim(head_dim if value_head_dim is None else value_head_dim)
  if max(dk, dv) <= 64:
    return MosaicBlockConfig(block_q=128, block_kv=128, stages=2)
  fits = lambda block_kv: forward_smem_bytes(64, block_kv, 2, dk, dv, 1, 1,
                                             out_nbytes) <= HOPPER_SMEM_BYTES
  widest = 128 if masked and kv_len < 8192 else 256
  # None fits (say head dim 256 with a float32 output): the smallest, which
  # ``fp8_misfit`` refuses, so that ``"auto"`` runs another backend.
  block_kv = next((b for b in sorted(FP8_BLOCK_KV, reverse=True) if b <= widest and fits(b)),
                  min(FP8_BLOCK_KV))
  return MosaicBlockConfig(block_q=64, block_kv=block_kv, stages=2)


def fp8_misfit(c: MosaicBlockConfig, head_dims: tuple[int, int], out_nbytes: int,
               smem_limit: int, vectors: tuple[int, int] = (0, 0),
               register_budget: int | None = MOSAIC_REGISTER_BUDGET) -> str | None:
  """Why config ``c`` does not fit the FP8 forward at head dims ``(dk, dv)`` on a device
  with ``smem_limit`` bytes of shared memory per CTA (None: it fits); ``vectors`` as
  ``mosaic_costs``'; ``register_budget`` None: shared memory only."""
  if c.block_kv not in FP8_BLOCK_KV:
    return f"FP8 forward block_kv must be one of {FP8_BLOCK_KV}, got {c.block_kv}"
  dk, dv = (mosaic_head_dim(d) for d in head_dims)
  cost = forward_cost(c.block_q, c.block_kv, c.stages, dk, dv, 1, out_nbytes,
                      vectors=vectors)
  return over_budget("forward", cost, smem_limit, register_budget)


def default_bias_config(head_dims: tuple[int, int], nbytes: int, bias_nbytes: int,
                        vectors: tuple[int, int] = (0, 0)) -> MosaicBlockConfig:
  """Hopper tiles with a dense bias (a tile of it per slot and consumer, as much shared
  memory as a K tile of head dim ``block_q``): the head dim's default forward where its
  bias tiles fit, else the first of 64 rows by 128 keys, by 64 keys in 3 stages, in 2;
  the default backward where it fits, else 64 by 64 tiles."""
  base = default_mosaic_config(*head_dims)
  forwards = ((base.block_q, base.block_kv, base.stages), (64, 128, 2), (64, 64, 3), (64, 64, 2))
  backwards = ((base.block_q_dq, base.block_kv_dq, base.block_q_dkv, base.block_kv_dkv,
                base.bwd_stages), (64, 64, 64, 64, 2))
  configs = [MosaicBlockConfig(*fwd, *bwd) for fwd in forwards for bwd in backwards]
  fits = lambda c: mosaic_misfit(c, head_dims, nbytes, ("forward", "dQ", "dK/dV"),
                                 HOPPER_SMEM_BYTES, vectors, bias_nbytes=bias_nbytes) is None
  return next((c for c in configs if fits(c)), configs[-1])


@functools.lru_cache(maxsize=4096)  # every "auto" choice on a GPU asks it
def mosaic_costs(c: MosaicBlockConfig, d: int, nbytes: int, dv: int | None = None,
                 vectors: tuple[int, int] = (0, 0),
                 bias_nbytes: int = 0) -> dict[str, tuple[int, float]]:
  """Per Hopper kernel: shared-memory bytes as Mosaic GPU counts them (the kernels' own
  buffer lists) and fp32 accumulators per consumer thread; ``d`` the padded head dim of
  q and k, ``dv`` of v (default ``d``); ``vectors`` the ``(row, col)`` counts of
  per-position vectors (segment ids, dropout's hashes, a function's parts);
  ``bias_nbytes``: a dense bias's bytes per value (0: none), its tiles (and the dQ
  kernel's dS tile) counted, two 16-bit values a register where it is held."""
  t = THREADS_PER_WARPGROUP
  dv = d if dv is None else dv
  dtype = stand_in_dtype(nbytes)
  bias = stand_in_dtype(bias_nbytes) if bias_nbytes else None
  rows, cols = ((jnp.int32,) * n for n in vectors)
  dkv = lambda fuse: smem_bytes(dkv_scratch(dtype, d, dv, c.block_q_dkv, c.block_kv_dkv,
                                            c.bwd_stages, rows, cols, fuse, bias),
                                reduces=False)
  dq_cols = fused_dq_columns(d)
  bias_tile = lambda bq, bkv: bool(bias_nbytes) * bq * bkv // 2
  return {
      "forward": forward_cost(c.block_q, c.block_kv, c.stages, d, dv, nbytes, ones_tile=True,
                              vectors=vectors, bias_nbytes=bias_nbytes),
      "dQ": (smem_bytes(dq_scratch(dtype, d, dv, c.block_q_dq, c.block_kv_dq, c.bwd_stages,
                                   rows, cols, bias, writes_ds=True), reduces=False),
             (c.block_q_dq * d + 2 * c.block_q_dq * c.block_kv_dq
              + bias_tile(c.block_q_dq, c.block_kv_dq)) / t),
      # (its bias tile starts the logits' accumulator: no registers of its own)
      "dK/dV": (dkv(False),
                (c.block_kv_dkv * (d + dv) + 2 * c.block_q_dkv * c.block_kv_dkv) / t),
      # The dQ accumulator is live once S and dP are spent.
      "dK/dV+dQ": (dkv(True),
                   (c.block_kv_dkv * (d + dv) + max(2 * c.block_q_dkv * c.block_kv_dkv,
                                                    c.block_q_dkv * (dq_cols + c.block_kv_dkv)))
                   / t),
  }


def mosaic_misfit(c: MosaicBlockConfig, head_dims: tuple[int, int], nbytes: int,
                  kernels: tuple[str, ...], smem_limit: int, vectors: tuple[int, int] = (0, 0),
                  register_budget: int | None = MOSAIC_REGISTER_BUDGET,
                  bias_nbytes: int = 0) -> str | None:
  """Why the Hopper ``kernels`` (names of ``mosaic_costs``) of config ``c`` do not fit
  a device with ``smem_limit`` bytes of shared memory per CTA at head dims
  ``(dk, dv)`` with ``vectors`` and ``bias_nbytes`` (as ``mosaic_costs``') (None: they
  fit); ``register_budget`` None: shared memory only, the limit the compiler enforces."""
  dk, dv = (mosaic_head_dim(d) for d in head_dims)
  costs = mosaic_costs(c, dk, nbytes, dv, vectors, bias_nbytes)
  for name in kernels:
    reason = over_budget(name, costs[name], smem_limit, register_budget)
    if reason is not None:
      return reason
  return None


def backward_kernels(c: MosaicBlockConfig, deterministic: bool) -> tuple[str, ...]:
  """The backward kernels config ``c`` runs (names of ``mosaic_costs``): deterministic
  calls never fuse dQ (its reduce-adds vary the sum order)."""
  return ("dK/dV+dQ",) if c.fused_dq and not deterministic else ("dQ", "dK/dV")


# The forward's tiles first, then (on the forward's winner) whether it runs persistent.
FORWARD_SEARCH = (
    SearchGrid("forward", "fwd", {"block_q": (64, 128), "block_kv": (64, 128, 192, 256),
                                  "stages": (2, 3, 4)}, ("forward",)),
    SearchGrid("persistent", "fwd", {"persistent": (True, False)}, ("forward",)),
)
BACKWARD_SEARCH = (
    # The dK/dV kernel shares the backward ring depth.
    SearchGrid("dQ", "fwd+bwd", {"block_q_dq": (64, 128), "block_kv_dq": (64, 128),
                                 "bwd_stages": (2, 3)}, ("dQ", "dK/dV")),
    SearchGrid("dK/dV", "fwd+bwd", {"block_q_dkv": (64, 128), "block_kv_dkv": (64, 128)},
               ("dK/dV",)),
    # deterministic=False calls: whether dQ fused into the dK/dV kernel is faster
    # (no kernels named: the cost model of whichever backward the config runs).
    SearchGrid("fused dQ", "fwd+bwd", {"fused_dq": (False, True)}, ()),
)
