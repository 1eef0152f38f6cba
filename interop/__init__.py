"""``jattn.interop``: the PyTorch side of jattn. The DLPack bridge, torch references
of every op, the cross-check harness (``crosscheck``, ``jattn check``), torch
checkpoint loading into the Flax models (``load_dat``), and the command-line tools.

jattn itself never imports this package; torch is imported lazily here, so
``import jattn.interop`` works without it.
"""

from jattn.interop.checkpoints import load_dat, read_state_dict
from jattn.interop.dlpack import same_memory, to_jax, to_torch
from jattn.interop.harness import CrosscheckReport, crosscheck
from jattn.interop.retnet_checkpoints import load_retnet
from jattn.interop.torch_reference import flash_attention_torch, retention_torch

__all__ = ["CrosscheckReport", "crosscheck", "flash_attention_torch", "load_dat", "load_retnet",
           "read_state_dict", "retention_torch", "same_memory", "to_jax", "to_torch"]
