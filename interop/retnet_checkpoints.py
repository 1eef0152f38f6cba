"""torchscale ``RetNetDecoder`` checkpoints into ``jattn.nn.RetNet``.

The state dict's names are torchscale's: ``embed_tokens.weight``,
``layers.<i>.retention.{q,k,v,g,out}_proj.weight``, ``layers.<i>.retention_layer_norm``,
``layers.<i>.ffn.{fc1,fc2,gate}.weight``, ``layers.<i>.final_layer_norm``,
``layer_norm``, ``layernorm_embedding`` (optional), ``output_projection.weight``
(absent or equal to the embedding when tied) and the buffers ``retnet_rel_pos.decay``
/ ``.angle``, which give the head count. A ``decoder.`` prefix (fairseq's language
model) is removed.

What the tensors do not record is passed as options: ``activation`` ("gelu", the
torchscale default, or "swish"), ``eps`` (1e-6), ``embed_scale`` (1.0), and
``num_heads`` when the buffers are missing.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jattn.interop.checkpoint_files import (CheckpointError, key_summary, read_checkpoint,
                                            tensor_of)
from jattn.interop.convert import load_torch_state_dict
from jattn.interop.stored_tensors import as_numpy
from jattn.nn.retention import RetNet, RetNetConfig, check_heads
from jattn.reference import default_decay

# Buffers the model recomputes from its config (the decay checked against num_heads).
RETNET_DERIVED = ("retnet_rel_pos.decay", "retnet_rel_pos.angle")


def _strip_prefix(state: dict, prefix: str = "decoder.") -> dict:
  if state and all(k.startswith(prefix) for k in state):
    return {k[len(prefix):]: v for k, v in state.items()}
  return state


def infer_retnet_config(state, *, num_heads: int | None = None, **options) -> RetNetConfig:
  """The ``RetNetConfig`` of a torchscale ``RetNetDecoder`` state dict, read off its
  shapes (and the small decay buffer); ``options`` give the fields the tensors do not
  record, and one they record must agree with them."""
  state = _strip_prefix(dict(state))
  if "embed_tokens.weight" not in state or "layers.0.retention.q_proj.weight" not in state:
    raise CheckpointError("not a RetNet checkpoint: no 'embed_tokens.weight' and "
                          f"'layers.0.retention.q_proj.weight' ({key_summary(state)})")
  need = lambda key, ndim: np.shape(tensor_of(state, key, ndim, "RetNet"))
  vocab_size, embed_dim = (int(n) for n in need("embed_tokens.weight", 2))
  value_dim = int(need("layers.0.retention.v_proj.weight", 2)[0])
  layers = 0
  while f"layers.{layers}.retention.q_proj.weight" in state:
    layers += 1
  embed, output = state["embed_tokens.weight"], state.get("output_projection.weight")
  tied = output is None or (np.shape(output) == np.shape(embed)
                            and np.array_equal(as_numpy(output), as_numpy(embed)))
  fields = dict(
      vocab_size=vocab_size, embed_dim=embed_dim, num_layers=layers, value_dim=value_dim,
      ffn_dim=int(need("layers.0.ffn.fc1.weight", 2)[0]),
      layernorm_embedding="layernorm_embedding.weight" in state, tie_embeddings=bool(tied))
  for name, value in options.items():
    if name in fields and value != fields[name]:
      raise CheckpointError(f"{name}={value!r} does not match the checkpoint, whose tensors give "
                            f"{name}={fields[name]!r}")
  if "retnet_rel_pos.decay" in state:
    stored = int(need("retnet_rel_pos.decay", 1)[0])
    if num_heads is not None and num_heads != stored:
      raise CheckpointError(f"num_heads={num_heads} but the checkpoint's decay buffer has "
                            f"{stored} heads")
    try:  # before the buffer is read: its length must be a head count of these widths
      check_heads(embed_dim, value_dim, stored)
    except ValueError as e:
      raise CheckpointError(f"not a RetNet checkpoint jattn can run: 'retnet_rel_pos.decay' "
                            f"has {stored} heads: {e}") from None
    num_heads = stored
    decay = as_numpy(state["retnet_rel_pos.decay"]).astype(np.float64)
    if not np.allclose(np.exp(decay), default_decay(stored), atol=1e-6):
      raise CheckpointError("the checkpoint's decay buffer is not RetNet's "
                            "1 - 2**(-5 - h): jattn.nn.RetNet has no other decay")
  if num_heads is None:
    raise CheckpointError("the checkpoint has no 'retnet_rel_pos.decay' buffer to read the "
                          "head count from: pass num_heads")
  return RetNetConfig(num_heads=num_heads, **{**fields, **options})


def retnet_from_state_dict(state, *, num_heads: int | None = None, backend: str = "auto",
                           dtype=None, rngs=None, **options) -> RetNet:
  """A ``jattn.nn.RetNet`` with the weights of a torchscale ``RetNetDecoder`` state dict
  (torch tensors, numpy arrays or ``StoredTensor``s: keys and shapes are checked
  against the model before any value is read)."""
  state = _strip_prefix(dict(state))
  config = infer_retnet_config(state, num_heads=num_heads, **options)
  for key in RETNET_DERIVED + (("output_projection.weight",) if config.tie_embeddings else ()):
    state.pop(key, None)
  # Built abstractly: every parameter is then set from the checkpoint.
  model = nnx.eval_shape(lambda: RetNet.from_config(config, backend=backend, dtype=dtype,
                                                    rngs=rngs or nnx.Rngs(0)))
  load_torch_state_dict(model, state)
  return model


def load_retnet(source, *, num_heads: int | None = None, backend: str = "auto", dtype=None,
                rngs=None, **options) -> RetNet:
  """``RetNet.from_torch``: ``source`` is a checkpoint path (``.pth``, as ``torch.save``
  writes it, or ``.safetensors``) or a state dict; ``options``
  are ``RetNetConfig`` fields the tensors do not record (see the module docstring).
  Raises ``CheckpointError`` (a ``ValueError``) for a file or state dict that is not
  such a checkpoint, naming what does not match."""
  state = source if isinstance(source, dict) else read_checkpoint(source)
  return retnet_from_state_dict(state, num_heads=num_heads, backend=backend, dtype=dtype,
                                rngs=rngs, **options)


__all__ = ["RETNET_DERIVED", "infer_retnet_config", "load_retnet", "retnet_from_state_dict"]
