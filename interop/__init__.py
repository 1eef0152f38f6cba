"""``jattn.interop``: the PyTorch side of jattn. The DLPack bridge, torch references
of every op, the cross-check harness (``crosscheck``, ``jattn check``), torch
checkpoint loading into the Flax models (``load_dat``, ``load_retnet``, ``load_llama``), and the command-line tools.

jattn itself never imports this package. Each public name is imported on first use
(``jattn.lazy_exports``): ``import jattn.interop`` loads neither JAX nor torch, and the
command-line tools start without them. The modules that use torch import it at their
top and are imported only where torch is needed (``jattn.interop.torch_import``).
"""

from jattn.lazy_exports import lazy_exports

lazy_exports(__name__, {
    "CrosscheckReport": "jattn.interop.harness:CrosscheckReport",
    "crosscheck": "jattn.interop.harness:crosscheck",
    "flash_attention_torch": "jattn.interop.torch_reference:flash_attention_torch",
    "load_dat": "jattn.interop.checkpoints:load_dat",
    "load_llama": "jattn.interop.llama_checkpoints:load_llama",
    "load_llama_torch": "jattn.interop.llama_checkpoints:load_llama_torch",
    "load_retnet": "jattn.interop.retnet_checkpoints:load_retnet",
    "read_checkpoint": "jattn.interop.checkpoint_files:read_checkpoint",
    "read_state_dict": "jattn.interop.checkpoint_files:read_state_dict",
    "retention_torch": "jattn.interop.torch_reference:retention_torch",
    "same_memory": "jattn.interop.dlpack:same_memory",
    "to_jax": "jattn.interop.dlpack:to_jax",
    "to_torch": "jattn.interop.dlpack:to_torch",
})
