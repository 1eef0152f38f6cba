"""Which attention backends exist, which are usable here, and how ``"auto"`` picks.

Backends: ``"pallas_triton"`` (Triton-lowered Pallas, Ampere+), ``"pallas_mosaic"``
(Pallas Mosaic GPU, Hopper sm_90 only), ``"cudnn"`` (through
``jax.nn.dot_product_attention``) and ``"xla"`` (the pure-jnp reference).
With ``JATTN_INTERPRET=1`` the Pallas kernels run in interpret mode on any device
and ``"auto"`` picks them even on CPU.
"""

from __future__ import annotations

import functools
import os

import jax

BACKENDS = ("auto", "pallas_triton", "pallas_mosaic", "cudnn", "xla")
INTERPRET_ENV = "JATTN_INTERPRET"


def interpret_mode() -> bool:
  """True when ``JATTN_INTERPRET=1``: Pallas kernels run in interpret mode."""
  return os.environ.get(INTERPRET_ENV, "0") == "1"


@functools.lru_cache(maxsize=None)
def gpu_compute_capability() -> tuple[int, int] | None:
  """Compute capability of the first CUDA device, or None without one."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  if not devices:
    return None
  cc = getattr(devices[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def usable_backends_for(cc: tuple[int, int] | None, interpret: bool) -> tuple[str, ...]:
  """Backends a device of compute capability ``cc`` (None: no GPU) can run, best first."""
  names = []
  if cc is not None and cc[0] == 9:  # wgmma kernels: Hopper only
    names.append("pallas_mosaic")
  if interpret or (cc is not None and cc >= (8, 0)):
    names.append("pallas_triton")
  if cc is not None and cc >= (8, 0):
    names.append("cudnn")
  names.append("xla")
  return tuple(names)


def usable_backends() -> tuple[str, ...]:
  """Backends that can run flash attention on this machine, best first."""
  return usable_backends_for(gpu_compute_capability(), interpret_mode())


def resolve_backend(backend: str, auto_choice=None) -> tuple[str, bool]:
  """Maps a requested backend to ``(name, interpret)``; raises if unusable here.

  ``auto_choice()`` gives the backend for ``"auto"`` (default: the best usable).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  usable = usable_backends()
  if backend == "auto":
    backend = auto_choice() if auto_choice is not None else usable[0]
  if backend not in usable:
    if backend == "pallas_mosaic":
      raise ValueError("backend='pallas_mosaic' needs a Hopper GPU (compute capability 9.0), "
                       f"none found (usable here: {usable})")
    hint = (f"; set {INTERPRET_ENV}=1 to run the Pallas kernel in interpret mode"
            if backend == "pallas_triton" else "")
    raise ValueError(f"backend={backend!r} needs a CUDA GPU of compute capability >= 8.0, "
                     f"none found (usable here: {usable}){hint}")
  return backend, backend == "pallas_triton" and interpret_mode()
