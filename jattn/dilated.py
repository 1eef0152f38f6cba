"""``jattn.dilated_attention``: LongNet's dilated attention.

For each pair ``(w_i, r_i)`` and head ``h``, the sequence is cut into segments of
``w_i`` positions (the last one may be shorter); within each, the positions ``≡ h
(mod r_i)`` (LongNet's head offsets) attend among themselves (causal: to earlier ones
and themselves). Each pair gives an output ``O_i`` and a log-sum-exp ``lse_i`` per
position it covers (``lse_i = -inf`` elsewhere), and the pairs are mixed as
``O = Σ_i softmax_i(lse_i) · O_i``. Gradients are exact: they flow through the mixing
weights too (torchscale detaches them).

Implementations: ``pallas_mosaic`` (Hopper, 16-bit, where every pair's segments are
whole and tile-aligned: each pair one Hopper forward on in-place dilated views, the
pairs mixed by their log-sum-exp; the backward is the Hopper flash backward kernels on
the same views), ``pallas_triton`` (``jattn.kernels.dilated``: in-place kernels on dilated views, pairs
merged into one running ``(o, lse)``) and ``xla`` (the float32 reference: gather,
dense attention per pair, mix).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.op import MosaicImpl, Problem, SoftmaxOp, XlaImpl
from jattn.core.sharding import KV_HEADS, Q_HEADS, ROW_STATS, ShardRule
from jattn.core.validation import check_attention_inputs, check_flag, scale_of
from jattn.kernels.common.config import BlockConfig, default_block_config, padded_head_dim
from jattn.flash import FLASH, FlashProblem, mosaic_budget
from jattn.kernels.dilated import (dilated_mosaic_backward, dilated_mosaic_forward,
                                   dilated_triton_backward, dilated_triton_forward,
                                   unsupported_pair)
from jattn.kernels.dilated.mosaic import pair_rows, pair_stats, pair_tile, spread_rows
from jattn.kernels.flash.config import (MosaicBlockConfig, backward_modelled,
                                        default_mosaic_config, mosaic_backward_runs)
from jattn.reference import dilated_attention_reference
from jattn.core.cache import bucket
from jattn.tuning.spaces import BlockTritonImpl

@dataclasses.dataclass(frozen=True)
class DilatedProblem(Problem):
  """One dilated-attention call, without its arrays."""

  batch: int = 1
  seq: int = 1
  heads: int = 1
  kv_heads: int | None = None  # default heads
  head_dim: int = 64
  dtype: Any = jnp.float16
  segment_lengths: tuple[int, ...] = (2048,)
  dilation_rates: tuple[int, ...] = (1,)
  causal: bool = False
  scale: float | None = None  # default head_dim ** -0.5

  def __post_init__(self):
    self._normalize(self.head_dim, kv_heads=self.heads)
    self._set(segment_lengths=tuple(int(w) for w in self.segment_lengths),
              dilation_rates=tuple(int(r) for r in self.dilation_rates))

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim,)

  @property
  def pairs(self) -> tuple[tuple[int, int], ...]:
    return tuple(zip(self.segment_lengths, self.dilation_rates))

  def local(self, batch_shards: int, head_shards: int) -> "DilatedProblem":
    """This problem on one shard of ``batch_shards`` x ``head_shards``. Head ``h``
    reads the positions ``≡ h (mod r)``: a shard's heads, numbered from 0, keep their
    offsets only where each shard holds a multiple of every rate."""
    heads = self.heads // head_shards
    if head_shards > 1 and any(heads % r for r in self.dilation_rates):
      raise ValueError(f"dilated_attention split over heads needs a multiple of every dilation "
                       f"rate {self.dilation_rates} per shard, got {heads} heads per shard "
                       f"({self.heads} over {head_shards})")
    return dataclasses.replace(self, batch=self.batch // batch_shards, heads=heads,
                               kv_heads=self.kv_heads // head_shards)


def check_pairs(segment_lengths, dilation_rates) -> None:
  """LongNet's pairs: non-empty, matched, positive ints, ``w`` a multiple of ``r``."""
  for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
    items = values if isinstance(values, (list, tuple)) else [values]
    if any(isinstance(x, jax.core.Tracer) for x in items):
      raise TypeError(f"{name} must be Python ints, not traced values: the pairs shape the "
                      "kernels (pass them as static arguments of jit)")
    if np.ndim(values) != 1:
      raise TypeError(f"{name} must be a sequence of ints (one per pair), got {values!r}")
  segment_lengths, dilation_rates = list(segment_lengths), list(dilation_rates)
  if not segment_lengths or len(segment_lengths) != len(dilation_rates):
    raise ValueError(f"segment_lengths {segment_lengths} and dilation_rates {dilation_rates} "
                     "must be non-empty and of the same length (one (w, r) pair each)")
  for w, r in zip(segment_lengths, dilation_rates):
    if (isinstance(w, (bool, np.bool_)) or isinstance(r, (bool, np.bool_)) or int(w) != w
        or int(r) != r or w < 1 or r < 1 or w % r):
      raise ValueError(f"each pair needs positive integers with the segment length a "
                       f"multiple of the dilation rate, got (w={w}, r={r})")


