"""What GPU this is, which backends it can run, and which one to use.

``gpu_info()`` describes the first JAX device; ``select_backend`` applies the rules
written in ``docs/backends.md``; ``benchmark_backends`` times every usable backend.
Everything answers on a CPU-only machine too (the backends there: ``xla``, and the
Pallas kernels in interpret mode when ``JATTN_INTERPRET=1``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from jattn.backends import interpret_mode, usable_backends_for

# CUdevice_attribute values of the CUDA driver API.
_CU_ATTR_SM_COUNT = 16
_CU_ATTR_L2_CACHE_SIZE = 38
_CU_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


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
  backends: tuple[str, ...]  # usable flash-attention backends, best first
  interpret: bool  # Pallas kernels run in interpret mode

  @property
  def is_gpu(self) -> bool:
    return self.platform == "gpu"


def architecture_name(cc: tuple[int, int] | None) -> str:
  """NVIDIA architecture family of a compute capability (``"cpu"`` for None)."""
  if cc is None:
    return "cpu"
  if cc >= (10, 0):
    return "blackwell"
  if cc >= (9, 0):
    return "hopper"
  if cc >= (8, 9):
    return "ada"
  if cc >= (8, 0):
    return "ampere"
  if cc >= (7, 5):
    return "turing"
  return "volta_or_older"


def describe(name: str, compute_capability: tuple[int, int] | None = None, *,
             memory_total_bytes=None, memory_free_bytes=None, sm_count=None,
             l2_cache_bytes=None, shared_memory_per_block_bytes=None,
             interpret: bool | None = None) -> GPUInfo:
  """Builds a GPUInfo from raw properties (``compute_capability=None`` means a CPU)."""
  cc = compute_capability
  interpret = interpret_mode() if interpret is None else interpret
  return GPUInfo(
      name=name, platform="cpu" if cc is None else "gpu", compute_capability=cc,
      architecture=architecture_name(cc), memory_total_bytes=memory_total_bytes,
      memory_free_bytes=memory_free_bytes, sm_count=sm_count, l2_cache_bytes=l2_cache_bytes,
      shared_memory_per_block_bytes=shared_memory_per_block_bytes,
      supports_bf16=cc is not None and cc >= (8, 0),
      supports_fp8=cc is not None and cc >= (8, 9),
      backends=usable_backends_for(cc, interpret), interpret=interpret)


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


def flash_backend_gaps(backend: str, *, dtype=jnp.float16, q_len: int = 1, kv_len: int = 1,
                       causal: bool = False, segment_ids: bool = False, softcap: bool = False,
                       return_lse: bool = False) -> list[str]:
  """The features of a call that ``backend`` lacks, as phrases for an error message."""
  f32 = jnp.dtype(dtype) == jnp.float32
  if backend == "cudnn":
    gaps = [("segment ids", segment_ids), ("softcap", softcap), ("return_lse", return_lse),
            ("float32 inputs", f32),
            ("causal with q_len != kv_len (cuDNN aligns causal masks top-left)",
             causal and q_len != kv_len)]
  elif backend == "pallas_mosaic":
    gaps = [("segment ids", segment_ids), ("softcap", softcap), ("float32 inputs", f32)]
  else:
    gaps = []
  return [name for name, used in gaps if used]


def flash_backend_supports(backend: str, *, dtype=jnp.float16, head_dim: int = 64,
                           q_len: int = 1, kv_len: int = 1, causal: bool = False,
                           segment_ids: bool = False, softcap: bool = False,
                           return_lse: bool = False, local_window: bool = False) -> bool:
  """Whether a flash-attention backend computes this problem (ignoring the device)."""
  del local_window  # every backend takes sliding windows
  if backend == "xla":
    return True
  if backend not in ("pallas_triton", "pallas_mosaic", "cudnn"):
    return False
  if head_dim > 256 or (backend == "cudnn" and head_dim % 8):
    return False
  return not flash_backend_gaps(backend, dtype=dtype, q_len=q_len, kv_len=kv_len,
                                causal=causal, segment_ids=segment_ids, softcap=softcap,
                                return_lse=return_lse)


SELECTABLE_OPS = ("flash_attention", "dilated_attention")


def select_backend(op: str = "flash_attention", *, info: GPUInfo | None = None,
                   **problem) -> str:
  """The backend ``"auto"`` uses for ``op`` on ``problem``; see docs/backends.md.

  ``op``: ``"flash_attention"``, whose ``problem`` holds what
  ``flash_backend_supports`` takes (dtype, head_dim, q_len, kv_len, causal,
  segment_ids, softcap, return_lse, local_window), or ``"dilated_attention"``
  (head_dim). The answer is always a backend usable on ``info`` (default: this
  machine) that supports it.
  """
  if op not in SELECTABLE_OPS:
    raise ValueError(f"op must be one of {SELECTABLE_OPS}, got {op!r}")
  if info is None:  # memory figures are not needed: skip the allocator query
    info = describe(**_static_info(jax.devices()[0]))
  if op == "dilated_attention":  # its kernels: Triton-lowered Pallas, head dims to 256
    pallas = "pallas_triton" in info.backends and problem.get("head_dim", 64) <= 256
    return "pallas_triton" if pallas else "xla"
  for backend in info.backends:  # best first
    if flash_backend_supports(backend, **problem):
      return backend
  return "xla"


def benchmark_backends(op: str = "flash_attention", *, batch=1, q_len=1024, kv_len=None,
                       q_heads=8, kv_heads=None, head_dim=64, dtype=None, causal=False,
                       mode="fwd+bwd", reps=10, info: GPUInfo | None = None) -> list[dict]:
  """Times every usable backend that supports the problem; returns rows, fastest first.

  Each row: ``backend``, ``ms`` (median of ``reps`` jitted calls), ``speedup`` over
  the slowest. Inputs are ``[batch, seq, heads, head_dim]`` random normals.
  """
  from jattn.flash import flash_attention

  if op != "flash_attention":
    raise ValueError(f"op must be 'flash_attention', got {op!r}")
  if mode not in ("fwd", "fwd+bwd"):
    raise ValueError(f"mode must be 'fwd' or 'fwd+bwd', got {mode!r}")
  info = gpu_info() if info is None else info
  dtype = recommended_dtype(info) if dtype is None else dtype
  kv_len = q_len if kv_len is None else kv_len
  kv_heads = q_heads if kv_heads is None else kv_heads
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (batch, q_len, q_heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  rows = []
  for backend in info.backends:
    if not flash_backend_supports(backend, dtype=dtype, head_dim=head_dim, q_len=q_len,
                                  kv_len=kv_len, causal=causal):
      continue
    attend = functools.partial(flash_attention, causal=causal, backend=backend)
    if mode == "fwd":
      fn = jax.jit(attend)
    else:
      fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    jax.block_until_ready(fn(q, k, v))
    samples = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      samples.append(time.perf_counter() - t0)
    rows.append({"backend": backend, "ms": statistics.median(samples) * 1e3})
  rows.sort(key=lambda r: r["ms"])
  slowest = max(r["ms"] for r in rows)
  for r in rows:
    r["speedup"] = slowest / r["ms"]
  return rows
