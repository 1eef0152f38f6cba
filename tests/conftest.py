"""Shared test setup: 4 simulated CPU devices (the rings), interpret mode on CPU, the
``gpu`` and ``kernel`` markers and the one error measure.

Markers:
- ``gpu``: needs a CUDA GPU; skipped elsewhere, run on the device with ``-m gpu``. The
  kernel modules keep their GPU cases next to the CPU ones, on the same check helpers.
- ``kernel``: runs on whatever is here: the kernels in interpret mode on CPU, compiled
  on a GPU, where ``-m gpu`` selects it too (the contract, tests/test_contract.py).
"""

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jattn.core.device import compile_interpreted_programs_fast

# XLA reads these once, when its backend starts (the first device query, not the
# import): the ring-attention tests shard over 4 (one case each over 8) simulated CPU
# devices, as many as the 4- and 8-GPU machines the rings are measured on; on a GPU, XLA
# does not time variants of each matmul (the tests compile hundreds of programs and
# time none); and on CPU the interpret-mode programs compile without LLVM's optimisations.
_DEVICES = "--xla_force_host_platform_device_count=8"
for _flag in (_DEVICES, "--xla_gpu_autotune_level=0"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
compile_interpreted_programs_fast()

ON_GPU = jax.default_backend() == "gpu"

# CPU runs exercise the real Pallas kernels in interpret mode.
if not ON_GPU:
  os.environ.setdefault("JATTN_INTERPRET", "1")


def rel_err(ours, ref, floor: float = 0.0) -> float:
  """``‖ours - ref‖ / ‖ref‖`` in float64 (NaN anywhere gives NaN, which fails any bound).

  ``floor``: the denominator is at least ``floor`` times the RMS-1 norm ``sqrt(size)``,
  for references that may be exactly zero (a softmax over one key has no logit
  gradient), where any rounding would count as an infinite relative error."""
  a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor * b.size ** 0.5, 1e-30))


RING_DEVICES = 4


def ring_mesh(devices: int = RING_DEVICES) -> Mesh:
  """A 1-D mesh ``("sp",)`` over the first ``devices`` devices (simulated CPU devices
  here, real ones on a GPU machine); skips the test where there are fewer."""
  if len(jax.devices()) < devices:
    pytest.skip(f"needs {devices} devices ({_DEVICES})")
  return Mesh(np.array(jax.devices()[:devices]), ("sp",))


@pytest.fixture(scope="module")
def mesh():
  """``ring_mesh()`` over 4 devices."""
  return ring_mesh()


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device with -m gpu)")
  config.addinivalue_line("markers", "kernel: runs the kernels here, and on a GPU with -m gpu")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: on a GPU, kernel tests are gpu tests
def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    for item in items:
      if "kernel" in item.keywords:
        item.add_marker(pytest.mark.gpu)
  else:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)



@pytest.fixture
def hopper_mask_choice(monkeypatch):
  """``dot_product_attention`` choosing, as on Hopper, whether a mask array runs as an
  additive bias (by its kernels' gaps: host code, so also on a CPU, whose kernels then
  run the call); the list of its choices (None: the call as it is)."""
  import jattn.dot_product as dot_product
  import jattn.flex.attention as flex_attention
  monkeypatch.setattr(flex_attention, "BIAS_TILES_SUPPORTED", True)
  monkeypatch.setattr(dot_product.FLEX, "select", lambda problem: (
      "pallas_triton" if flex_attention.MosaicFlex().gaps(problem) else "pallas_mosaic"))
  taken, choice = [], dot_product._mask_as_bias
  monkeypatch.setattr(dot_product, "_mask_as_bias",
                      lambda *a: taken.append(choice(*a)) or taken[-1])
  return taken
