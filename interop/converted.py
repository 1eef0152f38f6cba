"""Converted models: Flax params as ``params.safetensors`` (torch names and layouts)
plus ``config.json`` in a folder, what ``jattn-convert`` writes; read back without
torch.

Light to import (the models load when a folder is read), so that the command-line
tools check a converted folder before JAX loads."""

from __future__ import annotations

import dataclasses
import json
import os

from jattn.command_line import first_line
from jattn.interop.checkpoint_files import CheckpointError
from jattn.lazy_exports import import_attribute

# The model name config.json gives -> the function that builds it from the params and
# the config ("module:function", imported when a folder is loaded).
BUILDERS = {"DAT": "jattn.interop.checkpoints:dat_from_state_dict",
            "RetNet": "jattn.interop.retnet_checkpoints:retnet_from_state_dict"}
PARAMS_FILE, CONFIG_FILE = "params.safetensors", "config.json"
CONVERTED_FILES = (PARAMS_FILE, CONFIG_FILE)


def save_converted(model, out_dir) -> tuple[str, str]:
  """Writes ``model``'s weights to ``out_dir/params.safetensors`` and its config to
  ``out_dir/config.json``; returns both paths."""
  from safetensors.numpy import save_file

  from jattn.interop.convert import to_torch_state_dict

  os.makedirs(out_dir, exist_ok=True)
  params, config = (os.path.join(out_dir, name) for name in CONVERTED_FILES)
  save_file(to_torch_state_dict(model), params)
  with open(config, "w") as f:
    json.dump({"model": type(model).__name__, "config": dataclasses.asdict(model.config)}, f,
              indent=1)
  return params, config


def read_converted_config(out_dir, model: str | None = None) -> tuple[str, dict]:
  """``(model name, config fields)`` of the converted folder ``out_dir``, read off its
  ``config.json`` (quick: no weights, no JAX); a ``CheckpointError`` where that is not
  what ``save_converted`` writes, or (given ``model``) of another model."""
  try:
    with open(os.path.join(out_dir, CONFIG_FILE)) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{out_dir!r}: no readable {CONFIG_FILE} ({first_line(e)})") from None
  kind = meta.get("model") if isinstance(meta, dict) else None
  if kind not in BUILDERS or not isinstance(meta.get("config"), dict):
    raise CheckpointError(f"{out_dir!r}: {CONFIG_FILE} is not what jattn-convert writes "
                          '({"model": one of ' + f"{sorted(BUILDERS)}, " + '"config": {...}})')
  if model is not None and kind != model:
    raise CheckpointError(f"{out_dir!r} holds a converted {kind}, expected a {model}")
  return kind, meta["config"]


def load_converted(out_dir, *, dtype=None, backend: str = "auto", model: str | None = None):
  """The model ``save_converted`` (or ``jattn-convert``) wrote to ``out_dir``; ``model``
  (``"DAT"``, ``"RetNet"``): the kind it must be. A ``CheckpointError`` (one line naming
  the folder) for a folder that does not hold one."""
  from safetensors.numpy import load_file

  kind, config = read_converted_config(out_dir, model)
  try:
    state = load_file(os.path.join(out_dir, PARAMS_FILE))
  except Exception as e:  # safetensors raises its own error type for a bad header
    raise CheckpointError(f"{out_dir!r}: {PARAMS_FILE} is not a valid .safetensors file "
                          f"(truncated or corrupt: {first_line(e)})") from None
  build = import_attribute(BUILDERS[kind])
  try:
    return build(state, dtype=dtype, backend=backend, **config)
  except TypeError as e:  # a config field the model does not have
    raise CheckpointError(f"{out_dir!r}: {CONFIG_FILE} does not describe a {kind} "
                          f"({first_line(e)})") from None


__all__ = ["CONVERTED_FILES", "load_converted", "read_converted_config", "save_converted"]
