"""Flash attention kernels: Triton-lowered (Ampere+) and Mosaic GPU (Hopper)
forward/backward, with their shared masking and tile configs."""

from pallas_kernels.flash.common import EMPTY_ROW_LSE
from pallas_kernels.flash.config import (FlashBlockConfig, MosaicBlockConfig, default_config,
                                         default_mosaic_config)
from pallas_kernels.flash.mosaic import flash_attention_mosaic
from pallas_kernels.flash.triton import flash_attention_triton

__all__ = ["EMPTY_ROW_LSE", "FlashBlockConfig", "MosaicBlockConfig", "default_config",
           "default_mosaic_config", "flash_attention_mosaic", "flash_attention_triton"]
