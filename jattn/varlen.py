"""``jattn.flash_attention_varlen``: flash attention over packed sequences of different
lengths, addressed by cumulative lengths (FlashAttention's ``varlen`` API).

Implementations: ``pallas_mosaic`` (Hopper: the flash kernels on one batch row, the
sequences as segment ids with exact block ranges, where queries and keys are packed
alike; else on the sequences gathered into a batch with per-row lengths),
``pallas_triton`` (the flash kernels on ``PackedRows``: one program
per (sequence, query tile, head), its rows sliced from the packed arrays, its stores
masked to its sequence; tiles past a sequence's length do nothing, so the cost follows
the real lengths) and ``xla`` (``reference.flash_attention_varlen_reference``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.op import MosaicImpl, Op, XlaImpl
from jattn.core.sharding import PER_Q_HEAD, REPLICATED, Axes, ShardRule
from jattn.core.validation import (check_array, check_flag, check_heads, check_positive_int,
                                   check_same_dtype, check_shape, positive_number, scale_of,
                                   window_arg)
from jattn.flash import (AttentionTritonImpl, ServingProblem, flash_cache_key, mosaic_budget,
                         sink_arg, sink_grad, softmax_outputs)
from jattn.kernels.common.config import default_block_config
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, backward_delta, floor_sinks
from jattn.kernels.common.tiling import packed_positions, round_up
from jattn.kernels.flash import (MosaicBlockConfig, default_mosaic_config, flash_mosaic_backward,
                                 flash_mosaic_forward)
from jattn.kernels.flash.config import mosaic_backward_runs
from jattn.kernels.hopper.budget import MOSAIC_BLOCK
from jattn.kernels.hopper.inputs import PositionInputs
from jattn.kernels.flash.triton import flash_triton_varlen_backward, flash_triton_varlen_forward
from jattn.reference import flash_attention_varlen_reference


@dataclasses.dataclass(frozen=True)
class VarlenProblem(ServingProblem):
  """A varlen call: ``batch`` counts sequences, ``q_len`` / ``kv_len`` are the
  ``max_seqlen``s, ``total_q`` / ``total_k`` the packed rows."""

  total_q: int = 1
  total_k: int | None = None  # default total_q
  same_packing: bool = False  # queries and keys packed alike (self-attention)

  def __post_init__(self):
    super().__post_init__()
    if self.total_k is None:
      self._set(total_k=self.total_q)


def _check_cu(name: str, cu, total: int) -> None:
  """``[seqs + 1]`` integers; where their values are known, from 0, non-decreasing, at
  most ``total``."""
  if not hasattr(cu, "shape") or cu.ndim != 1 or cu.shape[0] < 2:
    raise ValueError(f"{name} must be [num_seqs + 1] integers, got "
                     f"{getattr(cu, 'shape', type(cu).__name__)}")
  if not jnp.issubdtype(cu.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got dtype {cu.dtype}")
  if isinstance(cu, jax.core.Tracer):
    return
  values = np.asarray(cu)
  if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] > total:
    raise ValueError(f"{name} must run from 0, never decreasing, to at most the "
                     f"{total} packed rows, got {values.tolist()}")


def _same(a, b) -> bool:
  """Whether two cumulative-length arrays are known to be equal: one array, or equal
  values where they are concrete."""
  if a is b:
    return True
  if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
    return False
  return a.shape == b.shape and bool(np.all(np.asarray(a) == np.asarray(b)))


class TritonVarlen(AttentionTritonImpl):
  def cache_key(self, p):  # (its lengths: the longest sequences')
    return flash_cache_key(p)

  def heuristic_config(self, p, info):
    return default_block_config(max(p.head_dims), p.dtype.itemsize)

  def forward(self, call, q, k, v, cu_q, cu_k, sinks):
    p = call.problem
    o, lse = flash_triton_varlen_forward(
        q, k, v, cu_q, cu_k, max_q=p.q_len, max_k=p.kv_len, causal=p.causal, scale=p.scale,
        local_window=p.local_window, softcap=p.softcap, config=call.config,
        interpret=call.interpret, sinks=sinks)
    return (o, lse), ((q, k, v, cu_q, cu_k, sinks), o, lse)

  def backward(self, call, residuals, cotangents):
    p = call.problem
    (q, k, v, cu_q, cu_k, sinks), o, lse = residuals
    dq, dk, dv = flash_triton_varlen_backward(
        q, k, v, cu_q, cu_k, o, lse, *cotangents, max_q=p.q_len, max_k=p.kv_len,
        causal=p.causal, scale=p.scale, local_window=p.local_window, softcap=p.softcap,
        config=call.config, interpret=call.interpret)
    return dq, dk, dv, None, None, _sink_grad(sinks, o, lse, cotangents)


def packed_ids(cu, total: int, max_len: int, missing: int):
  """``[1, total]`` int32: each row's sequence, ``missing`` for rows no sequence holds
  (or past ``max_len`` in its sequence): the segment ids of packed sequences."""
  seq, _, valid = packed_positions(cu, total, max_len)
  return jnp.where(valid, seq, missing)[None]


def _row_lengths(cu, max_len: int):
  """``[num_seqs]`` int32: each sequence's length, cut to ``max_len``."""
  return jnp.minimum(jnp.diff(cu), max_len)


