"""PyTorch side of jattn: DLPack bridge, torch references, cross-checks.

torch is imported lazily, so ``import interop`` works without it.
"""

from interop.harness import CrosscheckReport, crosscheck
from interop.dlpack import same_memory, to_jax, to_torch
from interop.torch_reference import flash_attention_torch, retention_torch

__all__ = ["CrosscheckReport", "crosscheck", "flash_attention_torch", "retention_torch", "same_memory", "to_jax",
           "to_torch"]
