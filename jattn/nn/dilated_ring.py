"""``DilatedRingAttention`` (Flax NNX): LongNet's multi-head dilated attention with the
sequence spread over the devices of a mesh axis (``jattn.parallel``'s dilated ring),
optionally over an image's tokens in Hilbert-curve order."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from jattn.gpu import select_backend
from jattn.nn.dilated import MultiheadDilatedAttention
from jattn.parallel import (hilbert_flatten, hilbert_permutation, hilbert_unflatten,
                            inverse_permutation, sharded_dilated_ring_attention)
from jattn.parallel.checks import mesh_axis_size


class DilatedRingAttention(MultiheadDilatedAttention):
  """Multi-head dilated attention whose sequence is sharded over ``mesh``'s
  ``axis_name`` (contiguous shards), computed by ``dilated_ring_attention``: pairs whose
  segments fit a shard need no communication, longer ones pass sparsified K/V around
  rings of devices. Same parameters as ``MultiheadDilatedAttention`` (its checkpoints
  load as they are) and the same result as it on one device.

  Args:
    embed_dim, num_heads, segment_lengths, dilation_rates: as
      ``MultiheadDilatedAttention``; each ``w_i`` must divide the per-device length,
      be a multiple of it, or cover the whole sequence.
    mesh: a ``jax.sharding.Mesh``; None runs on one device (no ring).
    axis_name: the mesh axis the sequence is split over.
    use_hilbert: reorder tokens along a generalized Hilbert curve (any height and
      width) before sharding and restore the order after, so each device holds a
      compact image region: inputs ``[batch, H, W, embed_dim]``, or ``[batch, H * W,
      embed_dim]`` row-major with ``grid=(H, W)``.
    grid: ``(H, W)`` of a flattened image, for ``use_hilbert`` with 3-D inputs.
    backend: ``None`` picks with ``jattn.gpu.select_backend("dilated_attention")``
      (the Pallas kernels on a GPU, else XLA); or ``"pallas_triton"`` / ``"xla"``.
    The other keywords go to ``MultiheadDilatedAttention`` (``num_kv_heads``,
    ``use_bias``, ``layer_norm``, ``layer_norm_eps``, ``gamma_init``, ``causal``,
    ``dtype``, ``param_dtype``, ``rngs``).
  """

  def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
               dilation_rates: Sequence[int], *, mesh=None, axis_name: str = "sp",
               use_hilbert: bool = False, grid: tuple[int, int] | None = None,
               backend: str | None = None, **kwargs):
    if mesh is not None:
      mesh_axis_size(mesh, axis_name)  # a ValueError naming the axis and the mesh's axes
    if grid is not None and not use_hilbert:
      raise ValueError("grid=(H, W) is only used with use_hilbert=True")
    if backend is None:
      backend = select_backend("dilated_attention", head_dim=embed_dim // num_heads)
    super().__init__(embed_dim, num_heads, segment_lengths, dilation_rates, backend=backend,
                     **kwargs)
    self.mesh, self.axis_name = mesh, axis_name
    self.use_hilbert, self.grid = use_hilbert, None if grid is None else tuple(grid)

  def _attend(self, q, k, v, causal: bool):
    if self.mesh is None:
      return super()._attend(q, k, v, causal)
    return sharded_dilated_ring_attention(
        q, k, v, mesh=self.mesh, axis_name=self.axis_name,
        segment_lengths=self.attention.segment_lengths,
        dilation_rates=self.attention.dilation_rates, causal=causal,
        scale=self.attention.scale, backend=self.attention.backend)

  def __call__(self, x, *, causal: bool | None = None):
    """Self-attention over ``x``: ``[batch, seq, embed_dim]``, or with ``use_hilbert``
    ``[batch, H, W, embed_dim]``. Returns the same shape, tokens in their original
    order."""
    if not self.use_hilbert:
      return super().__call__(x, causal=causal)
    if x.ndim == 4:
      return hilbert_unflatten(super().__call__(hilbert_flatten(x), causal=causal),
                               x.shape[1], x.shape[2])
    if self.grid is None:
      raise ValueError(f"use_hilbert with a [batch, seq, embed_dim] input needs grid=(H, W); "
                       f"got x of shape {x.shape}")
    height, width = self.grid
    if x.ndim != 3 or x.shape[1] != height * width:
      raise ValueError(f"x must be [batch, {height * width}, {self.embed_dim}] for grid "
                       f"{self.grid}, got {x.shape}")
    perm = hilbert_permutation(height, width)
    out = super().__call__(jnp.take(x, perm, axis=1), causal=causal)
    return jnp.take(out, inverse_permutation(perm), axis=1)
