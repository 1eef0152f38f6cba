"""The checkpoint readers (``jattn.interop.checkpoint_files``, without torch) against
torch's own files, and as untrusted input: what is refused says so in one line naming
the file, runs no pickled code, and reads no tensor before a loader's keys and shapes
fit; a fuzz run in a memory-capped subprocess (``fuzz_checkpoint_readers.py``)."""

import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jattn.interop.checkpoint_files import (CheckpointError, read_checkpoint,  # noqa: E402
                                            read_state_dict)
from jattn.interop.safetensors_files import write_safetensors  # noqa: E402
from jattn.interop.stored_tensors import MAX_INDEX_BYTES, StoredTensor  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def sample_state(seed: int = 0) -> dict:
  """Tensors of the kinds a state dict holds: dtypes, a parameter, views with an
  offset and strides into a larger storage, an empty tensor."""
  g = torch.Generator().manual_seed(seed)
  base = torch.randn(5, 6, generator=g)
  return collections.OrderedDict(
      w=torch.randn(4, 6, generator=g), half=torch.randn(3, generator=g).half(),
      bf16=torch.randn(2, 3, generator=g).to(torch.bfloat16), steps=torch.arange(7)[2:],
      mask=torch.tensor([True, False, True]), view=base.t()[1:, ::2],
      param=torch.nn.Parameter(torch.randn(2, generator=g)), empty=torch.zeros(0, 3))


