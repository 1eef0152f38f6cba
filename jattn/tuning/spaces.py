"""``BlockTritonImpl``: the implementation base of the Triton-lowered families on
``BlockConfig`` tiles (flash, window, dilated and parallel retention), whose search
space and cost model live beside the config (``jattn.kernels.common.config``)."""

from __future__ import annotations

from jattn.core.device import shared_memory_limit
from jattn.core.op import TritonImpl
from jattn.kernels.common.config import BLOCK_SEARCH, BlockConfig, block_misfit, clamp_blocks


class BlockTritonImpl(TritonImpl):
  """A Triton-lowered family on ``BlockConfig`` tiles: the shared search space and cost
  model. Subclasses say how many query and key rows the tiles cover (``rows``)."""

  config_cls = BlockConfig

  def rows(self, problem) -> tuple[int, int]:
    raise NotImplementedError

  def tuning_stages(self):
    return BLOCK_SEARCH

  def normalize_config(self, config, problem):
    return clamp_blocks(config, *self.rows(problem))

  def fits(self, config, problem, info, kernels=()):
    return block_misfit(config, problem.head_dims, problem.dtype.itemsize, kernels,
                        shared_memory_limit(info))