class TritonDilated(BlockTritonImpl):
  def rows(self, p):
    rows = -(-p.seq // min(p.dilation_rates))  # the longest pair's rows
    return rows, rows

  def heuristic_config(self, p, info):
    return default_block_config(p.head_dim, p.dtype.itemsize)

  def cache_key(self, p):
    pairs = ",".join(f"{w}:{r}" for w, r in p.pairs)
    return (p.dtype.name, f"d{padded_head_dim(p.head_dim)}",
            "causal" if p.causal else "noncausal", f"s{bucket(p.seq)}", pairs)

  def forward(self, call, q, k, v):
    p = call.problem
    o, lse = dilated_triton_forward(q, k, v, pairs=p.pairs, causal=p.causal, scale=p.scale,
                                    config=call.config, interpret=call.interpret)
    return (o, lse), ((q, k, v), o.astype(q.dtype), lse)

  def backward(self, call, residuals, cotangents):
    (q, k, v), o, lse = residuals
    p = call.problem
    return dilated_triton_backward(q, k, v, o, lse, *cotangents, pairs=p.pairs,
                                   causal=p.causal, scale=p.scale, config=call.config,
                                   interpret=call.interpret)


def flash_pairs_backward(p: DilatedProblem, residuals, do, backend: str):
  """Float32 ``(dq, dk, dv)`` of the pairs, given the mixture's ``(o, lse)``: each pair's
  blocks as flash attention on its rows gathered compactly (``pair_rows``: ``[batch *
  seq / w, w / r, heads, d]``, K and V copied per query head), whose gradients as one
  block of a merged softmax (``FLASH.partial_backward``) are scattered back and, for K
  and V, summed over each KV head's query heads. The mixture's log-sum-exp is no
  output of the op, so it has no cotangent here."""
  (q, k, v), o, lse = residuals
  batch, _, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  grads = [jnp.zeros((batch, q.shape[1], h, head_dim), jnp.float32)
           for h in (heads, kv_heads, kv_heads)]
  for w, r in p.pairs:
    rows = lambda x: pair_rows(x, w, r, heads)
    # The barrier keeps each gather a plain copy at the memory bandwidth: fused into the
    # backward's row sums (o * do), XLA runs them far below it (bench/results/
    # dilated_hopper_h100.md).
    qc, kc, vc, oc, doc = jax.lax.optimization_barrier(
        tuple(map(rows, (q, k, v, o, do.astype(q.dtype)))))
    lse_c = pair_stats(lse, w, r, heads)
    call = FLASH.prepare(FlashProblem.of(qc, kc, causal=p.causal, scale=p.scale,
                                         return_lse=True), backend)
    pair = FLASH.partial_backward(call, (qc, kc, vc, None, None, None, None, None), oc, lse_c,
                                  doc)[:3]
    for i, g in enumerate(pair):
      g = spread_rows(g, batch=batch, r=r)
      if i:  # per query head: summed over each KV head's group
        g = g.reshape(*g.shape[:2], kv_heads, heads // kv_heads, head_dim).sum(3)
      grads[i] = grads[i] + g
  return tuple(grads)


class MosaicDilated(MosaicImpl):
  """The Hopper kernels on in-place views (``jattn.kernels.dilated.mosaic``), forward
  and backward; for heads wider than the Hopper backward takes, the backward runs our
  flash backward on each pair's gathered rows (``flash_pairs_backward``)."""

  config_cls = MosaicBlockConfig

  def gaps(self, p):
    tile = pair_tile(default_mosaic_config(p.head_dim))
    pairs = tuple(why for w, r in p.pairs
                  if (why := unsupported_pair(p.seq, w, r, tile)) is not None)
    return super().gaps(p) + pairs

  def heuristic_config(self, p, info):
    return default_mosaic_config(p.head_dim)

  def fits(self, config, p, info, kernels=()):
    # Wider heads' backward is the flash op's, which chooses its own tiles.
    kernels = ("forward", "dQ", "dK/dV") if backward_modelled(p.head_dim, p.head_dim) else (
        "forward",)
    return mosaic_budget(config, (p.head_dim, p.head_dim), p.dtype.itemsize, kernels, info)

  def compile_misfit(self, config, p, info):
    kernels = ("forward", "dQ", "dK/dV") if mosaic_backward_runs(p.head_dim, p.head_dim) else (
        "forward",)
    return mosaic_budget(config, (p.head_dim, p.head_dim), p.dtype.itemsize, kernels, info,
                         registers=False)

  def forward(self, call, q, k, v):
    p = call.problem
    o, lse = dilated_mosaic_forward(q, k, v, pairs=p.pairs, causal=p.causal, scale=p.scale,
                                    config=call.config)
    return (o, lse), ((q, k, v), o.astype(q.dtype), lse)

  def backward(self, call, residuals, cotangents):
    p = call.problem
    if not mosaic_backward_runs(p.head_dim, p.head_dim):
      return flash_pairs_backward(p, residuals, cotangents[0], "pallas_mosaic")
    (q, k, v), o, lse = residuals
    return dilated_mosaic_backward(q, k, v, o, lse, cotangents[0], pairs=p.pairs,
                                   causal=p.causal, scale=p.scale, config=call.config)


class XlaDilated(XlaImpl):
  def forward(self, call, q, k, v):
    p = call.problem
    return dilated_attention_reference(q, k, v, segment_lengths=p.segment_lengths,
                                       dilation_rates=p.dilation_rates, causal=p.causal,
                                       scale=p.scale, guard_values=True), None


class DilatedAttention(SoftmaxOp):
  name = "dilated_attention"
  problem_cls = DilatedProblem
  arg_names = ("q", "k", "v")

  def bind(self, q, k, v, *, segment_lengths, dilation_rates, causal=False, scale=None):
    check_attention_inputs(q, k, v, same_length=True)
    batch, seq, heads, head_dim = q.shape
    check_pairs(segment_lengths, dilation_rates)
    problem = DilatedProblem(batch=batch, seq=seq, heads=heads, kv_heads=k.shape[2],
                             head_dim=head_dim, dtype=q.dtype, segment_lengths=segment_lengths,
                             dilation_rates=dilation_rates, causal=check_flag("causal", causal),
                             scale=scale_of(scale, head_dim))
    return problem, (q, k, v)

  def finish(self, problem, outputs):
    return outputs[0].astype(problem.dtype)

  def shard_rule(self, p: DilatedProblem) -> ShardRule:
    return ShardRule((Q_HEADS, KV_HEADS, KV_HEADS), (Q_HEADS, ROW_STATS), p.heads // p.kv_heads)

  def example(self, p: DilatedProblem, key):
    kq, kk, kv = jax.random.split(key, 3)
    normal = lambda k, h: jax.random.normal(k, (p.batch, p.seq, h, p.head_dim),
                                            jnp.float32).astype(p.dtype)
    return normal(kq, p.heads), normal(kk, p.kv_heads), normal(kv, p.kv_heads)


DILATED = DilatedAttention(MosaicDilated(), TritonDilated(), XlaDilated())


def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal: bool = False,
                      scale: float | None = None, backend: str = "auto",
                      config: BlockConfig | MosaicBlockConfig | None = None):
  """LongNet dilated attention.

  Args:
    q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``
      (``heads`` a multiple of ``kv_heads``; head ``h`` reads kv head
      ``h // (heads // kv_heads)``); float32, float16 or bfloat16.
    segment_lengths, dilation_rates: the pairs ``(w_i, r_i)``, each ``w_i`` a multiple
      of ``r_i``; any ``seq`` works (the last segment may be partial, and ``w_i`` may
      exceed ``seq``).
    causal: attend to earlier positions only, within each segment.
    scale: default ``head_dim ** -0.5``.
    backend: ``"auto"`` (the Pallas kernels where usable, else ``"xla"``),
      ``"pallas_mosaic"`` (Hopper, 16-bit inputs, every ``w_i`` dividing ``seq`` and
      ``w_i / r_i`` a multiple of the forward's tiles (128 rows for head dims above
      64, else 256); its backward runs our Hopper flash backward kernels on the same
      in-place views, or for heads wider than those take, on each pair's gathered
      rows), ``"pallas_triton"`` or
      ``"xla"`` (the float32 reference: gather, dense attention per pair, mix).
    config: tiles for the Pallas kernels, a ``BlockConfig`` (``MosaicBlockConfig``
      for ``"pallas_mosaic"``; default: the tuning cache, else the flash kernels'
      default for the head dim and dtype).

  Returns:
    ``[batch, seq, heads, head_dim]`` in q's dtype. Positions that no pair covers for
    a head (possible only without a pair of rate 1) give zeros.

  A single pair ``(seq, 1)`` is exactly full attention.
  """
  if np.ndim(q) == 4:
    check_pairs(segment_lengths, dilation_rates)
    # A segment past the sequence is one segment of it: as the least multiple of r that
    # covers seq, a w of 2^31 or more stays in the kernels' int32 (it had wrapped there,
    # silently: zeros under x64) and the dense reference pads no further. (Here, not in
    # bind: the rings bind local shards with the whole sequence's pairs.)
    seq = np.shape(q)[1]
    segment_lengths = [min(int(w), int(r) * -(-seq // int(r)))
                       for w, r in zip(segment_lengths, dilation_rates)]
  return DILATED(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                 causal=causal, scale=scale, backend=backend, config=config)
