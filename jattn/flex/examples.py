"""Named flex_attention problems: ready functions on arrays fixed by the shape. What
``jattn check`` and the cross-checks against PyTorch's FlexAttention run (the torch
side builds its own spelling of each from the same ``example_arrays``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jattn.flex import mods

EXAMPLES = ("alibi_causal", "documents", "sliding_window", "softcap")
WINDOW = 8  # keys a sliding-window query sees before its own position
CAP = 5.0  # the soft cap


def example_arrays(name: str, batch: int, q_heads: int, q_len: int, kv_len: int) -> dict:
  """The arrays example ``name`` closes over, as numpy: ALiBi ``slopes [q_heads]``;
  document ``ids [batch, kv_len]`` (three documents of uneven lengths, shifted per row;
  the queries are the last ``q_len`` positions)."""
  if name not in EXAMPLES:
    raise ValueError(f"example must be one of {EXAMPLES}, got {name!r}")
  if name == "alibi_causal":
    return {"slopes": np.asarray(mods.alibi_slopes(q_heads))}
  if name == "documents":
    cuts = np.array([kv_len // 5, kv_len // 2])[None, :] + np.arange(batch)[:, None]
    ids = (np.arange(kv_len)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    return {"ids": ids}
  return {}


def example_mods(name: str, batch: int, q_heads: int, q_len: int, kv_len: int):
  """``(score_mod, mask_mod)`` of example ``name`` (queries aligned to the last keys)."""
  arrays = {k: jnp.asarray(v) for k, v in
            example_arrays(name, batch, q_heads, q_len, kv_len).items()}
  offset = kv_len - q_len
  if name == "alibi_causal":
    return mods.alibi_score(arrays["slopes"]), mods.causal_mask(offset)
  if name == "documents":
    return None, mods.document_mask(arrays["ids"][:, offset:], arrays["ids"])
  if name == "sliding_window":
    return None, mods.sliding_window_mask(WINDOW, 0, offset)
  return mods.softcap_score(CAP), None
