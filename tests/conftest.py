import os

# The ring-attention tests shard over 4 simulated CPU devices; XLA reads this flag
# once, when JAX starts, so it is set before anything imports jax.
_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import pytest

# CPU runs exercise the real Pallas kernels in interpret mode.
if jax.default_backend() == "cpu":
  os.environ.setdefault("JATTN_INTERPRET", "1")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device with -m gpu)")


def pytest_collection_modifyitems(config, items):
  # JATTN_SHARD=i/n keeps every n-th test from the i-th: the device runs the slow
  # (compile-bound) GPU tests as n parallel processes.
  shard = os.environ.get("JATTN_SHARD")
  if shard:
    i, n = (int(x) for x in shard.split("/"))
    keep = [item for k, item in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