def to_batch(x, cu, max_len: int):
  """Packed rows ``[total, ...]`` -> ``[num_seqs, max_len, ...]``: sequence ``s``'s first
  ``max_len`` rows, zeros past its length."""
  rows = cu[:-1, None] + jnp.arange(max_len, dtype=jnp.int32)[None]
  inside = jnp.arange(max_len)[None] < _row_lengths(cu, max_len)[:, None]
  gathered = x[jnp.clip(rows, 0, x.shape[0] - 1)]
  return jnp.where(inside.reshape(inside.shape + (1,) * (x.ndim - 1)), gathered, 0)


def to_packed(x, cu, total: int, max_len: int):
  """``[num_seqs, max_len, ...]`` -> packed rows ``[total, ...]`` (``to_batch``'s
  inverse): rows no sequence holds within ``max_len`` are zeros."""
  seq, local, valid = packed_positions(cu, total, max_len)
  gathered = x[seq, jnp.minimum(local, max_len - 1)]
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), gathered, 0)


# The most padding (gathered rows / packed rows) at which "auto" gathers packings that
# differ into a batch for the Hopper kernels.
GATHER_MAX_PADDING = 2


class MosaicVarlen(MosaicImpl):
  """The Hopper flash kernels on packed sequences, two ways:

  - queries and keys packed alike (self-attention: one ``cu_seqlens``, equal
    ``max_seqlen``s and row counts): the packing as one batch row, the sequences as
    segment ids with exact block ranges (``hopper.inputs.packed_ranges``), so the
    tiles inside one sequence run unmasked and nothing is copied;
  - otherwise: the sequences gathered into a ``[num_seqs, max_seqlen, ...]`` batch
    with per-row lengths (causal bottom-right on each), whose tiles past a row's
    length are skipped; the copies cost ``num_seqs * max_seqlen`` rows of memory.
  """

  config_cls = MosaicBlockConfig

  def gaps(self, p):
    return super().gaps(p) + tuple(name for name, used in (
        ("head dims its backward does not take", not mosaic_backward_runs(*p.head_dims)),
    ) if used)

  def auto_passes_over(self, p):
    # The gathered batch holds num_seqs * max_seqlen rows, however short the others,
    # and its query rows run in tiles of at least 2 x 64. Where that stays within twice
    # the packed rows it ran faster than the Triton kernels on packed rows; with more
    # padding, no faster, on more memory (docs/backends.md, measured).
    if self.one_row(p):
      return None
    padded = max(p.batch * round_up(p.q_len, 2 * MOSAIC_BLOCK) / max(p.total_q, 1),
                 p.batch * p.kv_len / max(p.total_k, 1))
    if padded > GATHER_MAX_PADDING:
      return (f"not one packing of queries and keys, and gathering the sequences would "
              f"hold {padded:.1f}x the packed rows (more than {GATHER_MAX_PADDING}x)")
    return None

  @staticmethod
  def one_row(p) -> bool:
    """Whether the packing runs as one batch row (queries and keys packed alike)."""
    return p.same_packing and p.q_len == p.kv_len and p.total_q == p.total_k

  def heuristic_config(self, p, info):
    config = default_mosaic_config(*p.head_dims)
    # Sequence starts fall inside key tiles, which then run masked: the dQ kernel's
    # narrower key tiles waste less on them (docs/backends.md, measured).
    return dataclasses.replace(config, block_kv_dq=64) if self.one_row(p) else config

  def _vectors(self, p) -> tuple[int, int]:
    return PositionInputs(segments=self.one_row(p)).vectors  # the sequences as segment ids

  def fits(self, config, p, info, kernels=()):
    return mosaic_budget(config, p.head_dims, p.dtype.itemsize,
                         kernels or ("forward", "dQ", "dK/dV"), info, self._vectors(p))

  def compile_misfit(self, config, p, info):
    return mosaic_budget(config, p.head_dims, p.dtype.itemsize, ("forward", "dQ", "dK/dV"),
                         info, self._vectors(p), registers=False)

  def _segments(self, p, cu):
    return packed_ids(cu, p.total_q, p.q_len, -1), packed_ids(cu, p.total_k, p.kv_len, -2)

  def _batch(self, p, q, k, v, cu_q, cu_k):
    """The padded batch's ``q, k, v`` and per-row lengths ``[num_seqs, 2]``."""
    lengths = jnp.stack([_row_lengths(cu_q, p.q_len), _row_lengths(cu_k, p.kv_len)], axis=1)
    return (to_batch(q, cu_q, p.q_len), to_batch(k, cu_k, p.kv_len),
            to_batch(v, cu_k, p.kv_len), lengths)

  def forward(self, call, q, k, v, cu_q, cu_k, sinks):
    p = call.problem
    options = dict(causal=p.causal, scale=p.scale, local_window=p.local_window,
                   softcap=p.softcap, config=call.config, sinks=sinks)
    if self.one_row(p):
      o, lse = flash_mosaic_forward(q[None], k[None], v[None], *self._segments(p, cu_q),
                                    packed=(cu_q, p.q_len), **options)
      o, lse = o[0], lse[0]
    else:
      qb, kb, vb, lengths = self._batch(p, q, k, v, cu_q, cu_k)
      o, lse = flash_mosaic_forward(qb, kb, vb, None, None, lengths=lengths, **options)
      o = to_packed(o, cu_q, p.total_q, p.q_len)
      lse = to_packed(jnp.swapaxes(lse, 1, 2), cu_q, p.total_q, p.q_len).T
    # Rows no sequence holds see no key (with sinks, only the sink).
    valid = packed_positions(cu_q, p.total_q, p.q_len)[2]
    empty = EMPTY_ROW_LSE if sinks is None else floor_sinks(sinks)[:, None]
    lse = jnp.where(valid[None], lse, empty)
    return (o, lse), ((q, k, v, cu_q, cu_k, sinks), o, lse)

  def backward(self, call, residuals, cotangents):
    p = call.problem
    (q, k, v, cu_q, cu_k, sinks), o, lse = residuals
    options = dict(causal=p.causal, scale=p.scale, local_window=p.local_window,
                   softcap=p.softcap, config=dataclasses.replace(call.config, fused_dq=False))
    do, dlse = cotangents
    if self.one_row(p):
      dq, dk, dv = flash_mosaic_backward(q[None], k[None], v[None], *self._segments(p, cu_q),
                                         o[None], lse[None], do[None], dlse[None],
                                         packed=(cu_q, p.q_len), **options)
      dq, dk, dv = dq[0], dk[0], dv[0]
    else:
      qb, kb, vb, lengths = self._batch(p, q, k, v, cu_q, cu_k)
      rows = lambda x: to_batch(x, cu_q, p.q_len)
      stat_rows = lambda x: jnp.swapaxes(rows(x.T), 1, 2)  # [heads, total] -> [seqs, heads, len]
      dq, dk, dv = flash_mosaic_backward(qb, kb, vb, None, None, rows(o), stat_rows(lse),
                                         rows(do), stat_rows(dlse), lengths=lengths, **options)
      dq = to_packed(dq, cu_q, p.total_q, p.q_len)
      dk, dv = (to_packed(x, cu_k, p.total_k, p.kv_len) for x in (dk, dv))
    return (dq, dk, dv, None, None, _sink_grad(sinks, o, lse, cotangents))