def as_expected(state) -> dict:
  return {k: (v.detach().float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def assert_same(got: dict, expected: dict):
  assert sorted(got) == sorted(expected)
  for key, value in expected.items():
    assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)


# --- crafted files: the index and the records of a .pth, as an attacker writes them


class _Storage:
  def __init__(self, key, kind, numel):
    self.key, self.kind, self.numel = key, kind, numel


class _Tensor:
  def __init__(self, storage, offset, shape, stride):
    self.args = (storage, offset, tuple(shape), tuple(stride))


class _IndexPickler(pickle.Pickler):
  """Pickles ``_Tensor``s as ``torch.save`` does, with any shape, offset and numel."""

  def persistent_id(self, obj):
    if isinstance(obj, _Storage):
      return ("storage", obj.kind, obj.key, "cpu", obj.numel)
    return None

  def reducer_override(self, obj):
    if isinstance(obj, _Tensor):
      return torch._utils._rebuild_tensor_v2, (*obj.args, False, collections.OrderedDict())
    return NotImplemented


def crafted_pth(path, index, records):
  """A zip .pth laid out as torch.save does: ``index`` pickled (``_Tensor`` leaves) and
  ``records`` by storage key: bytes (stored), or an int n: n zero bytes deflated (in
  blocks of 16 MiB, each compressed once; the CRC is left 0, as nothing inflates it)."""
  buffer = io.BytesIO()
  _IndexPickler(buffer, protocol=2).dump(index)
  entries = [("archive/data.pkl", buffer.getvalue()), ("archive/version", b"3\n")]
  entries += [(f"archive/data/{key}", body) for key, body in records.items()]
  local, central = b"", b""
  for name, body in entries:
    if isinstance(body, bytes):
      method, crc, size, payload = 0, zlib.crc32(body), len(body), body
    else:
      block = bytes(16 << 20)
      deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
      once = deflate.compress(block) + deflate.flush(zlib.Z_FULL_FLUSH)
      payload = once * (body // len(block)) + deflate.flush()
      method, crc, size = 8, 0, body
    fields = struct.pack("<HHHHHIIIHH", 20, 0, method, 0, 0, crc, len(payload), size,
                         len(name), 0)
    central += (b"PK\x01\x02" + struct.pack("<H", 20) + fields
                + struct.pack("<HHHII", 0, 0, 0, 0, len(local)) + name.encode())
    local += b"PK\x03\x04" + fields + name.encode() + payload
  path.write_bytes(local + central + b"PK\x05\x06" + struct.pack(
      "<HHHHIIH", 0, 0, len(entries), len(entries), len(central), len(local), 0))


def float_tensor(key, numel, shape, stride=None, offset=0):
  stride = stride or [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
  return _Tensor(_Storage(key, torch.FloatStorage, numel), offset, shape, stride)


# --- tests


def test_reads_what_torch_and_safetensors_write(tmp_path):
  state = sample_state()
  expected = as_expected(state)
  torch.save({"params_ema": state, "iter": 10}, tmp_path / "basicsr.pth")
  torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "legacy.pth",
             _use_new_zipfile_serialization=False)
  for name in ("basicsr.pth", "legacy.pth"):
    assert_same(read_state_dict(tmp_path / name), expected)

  from safetensors.torch import load_file, save_file

  dense = {k: v.detach().contiguous() for k, v in state.items()}
  save_file(dense, tmp_path / "m.safetensors")
  assert_same(read_state_dict(tmp_path / "m.safetensors"), expected)
  # What we write is what the safetensors package reads, bfloat16 included.
  import ml_dtypes

  arrays = {k: v.float().numpy().astype(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16
            else v.numpy() for k, v in dense.items()}
  write_safetensors(tmp_path / "ours.safetensors", arrays)
  back = load_file(tmp_path / "ours.safetensors")
  assert back["bf16"].dtype == torch.bfloat16
  assert_same(as_expected(back), expected)


def test_the_index_comes_first_and_tensors_are_read_when_asked(tmp_path):
  """A 2 GiB tensor deflated into 2 MB: its shape is known, nothing is inflated, and a
  loader that does not want it never reads it (issue 37, item 9)."""
  path = tmp_path / "bomb.pth"
  crafted_pth(path, {"x": float_tensor("0", 1 << 29, (1 << 29,))}, {"0": 1 << 31})
  assert os.path.getsize(path) < 4 << 20
  tensors = read_checkpoint(path)
  assert isinstance(tensors["x"], StoredTensor) and np.shape(tensors["x"]) == (1 << 29,)
  with pytest.raises(CheckpointError, match="tensor data '0' is compressed, which torch.save "
                                            "never does"):
    tensors["x"].read()
  from jattn.interop.checkpoints import load_dat

  with pytest.raises(CheckpointError, match=r"not a DAT checkpoint: key 'conv_first.weight' is "
                                            r"missing \(it holds 1 tensors: 'x'\)"):
    load_dat(path)


REFUSED = {
    # issue 37, item 12: integer keys
    "int key": (lambda p: torch.save({1: torch.ones(3)}, p),
                "is not a state dict: a tensor's key is 1, of type int"),
    # item 13: a pickle that would call os.system (nothing runs: see the test)
    "os.system": (lambda p: p.write_bytes(pickle.dumps(_System(), protocol=2)),
                  r"holds Python objects besides tensors \(posix.system\): refused for safety"),
    "a module": (lambda p: torch.save({"model": torch.nn.Linear(2, 2)}, p),
                 r"Python objects besides tensors \(torch.nn.modules.linear.Linear\)"),
    "no state dict": (lambda p: torch.save([torch.ones(2)], p),
                      "expected a state dict \\(name -> tensor\\), got list"),
    "no tensors": (lambda p: torch.save({"epoch": 3}, p), "holds no tensors"),
    "shape past its storage": (
        lambda p: crafted_pth(p, {"w": float_tensor("0", 6, (1 << 40, 1 << 40))},
                              {"0": bytes(24)}),
        r"truncated or corrupt \(a tensor of shape \(1099511627776, 1099511627776\)"),
    "storage larger than its record": (
        lambda p: crafted_pth(p, {"w": float_tensor("0", 1 << 40, (4,))}, {"0": bytes(16)}),
        "storage '0' holds 16 bytes, not 4398046511104"),
    "safetensors header too long": (
        lambda p: p.write_bytes((MAX_INDEX_BYTES + 1).to_bytes(8, "little") + b"{" + bytes(64)),
        f"its .safetensors header is {MAX_INDEX_BYTES + 1} bytes long, more than jattn reads"),
    "safetensors shape past the data": (
        lambda p: p.write_bytes(_safetensors_header(
            {"w": {"dtype": "F32", "shape": [1 << 31, 1 << 31], "data_offsets": [0, 16]}})
            + bytes(16)),
        "tensor 'w' of shape \\[2147483648, 2147483648\\] takes bytes 0 to 16 of 16"),
    "pickle, not torch.save's": (lambda p: p.write_bytes(pickle.dumps({"a": 1}, protocol=2)),
                                 "is a pickle but not a PyTorch checkpoint"),
}


class _System:
  def __reduce__(self):
    return os.system, (f"touch {_System.marker}",)


def _safetensors_header(header: dict) -> bytes:
  import json

  text = json.dumps(header).encode()
  return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize("make,message", REFUSED.values(), ids=REFUSED)
def test_refusals_name_the_file_in_one_line(tmp_path, make, message):
  _System.marker = tmp_path / "ran"
  path = tmp_path / "c.pth"
  make(path)
  with pytest.raises(CheckpointError, match=message) as caught:
    read_state_dict(path)
  assert repr(str(path)) in str(caught.value) and "\n" not in str(caught.value)
  assert "weights_only=False" not in str(caught.value)
  assert not _System.marker.exists()  # the pickled call never ran


def test_fuzzed_checkpoints_fail_in_one_line_within_bounded_memory(tmp_path):
  """Random and truncated bytes, flipped index bytes, huge header lengths, shapes,
  memo indices and a deflated 2 GiB tensor, read in a subprocess whose address space
  is capped at 1 GiB: each file gives its tensors or one CheckpointError line naming
  it, never another exception."""
  seeds = tmp_path / "seeds"
  seeds.mkdir()
  state = sample_state(1)
  torch.save(state, seeds / "zip.pth")
  torch.save(state, seeds / "legacy.pth", _use_new_zipfile_serialization=False)
  from safetensors.torch import save_file

  save_file({k: v.detach().contiguous() for k, v in state.items()}, seeds / "st.safetensors")
  np.savez(seeds / "expected.npz", **as_expected(state))
  crafted_pth(seeds / "bomb.pth", {"x": float_tensor("0", 1 << 29, (1 << 29,))}, {"0": 1 << 31})
  crafted_pth(seeds / "strided.pth", {"w": float_tensor("0", 8, (1 << 20, 1 << 20), (0, 0))},
              {"0": bytes(32)})  # 2^40 elements on 8: read, it would take 4 TiB
  env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
  done = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_checkpoint_readers.py"),
                         str(seeds), str(tmp_path / "work")], capture_output=True, text=True,
                        env=env, timeout=120)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "cases, all read or refused in one line" in done.stdout, done.stdout
