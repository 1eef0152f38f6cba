"""Converted models: Flax params as ``params.safetensors`` (torch names and layouts)
plus ``config.json`` in a folder, what ``jattn-convert`` writes; written and read back
with numpy alone (no torch, no safetensors package).

Light to import (the models load when a folder is read), so that the command-line
tools check a converted folder before JAX loads. Both files are untrusted when read:
``config.json`` is read up to a size cap, and each field it gives that the weights fix
(widths, depths, head counts) must agree with them before a model is built.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jattn.command_line import first_line
from jattn.interop.safetensors_files import safetensors_index, write_safetensors
from jattn.interop.stored_tensors import CheckpointError
from jattn.lazy_exports import import_attribute

# The model name config.json gives -> the function that builds it from the params and
# the config ("module:function", imported when a folder is loaded).
BUILDERS = {"DAT": "jattn.interop.checkpoints:dat_from_state_dict",
            "RetNet": "jattn.interop.retnet_checkpoints:retnet_from_state_dict",
            "LlamaForCausalLM": "jattn.interop.llama_checkpoints:llama_from_state_dict"}
PARAMS_FILE, CONFIG_FILE = "params.safetensors", "config.json"
CONVERTED_FILES = (PARAMS_FILE, CONFIG_FILE)
MAX_CONFIG_BYTES = 1 << 20  # what save_converted writes is under 1 KB


def save_converted(model, out_dir) -> tuple[str, str]:
  """Writes ``model``'s weights to ``out_dir/params.safetensors`` and its config to
  ``out_dir/config.json``; returns both paths."""
  from jattn.interop.convert import to_torch_state_dict

  os.makedirs(out_dir, exist_ok=True)
  params, config = (os.path.join(out_dir, name) for name in CONVERTED_FILES)
  write_safetensors(params, to_torch_state_dict(model))
  with open(config, "w") as f:
    json.dump({"model": type(model).__name__, "config": dataclasses.asdict(model.config)}, f,
              indent=1)
  return params, config


def read_converted_config(out_dir, model: str | None = None) -> tuple[str, dict]:
  """``(model name, config fields)`` of the converted folder ``out_dir``, read off its
  ``config.json`` (quick: no weights, no JAX); a ``CheckpointError`` where that is not
  what ``save_converted`` writes, or (given ``model``) of another model."""
  try:
    with open(os.path.join(out_dir, CONFIG_FILE), "rb") as f:
      text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
      raise ValueError(f"more than {MAX_CONFIG_BYTES} bytes")
    meta = json.loads(text)
  except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested brackets
    raise CheckpointError(f"{out_dir!r}: no readable {CONFIG_FILE} ({first_line(e)})") from None
  kind = meta.get("model") if isinstance(meta, dict) else None
  if not (isinstance(kind, str) and kind in BUILDERS and isinstance(meta.get("config"), dict)):
    raise CheckpointError(f"{out_dir!r}: {CONFIG_FILE} is not what jattn-convert writes "
                          '({"model": one of ' + f"{sorted(BUILDERS)}, " + '"config": {...}})')
  if model is not None and kind != model:
    raise CheckpointError(f"{out_dir!r} holds a converted {kind}, expected a {model}")
  return kind, meta["config"]


def load_converted(out_dir, *, dtype=None, backend: str = "auto", model: str | None = None):
  """The model ``save_converted`` (or ``jattn-convert``) wrote to ``out_dir``; ``model``
  (``"DAT"``, ``"RetNet"``): the kind it must be. A ``CheckpointError`` (one line naming
  the folder) for a folder that does not hold one, or whose two files disagree."""
  kind, config = read_converted_config(out_dir, model)
  state = safetensors_index(os.path.join(out_dir, PARAMS_FILE))
  build = import_attribute(BUILDERS[kind])
  try:
    return build(state, dtype=dtype, backend=backend, **config)
  except (TypeError, ValueError) as e:  # a field the model lacks, or not what the weights say
    raise CheckpointError(f"{out_dir!r} does not hold a {kind} jattn can load: "
                          f"{first_line(e, 300)}") from None


__all__ = ["CONVERTED_FILES", "load_converted", "read_converted_config", "save_converted"]
