"""The Triton launch every Triton-lowered kernel here goes through, and the block
specs the ``(tiles, batch, heads)`` grids over ``[batch, seq, heads, d]`` arrays share."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The per-head scalar (e.g. log2 of a retention decay) as a one-element block.
HEAD_SCALAR = pl.BlockSpec((1,), lambda i, b, h: (h,))


# A ``[batch, 2]`` int32 array's row of the program's batch row: its (q_len, kv_len).
LENGTHS = pl.BlockSpec((None, 2), lambda i, b, h: (b, 0))
# A program's row of ``masking.segment_block_ranges(..., uniform=True)``: its tile's
# ``(first, full_lo, full_hi, end)`` in its batch row (grid: tile, batch row, head).
SEGMENT_RANGE = pl.BlockSpec((None, None, 4), lambda t, b, h: (b, t, 0))


def tile_spec(block: int, d: int):
  """Tile ``i`` of ``block`` positions of one (batch, head)."""
  return pl.BlockSpec((None, block, None, d), lambda i, b, h: (b, i, h, 0))


def last_first(spec: pl.BlockSpec, tiles: int) -> pl.BlockSpec:
  """``spec`` on a ``(tiles, ...)`` grid launched last tile first (``tile_last_first``
  in the kernel): under a causal mask a query tile's work grows with its index, and the
  heaviest tiles starting first leave the lightest to fill the last wave."""
  return pl.BlockSpec(spec.block_shape, lambda i, *rest: spec.index_map(tiles - 1 - i, *rest))


def tile_last_first():
  """Inside a kernel on a ``last_first`` grid: the program's tile."""
  return pl.num_programs(0) - 1 - pl.program_id(0)


def whole_sequence_spec(length: int, d: int, group: int = 1):
  """The whole sequence of one (batch, head), for any tile; with ``group > 1`` the
  kv head ``h // group`` of query head ``h`` (grouped-query attention)."""
  return pl.BlockSpec((None, length, None, d), lambda i, b, h: (b, 0, h // group, 0))


def row_stat_spec(block: int):
  """Tile ``i`` of a ``[batch, heads, seq]`` row statistic (lse, delta)."""
  return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))


def triton_call(kernel, *, grid, in_specs, out_specs, out_shape, name: str, interpret: bool,
                num_warps: int, num_stages: int, input_output_aliases=None):
  """``pl.pallas_call`` lowered through Triton with these launch parameters."""
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name,
                        input_output_aliases=input_output_aliases or {},
                        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                             num_stages=num_stages))


def whole_array_spec(x):
  """All of ``x`` for every program (an array a score or mask function reads)."""
  return pl.BlockSpec(x.shape, lambda *program: (0,) * x.ndim)
