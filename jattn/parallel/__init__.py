"""Attention over a sequence sharded across devices (inside ``shard_map``).

- ``ring_attention`` / ``sharded_ring_attention``: exact full attention, K/V shards
  passed around a ring with ``jax.lax.ppermute`` (``ring``), or all-gathered in one
  collective (``kv_exchange="allgather"``, ``allgather``).
- ``dilated_ring_attention`` / ``sharded_dilated_ring_attention``: LongNet's dilated
  attention, each device exchanging only the sparsified K/V of the segments it
  shares with others (``dilated_ring``).
- ``hilbert_flatten`` / ``hilbert_unflatten``: an image's tokens in the order of a
  generalized Hilbert curve (any height and width), so that contiguous shards of the
  sequence are compact image regions (``hilbert``).
"""

from jattn.parallel.dilated_ring import (dilated_ring_attention,
                                         sharded_dilated_ring_attention)
from jattn.parallel.hilbert import (hilbert_curve, hilbert_flatten, hilbert_permutation,
                                    hilbert_unflatten, inverse_permutation)
from jattn.parallel.layout import (LAYOUTS, segment_zigzag_order, segment_zigzag_restore,
                                   zigzag_order, zigzag_restore)
from jattn.parallel.ring import KV_EXCHANGES, ring_attention, sharded_ring_attention

__all__ = ["KV_EXCHANGES", "LAYOUTS", "dilated_ring_attention", "hilbert_curve",
           "hilbert_flatten", "hilbert_permutation", "hilbert_unflatten", "inverse_permutation",
           "ring_attention", "segment_zigzag_order", "segment_zigzag_restore",
           "sharded_dilated_ring_attention", "sharded_ring_attention", "zigzag_order",
           "zigzag_restore"]
