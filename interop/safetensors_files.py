""".safetensors files, read and written with numpy alone (no torch, no safetensors
package): an 8-byte little-endian header length, a JSON header ``{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the tensors'
bytes. Reading parses the header only; each tensor's bytes are read when asked for.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from jattn.interop.stored_tensors import (DTYPES, MAX_INDEX_BYTES, MAX_NDIM, CheckpointError,
                                          Storage, StoredTensor, contiguous_strides)

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _corrupt(path: str, what: str) -> CheckpointError:
  return CheckpointError(f"checkpoint {path!r} is not a valid .safetensors file (truncated or "
                         f"corrupt: {what}); download or save it again")


def safetensors_index(path: str) -> dict[str, StoredTensor]:
  """The tensors of a .safetensors file by name, their bytes not read; a
  ``CheckpointError`` for a header that is too large, not the format's, or that puts
  a tensor outside the file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    length = int.from_bytes(f.read(8), "little")
    if length > MAX_INDEX_BYTES:
      raise CheckpointError(f"checkpoint {path!r}: its .safetensors header is {length} bytes "
                            f"long, more than jattn reads ({MAX_INDEX_BYTES})")
    if 8 + length > size:
      raise _corrupt(path, f"a header of {length} bytes in a file of {size}")
    text = f.read(length)
  try:
    header = json.loads(text)
  except (ValueError, RecursionError) as e:  # RecursionError: deeply nested brackets
    raise _corrupt(path, f"its header is not JSON: {str(e)[:80]}") from None
  if not isinstance(header, dict):
    raise _corrupt(path, "its header is not a JSON object")
  data_start, data_size = 8 + length, size - 8 - length
  tensors = {}
  for name, entry in header.items():
    if name != "__metadata__":
      tensors[name] = _tensor(path, name, entry, data_start, data_size)
  return tensors


def _tensor(path, name, entry, data_start, data_size) -> StoredTensor:
  ok = isinstance(entry, dict) and entry.get("dtype") in DTYPES
  shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
  ints = lambda xs, n=None: (isinstance(xs, list) and (n is None or len(xs) == n)
                             and all(type(x) is int and x >= 0 for x in xs))
  if not (ok and ints(shape) and len(shape) <= MAX_NDIM and ints(offsets, 2)):
    raise _corrupt(path, f"tensor {name!r} is described as {str(entry)[:120]}")
  begin, end = offsets
  nbytes = math.prod(shape) * DTYPES[entry["dtype"]].itemsize
  if not begin <= end <= data_size or end - begin != nbytes:
    raise _corrupt(path, f"tensor {name!r} of shape {shape} takes bytes {begin} to {end} of "
                   f"{data_size}")
  storage = Storage(path, entry["dtype"], math.prod(shape), data_start + begin)
  return StoredTensor(storage, 0, tuple(shape), contiguous_strides(shape))


def write_safetensors(path, arrays: dict[str, np.ndarray]) -> None:
  """Writes ``arrays`` (numpy, of the types in ``DTYPES``) to ``path`` as .safetensors,
  the widest types first so that every tensor starts on a multiple of its size, as the
  safetensors package writes them."""
  names = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
  header, offset = {}, 0
  for name in names:
    value = arrays[name]
    if value.dtype not in _NAMES:
      raise TypeError(f"{name!r} has dtype {value.dtype}, which .safetensors files do not hold")
    header[name] = {"dtype": _NAMES[value.dtype], "shape": list(value.shape),
                    "data_offsets": [offset, offset + value.nbytes]}
    offset += value.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text)
    for name in names:
      f.write(np.ascontiguousarray(arrays[name]).tobytes())


__all__ = ["safetensors_index", "write_safetensors"]
