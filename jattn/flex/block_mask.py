"""``create_block_mask``: a mask evaluated once per tile, so that kernels skip the
tiles it empties and drop the element mask where it allows everything."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jattn.kernels.common.elementwise import elementwise
from jattn.core.sharding import typed_split
from jattn.core.validation import check_positive_int
from jattn.flex.functions import trace
from jattn.kernels.common.block_sparsity import (EMPTY, FULL, PARTIAL, classify_blocks,
                                                  tile_kinds)

__all__ = ["BlockMask", "EMPTY", "FULL", "PARTIAL", "block_mask_from_array", "create_block_mask"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """A ``mask_mod`` and, per ``(query block, key block)`` tile, whether it is empty
  (``EMPTY``: no pair may attend), ``FULL`` (every pair may) or ``PARTIAL``.

  Attributes:
    kinds: int8 ``[batch or 1, heads or 1, q_blocks, kv_blocks]`` (1: the same for
      every batch row or head).
    mask_mod: the function ``(b, h, q_idx, kv_idx) -> bool`` it was made from.
    q_len, kv_len, block_q, block_kv: the lengths and tile sizes it describes.
  """

  kinds: jax.Array
  mask_mod: Callable
  q_len: int
  kv_len: int
  block_q: int
  block_kv: int

  def tree_flatten(self):
    return (self.kinds,), (self.mask_mod, self.q_len, self.kv_len, self.block_q, self.block_kv)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def sparsity(self) -> float:
    """The fraction of tiles that are empty (skipped by the kernels)."""
    return float(jnp.mean(self.kinds == EMPTY))


def _blocks(block) -> tuple[int, int]:
  pair = (block, block) if not isinstance(block, (tuple, list)) else tuple(block)
  if len(pair) != 2:
    raise ValueError(f"block must be an int or (block_q, block_kv), got {block!r}")
  for size in pair:
    check_positive_int("block", size)
  return pair


def create_block_mask(mask_mod: Callable, batch: int | None, heads: int | None, q_len: int,
                      kv_len: int, block=128) -> BlockMask:
  """Evaluates ``mask_mod`` over ``[batch, heads, q_len, kv_len]`` one query block at a
  time and classifies each tile.

  Args:
    mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, called elementwise with int32 indices
      (``h`` the query head); it may close over arrays.
    batch, heads: sizes to evaluate over, or None when the mask does not depend on ``b``
      (or ``h``): then one entry serves every batch row (head).
    q_len, kv_len: sequence lengths of the calls it will serve.
    block: tile size, an int or ``(block_q, block_kv)``.

  Returns:
    A ``BlockMask`` (a pytree: it passes through ``jit``).
  """
  if mask_mod is None:
    raise TypeError("mask_mod must be a function (b, h, q_idx, kv_idx), got None")
  trace(mask_mod, "mask_mod")  # the same checks as flex_attention's
  for name, value in (("batch", batch), ("heads", heads)):
    check_positive_int(name, value, optional=True)
  check_positive_int("q_len", q_len)
  check_positive_int("kv_len", kv_len)
  block_q, block_kv = _blocks(block)
  kinds = classify_blocks(lambda *index: elementwise(mask_mod, *index), batch or 1, heads or 1,
                          (q_len, kv_len), (block_q, block_kv))
  return BlockMask(kinds, mask_mod, q_len, kv_len, block_q, block_kv)


def block_mask_from_array(mask_mod: Callable, allowed, block=128) -> BlockMask:
  """A ``BlockMask`` of ``mask_mod`` classified from ``allowed``, the same mask as a
  boolean array ``[batch or 1, heads or 1, q_len, kv_len]`` (True where a query may
  attend): one reduction over the array, where ``create_block_mask`` calls the
  function on every element (a function that reads a mask array gathers it element
  by element). ``mask_mod`` must be that mask: the kernels evaluate it on the
  partial tiles. ``block``: an int or ``(block_q, block_kv)``."""
  allowed = jnp.asarray(allowed)
  if allowed.ndim != 4 or allowed.dtype != jnp.bool_:
    raise ValueError("allowed must be a boolean [batch or 1, heads or 1, q_len, kv_len] "
                     f"array, got {allowed.dtype} of shape {allowed.shape}")
  block_q, block_kv = _blocks(block)
  batch, heads, q_len, kv_len = allowed.shape
  q_blocks, kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
  pad = ((0, 0), (0, 0), (0, q_blocks * block_q - q_len), (0, kv_blocks * block_kv - kv_len))
  tiles = (batch, heads, q_blocks, block_q, kv_blocks, block_kv)
  typed = typed_split(allowed)  # on a mesh of Explicit axes: its rows' split kept
  split = None if typed is None else NamedSharding(
      typed.mesh, PartitionSpec(*(tuple(typed.spec) + (None, None))[:2], None, None, None, None))
  in_tiles = lambda x: x.reshape(tiles) if split is None else jnp.reshape(
      x, tiles, out_sharding=split)
  # Padding counts as neither allowed nor refused.
  any_allowed = in_tiles(jnp.pad(allowed, pad)).any(axis=(3, 5))
  all_allowed = in_tiles(jnp.pad(allowed, pad, constant_values=True)).all(axis=(3, 5))
  return BlockMask(tile_kinds(any_allowed, all_allowed), mask_mod, q_len, kv_len, block_q,
                   block_kv)
