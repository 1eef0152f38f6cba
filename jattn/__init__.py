"""jattn: fast, differentiable attention kernels for JAX, written in Pallas.

Every op goes through one core (``jattn.core``): ``flash_attention``,
``flex_attention``, ``window_attention``, ``dilated_attention``, ``retention`` and
``retention_step``;
``jattn.gpu`` says which backend each uses here, ``jattn.nn`` holds the Flax
modules, ``jattn.parallel`` the ring attentions over several devices, and
``jattn.kernels`` the Pallas kernels themselves. The PyTorch bridge is
``jattn.interop`` (imported on its own: jattn never imports torch).
"""

from jattn import flex, gpu, nn, parallel
from jattn.core.device import BACKEND_NAMES
from jattn.dilated import dilated_attention
from jattn.flash import flash_attention
from jattn.flex import BlockMask, create_block_mask, flex_attention
from jattn.gpu import (backend_choices, benchmark_backends, gpu_info, recommended_dtype,
                       select_backend, usable_backends)
from jattn.kernels.common.config import BlockConfig
from jattn.kernels.common.softmax import EMPTY_ROW_LSE
from jattn.kernels.flash import MosaicBlockConfig
from jattn.reference import (dilated_attention_reference, flash_attention_reference,
                             flex_attention_reference, retention_reference,
                             window_attention_reference)
from jattn.retention import retention, retention_step
from jattn.window import window_attention

__version__ = "0.1.0"

BACKENDS = ("auto",) + BACKEND_NAMES  # what every op's ``backend=`` may name
FlashBlockConfig = BlockConfig  # its name before it served every Triton-lowered family

__all__ = ["BACKENDS", "BlockConfig", "BlockMask", "EMPTY_ROW_LSE", "FlashBlockConfig",
           "MosaicBlockConfig", "backend_choices", "benchmark_backends",
           "create_block_mask", "dilated_attention", "dilated_attention_reference",
           "flash_attention", "flash_attention_reference", "flex", "flex_attention",
           "flex_attention_reference", "gpu", "gpu_info", "nn", "parallel",
           "recommended_dtype", "retention", "retention_reference", "retention_step",
           "select_backend", "usable_backends", "window_attention",
           "window_attention_reference"]