def _sink_grad(sinks, o, lse, cotangents):
  """The sinks' gradient from packed rows' ``o [total, heads, dv]``, ``lse [heads,
  total]`` (None without sinks)."""
  if sinks is None:
    return None
  delta = backward_delta(o[None], cotangents[0][None], cotangents[1][None])
  return sink_grad(sinks, lse[None], delta)


class XlaVarlen(XlaImpl):
  def forward(self, call, q, k, v, cu_q, cu_k, sinks):
    p = call.problem
    return flash_attention_varlen_reference(
        q, k, v, cu_q, cu_k, max_seqlen_q=p.q_len, max_seqlen_k=p.kv_len, causal=p.causal,
        scale=p.scale, local_window=p.local_window, softcap=p.softcap, sinks=sinks), None


class FlashVarlen(Op):
  name = "flash_attention_varlen"
  problem_cls = VarlenProblem
  arg_names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks")
  diff_argnums = (0, 1, 2, 5)

  def shard_rule(self, p: VarlenProblem) -> ShardRule:
    # Packed rows have no batch axis: the sequences split over heads only.
    rows, kv_rows = Axes(heads=1), Axes(heads=1, kv=True)
    return ShardRule((rows, kv_rows, kv_rows, REPLICATED, REPLICATED, PER_Q_HEAD),
                     (rows, Axes(heads=0)), p.q_heads // p.kv_heads)

  def bind(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
           causal=False, scale=None, local_window=None, softcap=None, sinks=None,
           return_lse=False):
    check_array("q", q, "total_q, q_heads, head_dim")
    check_array("k", k, "total_k, kv_heads, head_dim")
    check_array("v", v, "total_k, kv_heads, head_dim_v")
    check_same_dtype(q=q, k=k, v=v)
    total_q, q_heads, head_dim = q.shape
    check_shape("k", k, (None, None, head_dim), "total_k, kv_heads, head_dim")
    check_shape("v", v, tuple(k.shape[:2]) + (None,), "total_k, kv_heads, head_dim_v")
    check_heads(q_heads, k.shape[1])
    _check_cu("cu_seqlens_q", cu_seqlens_q, total_q)
    _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    check_shape("cu_seqlens_k", cu_seqlens_k, tuple(cu_seqlens_q.shape), "num_seqs + 1")
    check_positive_int("max_seqlen_q", max_seqlen_q)
    check_positive_int("max_seqlen_k", max_seqlen_k)
    problem = VarlenProblem(
        batch=cu_seqlens_q.shape[0] - 1, q_len=int(max_seqlen_q), kv_len=int(max_seqlen_k),
        q_heads=q_heads, kv_heads=k.shape[1], head_dim=head_dim, dtype=q.dtype,
        scale=scale_of(scale, head_dim), total_q=total_q, total_k=k.shape[0],
        causal=check_flag("causal", causal),
        local_window=None if local_window is None else window_arg(local_window),
        softcap=None if softcap is None else positive_number("softcap", softcap),
        sinks=sinks is not None, value_head_dim=v.shape[-1],
        return_lse=check_flag("return_lse", return_lse),
        same_packing=_same(cu_seqlens_q, cu_seqlens_k))
    return problem, (q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32),
                     sink_arg(sinks, q_heads))

  def finish(self, problem, outputs):
    return softmax_outputs(problem, outputs)

  def example(self, p: VarlenProblem, key):
    kq, kk, kv, kl = jax.random.split(key, 4)
    q = jax.random.normal(kq, (p.total_q, p.q_heads, p.head_dim)).astype(p.dtype)
    k = jax.random.normal(kk, (p.total_k, p.kv_heads, p.head_dim)).astype(p.dtype)
    v = jax.random.normal(kv, (p.total_k, p.kv_heads, p.value_head_dim)).astype(p.dtype)
    cuts = jnp.sort(jax.random.randint(kl, (p.batch - 1,), 0, p.total_q + 1))
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), cuts.astype(jnp.int32),
                          jnp.full((1,), p.total_q, jnp.int32)])
    return q, k, v, cu, cu if p.total_k == p.total_q else cu * p.total_k // p.total_q, None


