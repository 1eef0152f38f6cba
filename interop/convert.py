"""Torch state dicts <-> Flax NNX modules, by parameter name.

A torch ``Linear`` named ``a.b`` stores ``a.b.weight [out, in]`` (and ``a.b.bias``);
the NNX module has ``a.b.kernel [in, out]`` (and ``a.b.bias``). Names follow the torch
modules that jattn's layers mirror, so the mapping is mechanical.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


def _nnx_linears(module) -> dict[str, nnx.Linear]:
  return {".".join(str(p) for p in path): m for path, m in nnx.iter_graph(module)
          if isinstance(m, nnx.Linear)}


def _as_numpy(value) -> np.ndarray:
  if hasattr(value, "detach"):  # a torch tensor
    value = value.detach().float().cpu().numpy()
  return np.asarray(value)


def load_torch_state_dict(module, state_dict) -> None:
  """Copies a torch ``state_dict`` into the NNX ``module``'s Linear layers, in place.

  Raises ValueError naming every missing or unexpected key and any shape mismatch.
  """
  linears = _nnx_linears(module)
  expected = {}
  for name, linear in linears.items():
    expected[f"{name}.weight"] = (linear, "kernel")
    if linear.bias is not None:
      expected[f"{name}.bias"] = (linear, "bias")
  missing = sorted(set(expected) - set(state_dict))
  unexpected = sorted(set(state_dict) - set(expected))
  if missing or unexpected:
    raise ValueError(f"checkpoint does not match {type(module).__name__}: missing keys "
                     f"{missing}, unexpected keys {unexpected}")
  for key, (linear, attr) in expected.items():
    value = _as_numpy(state_dict[key])
    param = getattr(linear, attr)
    # Shapes are reported in the checkpoint's (torch) layout.
    want = param.value.shape[::-1] if attr == "kernel" else param.value.shape
    if value.shape != want:
      raise ValueError(f"checkpoint key {key!r} has shape {value.shape}, the module expects "
                       f"{want}")
    param.value = jnp.asarray(value.T if attr == "kernel" else value, param.value.dtype)


def to_torch_state_dict(module) -> dict[str, np.ndarray]:
  """The NNX ``module``'s Linear layers as a torch-layout state dict of numpy arrays."""
  out = {}
  for name, linear in _nnx_linears(module).items():
    out[f"{name}.weight"] = np.asarray(linear.kernel.value).T
    if linear.bias is not None:
      out[f"{name}.bias"] = np.asarray(linear.bias.value)
  return out
