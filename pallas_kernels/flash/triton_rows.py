"""Where the Triton flash kernels' rows lie: the layout of Q, K, V and their outputs.

- ``BatchRows`` (``flash_attention``): ``[batch, seq, heads, d]``, a batch row per
  sequence; block specs hand each program its tiles, and per-row lengths (where the
  mask spec has them) come as a ``[batch, 2]`` array.
- ``PackedRows`` (``flash_attention_varlen``): ``[total, heads, d]``, sequences packed
  one after another, sequence ``s`` in rows ``[cu[s], cu[s + 1])`` (``cu`` a ``[seqs + 1,
  2]`` int32 array of the queries' and the keys' cumulative lengths); the grid's batch
  axis counts sequences, a program slices its rows from the whole arrays, and stores
  only its sequence's rows.

A layout's ``bind(spec, ref, seq)`` (in a kernel, ``ref`` the lengths or cumulative
lengths) gives the program's mask spec and its bound rows, whose methods read tiles
(``q_tile``, ``q_stat``, ``kv_tile``, ``q_rows``, ``stat_rows``, ``key_tile``) and store them
(``store``, ``store_keys``). Tile starts and row slices are in the sequence's own
positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jattn.kernels.common.masking import MaskSpec, bind_lengths


def _within(row, size: int, rows: int):
  """``pl.ds(row, size)`` kept inside ``rows``: only a tile past its sequence's end (no
  row of it real: its loads unused, its stores all masked) can reach past the padded
  arrays, whose loads are not bounds-checked on a GPU."""
  return pl.ds(jnp.minimum(row, rows - size), size)


def _shifted(rows, first, extent: int):
  """The slice ``rows`` (a ``pl.ds``) moved by ``first`` rows, within ``extent``."""
  return _within(first + rows.start, rows.size, extent)


def _at(first, start, size: int, extent: int):
  """Rows ``[first + start, ... + size)`` within ``extent`` (``start`` a program id's
  multiple: int64 in interpret mode with x64, where a slice's indices share one dtype)."""
  return _within(first + start.astype(jnp.int32), size, extent)


@dataclasses.dataclass(frozen=True)
class BatchRows:
  """``[batch, seq, heads, d]``: the program's query (key) tile is its block-spec ref;
  keys (queries, in the dK/dV pass) the whole sequence of its batch row."""

  def bind(self, spec: MaskSpec, lengths_ref, seq):
    del seq
    return bind_lengths(spec, lengths_ref), self

  def q_tile(self, ref, start, size: int):
    return ref[...]

  def q_stat(self, ref, start, size: int):
    return ref[...]

  def kv_tile(self, ref, rows):
    return ref[rows, :]

  def store(self, ref, start, x):
    ref[...] = x

  def q_rows(self, ref, rows, head):
    return ref[rows, head, :]

  def stat_rows(self, ref, head, rows):
    return ref[head, rows]

  def key_tile(self, ref, start, size: int):
    return ref[...]

  def store_keys(self, ref, start, x):
    ref[...] = x


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """``[total, heads, d]`` with sequences packed; ``max_q`` / ``max_k`` bound the
  lengths (a longer sequence's rows past them are not computed)."""

  max_q: int
  max_k: int

  def bind(self, spec: MaskSpec, cu_ref, seq):
    # (int32 indices throughout: program ids and literals are int64 in interpret mode
    # with x64, and a load's indices must share one dtype)
    seq, col_q, col_k = seq.astype(jnp.int32), jnp.int32(0), jnp.int32(1)
    q0, q1 = cu_ref[seq, col_q], cu_ref[seq + 1, col_q]
    k0, k1 = cu_ref[seq, col_k], cu_ref[seq + 1, col_k]
    q_len = jnp.minimum(q1 - q0, self.max_q)
    kv_len = jnp.minimum(k1 - k0, self.max_k)
    return spec.with_lengths(q_len, kv_len), _BoundPacked(q0, k0, q_len, kv_len)


@dataclasses.dataclass(frozen=True)
class _BoundPacked:
  q0: Any
  k0: Any
  q_len: Any
  kv_len: Any

  def q_tile(self, ref, start, size: int):
    return ref[_at(self.q0, start, size, ref.shape[0]), :]

  def q_stat(self, ref, start, size: int):
    return ref[_at(self.q0, start, size, ref.shape[0])]

  def kv_tile(self, ref, rows):
    return ref[_shifted(rows, self.k0, ref.shape[0]), :]

  def _store(self, ref, first, start, length, x):
    """Stores rows ``[start, start + rows)`` of a sequence, those below ``length``."""
    rows = x.shape[0] if x.ndim == 2 else x.shape[-1]
    valid = start + lax.broadcasted_iota(jnp.int32, (rows,), 0) < length
    # (the other axes' slices spelled out in int32: left implicit, interpret mode takes
    # them as int64 with x64 and fails)
    whole = tuple(pl.ds(jnp.int32(0), n) for n in ref.shape[1:])
    at = ref.at[(_at(first, start, rows, ref.shape[0]),) + whole]
    plgpu.store(at, x, mask=valid[:, None] if x.ndim == 2 else valid)

  def store(self, ref, start, x):
    self._store(ref, self.q0, start, self.q_len, x)

  def q_rows(self, ref, rows, head):
    return ref[_shifted(rows, self.q0, ref.shape[0]), jnp.int32(head), :]

  def stat_rows(self, ref, head, rows):
    return ref[jnp.int32(head), _shifted(rows, self.q0, ref.shape[-1])]

  def key_tile(self, ref, start, size: int):
    return ref[_at(self.k0, start, size, ref.shape[0]), :]

  def store_keys(self, ref, start, x):
    self._store(ref, self.k0, start, self.kv_len, x)


BATCH_ROWS = BatchRows()

