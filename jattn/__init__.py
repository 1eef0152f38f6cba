"""jattn: fast, differentiable attention kernels for JAX, written in Pallas.

Every op goes through one core (``jattn.core``): ``flash_attention``,
``flex_attention``, ``window_attention``, ``dilated_attention``, ``retention``,
``retention_step``, ``flash_attention_varlen`` and ``paged_attention`` (with
``write_kv_pages``); ``dot_product_attention`` takes ``jax.nn``'s signature to them;
``jattn.gpu`` says which backend each uses here, ``jattn.nn`` holds the Flax
modules, ``jattn.parallel`` the ring attentions over several devices, and
``jattn.kernels`` the Pallas kernels themselves. The PyTorch bridge is
``jattn.interop`` (imported on its own: jattn never imports torch).

Each public name is imported on first use (``jattn.lazy_exports``), so ``import jattn``
costs nothing until an op is called.
"""

from jattn.lazy_exports import lazy_exports

__version__ = "0.1.0"

# public name -> "module:attribute", or "module" for a module itself
_EXPORTS = {
    "BACKENDS": "jattn.core.device:BACKEND_ARGUMENTS",  # what every op's backend= may name
    "BlockConfig": "jattn.kernels.common.config:BlockConfig",
    "BlockMask": "jattn.flex:BlockMask",
    "EMPTY_ROW_LSE": "jattn.kernels.common.softmax:EMPTY_ROW_LSE",
    # BlockConfig's name before it served every Triton-lowered family
    "FlashBlockConfig": "jattn.kernels.common.config:BlockConfig",
    "MosaicBlockConfig": "jattn.kernels.flash:MosaicBlockConfig",
    "backend_choices": "jattn.gpu:backend_choices",
    "benchmark_backends": "jattn.gpu:benchmark_backends",
    "create_block_mask": "jattn.flex:create_block_mask",
    "dilated_attention": "jattn.dilated:dilated_attention",
    "dilated_attention_reference": "jattn.reference:dilated_attention_reference",
    "flash_attention": "jattn.flash:flash_attention",
    "flash_attention_reference": "jattn.reference:flash_attention_reference",
    "flash_attention_varlen": "jattn.varlen:flash_attention_varlen",
    "flash_attention_varlen_reference": "jattn.reference:flash_attention_varlen_reference",
    "flex": "jattn.flex",
    "flex_attention": "jattn.flex:flex_attention",
    "dot_product_attention": "jattn.dot_product:dot_product_attention",
    "flex_attention_reference": "jattn.reference:flex_attention_reference",
    "gpu": "jattn.gpu",
    "gpu_info": "jattn.gpu:gpu_info",
    "nn": "jattn.nn",
    "paged_attention": "jattn.paged:paged_attention",
    "parallel": "jattn.parallel",
    "recommended_dtype": "jattn.gpu:recommended_dtype",
    "retention": "jattn.retention:retention",
    "retention_reference": "jattn.reference:retention_reference",
    "retention_step": "jattn.retention:retention_step",
    "select_backend": "jattn.gpu:select_backend",
    "usable_backends": "jattn.gpu:usable_backends",
    "window_attention": "jattn.window:window_attention",
    "window_attention_reference": "jattn.reference:window_attention_reference",
    "write_kv_pages": "jattn.paged:write_kv_pages",
}
lazy_exports(__name__, _EXPORTS)
