"""What this machine is and which backends it can run.

``gpu_info()`` describes a JAX device; ``describe()`` builds the same description from
raw properties (tests make fake GPUs with it). The four backends and what each needs
of a device live here too, so that every op asks the same question the same way.
With ``JATTN_INTERPRET=1`` the Triton-lowered Pallas kernels run in interpret mode on
any device.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import importlib.util
import mmap
import os
from typing import Callable

import jax
import jax.numpy as jnp

INTERPRET_ENV = "JATTN_INTERPRET"

# CUdevice_attribute values of the CUDA driver API.
_CU_ATTR_SM_COUNT = 16
_CU_ATTR_L2_CACHE_SIZE = 38
_CU_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


# XLA flags that make CPU compiles cheaper for programs that run once (interpret mode):
# no LLVM optimisation, the older (faster-compiling) fusion code generator, one code
# module. About half the compile time of an interpreted kernel, at no cost to run it.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                      "--xla_cpu_parallel_codegen_split_count=1",
                      "--xla_llvm_disable_expensive_passes=true")


def compile_interpreted_programs_fast() -> None:
  """Where no CUDA plugin of JAX is installed, the Pallas kernels can only run
  interpreted, and their programs are compile-bound: asks XLA to compile them cheaply
  (``FAST_COMPILE_FLAGS``; the tests and ``jattn check`` take about half the time).
  Call it before JAX starts its backend. A flag already in ``XLA_FLAGS`` is kept, and
  one this jaxlib does not define is left out (XLA aborts on unknown flags)."""
  if any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    return
  flags = os.environ.get("XLA_FLAGS", "")
  wanted = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in flags]
  known = _flags_defined_by_jaxlib([f.split("=")[0][2:] for f in wanted])
  add = [f for f in wanted if f.split("=")[0][2:] in known]
  if add:
    os.environ["XLA_FLAGS"] = " ".join([flags] + add).strip()


def _flags_defined_by_jaxlib(names: list[str]) -> set[str]:
  """The XLA flag ``names`` whose definitions are in the installed jaxlib's libraries."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not names or not spec.submodule_search_locations:
    return set()
  found = set()
  for folder in spec.submodule_search_locations:
    for lib in glob.glob(os.path.join(folder, "*.so")):
      with open(lib, "rb") as f, contextlib.suppress(ValueError):  # ValueError: empty file
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
          # A flag's definition holds its name as a C string; a protobuf descriptor
          # (XLA's DebugOptions) keeps a removed flag's name inside other bytes, and
          # jaxlib 0.11.2 aborts on xla_cpu_use_fusion_emitters, which it has only so.
          found |= {n for n in names
                    if n not in found and data.find(b"\0" + n.encode() + b"\0") >= 0}
      if len(found) == len(names):
        return found
  return found


def interpret_mode() -> bool:
  """True when ``JATTN_INTERPRET=1``: Triton-lowered Pallas kernels run in interpret mode."""
  return os.environ.get(INTERPRET_ENV, "0") == "1"


@dataclasses.dataclass(frozen=True)
class Backend:
  """A way to compute an op. ``needs`` says why a device cannot run it (None: it can)."""

  name: str
  needs: Callable[["GPUInfo"], str | None]
  interpretable: bool = False  # runs in interpret mode under JATTN_INTERPRET=1


def _needs_hopper(info: "GPUInfo") -> str | None:
  cc = info.compute_capability
  return None if cc is not None and cc[0] == 9 else "needs a Hopper GPU (compute capability 9.x)"


def _needs_ampere_or_interpret(info: "GPUInfo") -> str | None:
  cc = info.compute_capability
  if info.interpret or (cc is not None and cc >= (8, 0)):
    return None
  return (f"needs a CUDA GPU of compute capability >= 8.0, or {INTERPRET_ENV}=1 to run the "
          "Pallas kernels in interpret mode")


def _needs_ampere(info: "GPUInfo") -> str | None:
  cc = info.compute_capability
  return None if cc is not None and cc >= (8, 0) else (
      "needs a CUDA GPU of compute capability >= 8.0")


PALLAS_MOSAIC = Backend("pallas_mosaic", _needs_hopper)
PALLAS_TRITON = Backend("pallas_triton", _needs_ampere_or_interpret, interpretable=True)
CUDNN = Backend("cudnn", _needs_ampere)
XLA = Backend("xla", lambda info: None)
# "auto" prefers them in this order (an op lists its implementations in it).
BACKENDS = (PALLAS_MOSAIC, PALLAS_TRITON, CUDNN, XLA)
BACKEND_NAMES = tuple(b.name for b in BACKENDS)
BACKEND_ARGUMENTS = ("auto",) + BACKEND_NAMES  # what every op's backend= may name


