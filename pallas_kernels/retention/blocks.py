"""Block specs and the Triton launch shared by the retention kernels.

The tiled kernels run on a grid ``(tiles, batch, heads)`` over ``[batch, seq, heads, d]``
arrays; the per-head decay ``log2 γ`` reaches each program as a one-element block.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

HEAD_SCALAR = pl.BlockSpec((1,), lambda i, b, h: (h,))


def tile_spec(block: int, d: int):
  """Tile ``i`` of ``block`` positions of one (batch, head)."""
  return pl.BlockSpec((None, block, None, d), lambda i, b, h: (b, i, h, 0))


def whole_sequence_spec(length: int, d: int):
  """The whole sequence of one (batch, head), for any tile."""
  return pl.BlockSpec((None, length, None, d), lambda i, b, h: (b, 0, h, 0))


def triton_call(kernel, *, grid, in_specs, out_specs, out_shape, name: str, interpret: bool,
                num_warps: int, num_stages: int, input_output_aliases=None):
  """``pl.pallas_call`` lowered through Triton with these launch parameters."""
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name,
                        input_output_aliases=input_output_aliases or {},
                        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                             num_stages=num_stages))
