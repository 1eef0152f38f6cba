"""What ``torch.save`` writes, read without torch and without running pickled code.

A PyTorch file is a pickle (the "index": dicts of tensors, each a storage key, an
offset, a shape and strides) plus the storages' bytes: in a zip archive
(``<name>/data.pkl`` and ``<name>/data/<key>``, torch >= 1.6) or after the pickle in
the legacy format. The index is unpickled by a restricted unpickler: it knows only
the few globals ``torch.save`` writes for tensors in dicts, builds no storage and
reads no tensor bytes; any other global (a module, ``os.system``) is refused before
anything is called, as ``torch.load(weights_only=True)`` does. The tensors come back
as ``StoredTensor``s whose bytes are read later, only if a loader needs them.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import pickletools
import struct
import zipfile

from jattn.interop.stored_tensors import MAX_INDEX_BYTES, CheckpointError, Storage, StoredTensor

# torch's storage types and the element type each holds.
STORAGE_TYPES = {
    "BoolStorage": "BOOL", "ByteStorage": "U8", "CharStorage": "I8", "ShortStorage": "I16",
    "IntStorage": "I32", "LongStorage": "I64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "FloatStorage": "F32", "DoubleStorage": "F64",
}
LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001

# The pickle opcodes of dicts, tuples, lists, numbers, strings and calls of allowed
# globals. Others (sets, bytearrays, object construction, extension codes) torch.save
# does not write for tensors in dicts; refusing them also bounds the memory an index
# builds to a small multiple of its size.
OPCODES = frozenset("""
PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1
BINFLOAT BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES EMPTY_TUPLE TUPLE
TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST APPEND APPENDS LIST EMPTY_DICT DICT SETITEM SETITEMS BINGET
LONG_BINGET BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL REDUCE BUILD BINPERSID
""".split())
OBJECT_OPCODES = frozenset("NEWOBJ NEWOBJ_EX INST OBJ EXT1 EXT2 EXT4".split())


class _Refused(Exception):
  """A global the index may not use: the file holds Python objects besides tensors."""


class _TensorRef:
  """A tensor in the index: ``torch._utils._rebuild_tensor_v2``'s arguments."""

  __slots__ = ("storage", "offset", "shape", "strides")

  def __init__(self, storage, offset, shape, strides, *_ignored):
    if not isinstance(storage, Storage):
      raise ValueError(f"a tensor's storage is {type(storage).__name__}, not a storage")
    self.storage, self.offset = storage, offset
    self.shape, self.strides = tuple(shape), tuple(strides)


def _parameter(data, *_ignored):
  """``torch._utils._rebuild_parameter(_with_state)``: an ``nn.Parameter`` is its tensor."""
  if not isinstance(data, _TensorRef):
    raise ValueError(f"a parameter holds {type(data).__name__}, not a tensor")
  return data


class _StorageType:
  def __init__(self, dtype: str):
    self.dtype = dtype


GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _TensorRef,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_TYPES.items()},
}


class _IndexUnpickler(pickle.Unpickler):
  """Unpickles an index: allowed globals only, storages as ``Storage`` records made by
  ``storage(key, dtype, numel)`` (one per key)."""

  def __init__(self, data: bytes, storage):
    super().__init__(io.BytesIO(data))
    self._storage, self.storages = storage, {}

  def find_class(self, module, name):
    if (module, name) not in GLOBALS:
      raise _Refused(f"{module}.{name}")
    return GLOBALS[module, name]

  def persistent_load(self, pid):
    # ('storage', type, key, location, numel), and view metadata (None) in the legacy format
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
            and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
            and type(pid[4]) is int and pid[4] >= 0 and (len(pid) == 5 or pid[5] is None)):
      raise ValueError(f"unexpected storage record {str(pid)[:80]}")
    _, kind, key, _, numel = pid[:5]
    if key not in self.storages:
      self.storages[key] = self._storage(key, kind.dtype, numel)
    stored = self.storages[key]
    if (stored.dtype, stored.numel) != (kind.dtype, numel):
      raise ValueError(f"storage {key!r} is described twice, differently")
    return stored


