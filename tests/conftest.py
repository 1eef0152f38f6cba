import os

import jax
import pytest

# CPU runs exercise the real Pallas kernels in interpret mode.
if jax.default_backend() == "cpu":
  os.environ.setdefault("JATTN_INTERPRET", "1")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device with -m gpu)")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
