"""The search space and cost model of a ``BlockConfig`` (the Triton-lowered forward,
dK/dV and dQ kernels of flash, window, dilated and parallel-retention attention), and
``BlockTritonImpl``, the implementation base those four share; the cost model of the
Hopper forward kernel (flash and parallel retention) and its search grid.

Cost model (prunes candidates before anything is compiled; ``d`` is the padded head
dim, ``bytes`` the element size, ``S`` the software-pipelining stages):

- shared memory per kernel must fit ``shared_memory_limit(info)``:
  forward ``(block_q*d + S*2*block_k*d)*bytes`` (Q resident, K and V streamed);
  dK/dV ``(2*block_k_dkv*d + S*2*block_q_dkv*d)*bytes`` (K, V resident; Q, dO
  streamed); dQ ``(2*block_q_dq*d + S*2*block_k_dq*d)*bytes`` (Q, dO resident).
- fp32 accumulators per thread must stay within ``REGISTER_BUDGET``:
  forward ``(block_q*d + block_q*block_k) / (32*num_warps)`` (O and the logits);
  dK/dV ``(2*block_k_dkv*d + block_q_dkv*block_k_dkv) / (32*bwd_num_warps)``;
  dQ ``(block_q_dq*d + block_q_dq*block_k_dq) / (32*bwd_num_warps)``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jattn.core.device import GPUInfo, shared_memory_limit
from jattn.core.op import TritonImpl
from jattn.kernels.common.config import BlockConfig, clamp_block, padded_head_dim
from jattn.kernels.flash.mosaic_config import MOSAIC_SMEM_OVERHEAD, forward_smem_bytes
from jattn.tuning.search import SearchStage

BLOCKS, WARPS, PIPELINE = (32, 64, 128), (4, 8), (1, 2, 3, 4)
Q_BLOCKS = ("block_q", "block_q_dkv", "block_q_dq")
K_BLOCKS = ("block_k", "block_k_dkv", "block_k_dq")

# Hopper and Ampere cap a thread at 255 registers; ~30 go to addresses, indices and
# the softmax row statistics. 224 rather than less: on the H100 sweep
# (bench/results/flash_sweep_fwd.json, d128) the forward winner holds 192 floats per
# thread (128x64 tiles, 4 warps), while 256 (128x128, 4 warps) ran at 60% of it.
REGISTER_BUDGET = 224


def block_costs(c: BlockConfig, d: int) -> dict[str, tuple[int, int, int]]:
  """Per kernel: shared-memory elements, fp32 accumulators, warps (``d``: padded head dim)."""
  return {
      "forward": (c.block_q * d + c.num_stages * 2 * c.block_k * d,
                  c.block_q * d + c.block_q * c.block_k, c.num_warps),
      "dK/dV": (2 * c.block_k_dkv * d + c.bwd_num_stages * 2 * c.block_q_dkv * d,
                2 * c.block_k_dkv * d + c.block_q_dkv * c.block_k_dkv, c.bwd_num_warps),
      "dQ": (2 * c.block_q_dq * d + c.bwd_num_stages * 2 * c.block_k_dq * d,
             c.block_q_dq * d + c.block_q_dq * c.block_k_dq, c.bwd_num_warps),
  }


def block_fits(*kernels: str):
  """The cost model restricted to ``kernels`` (all three when none are named), as a
  ``fits(config, problem, info) -> reason or None`` for problems with ``head_dims``
  and ``dtype``."""

  def fits(c: BlockConfig, problem, info: GPUInfo) -> str | None:
    limit = shared_memory_limit(info)
    costs = block_costs(c, padded_head_dim(max(problem.head_dims)))
    for name in kernels or tuple(costs):
      smem_elems, acc_floats, warps = costs[name]
      smem = smem_elems * jnp.dtype(problem.dtype).itemsize
      if smem > limit:
        return f"{name} shared memory: {smem // 1024} KiB > {limit // 1024} KiB"
      per_thread = acc_floats / (32 * warps)
      if per_thread > REGISTER_BUDGET:
        return f"{name} registers: {per_thread:.0f} fp32/thread > {REGISTER_BUDGET}"
    return None

  return fits


# Hopper (Mosaic GPU) kernels: consumer warpgroups hold 232 registers; ~30 go to
# addresses and row statistics. Measured on the H100 sweep (bench/results/
# flash_sweep_mosaic.json): 192 fp32 per thread ran at full speed, 256 spilled (d128
# 128x128 tiles: 270 vs 527 TFLOP/s).
MOSAIC_REGISTER_BUDGET = 200
MOSAIC_FORWARD_GRID = {"block_q": (64, 128), "block_kv": (64, 128, 192, 256), "stages": (2, 3, 4)}
MOSAIC_PERSISTENT_GRID = {"persistent": (True, False)}  # tried on the forward's winner


def mosaic_forward_cost(c, dk: int, dv: int, nbytes: int) -> tuple[int, float]:
  """The Hopper forward kernel's shared-memory bytes and fp32 accumulators per
  consumer thread (two consumer warpgroups of 128 threads, ``block_q`` rows each):
  ``forward_smem_bytes`` with one Q buffer (the kernel takes a second where it fits)."""
  smem = forward_smem_bytes(c.block_q, c.block_kv, c.stages, dk, dv, nbytes, 1)
  return smem + MOSAIC_SMEM_OVERHEAD, (c.block_q * dv + c.block_q * c.block_kv) / 128


def within_mosaic_budget(name: str, cost: tuple[int, float], info: GPUInfo) -> str | None:
  """Why a Hopper kernel of ``cost = (shared-memory bytes, fp32 per thread)`` does not
  fit ``info``'s device (None: it fits)."""
  smem, per_thread = cost
  limit = shared_memory_limit(info)
  if smem > limit:
    return f"{name} shared memory: {smem // 1024} KiB > {limit // 1024} KiB"
  if per_thread > MOSAIC_REGISTER_BUDGET:
    return f"{name} registers: {per_thread:.0f} fp32/thread > {MOSAIC_REGISTER_BUDGET}"
  return None