@contextlib.contextmanager
def _parsing(path: str, what: str):
  """Any error met parsing the untrusted bytes of ``path`` means they are damaged: one
  ``CheckpointError`` saying ``what`` could not be read. Not ``MemoryError``: the
  bounds on what is read are this module's to keep, so running out is a bug."""
  try:
    yield
  except (CheckpointError, _Refused, MemoryError):
    raise
  except Exception as e:  # what zipfile and pickle raise for damaged bytes varies
    raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt ({what}: "
                          f"{str(e)[:100] or type(e).__name__}); download or save it "
                          "again") from None


def _unpickle(path: str, data: bytes, storage):
  """``(object, storages by key)`` of one pickle of the index; the tensors in it are
  ``_TensorRef``s."""
  try:
    with _parsing(path, "its pickled index cannot be read"):
      return _load(data, storage)
  except _Refused as e:
    raise CheckpointError(
        f"checkpoint {path!r} holds Python objects besides tensors ({e}): refused for safety, "
        "as torch.load(weights_only=True) refuses them (unpickling them could run any code); "
        "save model.state_dict() or convert it to .safetensors") from None


def _load(data: bytes, storage):
  """The object and storages of one pickle, its opcodes checked first."""
  for opcode, arg, _ in pickletools.genops(data):
    if opcode.name == "GLOBAL" and tuple(arg.split(" ", 1)) not in GLOBALS:
      raise _Refused(arg.replace(" ", "."))
    if opcode.name in OBJECT_OPCODES:
      raise _Refused(f"made by the pickle opcode {opcode.name}")
    if opcode.name not in OPCODES:
      raise ValueError(f"pickle opcode {opcode.name}, which torch.save does not write")
    # The unpickler sizes its memo by the largest index: one past the data's length
    # cannot be one torch.save wrote (it numbers objects from 0).
    if opcode.name.endswith("PUT") and arg > len(data):
      raise ValueError(f"memo index {arg} in a pickle of {len(data)} bytes")
  unpickler = _IndexUnpickler(data, storage)
  return unpickler.load(), unpickler.storages


def _tensors(obj, depth: int = 2):
  """``obj`` with every ``_TensorRef`` in its dicts down to ``depth`` levels (a state
  dict, and BasicSR's ``{"params": state dict}`` around it) as a ``StoredTensor``."""
  if isinstance(obj, _TensorRef):
    return StoredTensor(obj.storage, obj.offset, obj.shape, obj.strides)
  if isinstance(obj, dict) and depth:
    return {k: _tensors(v, depth - 1) for k, v in obj.items()}
  return obj


def _checked_tensors(path: str, obj):
  try:
    return _tensors(obj)
  except ValueError as e:
    raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt ({e}); download or "
                          "save it again") from None


def _read_capped(stream, what: str, path: str) -> bytes:
  data = stream.read(MAX_INDEX_BYTES + 1)
  if len(data) > MAX_INDEX_BYTES:
    raise CheckpointError(f"checkpoint {path!r}: its {what} is more than {MAX_INDEX_BYTES} "
                          "bytes, more than jattn reads")
  return data


def open_archive(path: str) -> zipfile.ZipFile:
  """The zip archive ``path`` (its directory read: a truncated file is found here); a
  ``CheckpointError`` if it cannot be read."""
  with _parsing(path, "its zip archive cannot be read"):
    return zipfile.ZipFile(path)


