"""Flash attention kernels: Triton-lowered forward/backward and their shared masking."""

from pallas_kernels.flash.common import EMPTY_ROW_LSE
from pallas_kernels.flash.config import FlashBlockConfig, default_config
from pallas_kernels.flash.triton import flash_attention_triton

__all__ = ["EMPTY_ROW_LSE", "FlashBlockConfig", "default_config", "flash_attention_triton"]