# Three small grids (72 + 72 + 9) instead of one of all ten fields.
BLOCK_STAGES = (
    SearchStage("forward", "fwd", {"block_q": BLOCKS, "block_k": BLOCKS, "num_warps": WARPS,
                                   "num_stages": PIPELINE}, block_fits("forward")),
    # The dQ kernel shares the backward warps and stages.
    SearchStage("dK/dV", "fwd+bwd", {"block_q_dkv": BLOCKS, "block_k_dkv": BLOCKS,
                                     "bwd_num_warps": WARPS, "bwd_num_stages": PIPELINE},
                block_fits("dK/dV", "dQ")),
    SearchStage("dQ", "fwd+bwd", {"block_q_dq": BLOCKS, "block_k_dq": BLOCKS}, block_fits("dQ")),
)


def clamp_blocks(c: BlockConfig, q_rows: int, k_rows: int) -> BlockConfig:
  """``c`` with its query-side tiles clamped to ``q_rows`` and key-side ones to
  ``k_rows``: what the kernels run."""
  return dataclasses.replace(c, **{f: clamp_block(getattr(c, f), q_rows) for f in Q_BLOCKS},
                             **{f: clamp_block(getattr(c, f), k_rows) for f in K_BLOCKS})


class BlockTritonImpl(TritonImpl):
  """A Triton-lowered family on ``BlockConfig`` tiles: the shared search space and cost
  model. Subclasses say how many query and key rows the tiles cover (``rows``)."""

  config_cls = BlockConfig

  def rows(self, problem) -> tuple[int, int]:
    raise NotImplementedError

  def tuning_stages(self):
    return BLOCK_STAGES

  def normalize_config(self, config, problem):
    return clamp_blocks(config, *self.rows(problem))

  def fits(self, config, problem, info):
    return block_fits()(config, problem, info)
