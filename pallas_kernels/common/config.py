"""Tile configs of the Triton-lowered kernels (``BlockConfig``: its heuristic, search
space and cost model), the head-dim and tile arithmetic every kernel family shares,
and ``SearchGrid``, the shape of every family's search space.

Cost model of a ``BlockConfig`` (prunes candidates before anything is compiled; ``d``
is the padded head dim, ``S`` the software-pipelining stages):

- shared memory per kernel must fit the device's:
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
from typing import Mapping

MIN_BLOCK = 16  # Triton's dot needs every tile side to be at least 16.
# The widest head any Pallas kernel here takes (its tiles and accumulators must fit
# shared memory and registers).
MAX_HEAD_DIM = 256
# Hopper and Ampere cap a thread at 255 registers; about 30 go to addresses, indices
# and the softmax row statistics.
REGISTER_BUDGET = 224
MODES = ("fwd", "fwd+bwd")  # what a search stage is timed on


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: ``space`` is a dict
class SearchGrid:
  """One stage of a config search: the fields varied together over ``space`` (the
  others stay at the previous stage's winner), timed on ``mode`` (``"fwd"`` or
  ``"fwd+bwd"``). ``kernels``: the kernels of the family's cost model these fields
  change, which prune the stage's candidates (none named: every kernel the config runs)."""

  name: str
  mode: str
  space: Mapping[str, tuple]
  kernels: tuple[str, ...] = ()

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"SearchGrid.mode must be one of {MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiles and launch parameters of a Triton-lowered attention-shaped kernel family:
  a forward kernel (``block_q`` x ``block_k``), a dK/dV kernel and a dQ kernel.
  Flash, window, dilated and parallel-retention attention all run on it.

  Every block size must be a power of two and at least 16. They are clamped to
  the (padded) sequence lengths of a call, so one config serves every length.
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  block_q_dkv: int = 64
  block_k_dkv: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  bwd_num_warps: int = 8
  bwd_num_stages: int = 2

  def __post_init__(self):
    check_powers_of_two(self, ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq",
                               "block_k_dq"), MIN_BLOCK)
    for field in ("num_warps", "bwd_num_warps"):
      value = getattr(self, field)
      if value not in (1, 2, 4, 8, 16):
        raise ValueError(f"BlockConfig.{field} must be one of 1, 2, 4, 8, 16, got {value}")
    for field in ("num_stages", "bwd_num_stages"):
      if getattr(self, field) < 1:
        raise ValueError(f"BlockConfig.{field} must be >= 1, got {getattr(self, field)}")


def check_powers_of_two(config, fields: tuple[str, ...], minimum: int) -> None:
  """Raises, naming the config class and the field, unless each of ``fields`` is a power
  of two >= ``minimum``."""
  for field in fields:
    value = getattr(config, field)
    if value < minimum or value & (value - 1):
      raise ValueError(f"{type(config).__name__}.{field} must be a power of two >= "
                       f"{minimum}, got {value}")


def next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def padded_head_dim(head_dim: int) -> int:
  """Head dims are padded with zeros to a power of two (>= 16) for the tiles."""
  return max(MIN_BLOCK, next_power_of_two(head_dim))


def clamp_block(block: int, length: int) -> int:
  """The block actually used for a sequence of ``length``: never larger than needed."""
  return max(MIN_BLOCK, min(block, next_power_of_two(length)))


def default_block_config(head_dim: int, dtype_bytes: int) -> BlockConfig:
  """Heuristic defaults by padded head dim and element size (measured on H100)."""
  d = padded_head_dim(head_dim)
  if dtype_bytes >= 4:
    # fp32 tiles take twice the shared memory and registers of fp16 ones.
    return BlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                            block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                            bwd_num_warps=4, bwd_num_stages=2)
  # d <= 64 and d <= 128: the winners of bench/flash.py --sweep on an H100, fp16,
  # causal and not.
  if d <= 64:
    return BlockConfig(block_q=64, block_k=64, num_warps=4, num_stages=3,
                            block_q_dkv=64, block_k_dkv=64, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=4, bwd_num_stages=3)
  if d <= 128:
    return BlockConfig(block_q=128, block_k=64, num_warps=4, num_stages=2,
                            block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64,
                            bwd_num_warps=8, bwd_num_stages=3)
  return BlockConfig(block_q=64, block_k=32, num_warps=4, num_stages=2,
                          block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                          bwd_num_warps=8, bwd_num_stages=1)


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


def block_misfit(c: BlockConfig, head_dims: tuple[int, ...], nbytes: int,
                 kernels: tuple[str, ...], smem_limit: int) -> str | None:
  """Why the ``kernels`` (names of ``block_costs``; all three when none are named) of
  config ``c`` do not fit a device with ``smem_limit`` bytes of shared memory per block
  (None: they fit)."""
  costs = block_costs(c, padded_head_dim(max(head_dims)))
  for name in kernels or tuple(costs):
    smem_elems, acc_floats, warps = costs[name]
    reason = over_budget(name, (smem_elems * nbytes, acc_floats / (32 * warps)), smem_limit,
                         REGISTER_BUDGET)
    if reason is not None:
      return reason
  return None


def over_budget(name: str, cost: tuple[int, float], smem_limit: int,
                register_budget: int | None) -> str | None:
  """Why a kernel of ``cost = (shared-memory bytes, fp32 accumulators per thread)``
  does not fit ``smem_limit`` bytes of shared memory and ``register_budget`` (None:
  shared memory only) (None: it fits). Every family's cost model ends here."""
  smem, per_thread = cost
  if smem > smem_limit:
    return f"{name} shared memory: {smem:,} B > {smem_limit:,} B"
  if register_budget is not None and per_thread > register_budget:
    return f"{name} registers: {per_thread:.0f} fp32/thread > {register_budget}"
  return None


def clamp_blocks(c: BlockConfig, q_rows: int, k_rows: int) -> BlockConfig:
  """``c`` with its query-side tiles clamped to ``q_rows`` and key-side ones to
  ``k_rows``: what the kernels run."""
  q_blocks = ("block_q", "block_q_dkv", "block_q_dq")
  k_blocks = ("block_k", "block_k_dkv", "block_k_dq")
  return dataclasses.replace(c, **{f: clamp_block(getattr(c, f), q_rows) for f in q_blocks},
                             **{f: clamp_block(getattr(c, f), k_rows) for f in k_blocks})


_BLOCKS, _WARPS, _PIPELINE = (32, 64, 128), (4, 8), (1, 2, 3, 4)
# Three small grids (72 + 72 + 9) instead of one of all ten fields.
BLOCK_SEARCH = (
    SearchGrid("forward", "fwd", {"block_q": _BLOCKS, "block_k": _BLOCKS, "num_warps": _WARPS,
                                  "num_stages": _PIPELINE}, ("forward",)),
    # The dQ kernel shares the backward warps and stages.
    SearchGrid("dK/dV", "fwd+bwd", {"block_q_dkv": _BLOCKS, "block_k_dkv": _BLOCKS,
                                    "bwd_num_warps": _WARPS, "bwd_num_stages": _PIPELINE},
               ("dK/dV", "dQ")),
    SearchGrid("dQ", "fwd+bwd", {"block_q_dq": _BLOCKS, "block_k_dq": _BLOCKS}, ("dQ",)),
)
