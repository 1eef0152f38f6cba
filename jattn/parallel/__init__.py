"""Attention over a sequence sharded across devices (inside ``shard_map``).

- ``ring_attention`` / ``sharded_ring_attention``: exact full attention, K/V shards
  passed around a ring with ``jax.lax.ppermute`` (``ring``).
- ``dilated_ring_attention`` / ``sharded_dilated_ring_attention``: LongNet's dilated
  attention, each device exchanging only the sparsified K/V of the segments it
  shares with others (``dilated_ring``).
"""

from jattn.parallel.ring import (LAYOUTS, ring_attention, sharded_ring_attention, zigzag_order,
                                 zigzag_restore)

__all__ = ["LAYOUTS", "ring_attention", "sharded_ring_attention", "zigzag_order",
           "zigzag_restore"]
