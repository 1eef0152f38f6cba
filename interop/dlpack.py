"""Zero-copy exchange of arrays between PyTorch and JAX through DLPack.

This module imports torch; ``jattn.interop`` exports its names lazily.
"""

from __future__ import annotations

import jax
import torch


def to_jax(tensor):
  """PyTorch tensor -> JAX array on the same device, sharing memory.

  Works for float32/float16/bfloat16 and integer tensors on CPU or CUDA.
  JAX arrays are dense and row-major, so a non-contiguous tensor (a transpose,
  a strided slice) is first made contiguous: that one case copies. Tensors that
  require grad are detached (JAX does its own differentiation).
  """
  if not isinstance(tensor, torch.Tensor):
    raise TypeError(f"to_jax expects a torch.Tensor, got {type(tensor).__name__}")
  tensor = tensor.detach()
  if not tensor.is_contiguous():
    tensor = tensor.contiguous()
  return jax.dlpack.from_dlpack(tensor)


def to_torch(array):
  """JAX array -> PyTorch tensor on the same device, sharing memory (no copy)."""
  if not isinstance(array, jax.Array):
    raise TypeError(f"to_torch expects a jax.Array, got {type(array).__name__}")
  return torch.from_dlpack(array)


def same_memory(array, tensor) -> bool:
  """True when a JAX array and a torch tensor start at the same device address."""
  return array.unsafe_buffer_pointer() == tensor.data_ptr()


__all__ = ["to_jax", "to_torch", "same_memory"]