VARLEN = FlashVarlen(MosaicVarlen(), TritonVarlen(), XlaVarlen())


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                           max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                           local_window=None, softcap: float | None = None, sinks=None,
                           return_lse: bool = False, backend: str = "auto", config=None):
  """Flash attention over packed sequences of different lengths, differentiable.

  Args:
    q: ``[total_q, q_heads, head_dim]``; k: ``[total_k, kv_heads, head_dim]``; v:
      ``[total_k, kv_heads, head_dim_v]``: the sequences' rows one after another.
    cu_seqlens_q, cu_seqlens_k: ``[num_seqs + 1]`` integers (traced: one compile
      serves every packing of as many sequences), from 0, never decreasing: sequence
      ``s`` is rows ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])`` of q and
      ``[cu_seqlens_k[s], cu_seqlens_k[s + 1])`` of k, v. Sequences are independent;
      rows past ``cu_seqlens_q[-1]`` are padding (zeros).
    max_seqlen_q, max_seqlen_k: Python ints at least the longest sequence's lengths
      (they size the kernels' grids); a longer sequence is cut to them (its rows past
      ``max_seqlen_q`` give zeros, its keys past ``max_seqlen_k`` are not seen).
    causal: within each sequence, aligned bottom-right on its own lengths: query ``i``
      sits at key position ``i + len_k - len_q``.
    scale, local_window, softcap, sinks: as ``flash_attention``'s.
    return_lse: also return ``lse: [q_heads, total_q]`` float32.
    backend: ``"auto"``, ``"pallas_mosaic"`` (Hopper, 16-bit; fastest with queries and
      keys packed alike: one array passed as both ``cu_seqlens``, equal ``max_seqlen``s
      and row counts, where a non-finite value in one sequence's keys or values can
      reach the others that share its tiles, as with ``flash_attention``'s segment ids
      on Hopper; other packings are gathered into a ``[num_seqs, max_seqlen]`` batch,
      which ``"auto"`` does while it holds at most twice the packed rows),
      ``"pallas_triton"`` or ``"xla"``.
    config: a ``BlockConfig`` for ``pallas_triton``, a ``MosaicBlockConfig`` for
      ``pallas_mosaic``.

  Returns:
    ``o: [total_q, q_heads, head_dim_v]`` in q's dtype (and ``lse``). Gradients flow to
    q, k, v and sinks.
  """
  return VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, local_window=local_window,
                softcap=softcap, sinks=sinks, return_lse=return_lse, backend=backend,
                config=config)
