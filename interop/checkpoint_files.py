"""Reading checkpoint files: what format a file is (read off its first bytes), and its
tensors by key, as ``StoredTensor``s whose bytes are read only when asked for
(``read_checkpoint``), or as numpy arrays (``read_state_dict``).

Files are untrusted input: ``.safetensors`` headers are parsed here, and what
``torch.save`` writes is read through a restricted unpickler that runs no pickled code
and builds no storage (``jattn.interop.torch_files``). Numpy alone: neither torch nor
JAX is imported, so the command-line tools check the files they are given first.
"""

from __future__ import annotations

import os

import numpy as np

from jattn.interop.safetensors_files import safetensors_index
from jattn.interop.stored_tensors import CheckpointError, StoredTensor
from jattn.interop.torch_files import open_archive, torch_legacy_index, torch_zip_index

WRAPPERS = ("params_ema", "params", "state_dict", "model")


def _unwrap(obj, path):
  for key in WRAPPERS:  # BasicSR saves {"params": ...} or {"params_ema": ...}
    if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
      return obj[key]
  if not isinstance(obj, dict):
    raise CheckpointError(f"{path!r}: expected a state dict (name -> tensor), "
                          f"got {type(obj).__name__}")
  return obj


def checkpoint_format(path) -> str:
  """``"safetensors"``, ``"torch"`` (a zip archive, what ``torch.save`` writes) or
  ``"torch-legacy"`` (a pickle, torch < 1.6), read off the file's first bytes (not its
  name); a ``CheckpointError`` for a missing file, a folder, or anything else."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint {path!r}: no such file")
  if os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path!r} is a folder; expected a .pth or "
                          ".safetensors file")
  if not os.path.isfile(path):  # a pipe or a device: reading would block or never end
    raise CheckpointError(f"checkpoint {path!r} is not a regular file")
  try:
    with open(path, "rb") as f:
      head = f.read(9)
  except OSError as e:
    raise CheckpointError(f"checkpoint {path!r} cannot be read ({e.strerror})") from None
  if head.startswith(b"PK\x03\x04"):
    open_archive(path).close()  # reads the directory at the end: finds truncation
    return "torch"
  if len(head) == 9 and head[8:9] == b"{":
    return "safetensors"  # an 8-byte header length, then the JSON header
  if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
    return "torch-legacy"
  raise CheckpointError(f"{path!r} is not a checkpoint: neither a PyTorch file (.pth, as "
                        "torch.save writes it) nor a .safetensors file")


def read_checkpoint(path) -> dict[str, StoredTensor]:
  """The tensors of a checkpoint file by torch key, their values not read yet.

  The format is read off the file's content: ``.safetensors``, or what ``torch.save``
  writes (no pickled code runs: only tensors in dicts are accepted). BasicSR's
  ``params_ema`` / ``params`` wrappers and a DataParallel ``module.`` prefix are
  removed. Raises ``CheckpointError`` (one line naming the file) for anything else.
  """
  path = os.fspath(path)
  kind = checkpoint_format(path)
  if kind == "safetensors":
    state = safetensors_index(path)
  else:
    obj = (torch_zip_index if kind == "torch" else torch_legacy_index)(path)
    state = _unwrap(obj, path)
  tensors = {}
  for key, value in state.items():
    if not isinstance(value, StoredTensor):
      continue  # an entry that is no tensor (a step count) is no weight either
    if not isinstance(key, str):
      raise CheckpointError(f"checkpoint {path!r} is not a state dict: a tensor's key is "
                            f"{key!r}, of type {type(key).__name__}, not a parameter name")
    tensors[key] = value
  if not tensors:
    raise CheckpointError(f"checkpoint {path!r} holds no tensors")
  if all(k.startswith("module.") for k in tensors):  # saved from DataParallel
    tensors = {k[len("module."):]: v for k, v in tensors.items()}
  return tensors


def read_state_dict(path) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint file (``read_checkpoint``) as a numpy array by torch
  key: floating types as float32, the others as stored."""
  return {key: tensor.read() for key, tensor in read_checkpoint(path).items()}


def key_summary(state) -> str:
  """How many tensors ``state`` holds and its first few keys, for error messages."""
  keys = sorted(state)
  return (f"it holds {len(keys)} tensors: " + ", ".join(map(repr, keys[:3]))
          + (", ..." if len(keys) > 3 else ""))


def tensor_of(state, key: str, ndim: int, model: str):
  """``state[key]``, a tensor of ``ndim`` dimensions, none empty; a ``CheckpointError``
  naming the key otherwise (what a config is read off must be what the model stores)."""
  if key not in state:
    raise CheckpointError(f"not a {model} checkpoint: key {key!r} is missing "
                          f"({key_summary(state)})")
  shape = tuple(np.shape(state[key]))
  if len(shape) != ndim or 0 in shape:
    raise CheckpointError(f"not a {model} checkpoint: {key!r} has shape {shape}, expected "
                          f"{ndim} non-empty dimensions")
  return state[key]