def torch_zip_index(path: str):
  """The object a zip-format ``torch.save`` file holds, its tensors ``StoredTensor``s."""
  size = os.path.getsize(path)
  with open_archive(path) as archive, open(path, "rb") as raw:
    pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
    if len(pickles) != 1:
      raise CheckpointError(f"{path!r} is a zip archive but not a PyTorch checkpoint (it has no "
                            "<name>/data.pkl)")
    prefix = pickles[0][:-len("data.pkl")]

    def storage(key: str, dtype: str, numel: int) -> Storage:
      record = Storage(path, dtype, numel)
      try:
        info = archive.getinfo(f"{prefix}data/{key}")
      except KeyError:
        raise ValueError(f"storage {key!r} is missing") from None
      if info.file_size != record.nbytes:
        raise ValueError(f"storage {key!r} holds {info.file_size} bytes, not {record.nbytes}")
      if info.compress_type != zipfile.ZIP_STORED:
        record.refusal = (f"checkpoint {path!r}: tensor data {key!r} is compressed, which "
                          "torch.save never does (and jattn does not inflate); save it again "
                          "with torch.save")
        return record
      # The bytes follow the record's local header (30 bytes, its name and extra field).
      raw.seek(info.header_offset)
      local = raw.read(30)
      if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"storage {key!r} has no local header")
      name_length, extra_length = struct.unpack("<HH", local[26:30])
      record.start = info.header_offset + 30 + name_length + extra_length
      if record.start + record.nbytes > size:
        raise ValueError(f"storage {key!r} ends past the end of the file")
      return record

    with _parsing(path, "its zip archive cannot be read"):
      with archive.open(pickles[0]) as stream:
        data = _read_capped(stream, "pickled index", path)
      byteorder = b"little"  # what torch < 1.10 wrote no record of
      if prefix + "byteorder" in archive.namelist():
        with archive.open(prefix + "byteorder") as stream:
          byteorder = stream.read(16)
    obj, storages = _unpickle(path, data, storage)
  for record in storages.values():
    record.big_endian = byteorder == b"big"
  return _checked_tensors(path, obj)


def torch_legacy_index(path: str):
  """The object a legacy ``torch.save`` file (torch < 1.6) holds: pickles of a magic
  number, the protocol, system facts, the object and its storage keys, then each
  storage as an 8-byte element count and its bytes."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    stream = io.BytesIO(f.read(MAX_INDEX_BYTES + 4096))  # the index and four small pickles
  capped = len(stream.getbuffer()) < size

  def next_object(storage=None):
    def no_storage(*_):
      raise ValueError("a storage outside the object")
    return _unpickle(path, _next_pickle(path, stream, capped), storage or no_storage)

  if next_object()[0] != LEGACY_MAGIC:
    raise CheckpointError(f"{path!r} is a pickle but not a PyTorch checkpoint: jattn reads only "
                          "what torch.save writes")
  protocol, info = next_object()[0], next_object()[0]
  little = not isinstance(info, dict) or info.get("little_endian") is not False
  obj, storages = next_object(lambda key, dtype, numel: Storage(path, dtype, numel,
                                                                big_endian=not little))
  keys = next_object()[0]
  if (protocol != LEGACY_PROTOCOL or not isinstance(keys, list)
      or not all(isinstance(k, str) for k in keys) or sorted(keys) != sorted(storages)):
    raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt (its storage list does "
                          "not match its index); download or save it again")
  position = stream.tell()
  with open(path, "rb") as f:
    for key in keys:  # the storages follow in this order
      record = storages[key]
      f.seek(position)
      count = int.from_bytes(f.read(8), "little" if little else "big")
      record.start = position + 8
      position = record.start + record.nbytes
      if count != record.numel or position > size:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupt (storage {key!r} "
                              "does not match its index); download or save it again")
  return _checked_tensors(path, obj)


def _next_pickle(path: str, stream: io.BytesIO, capped: bool) -> bytes:
  """The bytes of the pickle at ``stream``'s position (which moves past it); ``capped``:
  the stream holds only the file's first bytes."""
  start = stream.tell()
  try:
    end = next(pos for op, _, pos in pickletools.genops(stream) if op.name == "STOP") + 1
  except Exception:  # no end in sight, or damaged bytes: _unpickle says which
    if capped and len(stream.getbuffer()) - start > MAX_INDEX_BYTES:
      raise CheckpointError(f"checkpoint {path!r}: its pickled index is more than "
                            f"{MAX_INDEX_BYTES} bytes, more than jattn reads") from None
    end = len(stream.getbuffer())
  stream.seek(end)
  return bytes(stream.getbuffer()[start:end])


__all__ = ["open_archive", "torch_legacy_index", "torch_zip_index"]
