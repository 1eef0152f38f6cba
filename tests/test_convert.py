"""Torch MultiScaleRetention checkpoints load into jattn.nn.MultiScaleRetention."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from jattn.interop.convert import load_torch_state_dict, to_torch_state_dict
from jattn.interop.torch_reference import multi_scale_retention_torch
from jattn.nn import MultiScaleRetention


def _pair(embed_dim=32, heads=4, seed=0):
  torch.manual_seed(seed)
  torch_layer = multi_scale_retention_torch(embed_dim, heads)
  layer = MultiScaleRetention(embed_dim, heads, rngs=nnx.Rngs(seed + 1))
  return torch_layer, layer


@pytest.mark.parametrize("mode", ["parallel", "chunkwise", "recurrent"])
def test_torch_checkpoint_gives_the_same_outputs(mode):
  torch_layer, layer = _pair()
  load_torch_state_dict(layer, torch_layer.state_dict())
  x = np.random.default_rng(0).standard_normal((2, 19, 32)).astype(np.float32)
  with torch.no_grad():
    expected = torch_layer(torch.from_numpy(x)).numpy()
  # jitted: eagerly every op (of the interpret-mode kernels too) compiles on its own.
  run = nnx.jit(lambda layer, x: layer(x, mode=mode, chunk_size=8))
  ours = np.asarray(run(layer, jnp.asarray(x)))
  # torchscale's per-row score rescalings cancel in the RMS norm up to its epsilon.
  np.testing.assert_allclose(ours, expected, rtol=2e-3, atol=2e-4)


def test_round_trip_to_torch_and_back():
  torch_layer, layer = _pair(seed=3)
  other = multi_scale_retention_torch(32, 4)
  other.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in to_torch_state_dict(layer).items()})
  back = MultiScaleRetention(32, 4, rngs=nnx.Rngs(9))
  load_torch_state_dict(back, other.state_dict())
  for name in ("q_proj", "k_proj", "v_proj", "g_proj", "out_proj"):
    np.testing.assert_array_equal(getattr(back, name).kernel[...], getattr(layer, name).kernel[...])


def test_mismatched_checkpoints_are_named():
  torch_layer, layer = _pair()
  state = dict(torch_layer.state_dict())
  state["extra.weight"] = state.pop("g_proj.weight")
  with pytest.raises(ValueError, match=r"missing keys \['g_proj.weight'\], unexpected keys "
                                       r"\['extra.weight'\]"):
    load_torch_state_dict(layer, state)
  wide = multi_scale_retention_torch(32, 4, value_dim=32).state_dict()
  with pytest.raises(ValueError, match=r"'g_proj.weight' has shape \(32, 32\), the module "
                                       r"expects \(64, 32\)"):
    load_torch_state_dict(layer, wide)
