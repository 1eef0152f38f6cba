"""Converted models: Flax params as ``params.safetensors`` (torch names and layouts)
plus ``config.json`` in a folder, what ``jattn-convert`` writes; read back without
torch."""

from __future__ import annotations

import dataclasses
import json
import os

from jattn.interop.checkpoints import CheckpointError, dat_from_state_dict
from jattn.interop.convert import to_torch_state_dict
from jattn.interop.retnet_checkpoints import retnet_from_state_dict

# The model name config.json gives -> how to build it from the params and the config.
BUILDERS = {"DAT": dat_from_state_dict, "RetNet": retnet_from_state_dict}


def save_converted(model, out_dir) -> tuple[str, str]:
  """Writes ``model``'s weights to ``out_dir/params.safetensors`` and its config to
  ``out_dir/config.json``; returns both paths."""
  from safetensors.numpy import save_file

  os.makedirs(out_dir, exist_ok=True)
  params = os.path.join(out_dir, "params.safetensors")
  config = os.path.join(out_dir, "config.json")
  save_file(to_torch_state_dict(model), params)
  with open(config, "w") as f:
    json.dump({"model": type(model).__name__, "config": dataclasses.asdict(model.config)}, f,
              indent=1)
  return params, config


def load_converted(out_dir, *, dtype=None, backend: str = "auto"):
  """The model ``save_converted`` (or ``jattn-convert``) wrote to ``out_dir``."""
  from safetensors.numpy import load_file

  try:
    with open(os.path.join(out_dir, "config.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{out_dir}: no readable config.json ({e})") from None
  build = BUILDERS.get(meta.get("model") if isinstance(meta, dict) else None)
  if build is None:
    raise CheckpointError(f"{out_dir}: config.json describes {meta.get('model')!r}, expected "
                          f"one of {sorted(BUILDERS)}")
  state = load_file(os.path.join(out_dir, "params.safetensors"))
  return build(state, dtype=dtype, backend=backend, **meta["config"])


__all__ = ["load_converted", "save_converted"]