@dataclasses.dataclass(frozen=True)
class GPUInfo:
  """A description of one device, real or made up (tests build fakes with ``describe``)."""

  name: str
  platform: str  # "gpu" or "cpu"
  compute_capability: tuple[int, int] | None
  architecture: str  # "hopper", "ampere", ..., or "cpu"
  memory_total_bytes: int | None  # what JAX's allocator may use on this device
  memory_free_bytes: int | None
  sm_count: int | None
  l2_cache_bytes: int | None
  shared_memory_per_block_bytes: int | None  # opt-in maximum per thread block
  supports_bf16: bool
  supports_fp8: bool
  backends: tuple[str, ...]  # usable backends, in "auto" order
  interpret: bool  # Pallas kernels run in interpret mode

  @property
  def is_gpu(self) -> bool:
    return self.platform == "gpu"


def architecture_name(cc: tuple[int, int] | None) -> str:
  """NVIDIA architecture family of a compute capability (``"cpu"`` for None)."""
  if cc is None:
    return "cpu"
  for floor, name in (((10, 0), "blackwell"), ((9, 0), "hopper"), ((8, 9), "ada"),
                      ((8, 0), "ampere"), ((7, 5), "turing")):
    if cc >= floor:
      return name
  return "volta_or_older"


def describe(name: str, compute_capability: tuple[int, int] | None = None, *,
             memory_total_bytes=None, memory_free_bytes=None, sm_count=None,
             l2_cache_bytes=None, shared_memory_per_block_bytes=None,
             interpret: bool | None = None) -> GPUInfo:
  """Builds a GPUInfo from raw properties (``compute_capability=None`` means a CPU)."""
  cc = compute_capability
  interpret = interpret_mode() if interpret is None else interpret
  info = GPUInfo(
      name=name, platform="cpu" if cc is None else "gpu", compute_capability=cc,
      architecture=architecture_name(cc), memory_total_bytes=memory_total_bytes,
      memory_free_bytes=memory_free_bytes, sm_count=sm_count, l2_cache_bytes=l2_cache_bytes,
      shared_memory_per_block_bytes=shared_memory_per_block_bytes,
      supports_bf16=cc is not None and cc >= (8, 0),
      supports_fp8=cc is not None and cc >= (8, 9), backends=(), interpret=interpret)
  usable = tuple(b.name for b in BACKENDS if b.needs(info) is None)
  return dataclasses.replace(info, backends=usable)


def _driver_attributes(ordinal: int) -> dict[str, int]:
  """SM count, L2 size and shared memory from the CUDA driver; empty if unavailable."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return {}
  if cuda.cuInit(0) != 0:
    return {}
  device = ctypes.c_int()
  if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
    return {}
  out = {}
  for name, attr in (("sm_count", _CU_ATTR_SM_COUNT), ("l2_cache_bytes", _CU_ATTR_L2_CACHE_SIZE),
                     ("shared_memory_per_block_bytes", _CU_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)):
    value = ctypes.c_int()
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device) == 0:
      out[name] = value.value
  return out


@functools.lru_cache(maxsize=None)
def _static_info(device) -> dict:
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or cc is None:
    return dict(name=f"cpu ({getattr(device, 'device_kind', 'cpu')})", compute_capability=None)
  major, minor = (int(x) for x in str(cc).split("."))
  props = dict(name=device.device_kind, compute_capability=(major, minor),
               sm_count=getattr(device, "core_count", None))
  driver = _driver_attributes(getattr(device, "local_hardware_id", None) or 0)
  props.update({k: v for k, v in driver.items() if v})
  return props


def current_device() -> GPUInfo:
  """This machine's first device, without the allocator's memory figures (cheap: what
  backend and config choices need)."""
  return describe(**_static_info(jax.devices()[0]))


def gpu_info(device=None) -> GPUInfo:
  """Describes ``device`` (default: the first JAX device).

  Memory figures come from JAX's allocator (``memory_stats``): what JAX may use
  and what it has not used yet. SM count, L2 size and the per-block shared memory
  limit come from the CUDA driver; fields that cannot be read are None.
  """
  device = jax.devices()[0] if device is None else device
  props = dict(_static_info(device))
  stats = device.memory_stats() if props["compute_capability"] is not None else None
  if stats:
    total = stats.get("bytes_limit")
    props["memory_total_bytes"] = total
    if total is not None:
      props["memory_free_bytes"] = total - stats.get("bytes_in_use", 0)
  return describe(**props)


def shared_memory_limit(info: GPUInfo) -> int:
  """Opt-in shared memory per block; if unknown, the usual figure for the architecture."""
  if info.shared_memory_per_block_bytes:
    return info.shared_memory_per_block_bytes
  cc = info.compute_capability
  if cc is not None and cc[0] == 9:
    return 227 * 1024
  if cc == (8, 0):
    return 163 * 1024
  return 99 * 1024


def recommended_dtype(info: GPUInfo | None = None):
  """bfloat16 where the hardware has it (Ampere+), float16 on older GPUs, float32 on CPU."""
  info = gpu_info() if info is None else info
  if not info.is_gpu:
    return jnp.float32
  return jnp.bfloat16 if info.supports_bf16 else jnp.float16
