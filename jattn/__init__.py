"""jattn: fast, differentiable attention kernels for JAX, written in Pallas."""

from jattn import autotune, gpu, nn
from jattn.backends import BACKENDS, usable_backends
from jattn.dilated import dilated_attention
from jattn.flash import flash_attention
from jattn.gpu import benchmark_backends, gpu_info, recommended_dtype, select_backend
from jattn.reference import (dilated_attention_reference, flash_attention_reference,
                             retention_reference, window_attention_reference)
from jattn.retention import retention, retention_step
from jattn.window import window_attention
from pallas_kernels.flash import EMPTY_ROW_LSE, FlashBlockConfig, MosaicBlockConfig

__version__ = "0.1.0"

__all__ = ["BACKENDS", "EMPTY_ROW_LSE", "FlashBlockConfig", "MosaicBlockConfig", "autotune",
           "benchmark_backends", "dilated_attention", "dilated_attention_reference", "flash_attention", "flash_attention_reference", "gpu",
           "gpu_info", "nn", "recommended_dtype", "retention", "retention_reference",
           "retention_step", "select_backend", "usable_backends", "window_attention",
           "window_attention_reference"]
