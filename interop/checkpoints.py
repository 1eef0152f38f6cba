"""Turning DAT checkpoints into ``jattn.nn.DAT`` models.

- ``read_checkpoint(path)`` (``jattn.interop.checkpoint_files``): a ``.pth`` / ``.pt`` /
  ``.ckpt`` as ``torch.save`` writes it (no pickled code runs), or a ``.safetensors``
  file, its tensors not read yet; BasicSR's ``params_ema`` / ``params`` wrappers and a
  ``module.`` prefix are removed.
- ``infer_dat_config(state_dict)``: the DAT hyper-parameters from tensor names and shapes.
- ``load_dat(path)`` / ``dat_from_state_dict(state)``: the weights copied into a Flax
  ``DAT``: keys and shapes are checked against the model before any value is read, so
  only the tensors it needs are read.
- ``dat_to_torch_state_dict(model)``: back to the original's state dict, buffers included.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.interop.checkpoint_files import (CheckpointError, key_summary, read_checkpoint,
                                            tensor_of)
from jattn.interop.convert import load_torch_state_dict, to_torch_state_dict
from jattn.interop.stored_tensors import as_numpy
from jattn.nn.dat import (DAT, MAX_WINDOW_SIDE, AdaptiveSpatialAttention, DATConfig,
                          DATConfigError, relative_positions, shift_masks)

# DAT buffers that the Flax model recomputes from its config.
DAT_DERIVED = ("rpe_biases", "relative_position_index", "attn_mask_0", "attn_mask_1")
RPE_KEY = "layers.0.blocks.0.attn.attns.0.rpe_biases"
MAX_RPE_ROWS = (2 * MAX_WINDOW_SIDE - 1) ** 2


def _count(state, prefix: str, step: int = 1) -> int:
  """How many ``prefix.<i>.`` entries there are, numbered 0, step, 2 * step, ... (a
  number past the keys' own count would make a model the tensors do not describe)."""
  pattern = re.compile(re.escape(prefix) + r"\.(\d{1,9})\.")
  found = {int(m.group(1)) for k in state for m in [pattern.match(k)] if m}
  if found != set(range(0, step * len(found), step)):
    raise CheckpointError(f"not a DAT checkpoint: its '{prefix}.<i>' keys are numbered "
                          f"{sorted(found)[:4]}{' ...' if len(found) > 4 else ''}, not "
                          f"0{f', {step}' if len(found) > 1 else ''}, ... in order")
  return len(found)


def _window(state) -> tuple[int, int]:
  """The window sides ``(h, w)`` read off the first branch's ``rpe_biases``: the
  relative offsets ``(dh, dw)`` for ``dh`` in ``1 - h .. h - 1`` and ``dw`` in
  ``1 - w .. w - 1``, checked row by row (no size is taken from a value alone)."""
  rpe = tensor_of(state, RPE_KEY, 2, "DAT")
  rows, columns = np.shape(rpe)
  if columns != 2 or rows > MAX_RPE_ROWS:
    raise CheckpointError(f"not a DAT checkpoint: {RPE_KEY!r} has shape {(rows, columns)}, "
                          f"expected [offsets, 2] with at most {MAX_RPE_ROWS} offsets (windows of "
                          f"up to {MAX_WINDOW_SIDE} pixels a side)")
  table = as_numpy(rpe)
  last = table[-1]
  if np.all(np.isfinite(last)) and np.all(last >= 0) and np.all(last == np.round(last)):
    h, w = int(last[0]) + 1, int(last[1]) + 1
    if (2 * h - 1) * (2 * w - 1) == rows and np.array_equal(table, relative_positions(h, w)[0]):
      return h, w
  raise CheckpointError(f"not a DAT checkpoint: {RPE_KEY!r} is not a table of relative window "
                        f"offsets (its last row is {tuple(float(x) for x in last)} of {rows})")


def _agrees(name: str, value, fields: dict) -> bool:
  """Whether an override of ``name`` says what the tensors say."""
  if name == "expansion_factor":  # the tensors fix the FFN width it gives, not the float
    embed = fields["embed_dim"]
    return (isinstance(value, (int, float)) and math.isfinite(value)
            and int(embed * value) == int(embed * fields[name]))
  if isinstance(fields[name], tuple):
    return isinstance(value, (list, tuple)) and tuple(value) == fields[name]
  return value == fields[name]


def infer_dat_config(state, **overrides):
  """``(DATConfig, img_size)`` read off a DAT state dict's names and shapes.

  Only shapes are read, and the small ``rpe_biases`` table for the window size.
  ``overrides`` give the fields the tensors do not fix (``img_range``, default 1.0;
  ``split_size`` when there is no ``rpe_biases``); one the tensors fix must agree with
  them. ``img_size`` is the size the stored shift masks were built for (None without
  them); it does not change the model's output. A ``CheckpointError`` names the keys
  of what does not fit.
  """
  def need(key, ndim):
    return tensor_of(state, key, ndim, "DAT")

  conv_first = np.shape(need("conv_first.weight", 4))
  in_chans, embed_dim = int(conv_first[1]), int(conv_first[0])
  groups = _count(state, "layers")
  if not groups:
    raise CheckpointError(f"not a DAT checkpoint: no 'layers.<i>.blocks.<j>' keys "
                          f"({key_summary(state)})")
  depth = tuple(_count(state, f"layers.{i}.blocks") for i in range(groups))
  ffn = "layers.0.blocks.0.ffn.fc1.weight"
  sources = {"in_chans": "conv_first.weight", "embed_dim": "conv_first.weight",
             "expansion_factor": ffn}
  heads = []
  for i, d in enumerate(depth):
    # A channel-attention block stores one temperature per head, a spatial branch's
    # bias MLP one output per half of them.
    key = (f"layers.{i}.blocks.1.attn.temperature" if d >= 2
           else f"layers.{i}.blocks.0.attn.attns.0.pos.pos3.2.weight")
    heads.append((1 if d >= 2 else 2) * int(np.shape(need(key, 3 if d >= 2 else 2))[0]))
    sources[f"num_heads[{i}]"] = key
  fields = dict(in_chans=in_chans, embed_dim=embed_dim, depth=depth, num_heads=tuple(heads),
                expansion_factor=float(np.shape(need(ffn, 2))[0]) / embed_dim,
                qkv_bias="layers.0.blocks.0.attn.qkv.bias" in state,
                resi_connection="1conv" if "conv_after_body.weight" in state else "3conv")
  if RPE_KEY in state:
    fields["split_size"], sources["split_size"] = _window(state), RPE_KEY
  elif "split_size" not in overrides:
    raise CheckpointError("the checkpoint has no 'rpe_biases' buffer to read the window size "
                          "from: pass split_size=(h, w)")
  if "conv_last.weight" in state:
    fields["upsampler"] = "pixelshuffle"
    num_feat = int(np.shape(need("conv_before_upsample.0.weight", 4))[0])
    # Each upsample conv feeds a pixel shuffle: 4 * num_feat channels per x2, 9 per x3.
    convs = [f"upsample.{i}.weight" for i in range(0, 2 * _count(state, "upsample", 2), 2)]
    fields["upscale"] = math.prod(int(round(math.sqrt(np.shape(need(key, 4))[0] // num_feat)))
                                  for key in convs)
    sources["upscale"] = convs[0] if convs else "conv_last.weight"
  else:
    fields["upsampler"] = "pixelshuffledirect"
    fields["upscale"] = int(round(math.sqrt(np.shape(need("upsample.0.weight", 4))[0]
                                            // in_chans)))
    sources["upscale"] = "upsample.0.weight"
  for name, value in overrides.items():
    if name in fields and not _agrees(name, value, fields):
      raise CheckpointError(f"{name}={value!r} does not match the checkpoint, whose tensors give "
                            f"{name}={fields[name]!r}")
  fields.update(overrides)
  try:
    config = DATConfig(**fields)
  except DATConfigError as e:
    keys = dict.fromkeys(sources[f] for f in e.fields if f in sources)
    named = ", ".join(f"{k!r} {tuple(np.shape(state[k]))}" for k in keys)
    raise CheckpointError(f"not a DAT checkpoint jattn can run ({named or 'the options'}): "
                          f"{e}") from None
  masks = [v for k, v in state.items()
           if k.endswith("attn.attn_mask_0") and len(np.shape(v)) == 3]
  img_size = None
  if masks:
    windows = np.shape(masks[0])[0]
    img_size = int(round(math.sqrt(windows * config.split_size[0] * config.split_size[1])))
  return config, img_size


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
    path: ``.pth`` / ``.pt`` (what ``torch.save`` writes) or ``.safetensors``.
    dtype: computation dtype (default float32); parameters stay float32.
    overrides: ``DATConfig`` fields the tensors do not fix (``img_range``); one they
      fix must agree with them.

  Raises ValueError naming what does not match (missing, unexpected or mis-shaped keys).
  """
  return dat_from_state_dict(read_checkpoint(path), dtype=dtype, backend=backend, rngs=rngs,
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
