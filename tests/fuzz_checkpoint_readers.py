"""Fuzzes the checkpoint readers in a process whose address space is capped at 1 GiB
(run by tests/test_checkpoint_files.py; by hand: ``python fuzz_checkpoint_readers.py
SEEDS WORK``).

SEEDS holds zip.pth, legacy.pth and st.safetensors of one state dict (expected.npz:
its values), and crafted files (bomb.pth, strided.pth). Each case, a fixed-seed
mutation of a seed or a made-up file, must read (every tensor) or raise one
CheckpointError line naming the file: any other exception, or running out of memory,
fails. Numpy alone: neither torch nor JAX is imported.
"""

import json
import os
import pickle
import random
import resource
import sys
import traceback
import zipfile

resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

import numpy as np  # noqa: E402

from jattn.interop.checkpoint_files import CheckpointError, read_state_dict  # noqa: E402
from jattn.interop.stored_tensors import MAX_INDEX_BYTES  # noqa: E402

SEEDS, WORK = sys.argv[1:3]
rng = random.Random(37)


def index_span(name: str, data: bytes) -> tuple[int, int]:
  """Where a seed's index lies: the .safetensors header, a zip's data.pkl record, the
  legacy format's pickles."""
  if name.endswith(".safetensors"):
    return 0, 8 + int.from_bytes(data[:8], "little")
  if name == "zip.pth":
    with zipfile.ZipFile(os.path.join(SEEDS, name)) as archive:
      info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    return info.header_offset, info.header_offset + 30 + len(info.filename) + info.file_size
  return 0, 700


def mutations(name: str, data: bytes):
  begin, end = index_span(name, data)
  for n in sorted(rng.sample(range(1, len(data)), 12)):
    yield f"{name} cut at {n}", data[:n]
  for i in range(40):
    flipped = bytearray(data)
    for _ in range(rng.randint(1, 6)):
      flipped[rng.randrange(begin, end)] = rng.randrange(256)
    yield f"{name} flip {i}", bytes(flipped)
  yield f"{name} head of random bytes", data[:16] + rng.randbytes(2000)


def made_up():
  header = lambda h: (lambda t: len(t).to_bytes(8, "little") + t)(json.dumps(h).encode())
  for length in (1 << 63, 1 << 32, MAX_INDEX_BYTES + 1, 100):
    yield f"safetensors header length {length}", length.to_bytes(8, "little") + b'{"a": 1}'
  for shape in ([1 << 62], [1 << 40, 1 << 40], [-1, 4], [2.5], [3] * 100, "x"):
    entry = {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}
    yield f"safetensors shape {str(shape)[:20]}", header({"w": entry}) + bytes(16)
  for offsets in ([0, 1 << 62], [16, 0], [-16, 0], [0, 16, 32]):
    entry = {"dtype": "F32", "shape": [4], "data_offsets": offsets}
    yield f"safetensors offsets {offsets}", header({"w": entry}) + bytes(16)
  yield "safetensors dtype", header({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}})
  yield "safetensors nested", (lambda t: len(t).to_bytes(8, "little") + t)(b"{" + b"[" * 100000)
  yield "pickle memo index 2^31", b"\x80\x02N" + b"r" + (0x7FFFFFFF).to_bytes(4, "little") + b"."
  yield "pickle of sets", b"\x80\x04(" + b"\x8f" * (1 << 20) + b"l."
  yield "pickle of dicts at the cap", b"\x80\x02(" + b"}" * (MAX_INDEX_BYTES - 6) + b"l."
  yield "pickle bytes8 2^62", b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"."
  yield "pickle, not an index", pickle.dumps(list(range(1000)), protocol=2)
  yield "PK and noise", b"PK\x03\x04" + rng.randbytes(4000)
  yield "empty", b""


def check(label: str, path: str, failures: list) -> None:
  try:
    read_state_dict(path)
  except CheckpointError as e:
    text = str(e)
    if "\n" in text or repr(path) not in text:
      failures.append(f"{label}: not one line naming the file: {text!r}")
  except BaseException as e:  # MemoryError included: the point is that none comes
    failures.append(f"{label}: {type(e).__name__}: {str(e)[:200]}\n"
                    + "".join(traceback.format_tb(e.__traceback__)[-3:]))


def main() -> int:
  os.makedirs(WORK, exist_ok=True)
  expected = np.load(os.path.join(SEEDS, "expected.npz"))
  for name in ("zip.pth", "legacy.pth", "st.safetensors"):
    got = read_state_dict(os.path.join(SEEDS, name))
    for key in expected.files:
      np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name}: {key}")
  failures, count = [], 0
  for name in ("bomb.pth", "strided.pth"):
    check(name, os.path.join(SEEDS, name), failures)
    count += 1
  cases = [case for name in ("zip.pth", "legacy.pth", "st.safetensors")
           for case in mutations(name, open(os.path.join(SEEDS, name), "rb").read())]
  for label, data in cases + list(made_up()):
    path = os.path.join(WORK, "case.bin")
    with open(path, "wb") as f:
      f.write(data)
    check(label, path, failures)
    count += 1
  if any(m.startswith(("torch", "jax")) for m in sys.modules):
    failures.append("torch or jax was imported")
  print("\n".join(failures))
  print(f"{count} cases, all read or refused in one line" if not failures else
        f"{len(failures)} of {count} cases failed")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
