"""Tensors of a checkpoint file, known by their index before any of their bytes is
read: what the ``.safetensors`` and PyTorch readers give, so that a loader checks keys
and shapes against its model first and then reads only the tensors it needs.

Everything here comes from an untrusted file: a ``StoredTensor`` checks that its
shape and strides stay inside the bytes its storage holds before it can exist, and
reads exactly those bytes (never more than the file holds past its offset).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes  # bfloat16 and float8 for numpy (a dependency of jax)
import numpy as np

# The index of a checkpoint (a .safetensors header, a PyTorch file's pickle) is read
# whole, so its size is capped: 4 MiB is ten times the index of DAT's largest
# presets (2116 tensors, 364 KB) and keeps what parsing it builds to a few hundred MB.
MAX_INDEX_BYTES = 4 << 20
MAX_NDIM = 32

# Element types by their .safetensors names (PyTorch's storage types map onto them).
DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOATS = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")


class CheckpointError(ValueError):
  """A checkpoint file that cannot be used: missing, not a checkpoint, truncated or
  corrupt, holding pickled objects, or of another model. The message is one line that
  names the file and says which."""


@dataclasses.dataclass
class Storage:
  """``numel`` elements of type ``dtype`` (a key of ``DTYPES``) stored in ``path`` from
  byte ``start`` on (None until the file's layout says where); ``refusal``: why they
  cannot be read, if so (said when a tensor on them is read, not before: a loader
  first names the keys it misses)."""

  path: str
  dtype: str
  numel: int
  start: int | None = None
  big_endian: bool = False
  refusal: str | None = None

  @property
  def nbytes(self) -> int:
    return self.numel * DTYPES[self.dtype].itemsize


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """A tensor of ``shape`` on ``storage``, from element ``offset`` on with ``strides``
  (in elements); raises ``ValueError`` if that reaches outside the storage or holds
  more elements than it (so reading one allocates no more than its file holds).
  ``np.shape`` reads its shape without reading its values; ``read()`` (or
  ``np.asarray``) reads them."""

  storage: Storage
  offset: int
  shape: tuple[int, ...]
  strides: tuple[int, ...]

  def __post_init__(self):
    if not (isinstance(self.storage, Storage) and isinstance(self.shape, tuple)
            and isinstance(self.strides, tuple) and len(self.shape) == len(self.strides) <= MAX_NDIM
            and all(_is_int(n) and n >= 0 for n in self.shape + self.strides)
            and _is_int(self.offset) and self.offset >= 0):
      raise ValueError(f"a tensor's shape {self.shape!r}, strides {self.strides!r} or offset "
                       f"{self.offset!r} is not non-negative integers")
    if math.prod(self.shape) > self.storage.numel:  # what reading it allocates: bounded
      raise ValueError(f"a tensor of shape {self.shape} has more elements than its storage "
                       f"({self.storage.numel}): an expanded view, which no state dict holds")
    if self.offset + self.extent > self.storage.numel:
      raise ValueError(f"a tensor of shape {self.shape} (offset {self.offset}, strides "
                       f"{self.strides}) reaches past its storage of {self.storage.numel} "
                       "elements")

  @property
  def extent(self) -> int:
    """How many elements of the storage, from ``offset`` on, the tensor spans."""
    if 0 in self.shape:
      return 0
    return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

  @property
  def is_floating_point(self) -> bool:
    return self.storage.dtype in FLOATS

  def read(self) -> np.ndarray:
    """The values, a new array: floating types as float32 (numpy has no bfloat16 of
    its own; what the models compute in), the others as stored."""
    s = self.storage
    if s.refusal is not None:
      raise CheckpointError(s.refusal)
    dtype = DTYPES[s.dtype].newbyteorder(">" if s.big_endian else "<")
    buffer = np.empty(self.extent * dtype.itemsize, np.uint8)
    with open(s.path, "rb") as f:
      f.seek(s.start + self.offset * dtype.itemsize)
      complete = f.readinto(buffer) == buffer.size
    if not complete:  # the file changed or ends early: its index said otherwise
      raise CheckpointError(f"checkpoint {s.path!r} is truncated or corrupt (it ends inside "
                            "a tensor's data); download or save it again")
    flat = buffer.view(dtype)
    if self.strides == contiguous_strides(self.shape):
      values = flat.reshape(self.shape)
    else:  # a view into a larger storage: its elements gathered into an array of its own
      values = np.array(np.lib.stride_tricks.as_strided(
          flat, self.shape, [n * dtype.itemsize for n in self.strides]))
    values = values.astype(dtype.newbyteorder("="), copy=False)
    return values.astype(np.float32, copy=False) if self.is_floating_point else values

  def __array__(self, dtype=None, copy=None):
    values = self.read()
    return values if dtype is None else values.astype(dtype)


def contiguous_strides(shape) -> tuple[int, ...]:
  """Row-major strides, in elements, of ``shape``."""
  strides, step = [], 1
  for n in reversed(shape):
    strides.append(step)
    step *= max(n, 1)
  return tuple(reversed(strides))


def as_numpy(value) -> np.ndarray:
  """A checkpoint value as a numpy array: a ``StoredTensor`` read, a torch tensor
  converted (floating types to float32), anything else through ``np.asarray``."""
  if isinstance(value, StoredTensor):
    return value.read()
  if hasattr(value, "detach"):  # a torch tensor
    value = value.detach().cpu()
    return (value.float() if value.is_floating_point() else value).numpy()
  return np.asarray(value)


__all__ = ["CheckpointError", "DTYPES", "FLOATS", "MAX_INDEX_BYTES", "Storage", "StoredTensor",
           "as_numpy", "contiguous_strides"]
