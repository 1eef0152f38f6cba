"""Reading PyTorch checkpoints and turning DAT ones into ``jattn.nn.DAT`` models.

- ``read_state_dict(path)`` (``jattn.interop.checkpoint_files``): a ``.pth`` / ``.pt`` /
  ``.ckpt`` through ``torch.load(weights_only=True)`` (no pickled code runs), or a
  ``.safetensors`` file; BasicSR's ``params_ema`` / ``params`` wrappers and a
  ``module.`` prefix are removed.
- ``infer_dat_config(state_dict)``: the DAT hyper-parameters from tensor names and shapes.
- ``load_dat(path)`` / ``dat_from_state_dict(state)``: the weights copied into a Flax ``DAT``.
- ``dat_to_torch_state_dict(model)``: back to the original's state dict, buffers included.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.interop.checkpoint_files import (CheckpointError, key_summary, read_state_dict,
                                            tensor_of)
from jattn.interop.convert import load_torch_state_dict, to_torch_state_dict
from jattn.nn.dat import DAT, AdaptiveSpatialAttention, DATConfig, relative_positions, shift_masks

# DAT buffers that the Flax model recomputes from its config.
DAT_DERIVED = ("rpe_biases", "relative_position_index", "attn_mask_0", "attn_mask_1")


def _count(state, prefix: str) -> int:
  """How many ``prefix.<i>.`` entries there are (``i`` = 0, 1, ...)."""
  pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
  found = {int(m.group(1)) for k in state for m in [pattern.match(k)] if m}
  return max(found) + 1 if found else 0


def infer_dat_config(state, **overrides):
  """``(DATConfig, img_size)`` read off a DAT state dict's names and shapes.

  ``img_range`` cannot be read from the tensors (default 1.0); ``overrides`` replace
  any field. ``img_size`` is the size the stored shift masks were built for (None
  without them); it does not change the model's output.
  """
  def need(key, ndim):
    return tensor_of(state, key, ndim, "DAT")

  conv_first = need("conv_first.weight", 4)
  in_chans, embed_dim = int(conv_first.shape[1]), int(conv_first.shape[0])
  groups = _count(state, "layers")
  if not groups:
    raise CheckpointError(f"not a DAT checkpoint: no 'layers.<i>.blocks.<j>' keys "
                          f"({key_summary(state)})")
  depth = tuple(_count(state, f"layers.{i}.blocks") for i in range(groups))
  heads = []
  for i, d in enumerate(depth):
    if d >= 2:  # a channel-attention block stores one temperature per head
      heads.append(int(need(f"layers.{i}.blocks.1.attn.temperature", 3).shape[0]))
    else:  # a spatial branch has half the heads
      heads.append(2 * int(need(f"layers.{i}.blocks.0.attn.attns.0.pos.pos3.2.weight",
                                2).shape[0]))
  rpe_key = "layers.0.blocks.0.attn.attns.0.rpe_biases"
  if rpe_key in state:  # offsets run up to (split_h - 1, split_w - 1)
    rpe = need(rpe_key, 2)
    if rpe.shape[1] != 2:
      raise CheckpointError(f"not a DAT checkpoint: {rpe_key!r} has shape {rpe.shape}, "
                            "expected [offsets, 2]")
    split = (int(rpe[-1][0]) + 1, int(rpe[-1][1]) + 1)
  elif "split_size" in overrides:
    split = tuple(overrides["split_size"])
  else:
    raise ValueError("the checkpoint has no 'rpe_biases' buffer to read the window size "
                     "from: pass split_size=(h, w)")
  if "conv_last.weight" in state:
    upsampler = "pixelshuffle"
    num_feat = int(need("conv_before_upsample.0.weight", 4).shape[0])
    # Each upsample conv feeds a pixel shuffle: 4 * num_feat channels per x2, 9 per x3.
    upscale = math.prod(int(round(math.sqrt(need(f"upsample.{i}.weight", 4).shape[0]
                                            // num_feat)))
                        for i in range(0, _count(state, "upsample"), 2))
  else:
    upsampler = "pixelshuffledirect"
    upscale = int(round(math.sqrt(need("upsample.0.weight", 4).shape[0] // in_chans)))
  fields = dict(
      in_chans=in_chans, embed_dim=embed_dim, split_size=split, depth=depth,
      num_heads=tuple(heads), upscale=upscale, upsampler=upsampler,
      expansion_factor=float(need("layers.0.blocks.0.ffn.fc1.weight", 2).shape[0]) / embed_dim,
      qkv_bias="layers.0.blocks.0.attn.qkv.bias" in state,
      resi_connection="1conv" if "conv_after_body.weight" in state else "3conv")
  fields.update(overrides)
  masks = [v for k, v in state.items() if k.endswith("attn.attn_mask_0")]
  img_size = None
  if masks:
    windows = masks[0].shape[0]
    img_size = int(round(math.sqrt(windows * split[0] * split[1])))
  return DATConfig(**fields), img_size


def dat_from_state_dict(state, *, dtype=None, backend: str = "auto", rngs=None, **overrides):
  """A ``jattn.nn.DAT`` built from a DAT state dict's inferred config, with its weights."""
  dtype = dtype or jnp.float32
  config, _ = infer_dat_config(state, **overrides)
  # Built abstractly: every parameter is then set from the checkpoint (a missing one is
  # an error), so random initial values would be computed only to be thrown away.
  model = nnx.eval_shape(lambda: DAT(config, dtype=dtype, backend=backend,
                                     rngs=rngs or nnx.Rngs(0)))
  load_torch_state_dict(model, state, derived=DAT_DERIVED)
  return model


def load_dat(path, *, dtype=None, backend: str = "auto", rngs=None, **overrides):
  """A ``jattn.nn.DAT`` with the weights of a PyTorch DAT checkpoint.

  Args:
    path: ``.pth`` / ``.pt`` (``torch.load(weights_only=True)``) or ``.safetensors``.
    dtype: computation dtype (default float32); parameters stay float32.
    overrides: ``DATConfig`` fields the tensors do not fix (``img_range``) or that
      should be forced.

  Raises ValueError naming what does not match (missing, unexpected or mis-shaped keys).
  """
  return dat_from_state_dict(read_state_dict(path), dtype=dtype, backend=backend, rngs=rngs,
                             **overrides)


def dat_to_torch_state_dict(model, *, img_size: int = 64) -> dict[str, np.ndarray]:
  """A Flax ``DAT``'s state dict as the original PyTorch DAT stores it: the weights
  plus the buffers it keeps (each branch's relative offsets and their index, and the
  shifted blocks' masks for ``img_size x img_size`` inputs, the original's default
  64), so ``load_state_dict(strict=True)`` takes it and ``.pth`` readers such as
  ``read_state_dict`` infer the full config from it."""
  state = to_torch_state_dict(model)
  for i, group in enumerate(model.layers):
    for j, block in enumerate(group.blocks):
      attn, prefix = block.attn, f"layers.{i}.blocks.{j}.attn"
      if not isinstance(attn, AdaptiveSpatialAttention):
        continue
      for b, branch in enumerate(attn.attns):
        table, index = relative_positions(*branch.window)
        state[f"{prefix}.attns.{b}.rpe_biases"] = table
        state[f"{prefix}.attns.{b}.relative_position_index"] = index.astype(np.int64)
      if attn.shifted:
        masks = shift_masks(img_size, img_size, attn.split_size, attn.shift_size)
        state[f"{prefix}.attn_mask_0"], state[f"{prefix}.attn_mask_1"] = masks
  return state
