"""Hugging Face Llama-family checkpoints (Llama, Qwen2, Mistral) into
``jattn.nn.LlamaForCausalLM``.

- ``read_hf_folder(folder)``: ``config.json`` and the weights' index: one
  ``model.safetensors``, or the shards ``model.safetensors.index.json`` names; read with
  numpy alone (no torch), each tensor's bytes read when loaded.
- ``llama_from_state_dict(state, config=...)``: the model, its keys and shapes checked
  against the config before any value is read (parameters in the checkpoint's dtype
  unless told otherwise).
- ``load_llama(folder)``: either kind of folder: Hugging Face's, or the one
  ``jattn-convert llama`` writes (``params.safetensors`` with the same keys, and our
  ``config.json``). ``load_llama_torch(module_or_state_dict, config)``: a live torch model.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.command_line import about
from jattn.interop.convert import load_torch_state_dict
from jattn.interop.safetensors_files import safetensors_index
from jattn.interop.stored_tensors import DTYPES, CheckpointError, StoredTensor
from jattn.nn.llama import LlamaForCausalLM
from jattn.nn.llama_config import LlamaConfig, LlamaConfigError

HF_CONFIG, HF_WEIGHTS, HF_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_JSON_BYTES = 1 << 24
# Buffers older checkpoints store that the model recomputes.
LLAMA_DERIVED = ("inv_freq",)


def _json(path: str):
  try:
    with open(path, "rb") as f:
      text = f.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
      raise ValueError(f"more than {MAX_JSON_BYTES} bytes")
    value = json.loads(text)
  except (OSError, ValueError, RecursionError) as e:
    raise CheckpointError(f"{path!r} is not a readable JSON file ({str(e)[:100]})") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path!r} does not hold a JSON object")
  return value


def read_hf_folder(folder) -> tuple[dict, dict[str, StoredTensor]]:
  """``(config dict, tensors by key)`` of a Hugging Face model folder; a
  ``CheckpointError`` naming what is missing or malformed."""
  if not os.path.isdir(folder):
    raise CheckpointError(f"{folder!r} is not a folder (a Hugging Face model folder holds "
                          f"{HF_CONFIG} and {HF_WEIGHTS} or its shards)")
  config = _json(os.path.join(folder, HF_CONFIG))
  index_path = os.path.join(folder, HF_INDEX)
  if os.path.exists(index_path):
    weight_map = _json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and os.path.basename(v) == v for v in weight_map.values()):
      raise CheckpointError(f"{index_path!r}: its weight_map must map keys to file names in "
                            "the folder")
    files = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(folder, HF_WEIGHTS)):
    weight_map, files = None, [HF_WEIGHTS]
  else:
    raise CheckpointError(f"{folder!r} holds neither {HF_WEIGHTS} nor {HF_INDEX} (only "
                          "safetensors weights are read)")
  tensors = {}
  for name in files:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise CheckpointError(f"{folder!r}: the shard {name!r} its index names is missing")
    for key, tensor in safetensors_index(path).items():
      if weight_map is None or weight_map.get(key) == name:
        tensors[key] = tensor
  if weight_map is not None and set(weight_map) - set(tensors):
    missing = sorted(set(weight_map) - set(tensors))
    raise CheckpointError(f"{folder!r}: {missing[0]!r} is not in the shard its index names"
                          + (f" ({len(missing) - 1} more)" if len(missing) > 1 else ""))
  return config, tensors


def _stored_dtype(value):
  """The dtype a checkpoint value is stored in (floating parameters keep it)."""
  if isinstance(value, StoredTensor):
    return jnp.dtype(DTYPES[value.storage.dtype])
  if hasattr(value, "detach"):  # torch
    return jnp.dtype(str(value.dtype).removeprefix("torch."))
  return jnp.dtype(np.asarray(value).dtype)


def llama_from_state_dict(state, *, config=None, dtype=None, param_dtype=None,
                          backend: str = "auto", **fields) -> LlamaForCausalLM:
  """A ``LlamaForCausalLM`` with the weights of ``state`` (Hugging Face keys).

  Args:
    state: tensors (``StoredTensor``, torch or numpy) by key.
    config: a ``LlamaConfig``, a Hugging Face config dict or a transformers config; or
      the ``LlamaConfig`` fields as keyword arguments (what a converted folder holds).
    dtype, param_dtype: computation and parameter dtypes (default: the dtype the
      embedding is stored in, for both).
    backend: the attention backend.
  """
  if config is None:
    config = LlamaConfig(**fields)
  elif not isinstance(config, LlamaConfig):
    config = LlamaConfig.from_hf(config)
  state = dict(state)
  if config.tie_word_embeddings:  # some tied checkpoints store the head's copy too
    state.pop("lm_head.weight", None)
  embed = state.get("model.embed_tokens.weight")
  if param_dtype is None:
    param_dtype = _stored_dtype(embed) if embed is not None else jnp.float32
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, backend=backend, dtype=dtype,
                                                  param_dtype=param_dtype,
                                                  rngs=nnx.Rngs(0)))
  load_torch_state_dict(model, state, derived=LLAMA_DERIVED)
  return model


def load_llama(folder, *, dtype=None, param_dtype=None, backend: str = "auto"):
  """``LlamaForCausalLM.from_pretrained``: the model of a Hugging Face folder or of a
  ``jattn-convert llama`` output folder; ``CheckpointError`` / ``LlamaConfigError``
  (one line) where it is neither or does not match its config."""
  try:
    if _is_converted(folder):
      from jattn.interop.converted import PARAMS_FILE, read_converted_config

      _, fields = read_converted_config(folder, "LlamaForCausalLM")
      tensors = safetensors_index(os.path.join(folder, PARAMS_FILE))
      config = LlamaConfig(**fields)
    else:
      config, tensors = read_hf_folder(folder)
    return llama_from_state_dict(tensors, config=config, dtype=dtype, param_dtype=param_dtype,
                                 backend=backend)
  except LlamaConfigError:
    raise
  except (TypeError, ValueError) as e:  # led by the folder, once (read_hf_folder names it)
    raise CheckpointError(about(folder, e)) from None


def _is_converted(folder) -> bool:
  from jattn.interop.converted import CONFIG_FILE, PARAMS_FILE

  path = os.path.join(folder, CONFIG_FILE)
  return (os.path.isfile(os.path.join(folder, PARAMS_FILE)) and os.path.isfile(path)
          and _json(path).get("model") == "LlamaForCausalLM")


def load_llama_torch(module_or_state_dict, config=None, *, dtype=None, param_dtype=None,
                     backend: str = "auto"):
  """``LlamaForCausalLM.from_torch``: a transformers ``LlamaForCausalLM`` /
  ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (its ``config`` unless one is given), or
  a state dict with their keys and a ``config``."""
  if hasattr(module_or_state_dict, "state_dict"):
    config = module_or_state_dict.config if config is None else config
    state = module_or_state_dict.state_dict()
  else:
    state = module_or_state_dict
  if config is None:
    raise ValueError("from_torch of a state dict needs its config (a LlamaConfig, a config "
                     "dict or a transformers config)")
  return llama_from_state_dict(state, config=config, dtype=dtype, param_dtype=param_dtype,
                               backend=backend)

