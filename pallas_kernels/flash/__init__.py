"""Flash attention kernels: the Triton-lowered family (Ampere+) and the Hopper family
(Pallas Mosaic GPU), forward and backward; host functions pad to the tiles."""

from jattn.kernels.flash.config import MosaicBlockConfig, default_mosaic_config
from jattn.kernels.flash.mosaic import flash_mosaic_backward, flash_mosaic_forward
from jattn.kernels.flash.triton import (FlexMods, flash_triton_backward, flash_triton_forward,
                                       kernel_tiles)

__all__ = ["FlexMods", "MosaicBlockConfig", "default_mosaic_config", "flash_mosaic_backward",
           "flash_mosaic_forward", "flash_triton_backward", "flash_triton_forward",
           "kernel_tiles"]
