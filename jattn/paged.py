"""``jattn.paged_attention`` and ``jattn.write_kv_pages``: attention over a paged KV
cache (vLLM's layout), for serving many sequences of different lengths from one pool
of pages.

The cache is a pool of pages ``[num_pages, page_size, kv_heads, head_dim]`` and a
block table per sequence: key ``t`` of sequence ``b`` lies in page ``block_tables[b, t
// page_size]``, slot ``t % page_size``. Implementations: ``pallas_mosaic`` (the
Hopper decode kernel, TMA copies through the block table: pages a multiple of 64),
``pallas_triton`` (the split-KV decode kernel reading K/V through the block table,
any page size: ``jattn.kernels.flash.triton_decode``) and ``xla`` (the pages gathered into a
contiguous cache, then the flash reference). Forward only: a serving op.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.op import Impl, MosaicImpl, Op, TritonImpl, XlaImpl
from jattn.core.sharding import PER_Q_HEAD, PER_ROW, Q_HEADS, ROW_STATS, Axes, ShardRule
from jattn.core.validation import (check_array, check_flag, check_heads, check_integer_array,
                                   check_same_dtype, check_shape, positive_number, scale_of,
                                   window_arg)
from jattn.flash import (ServingProblem, decode_forward, hopper_decodes, row_lengths, sink_arg,
                         softmax_outputs)
from jattn.kernels.flash.mosaic_decode import mosaic_decode_runs
from jattn.reference import flash_attention_reference

NO_GRADIENT = ("paged_attention has no gradient (it serves a cache); train with "
               "flash_attention(..., kv_lengths=...) on contiguous keys")


@dataclasses.dataclass(frozen=True)
class PagedProblem(ServingProblem):
  """A paged-attention call: ``kv_len`` is the block table's capacity
  (``pages_per_seq * page_size``)."""

  page_size: int = 16
  num_pages: int = 1

  @property
  def pages_per_seq(self) -> int:
    return -(-self.kv_len // self.page_size)


class _ForwardOnly(Impl):
  """An implementation whose backward is a clear error (not autodiff of a kernel)."""

  has_backward = True

  def backward(self, call, residuals, cotangents):
    raise NotImplementedError(NO_GRADIENT)


class MosaicPaged(_ForwardOnly, MosaicImpl):
  """The Hopper decode kernel reading K/V by TMA through the block table: pages a
  multiple of its 64-key tiles; where the Triton kernel is the faster
  (``flash.hopper_decodes``), that one."""

  def gaps(self, p):
    runs = mosaic_decode_runs(p.q_heads, p.kv_heads, p.head_dims, p.page_size)
    return super().gaps(p) + (() if runs else (
        "page sizes that are not a multiple of 64, query heads per KV head that do not "
        "divide 64, or head dims not a multiple of 64 or past 384",))

  def forward(self, call, q, k_pages, v_pages, tables, lengths, sinks):
    p = call.problem
    return decode_forward(p, q, k_pages, v_pages, lengths, sinks,
                          hopper=hopper_decodes(p, p.page_size), interpret=call.interpret,
                          block_tables=tables), None


class TritonPaged(_ForwardOnly, TritonImpl):
  def forward(self, call, q, k_pages, v_pages, tables, lengths, sinks):
    return decode_forward(call.problem, q, k_pages, v_pages, lengths, sinks, hopper=False,
                          interpret=call.interpret, block_tables=tables), None


def gather_pages(pages, block_tables):
  """``[num_pages, page_size, kv_heads, d]`` pages as a contiguous ``[batch,
  pages_per_seq * page_size, kv_heads, d]`` cache (page ids clamped into the pool)."""
  tables = jnp.clip(block_tables, 0, pages.shape[0] - 1)
  batch, per_seq = tables.shape
  return pages[tables].reshape(batch, per_seq * pages.shape[1], *pages.shape[2:])


class XlaPaged(_ForwardOnly, XlaImpl):
  def forward(self, call, q, k_pages, v_pages, tables, lengths, sinks):
    p = call.problem
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)
    out = flash_attention_reference(q, k, v, causal=p.causal, scale=p.scale,
                                    local_window=p.local_window, softcap=p.softcap,
                                    sinks=sinks, guard_values=True, lengths=lengths)
    return out, None


class PagedAttention(Op):
  name = "paged_attention"
  problem_cls = PagedProblem
  arg_names = ("q", "k_pages", "v_pages", "block_tables", "lengths", "sinks")
  diff_argnums = ()  # a serving op: no gradient

  def shard_rule(self, p: PagedProblem) -> ShardRule:
    # The page pool has no batch axis: every batch shard reads its rows' pages from
    # the whole pool (held whole, split over KV heads only).
    pool = Axes(heads=2, kv=True)
    return ShardRule((Q_HEADS, pool, pool, PER_ROW, PER_ROW, PER_Q_HEAD), (Q_HEADS, ROW_STATS),
                     p.q_heads // p.kv_heads)

  def bind(self, q, k_pages, v_pages, block_tables, kv_lengths, *, q_lengths=None,
           causal=False, scale=None, softcap=None, local_window=None, sinks=None,
           return_lse=False):
    check_array("q", q, "batch, q_len, q_heads, head_dim")
    check_array("k_pages", k_pages, "num_pages, page_size, kv_heads, head_dim")
    check_array("v_pages", v_pages, "num_pages, page_size, kv_heads, head_dim_v")
    check_same_dtype(q=q, k_pages=k_pages, v_pages=v_pages)
    batch, q_len, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    check_shape("k_pages", k_pages, (None, None, None, head_dim),
                "num_pages, page_size, kv_heads, head_dim")
    check_shape("v_pages", v_pages, (num_pages, page_size, kv_heads, None),
                "num_pages, page_size, kv_heads, head_dim_v")
    check_heads(q_heads, kv_heads, kv_name="k_pages")
    check_integer_array("block_tables", block_tables, (batch, None), "batch, pages_per_seq")
    if kv_lengths is None:
      raise ValueError("kv_lengths must be [batch] integers (each sequence's cached keys), "
                       "got None")
    capacity = block_tables.shape[1] * page_size
    lengths = row_lengths(q_lengths, kv_lengths, batch, q_len, capacity)
    problem = PagedProblem(
        batch=batch, q_len=q_len, kv_len=capacity, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=q.dtype, scale=scale_of(scale, head_dim),
        page_size=page_size, num_pages=num_pages, causal=check_flag("causal", causal),
        local_window=None if local_window is None else window_arg(local_window),
        softcap=None if softcap is None else positive_number("softcap", softcap),
        sinks=sinks is not None, value_head_dim=v_pages.shape[-1],
        return_lse=check_flag("return_lse", return_lse))
    return problem, (q, k_pages, v_pages, block_tables.astype(jnp.int32), lengths,
                     sink_arg(sinks, q_heads))

  def finish(self, problem, outputs):
    return softmax_outputs(problem, outputs)

  def example(self, p: PagedProblem, key):
    kq, kk, kv, kt, kl = jax.random.split(key, 5)
    q = jax.random.normal(kq, (p.batch, p.q_len, p.q_heads, p.head_dim)).astype(p.dtype)
    pages = p.batch * p.pages_per_seq
    k = jax.random.normal(kk, (pages, p.page_size, p.kv_heads, p.head_dim)).astype(p.dtype)
    v = jax.random.normal(kv, (pages, p.page_size, p.kv_heads, p.value_head_dim)).astype(
        p.dtype)
    tables = jax.random.permutation(kt, pages).reshape(p.batch, p.pages_per_seq)
    lengths = jax.random.randint(kl, (p.batch,), p.q_len, p.kv_len + 1)
    return (q, k, v, tables.astype(jnp.int32),
            row_lengths(None, lengths, p.batch, p.q_len, p.kv_len), None)


PAGED = PagedAttention(MosaicPaged(), TritonPaged(), XlaPaged())


def paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, *, q_lengths=None,
                    causal: bool = False, scale: float | None = None,
                    softcap: float | None = None, local_window=None, sinks=None,
                    return_lse: bool = False, backend: str = "auto"):
  """Attention of a few new query positions per sequence against a paged KV cache.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``: each sequence's newest ``q_len``
      positions (1 for a decode step; more for speculative decoding or a chunk of a
      prefill).
    k_pages: ``[num_pages, page_size, kv_heads, head_dim]``; v_pages: ``[num_pages,
      page_size, kv_heads, head_dim_v]``: the pool of pages (any page size), q's dtype.
    block_tables: ``[batch, pages_per_seq]`` integers: key ``t`` of sequence ``b`` lies
      in page ``block_tables[b, t // page_size]``, slot ``t % page_size``. Entries past
      a sequence's pages are never read; an id outside the pool reads a page clamped
      into it (never out of bounds).
    kv_lengths: ``[batch]`` integers: each sequence's cached keys (the new ones
      included), clipped to ``[0, pages_per_seq * page_size]``.
    q_lengths: ``[batch]`` integers, or None (every row ``q_len``): query rows at or
      past a sequence's count are padding and give zeros.
    causal: query ``i`` of sequence ``b`` sits at key position ``i + kv_lengths[b] -
      q_lengths[b]`` and sees keys up to it (bottom-right alignment).
    scale, softcap, local_window, sinks: as ``flash_attention``'s.
    return_lse: also return ``lse: [batch, q_heads, q_len]`` float32.
    backend: ``"auto"``, ``"pallas_mosaic"`` (Hopper, 16-bit, pages a multiple of 64),
      ``"pallas_triton"`` or ``"xla"``.

  Returns:
    ``o: [batch, q_len, q_heads, head_dim_v]`` in q's dtype (and ``lse``). No
    gradient: differentiating it raises an error that says so.
  """
  return PAGED(q, k_pages, v_pages, block_tables, kv_lengths, q_lengths=q_lengths,
               causal=causal, scale=scale, softcap=softcap, local_window=local_window,
               sinks=sinks, return_lse=return_lse, backend=backend)


def write_kv_pages(k_pages, v_pages, k_new, v_new, block_tables, positions, num_new=None):
  """Writes new tokens' keys and values into their sequences' pages.

  Args:
    k_pages, v_pages: the pools, ``[num_pages, page_size, kv_heads, head_dim(_v)]``.
    k_new, v_new: ``[batch, new_tokens, kv_heads, head_dim(_v)]``.
    block_tables: ``[batch, pages_per_seq]`` integers (as ``paged_attention``'s).
    positions: ``[batch]`` integers: where each sequence's new tokens start (its
      cached length before them).
    num_new: ``[batch]`` integers, or None (all ``new_tokens``): how many of a
      sequence's new tokens to write (the rest are padding).

  Returns:
    The updated ``(k_pages, v_pages)``. Jitted; donate the pools (``jax.jit(...,
    donate_argnums=(0, 1))`` around a step) and the update happens in place. Tokens
    past a sequence's block table, or past ``num_new``, or whose table entry is not a
    page of the pool (a negative id, say), are not written. Two tokens must not write
    one slot of one page (rows sharing a page they write, a table listing a page twice):
    which write lands would be unspecified. Checked where the tables, positions and
    ``num_new`` are concrete; under ``jit`` that is the caller's to keep.
  """
  check_array("k_pages", k_pages, "num_pages, page_size, kv_heads, head_dim")
  check_array("v_pages", v_pages, "num_pages, page_size, kv_heads, head_dim_v")
  check_array("k_new", k_new, "batch, new_tokens, kv_heads, head_dim")
  check_shape("k_new", k_new, (None, None) + tuple(k_pages.shape[2:]),
              "batch, new_tokens, kv_heads, head_dim")
  check_shape("v_new", v_new, tuple(k_new.shape[:2]) + tuple(v_pages.shape[2:]),
              "batch, new_tokens, kv_heads, head_dim_v")
  check_integer_array("block_tables", block_tables, (k_new.shape[0], None),
                      "batch, pages_per_seq")
  check_integer_array("positions", positions, (k_new.shape[0],), "batch")
  if num_new is not None:
    check_integer_array("num_new", num_new, (k_new.shape[0],), "batch")
  if not any(isinstance(x, jax.core.Tracer) for x in (block_tables, positions, num_new)):
    _check_distinct_slots(np.asarray(block_tables), np.asarray(positions),
                          None if num_new is None else np.asarray(num_new),
                          k_new.shape[1], *k_pages.shape[:2])
  return _write_pages(k_pages, v_pages, k_new, v_new, block_tables, positions, num_new)


def _write_targets(xp, tables, positions, num_new, new_tokens: int, num_pages: int,
                   page_size: int):
  """Where ``_write_pages`` puts each new token, ``[batch, new_tokens]`` each: its
  position ``t``, its page, and whether it is written. ``xp``: ``jnp`` in the write,
  ``np`` in the host check of concrete tables."""
  t = positions.astype(xp.int32)[:, None] + xp.arange(new_tokens, dtype=xp.int32)[None]
  slot_of_table = xp.clip(t // page_size, 0, tables.shape[1] - 1)
  page = xp.take_along_axis(tables.astype(xp.int32), slot_of_table, axis=1)
  # A page id outside the pool (-1 for "none yet", say) is never written: negative
  # indices would wrap around to another sequence's page.
  written = (t < tables.shape[1] * page_size) & (t >= 0) & (page >= 0) & (page < num_pages)
  if num_new is not None:
    written &= xp.arange(new_tokens)[None] < num_new[:, None]
  return t, page, written


def _check_distinct_slots(tables, positions, num_new, new_tokens: int, num_pages: int,
                          page_size: int):
  """Raises unless the tokens ``_write_pages`` writes land in distinct (page, slot)s."""
  t, page, written = _write_targets(np, tables, positions, num_new, new_tokens, num_pages,
                                    page_size)
  rows, tokens = np.nonzero(written)
  targets = page[rows, tokens].astype(np.int64) * page_size + t[rows, tokens] % page_size
  unique, counts = np.unique(targets, return_counts=True)
  if np.any(counts > 1):
    target = unique[counts > 1][0]
    who = [(int(r), int(p)) for r, p, x in zip(rows, t[rows, tokens], targets) if x == target]
    raise ValueError(
        f"block_tables send two new tokens to slot {target % page_size} of page "
        f"{target // page_size} ((row, position) {who[0]} and {who[1]}): rows may not share "
        "a slot they write, nor a table list a page twice where the write covers both (a row "
        "that writes nothing takes num_new 0 or negative page ids)")


@jax.jit
def _write_pages(k_pages, v_pages, k_new, v_new, block_tables, positions, num_new):
  new_tokens = k_new.shape[1]
  num_pages, page_size = k_pages.shape[:2]
  t, page, valid = _write_targets(jnp, block_tables, positions, num_new, new_tokens,
                                  num_pages, page_size)
  page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
  slot = t % page_size
  k_pages = k_pages.at[page, slot].set(k_new.astype(k_pages.dtype), mode="drop")
  v_pages = v_pages.at[page, slot].set(v_new.astype(v_pages.dtype), mode="drop")
  return k_pages, v_pages
