"""Reading PyTorch checkpoint files: what format a file is (read off its first bytes),
and its tensors as numpy arrays (``torch.load(weights_only=True)``, or safetensors).

Light to import (numpy; torch and safetensors only when a file is read), so that the
command-line tools check the files they are given before JAX loads.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from jattn.command_line import first_line

WRAPPERS = ("params_ema", "params", "state_dict", "model")


class CheckpointError(ValueError):
  """A checkpoint file that cannot be used: missing, not a checkpoint, truncated or
  corrupt, holding pickled objects, or of another model. The message is one line that
  names the file and says which."""


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
    try:
      zipfile.ZipFile(path).close()  # reads the directory at the end: finds truncation
    except (zipfile.BadZipFile, OSError):
      raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt (its zip archive "
                            "cannot be read); download or save it again") from None
    return "torch"
  if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 1 << 30:
    return "safetensors"  # an 8-byte header length, then the JSON header
  if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
    return "torch-legacy"
  raise CheckpointError(f"{path!r} is not a checkpoint: neither a PyTorch file (.pth, as "
                        "torch.save writes it) nor a .safetensors file")


def read_state_dict(path) -> dict[str, np.ndarray]:
  """The tensors of a checkpoint file as numpy arrays by torch key.

  The format is read off the file's content: ``.safetensors``, or what ``torch.save``
  writes, loaded with ``torch.load(weights_only=True)`` (no pickled code runs). Raises
  ``CheckpointError`` (one line naming the file) for anything that is not that.
  """
  path = os.fspath(path)
  if checkpoint_format(path) == "safetensors":
    from safetensors.numpy import load_file

    try:
      state = load_file(path)
    except Exception as e:  # safetensors raises its own error type for a bad header
      raise CheckpointError(f"checkpoint {path!r} is not a valid .safetensors file "
                            f"(truncated or corrupt: {first_line(e)})") from None
  else:
    state = _unwrap(_torch_load(path), path)
    state = {k: v.detach().cpu().float().numpy() if v.is_floating_point() else v.cpu().numpy()
             for k, v in state.items() if hasattr(v, "detach")}
  if not state:
    raise CheckpointError(f"checkpoint {path!r} holds no tensors")
  if all(k.startswith("module.") for k in state):  # saved from DataParallel
    state = {k[len("module."):]: v for k, v in state.items()}
  return state


def _torch_load(path: str):
  import pickle

  import torch

  try:
    return torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    # torch's own message suggests weights_only=False: never for a file from elsewhere,
    # so none of its text is passed on.
    if "Unsupported global" in str(e):
      raise CheckpointError(
          f"checkpoint {path!r} holds Python objects besides tensors, which jattn does not "
          "unpickle (torch.load(weights_only=True)); save model.state_dict() or convert it "
          "to .safetensors") from None
    raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt (its pickled index "
                          "cannot be read); download or save it again") from None
  except Exception as e:
    raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt (torch cannot read "
                          f"it: {first_line(e)})") from None


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
