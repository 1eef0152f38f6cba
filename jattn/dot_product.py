"""``dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and semantics
on jattn's kernels, so that code written against JAX's entry point (MaxText's and
Levanter's layers, Flax models) switches by changing one import.

Calls without a bias or a mask array, whose masks jattn's flash attention expresses
as they are, run ``flash_attention``; the others run ``flex_attention`` with the same
masks as functions (JAX's causal mask and window are aligned top-left, at absolute
positions; the bias is added to the scaled logits and gets its gradient).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn.core.validation import check_integer_array, is_int
from jattn.flash import flash_attention
from jattn.flex.attention import FLEX, flex_attention
from jattn.flex.block_mask import block_mask_from_array
from jattn.flex.functions import built_function
from jattn.flex.mods import bias_score, broadcast_at
from jattn.kernels.common.config import MIN_BLOCK

# ``implementation`` -> jattn backend (JAX's names, and jattn's own).
IMPLEMENTATIONS = {None: "auto", "xla": "xla", "cudnn": "cudnn", "auto": "auto",
                   "pallas_mosaic": "pallas_mosaic", "pallas_triton": "pallas_triton"}


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None):
  """Scaled dot-product attention as ``jax.nn.dot_product_attention`` computes it.

  Args:
    query: ``[batch, q_len, heads, head_dim]`` (or without the batch axis).
    key, value: ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` a multiple of
      ``kv_heads`` (GQA/MQA).
    bias: added to the scaled logits, 4-d and broadcastable to ``[batch, heads,
      q_len, kv_len]`` (without the batch axis: to ``[heads, q_len, kv_len]``); it
      gets a gradient.
    mask: boolean, broadcastable like ``bias``; True where a query may attend.
    scale: logit scale, default ``head_dim ** -0.5``.
    is_causal: key ``j`` is seen by query ``i`` when ``j <= i`` (aligned top-left, as
      JAX's; ``flash_attention(causal=True)`` aligns the ends instead).
    query_seq_lengths, key_value_seq_lengths: ``[batch]`` ints: padding past them.
    local_window_size: ``w`` or ``(left, right)``: query ``i`` sees keys ``i - left``
      to ``i + right``.
    implementation: None (jattn's ``auto``), ``"xla"``, ``"cudnn"``, or a jattn
      backend name (``"pallas_mosaic"``, ``"pallas_triton"``). ``"cudnn"`` with a bias
      or mask array (or masks flash attention does not express) is JAX's own cuDNN
      call, with JAX's semantics.

  Returns:
    Shaped as ``query``. A query row that sees no key gives zeros (JAX's ``xla``
    path gives the mean of the values there, unless the row is query padding).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {sorted(map(str, IMPLEMENTATIONS))}, "
                     f"got {implementation!r}")
  backend = IMPLEMENTATIONS[implementation]
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError("query, key and value must have rank 4 [batch, seq, heads, head_dim] "
                     f"or 3 [seq, heads, head_dim], got shapes {query.shape}, {key.shape}, "
                     f"{value.shape}")
  window = _window(local_window_size)
  batch, q_len, heads, _ = query.shape
  kv_len = key.shape[1]
  full = (batch, heads, q_len, kv_len)
  bias = None if bias is None else _four_d("bias", bias, full)
  mask = None if mask is None else _four_d("mask", mask, full)
  if mask is not None and mask.dtype != jnp.bool_:
    raise TypeError(f"mask must be boolean (an additive mask goes in bias), got {mask.dtype}")
  if bias is not None and bias.dtype == jnp.bool_:
    raise TypeError("bias must be numbers added to the logits, got a boolean array (a "
                    "boolean mask goes in mask)")
  lengths = {}
  for name, arg, given in (("query_seq_lengths", "q_lengths", query_seq_lengths),
                           ("key_value_seq_lengths", "kv_lengths", key_value_seq_lengths)):
    if given is not None:  # checked here: the masks below index it by batch row
      given = jnp.asarray(given)
      check_integer_array(name, given, (batch,), "batch")
    lengths[arg] = given
  aligned = q_len == kv_len and query_seq_lengths is None and key_value_seq_lengths is None
  if bias is None and mask is None and (aligned or not (is_causal or window)):
    out = flash_attention(query, key, value, causal=is_causal, scale=scale,
                          local_window=window, backend=backend, **lengths)
  elif backend == "cudnn":  # flex has no cuDNN backend: JAX's own cuDNN call, as it is
    out = jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="cudnn")
  else:
    masks = (mask, is_causal, window, lengths["q_lengths"], lengths["kv_lengths"])
    mask_mod = _mask_fn(*masks)
    call = dict(score_mod=None if bias is None else bias_score(bias), mask_mod=mask_mod)
    if mask is not None:
      # A mask array's tiles are classified by one reduction over it, not through
      # mask_mod, whose reads of the array gather it element by element.
      allowed = _allowed(*masks, batch, q_len, kv_len)
      call = dict(call, mask_mod=None, block_mask=block_mask_from_array(mask_mod, allowed,
                                                                        MIN_BLOCK))
      call = _mask_as_bias(query, key, value, bias, mask, masks[1:], call, backend) or call
    out = flex_attention(query, key, value, scale=scale, backend=backend, **call)
  return out[0] if unbatched else out


def _mask_as_bias(query, key, value, bias, mask, index_masks, call: dict, backend: str):
  """``call`` (flex's ``score_mod`` and the whole mask's ``block_mask``) with the mask
  array as a 16-bit additive bias (``bias`` where the mask allows, else -inf; 0 for
  no bias), which the Hopper kernels read tile by tile where they cannot gather the
  boolean array; None where the call as it is runs on them already (say a key-padding
  mask, split into parts), or the bias form would not (``backend``: "auto" choosing
  them, or named). The block mask keeps its tiles' kinds, its function the index
  masks alone (causal, window, lengths): the array's part is in the bias. Not for a
  bias and a mask broadcasting to more than the bias (their sum would be larger)."""
  if backend not in ("auto", "pallas_mosaic"):
    return None
  dtype = query.dtype if bias is None else bias.dtype
  if not (jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2) or (
      bias is not None and jnp.broadcast_shapes(bias.shape, mask.shape) != bias.shape):
    return None
  # (a mask that refuses nothing, where the block mask calls a tile partial)
  index_mod = _mask_fn(None, *index_masks) or (lambda b, h, q_idx, kv_idx: kv_idx >= 0)
  block_mask = dataclasses.replace(call["block_mask"], mask_mod=index_mod)
  as_bias = lambda mask, bias: jnp.where(mask, 0.0 if bias is None else bias,
                                         -jnp.inf).astype(dtype)
  on_hopper = []

  def decide(query, key, value, mask, bias):  # on shapes alone: nothing built eagerly
    def runs(**options):
      problem, _ = FLEX.bind(query, key, value, **options)
      if backend == "auto":
        return FLEX.select(problem) == "pallas_mosaic"
      return dict(FLEX.choices(problem))["pallas_mosaic"] is None
    on_hopper.extend([runs(**call), runs(score_mod=bias_score(as_bias(mask, bias)),
                                          block_mask=block_mask)])

  jax.eval_shape(decide, query, key, value, mask, bias)
  if on_hopper[0] or not on_hopper[1]:
    return None
  return dict(call, score_mod=bias_score(as_bias(mask, bias)), block_mask=block_mask)


def _window(local_window_size):
  if local_window_size is None:
    return None
  if is_int(local_window_size):
    local_window_size = (local_window_size, local_window_size)
  if not (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and all(
      is_int(w) and w >= 0 for w in local_window_size)):
    raise ValueError("local_window_size must be an int >= 0 or a (left, right) pair of them, "
                     f"got {local_window_size!r}")
  return tuple(int(w) for w in local_window_size)


def _four_d(name: str, x, full: tuple):
  """``x`` as a 4-d array broadcastable to ``full`` (leading axes added as JAX does)."""
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"{name} must have rank at most 4, got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(n not in (1, f) for n, f in zip(x.shape, full)):
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to [batch, heads, q_len, "
                     f"kv_len] = {full}")
  return x


def _index_mask(is_causal: bool, window, q_lengths, kv_lengths, b, q_idx, kv_idx):
  """JAX's masks other than the mask array at ``(b, q_idx, kv_idx)`` (scalars, or index
  arrays that broadcast together): True where none of them refuses."""
  seen = jnp.ones((), jnp.bool_)
  if is_causal:
    seen &= kv_idx <= q_idx
  if window is not None:
    seen &= (kv_idx >= q_idx - window[0]) & (kv_idx <= q_idx + window[1])
  if q_lengths is not None:
    seen &= q_idx < q_lengths[b]
  if kv_lengths is not None:
    seen &= kv_idx < kv_lengths[b]
  return seen


def _allowed(mask, is_causal: bool, window, q_lengths, kv_lengths, batch: int, q_len: int,
             kv_len: int):
  """``_mask_fn``'s mask as a boolean array ``[batch or 1, heads or 1, q_len, kv_len]``
  (``mask``: 4-d), evaluated on broadcast index vectors: the array is read whole, not
  gathered."""
  index = (jnp.arange(batch, dtype=jnp.int32)[:, None, None, None],
           jnp.arange(q_len, dtype=jnp.int32)[:, None], jnp.arange(kv_len, dtype=jnp.int32))
  seen = mask & _index_mask(is_causal, window, q_lengths, kv_lengths, *index)
  return jnp.broadcast_to(seen, seen.shape[:2] + (q_len, kv_len))


def _mask_fn(mask, is_causal: bool, window, q_lengths, kv_lengths):
  """JAX's masks as one ``mask_mod`` (absolute positions, top-left), or None (lengths:
  arrays or None)."""
  if mask is None and not is_causal and window is None and q_lengths is None and (
      kv_lengths is None):
    return None

  given = (mask, q_lengths, kv_lengths)

  def build(*arrays):  # from the given arrays (flex traces it with them as inputs)
    it = iter(arrays)
    mask, q_lengths, kv_lengths = (None if x is None else next(it) for x in given)

    def mask_mod(b, h, q_idx, kv_idx):
      seen = _index_mask(is_causal, window, q_lengths, kv_lengths, b, q_idx, kv_idx)
      return seen if mask is None else seen & broadcast_at(mask, b, h, q_idx, kv_idx)

    return mask_mod

  return built_function(build, tuple(x for x in given if x is not None))
