"""jattn: fast, differentiable attention kernels for JAX, written in Pallas."""

from jattn import nn
from jattn.backends import BACKENDS, usable_backends
from jattn.flash import flash_attention
from jattn.reference import flash_attention_reference
from pallas_kernels.flash import EMPTY_ROW_LSE, FlashBlockConfig

__version__ = "0.1.0"

__all__ = ["BACKENDS", "EMPTY_ROW_LSE", "FlashBlockConfig", "flash_attention",
           "flash_attention_reference", "nn", "usable_backends"]
