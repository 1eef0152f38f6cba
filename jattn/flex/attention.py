"""``jattn.flex_attention``: attention with user score and mask functions, on the op core.

Backends:
- ``pallas_mosaic`` (Hopper): flash attention's Mosaic GPU kernels with the functions
  split into parts computed outside (what reads arrays per row, per column or per
  head: ``jattn.kernels.common.factored_functions``) and an elementwise rest evaluated
  on the tiles; the block mask as each tile's range of blocks; a 16-bit dense bias read
  tile by tile;
- ``pallas_triton``: flash attention's Triton-lowered kernels with the functions
  evaluated on the tiles (``jattn.kernels.common.element_functions``, closed-over
  arrays read from refs) and the block mask as block-sparse tile lists;
- ``xla``: the dense float32 computation of ``jattn.reference.flex_attention_reference``,
  differentiated by autodiff, the closed-over arrays included.

The kernel backends take the gradients of closed-over arrays from ``array_grads``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn.core.op import AttentionProblem, MosaicImpl, SoftmaxOp, XlaImpl
from jattn.core.sharding import KV_HEADS, Q_HEADS, ROW_STATS, Axes, ShardRule
from jattn.core.validation import check_attention_inputs, check_flag, scale_of
from jattn.flex.array_grads import score_array_grads, summed_over_broadcast
from jattn.flex.block_mask import BlockMask
from jattn.flex.examples import example_mods
from jattn.flex.functions import ElementFunction, trace
from jattn.flex.mods import broadcast_at
from jattn.flash import AttentionTritonImpl, mosaic_budget
from jattn.kernels.common.block_sparsity import classify_blocks
from jattn.kernels.common.config import padded_head_dim
from jattn.kernels.common.softmax import (EMPTY_ROW_LSE, LARGE_ROW, shared_row_shift,
                                          unshifted_lse)
from jattn.kernels.flash import (FlexMods, MosaicBlockConfig, default_mosaic_config,
                                 flash_mosaic_backward, flash_mosaic_forward,
                                 flash_triton_backward, flash_triton_forward, kernel_tiles)
from jattn.kernels.flash.config import default_bias_config, mosaic_backward_runs
from jattn.kernels.flash.mosaic_bwd import BIAS_TILES_SUPPORTED
from jattn.kernels.hopper.inputs import DenseBias, PositionInputs
from jattn.reference import flex_attention_reference


@dataclasses.dataclass(frozen=True)
class FlexProblem(AttentionProblem):
  """One flex-attention call without its arrays: shapes, dtype and the traced
  functions (whose closed-over arrays follow q, k, v among the op's arrays)."""

  score_mod: ElementFunction | None = None
  mask_mod: ElementFunction | None = None
  return_lse: bool = False
  # (block_q, block_kv) of a caller's block mask, whose classification is then the
  # op's last array; None: the kernels classify their own tiles.
  block_mask: tuple[int, int] | None = None
  # Whether that classification has a row per batch row / per head (not one for all).
  block_mask_rows: tuple[bool, bool] = (False, False)
  # A named problem of ``jattn.flex.examples`` (checks and benchmarks), else None.
  example: str | None = None

  @property
  def has_functions(self) -> bool:
    """Whether a function (or block mask) can keep some rows from some keys."""
    return self.score_mod is not None or self.mask_mod is not None

  @property
  def num_consts(self) -> int:
    """How many arrays the functions close over (the op's arrays after q, k, v)."""
    return sum(f.num_consts for f in (self.score_mod, self.mask_mod) if f is not None)

  def split_arrays(self, rest: tuple) -> tuple[tuple, object]:
    """The op's arrays after q, k, v: ``(the closed-over arrays, the block mask's
    classification or None)``."""
    return (tuple(rest[:-1]), rest[-1]) if self.block_mask is not None else (tuple(rest), None)

  def split_consts(self, consts: tuple) -> tuple[tuple, tuple]:
    """The op's arrays after q, k, v: ``(score_mod's, mask_mod's)``."""
    n = self.score_mod.num_consts if self.score_mod is not None else 0
    return tuple(consts[:n]), tuple(consts[n:])

  def array_axes(self) -> tuple[tuple[Axes, ...], dict[str, str]]:
    """``(Axes of each closed-over array, score_mod's then mask_mod's; {"batch" |
    "heads": why that axis cannot split})``. An array the functions read only at ``b``
    (``h``), a whole batch (all query heads) along one axis, splits along it: a shard
    reads its own rows with its own indices. Any other use of a split index would see
    the shard's numbering from 0."""
    axes, refusals = [], {}
    for fn in (f for f in (self.score_mod, self.mask_mod) if f is not None):
      shapes = [v.aval.shape for v in fn.jaxpr.invars[:fn.num_consts]]
      split = [{} for _ in shapes]
      for name, index, size in (("batch", "b", self.batch), ("heads", "h", self.q_heads)):
        if not fn.uses(index):
          continue
        reads = fn.index_reads(index)
        if reads is not None:  # an axis of one is read at row 0 whatever the index: whole
          reads = {i: axis for i, axis in reads.items() if shapes[i][axis] != 1}
        if reads is None or any(shapes[i][axis] != size for i, axis in reads.items()):
          refusals[name] = (f"its {fn.kind} reads the {name} index {index!r} other than as "
                            f"the row of an array of {size} it closes over, and a shard "
                            "would number it from 0")
          continue
        for i, axis in reads.items():
          split[i][name] = axis
      axes += [Axes(**where, gather_rest=True) for where in split]
    return tuple(axes), refusals

  def local(self, batch_shards: int, head_shards: int) -> "FlexProblem":
    local = super().local(batch_shards, head_shards)
    if batch_shards == head_shards == 1:
      return local
    functions = {}
    for name, fn_axes in zip(("score_mod", "mask_mod"), self.split_consts(self.array_axes()[0])):
      fn = getattr(self, name)
      if all(a.batch is None and a.heads is None for a in fn_axes):
        continue  # (no function, or none of its arrays split)
      shapes = []
      for a, v in zip(fn_axes, fn.jaxpr.invars):
        shape = list(v.aval.shape)
        for axis, shards in ((a.batch, batch_shards), (a.heads, head_shards)):
          if axis is not None:
            shape[axis] //= shards
        shapes.append(shape)
      functions[name] = fn.with_array_shapes(shapes)
    return dataclasses.replace(local, **functions)


class _FlexKernels:
  """What both kernel families share: the block classification, the functions as
  the kernels take them (``_mods``), and the gradients of closed-over arrays."""

  def _finest_tiles(self, call) -> tuple[int, int]:
    raise NotImplementedError

  def _function(self, fn: ElementFunction, consts, p, call):
    """``(the function as the kernels evaluate it in ``call``, the arrays it reads)``."""
    raise NotImplementedError

  def _mods(self, call, rest) -> FlexMods:
    p = call.problem
    consts, kinds = p.split_arrays(rest)
    score_consts, mask_consts = p.split_consts(consts)
    block = p.block_mask
    if p.mask_mod is not None and kinds is None:  # the mask's at the finest kernel tiles
      block = self._finest_tiles(call)
      batch = p.batch if p.mask_mod.uses("b") else 1
      heads = p.q_heads if p.mask_mod.uses("h") else 1
      allowed_at = lambda *index: p.mask_mod(mask_consts, *index)
      kinds = classify_blocks(allowed_at, batch, heads, (p.q_len, p.kv_len), block)
    score, score_arrays = self._function(p.score_mod, score_consts, p, call)
    mask, mask_arrays = self._function(p.mask_mod, mask_consts, p, call)
    return FlexMods(score, score_arrays, mask, mask_arrays,
                    kinds if p.mask_mod is not None else None,
                    block if p.mask_mod is not None else None)

  def residuals_of(self, call, arrays, outputs):
    o, lse = outputs
    q, k, v, *rest = arrays
    return ((q, k, v), call.problem.split_arrays(tuple(rest))[0], self._mods(call, rest),
            o.astype(q.dtype), lse)

  def forward(self, call, q, k, v, *rest):
    mods = self._mods(call, rest)
    consts = call.problem.split_arrays(rest)[0]
    o, lse = self._kernel_forward(call, q, k, v, mods)
    if _dense_bias(call.problem):
      def shifted():
        _, mods_s, shift = self._shifted_bias(call, consts, mods, lse)
        o_s, lse_s = self._kernel_forward(call, q, k, v, mods_s)
        return o_s, unshifted_lse(lse_s, shift)

      o, lse = jax.lax.cond(_has_large_rows(lse), shifted, lambda: (o, lse))
    return (o, lse), ((q, k, v), consts, mods, o, lse)

  # Whether rows of one (batch row, query position) share a shift across heads: where
  # the kernels read no array per head and position (``FactoredFunction``).
  heads_share_shift = False

  def _shifted_bias(self, call, consts, mods, lse):
    """A dense bias's score function less each row's shift (``_shift_of``): ``(the
    function's problem and arrays, the mods, the shift shaped as ``lse``)``."""
    shift = _shift_of(lse, consts[0], self.heads_share_shift)
    problem, arrays = _row_shifted(call.problem, consts[0], shift)
    score, score_arrays = self._function(problem.score_mod, arrays, problem, call)
    return ((problem, arrays), dataclasses.replace(mods, score=score, score_arrays=score_arrays),
            _as_lse(shift, lse))

  def writes_ds(self, p) -> bool:
    """Whether the backward kernels can write ``p``'s dS out (``_kernel_backward``'s
    ``ds_dtype``)."""
    return False

  def backward(self, call, residuals, cotangents):
    (q, k, v), consts, mods, o, lse = residuals
    p = call.problem
    score_consts, mask_consts = p.split_consts(consts)
    # The score function's arrays follow q, k, v; a fixed one (a constant ALiBi table,
    # a bias under stop_gradient) gets no gradient and costs nothing.
    wanted = [call.wants_grad(3 + i) and jnp.issubdtype(c.dtype, jnp.inexact)
              for i, c in enumerate(score_consts)]
    # A dense bias's gradient is dS summed over its broadcast axes: the kernels write dS
    # as they compute it (16-bit for a 16-bit bias).
    writes_ds = (self.writes_ds(p) and _dense_bias(p) and wanted[0]
                 and _ds_fits(p, score_consts[0]))

    def grads(problem, score_consts, mods, lse):
      """``(dq, dk, dv, dS)`` or ``(dq, dk, dv, the score arrays' gradients)``."""
      if writes_ds:
        bias = score_consts[0]
        ds_dtype = bias.dtype if bias.dtype.itemsize <= 2 else jnp.float32
        return self._kernel_backward(call, q, k, v, o, lse, cotangents, mods,
                                     ds_dtype=ds_dtype)
      dq, dk, dv = self._kernel_backward(call, q, k, v, o, lse, cotangents, mods)
      # (a shifted function's extra array, the shift, gets no gradient)
      wants = wanted + [False] * (len(score_consts) - len(wanted))
      return dq, dk, dv, score_array_grads(problem, score_consts, wants, mask_consts, q, k,
                                           v, o, lse, *cotangents)[:len(wanted)]

    if _dense_bias(p):
      # A row's float32 lse keeps its log(sum) only near 0: such rows' weights come from
      # the shifted function's lse, recomputed (the forward returned the unshifted one;
      # so this holds for this op's own lse, not one merged with other blocks, which no
      # ring passes flex). dS leaves the cond as the kernels wrote it: its float32 sum
      # would be a full pass.
      def shifted():
        (problem, arrays), mods_s, _ = self._shifted_bias(call, consts, mods, lse)
        return grads(problem, arrays, mods_s, self._kernel_forward(call, q, k, v, mods_s)[1])

      dq, dk, dv, extra = jax.lax.cond(_has_large_rows(lse), shifted,
                                       lambda: grads(p, score_consts, mods, lse))
    else:
      dq, dk, dv, extra = grads(p, score_consts, mods, lse)
    array_grads = [summed_over_broadcast(extra, score_consts[0].shape)] if writes_ds else extra
    kinds = (None,) if p.block_mask is not None else ()
    return (dq, dk, dv, *array_grads, *(None,) * len(mask_consts), *kinds)


def _dense_bias(p) -> bool:
  """Whether the score function is ``bias_score``'s (its one array a dense bias)."""
  return p.score_mod is not None and p.score_mod.dense_bias


def _bias_tiles(p) -> bool:
  """Whether the Hopper kernels read ``p``'s dense bias tile by tile (``DenseBias``): a
  16-bit one over every query and key position (one constant along a position axis is
  split into parts instead, as any function: ``MosaicFlex``), on jax 0.11 or later."""
  if not (_dense_bias(p) and BIAS_TILES_SUPPORTED):
    return False
  bias = p.score_mod.jaxpr.invars[0].aval
  return (tuple(bias.shape[-2:]) == (p.q_len, p.kv_len) and p.score_mod.factored.gap is not None
          and jnp.issubdtype(bias.dtype, jnp.floating) and jnp.dtype(bias.dtype).itemsize == 2)


def _as_4d(bias):
  return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


def _shift_of(lse, bias, heads_share: bool = False):
  """What is taken off each row of a dense ``bias`` (float32, 4-d, broadcastable to
  ``[batch, q_heads, q_len, 1]``). A bias constant along the keys is its own shift:
  it changes no weight, and off it the logits are the scores, exactly. Otherwise each
  row's ``shared_row_shift`` from its log-sum-exp ``lse [batch, q_heads, q_len]`` (which
  counts only the keys the row sees), one per row, not shared along the axes the bias
  broadcasts: rows that share a bias row may see different keys (masks, lengths), and a
  shift suits only the row it was taken from; ``heads_share``: one per (batch row,
  query position), the heads' peaks nearest 0 (a part the Hopper kernels can read)."""
  if bias.shape[-1] == 1:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape).astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(bias), bias, 0.0))
  peaks = jnp.where(lse <= EMPTY_ROW_LSE, -jnp.inf, lse)
  return shared_row_shift(peaks, (1,) if heads_share else ())[..., None]


def _as_lse(shift, lse):
  """``_shift_of``'s shift shaped as ``lse`` (one per row)."""
  return jnp.broadcast_to(shift[..., 0], lse.shape)


def _row_shifted(p, bias, shift):
  """A dense-bias problem's score function less ``shift`` (``_shift_of``'s) on each row:
  ``(p with that function, its arrays (bias, shift))``."""
  def score_mod(score, b, h, q_idx, kv_idx):
    # bias_score's function, the shift taken off the bias first: exactly, where the
    # row's large values are near it, before the small score is added.
    return score + (broadcast_at(bias, b, h, q_idx, kv_idx)
                    - broadcast_at(shift, b, h, q_idx, kv_idx))

  fn, arrays = trace(score_mod, "score_mod")
  return dataclasses.replace(p, score_mod=fn), arrays


@jax.custom_batching.custom_vmap
def _has_large_rows(lse):
  """Whether some row (that sees a key) has a log-sum-exp beyond ``LARGE_ROW``: the one
  check the kernels pay for a bias's rows of large values (``shared_row_shift``)."""
  return jnp.any((jnp.abs(lse) > LARGE_ROW) & (jnp.abs(lse) < -EMPTY_ROW_LSE))


@_has_large_rows.def_vmap
def _(axis_size, in_batched, lse):
  # One answer for the whole batch: a batched predicate would make the cond run both
  # branches; the shifted one leaves rows that need no shift as they are.
  return _has_large_rows(lse), False


# dS is [batch, heads, q_len, kv_len] whatever the bias's shape: written out only while
# it is at most this many times the bias, or small, else the bias's gradient takes the
# pass that walks blocks of rows (bounded memory, one more dense pass).
_DS_BROADCAST_LIMIT = 8
_DS_SMALL_BYTES = 1 << 30


def _ds_fits(p, bias) -> bool:
  ds = p.batch * p.q_heads * p.q_len * p.kv_len
  return ds <= _DS_BROADCAST_LIMIT * bias.size or ds * bias.dtype.itemsize <= _DS_SMALL_BYTES


class TritonFlex(_FlexKernels, AttentionTritonImpl):
  """Flash attention's Triton kernels with the functions evaluated on the tiles: the
  score transform and its derivative in the forward, dQ and dK/dV kernels; the mask
  with the padding mask on the tiles a block mask lists as partial, none on the
  full ones, and the empty ones skipped."""

  def gaps(self, p):
    unsupported = tuple(f"a {f.kind} the tiles cannot evaluate ({f.kernel_gap})"
                        for f in (p.score_mod, p.mask_mod) if f is not None and f.kernel_gap)
    return super().gaps(p) + unsupported

  def heuristic_config(self, p, info):
    config = super().heuristic_config(p, info)
    if (_dense_bias(p) and p.mask_mod is None and p.block_mask is None
        and p.dtype.itemsize == 2 and 64 < padded_head_dim(p.head_dim) <= 128
        and p.kv_len >= 8192):
      # A 16-bit bias alone over long key loops: the sweep's winner there
      # (bench/results/flex_bias_configs_h100.md); the flash default stays ahead over
      # 4096 keys and under a mask.
      return dataclasses.replace(config, num_warps=8, num_stages=3)
    return config

  def tuning_stages(self):
    # Not tuned: a cached config would have to be keyed by the functions too.
    return ()

  def _finest_tiles(self, call):
    bq, bk, _, _ = kernel_tiles(call.config, call.problem.q_len, call.problem.kv_len)
    return min(bq), min(bk)

  def _function(self, fn, consts, p, call):
    if fn is None:
      return None, ()
    # Its results count at every batch row, query head and position of the sequences;
    # the kernels evaluate it on whole tiles, past the ends. The query position is
    # clamped there (one min per row); a key position is not (a clamp along the keys
    # would make its reads elementwise): reads past the keys' end must stay in memory.
    _, _, _, kv_len_p = kernel_tiles(call.config, p.q_len, p.kv_len)
    rows = ((0, p.batch - 1), (0, p.q_heads - 1), (0, p.q_len - 1))
    score = (None,) if fn.kind == "score_mod" else ()
    bounds = score + rows + ((0, p.kv_len - 1),)
    reach = score + rows + ((0, kv_len_p - 1),)
    clamped = (False,) * len(score) + (False, False, True, False)
    return (fn.tile_function.with_bounds(bounds, reach, clamped), fn.kernel_arrays(consts))

  def _kernel_forward(self, call, q, k, v, mods):
    return flash_triton_forward(q, k, v, None, None, causal=False, scale=call.problem.scale,
                                local_window=None, softcap=None, config=call.config,
                                interpret=call.interpret, mods=mods)

  def writes_ds(self, p) -> bool:
    return True

  def _kernel_backward(self, call, q, k, v, o, lse, cotangents, mods, ds_dtype=None):
    return flash_triton_backward(q, k, v, None, None, o, lse, *cotangents, causal=False,
                                 scale=call.problem.scale, local_window=None, softcap=None,
                                 config=call.config, interpret=call.interpret, mods=mods,
                                 ds_dtype=ds_dtype)


class MosaicFlex(_FlexKernels, MosaicImpl):
  """Flash attention's Hopper kernels with the functions split (``FactoredFunction``):
  parts read from arrays per row, column or head computed outside, the elementwise
  rest on the tiles; the block mask as each tile's range of key (query) blocks, its
  first run of full blocks unmasked. Deterministic backward (no fused dQ).

  A dense bias (``bias_score``'s, 16-bit, over every query and key position) is read
  tile by tile instead (``DenseBias``), and the dQ kernel writes dS for its gradient."""

  config_cls = MosaicBlockConfig
  heads_share_shift = True

  def gaps(self, p):
    wide = (() if mosaic_backward_runs(p.head_dim, p.head_dim)
            else ("head dims above 128 (its backward)",))
    # (a dense bias it reads tile by tile needs no split)
    split = [f for f in (p.score_mod, p.mask_mod) if f is not None and not (
        f is p.score_mod and _bias_tiles(p))]
    unsplit = tuple(f"a {f.kind} its kernels cannot split ({f.slope_gap or f.factored.gap})"
                    for f in split if f.slope_gap or f.factored.gap)
    return super().gaps(p) + wide + unsplit

  def heuristic_config(self, p, info):
    if _bias_tiles(p):
      return default_bias_config((p.head_dim, p.head_dim), p.dtype.itemsize, 2,
                                 self._vectors(p))
    return default_mosaic_config(p.head_dim)

  def tuning_stages(self):
    return ()  # as TritonFlex

  @staticmethod
  def _vectors(p) -> tuple[int, int]:
    """The functions' per-row and per-column parts, held in shared memory per tile; a
    dense bias's kernels with its rows shifted (``_shifted_bias``, compiled beside the
    others) read one more row part, the shift."""
    factored = lambda f: None if f is None else f.factored
    rows, cols = PositionInputs(mask=factored(p.mask_mod), score=factored(p.score_mod)).vectors
    return rows + _dense_bias(p), cols

  def _budget(self, config, p, info, kernels=(), registers: bool = True):
    # (never the fused dQ: the backward is deterministic)
    return mosaic_budget(config, (p.head_dim, p.head_dim), p.dtype.itemsize,
                         kernels or ("forward", "dQ", "dK/dV"), info, self._vectors(p),
                         registers, bias_nbytes=2 * _bias_tiles(p))

  def fits(self, config, p, info, kernels=()):
    return self._budget(config, p, info, kernels)

  def compile_misfit(self, config, p, info):
    return self._budget(config, p, info, registers=False)

  def _finest_tiles(self, call):
    c = call.config
    return (min(c.block_q, c.block_q_dq, c.block_q_dkv),
            min(c.block_kv, c.block_kv_dq, c.block_kv_dkv))

  def _function(self, fn, consts, p, call):
    if fn is None:
      return None, ()
    if fn.dense_bias and _bias_tiles(p):  # read by the forward tile by tile
      return DenseBias(), (_as_4d(consts[0]),)
    parts = fn.factored.part_arrays(fn.tile_arrays(consts), p.batch, p.q_heads, p.q_len,
                                    p.kv_len)
    return fn.factored, tuple(parts)

  def _kernel_forward(self, call, q, k, v, mods):
    return flash_mosaic_forward(q, k, v, None, None, causal=False, scale=call.problem.scale,
                                local_window=None, softcap=None, config=call.config, mods=mods)

  def _shifted_bias(self, call, consts, mods, lse):
    if not _bias_tiles(call.problem):
      return super()._shifted_bias(call, consts, mods, lse)
    # Each row's own shift (a row vector per head: unlike a split function's parts, the
    # tile's bias may differ per head), taken off the bias tile by tile.
    shift = _shift_of(lse, consts[0])
    return (_row_shifted(call.problem, consts[0], shift),
            dataclasses.replace(mods, score=DenseBias(shifted=True),
                                score_arrays=(mods.score_arrays[0], shift[..., 0])),
            _as_lse(shift, lse))

  def writes_ds(self, p) -> bool:
    return _bias_tiles(p)  # its dQ kernel, for a bias it reads tile by tile

  def _kernel_backward(self, call, q, k, v, o, lse, cotangents, mods, ds_dtype=None):
    config = dataclasses.replace(call.config, fused_dq=False)
    return flash_mosaic_backward(q, k, v, None, None, o, lse, *cotangents, causal=False,
                                 scale=call.problem.scale, local_window=None, softcap=None,
                                 config=config, mods=mods, ds_dtype=ds_dtype)


class XlaFlex(XlaImpl):
  def forward(self, call, q, k, v, *rest):
    p = call.problem
    score_consts, mask_consts = p.split_consts(p.split_arrays(rest)[0])
    mask = None if p.mask_mod is None else p.mask_mod.bind(mask_consts)

    def attend(problem, score_consts):
      score = None if problem.score_mod is None else problem.score_mod.bind(score_consts)
      return flex_attention_reference(q, k, v, score_mod=score, mask_mod=mask, scale=p.scale,
                                      guard_values=p.has_functions)

    o, lse = attend(p, score_consts)
    if _dense_bias(p):  # the kernels' rows, exactly: float32 would round q·k off them
      def shifted():
        shift = _shift_of(lse, score_consts[0])
        o_s, lse_s = attend(*_row_shifted(p, score_consts[0], shift))
        return o_s, unshifted_lse(lse_s, _as_lse(shift, lse))

      o, lse = jax.lax.cond(_has_large_rows(jax.lax.stop_gradient(lse)), shifted,
                            lambda: (o, lse))
    return (o, lse), None


class FlexAttention(SoftmaxOp):
  name = "flex_attention"
  problem_cls = FlexProblem
  arg_names = ("q", "k", "v")  # then the arrays the functions close over

  def bind(self, q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None,
           return_lse=False):
    check_attention_inputs(q, k, v)
    batch, q_len, q_heads, head_dim = q.shape
    kinds = ()
    if block_mask is not None:
      mask_mod = _check_block_mask(block_mask, mask_mod, batch, q_heads, q_len, k.shape[1])
      kinds = (block_mask.kinds,)
    sizes = dict(batch=batch, heads=q_heads, q_len=q_len, kv_len=k.shape[1])
    for fn in (score_mod, mask_mod):  # jattn.flex's functions know their arrays' shapes
      getattr(fn, "check_shapes", lambda sizes: None)(sizes)
    score_fn, score_consts = trace(score_mod, "score_mod")
    mask_fn, mask_consts = trace(mask_mod, "mask_mod")
    problem = FlexProblem.of(
        q, k, scale=scale_of(scale, head_dim), score_mod=score_fn, mask_mod=mask_fn,
        return_lse=check_flag("return_lse", return_lse),
        block_mask=None if block_mask is None else (block_mask.block_q, block_mask.block_kv),
        block_mask_rows=(False, False) if block_mask is None else tuple(
            n > 1 for n in block_mask.kinds.shape[:2]))
    return problem, (q, k, v) + score_consts + mask_consts + kinds

  def finish(self, problem, outputs):
    o, lse = outputs
    return (o, lse) if problem.return_lse else o

  def shard_rule(self, p: FlexProblem) -> ShardRule:
    # The functions' arrays read at b or h split with the rows they hold (a bias_score
    # bias, key lengths, ALiBi's slopes); so does a block mask's classification.
    consts, refusals = p.array_axes()
    per_batch, per_head = p.block_mask_rows
    kinds = (Axes(batch=0 if per_batch else None, heads=1 if per_head else None,
                  gather_rest=True),
             ) if p.block_mask is not None else ()
    return ShardRule((Q_HEADS, KV_HEADS, KV_HEADS) + consts + kinds, (Q_HEADS, ROW_STATS),
                     p.q_heads // p.kv_heads, tuple(refusals.items()))

  def problem(self, example: str | None = None, **keywords):
    """A problem from keywords; ``example`` names one of ``jattn.flex.examples``,
    whose functions it then has."""
    p = super().problem(**keywords)
    if example is None:
      return p
    score_mod, mask_mod = example_mods(example, p.batch, p.q_heads, p.q_len, p.kv_len)
    return dataclasses.replace(p, score_mod=trace(score_mod, "score_mod")[0],
                               mask_mod=trace(mask_mod, "mask_mod")[0], example=example)

  def example(self, p: FlexProblem, key):
    qkv = p.random_qkv(jax.random.split(key, 3))
    if p.example is None:
      if p.score_mod is not None or p.mask_mod is not None:
        raise ValueError("inputs can be drawn for flex_attention problems without functions "
                         "or with a named example (jattn.flex.examples), not for others")
      return qkv
    score_mod, mask_mod = example_mods(p.example, p.batch, p.q_heads, p.q_len, p.kv_len)
    return qkv + trace(score_mod, "score_mod")[1] + trace(mask_mod, "mask_mod")[1]


def _check_block_mask(block_mask, mask_mod, batch, heads, q_len, kv_len):
  """The mask function a valid ``block_mask`` stands for."""
  if not isinstance(block_mask, BlockMask):
    raise TypeError("block_mask must be a BlockMask (jattn.create_block_mask), got "
                    f"{type(block_mask).__name__}")
  if mask_mod is not None and mask_mod is not block_mask.mask_mod:
    raise ValueError("pass mask_mod or a block_mask made from it, not two different masks")
  if (block_mask.q_len, block_mask.kv_len) != (q_len, kv_len):
    raise ValueError(f"block_mask was made for q_len {block_mask.q_len}, kv_len "
                     f"{block_mask.kv_len}; this call has q_len {q_len}, kv_len {kv_len}")
  b, h = block_mask.kinds.shape[:2]
  if b not in (1, batch) or h not in (1, heads):
    raise ValueError(f"block_mask was made for batch {b}, heads {h}; this call has batch "
                     f"{batch}, q heads {heads} (make it with these, or None for 'any')")
  return block_mask.mask_mod


FLEX = FlexAttention(MosaicFlex(), TritonFlex(), XlaFlex())


def flex_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask: BlockMask | None = None,
                   scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                   config=None):
  """Attention with a user score function and mask, PyTorch FlexAttention's semantics.

  ``softmax(where(mask_mod, score_mod(scale · q kᵀ, b, h, q_idx, kv_idx), -inf)) v``.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``q_heads`` a multiple of
      ``kv_heads``. float32, float16 or bfloat16, all the same dtype; any lengths.
    score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, called elementwise (as by
      ``vmap``) with a float32 score and int32 indices; ``h`` is the query head.
    mask_mod: ``(b, h, q_idx, kv_idx) -> bool``: True where the query may attend.
      Both functions are written with ``jnp`` and may close over arrays (slopes,
      tables, biases, document ids): those arrays get gradients. Ready ones:
      ``jattn.flex``.
    block_mask: a ``BlockMask`` from ``jattn.create_block_mask`` (instead of, or made
      from, ``mask_mod``).
    scale: logit scale (> 0), default ``head_dim ** -0.5``.
    return_lse: also return the log-sum-exp of each row.
    backend: ``"auto"``, ``"pallas_mosaic"`` (Hopper, 16-bit inputs, head dims up to
      128; functions whose arrays are read per row, column or head, e.g. ``slopes[h]``
      or ``documents[b, q_idx]``, and ``bias_score`` of a 16-bit bias over every
      query and key position, which its kernels read tile by tile),
      ``"pallas_triton"`` (functions that read their
      arrays by index, e.g. ``table[h, kv_idx - q_idx]``) or ``"xla"``; what a backend
      cannot run is its gap, and ``auto`` takes the next.
    config: a ``MosaicBlockConfig`` for ``pallas_mosaic`` or a ``BlockConfig`` for
      ``pallas_triton`` (default: the heuristic by head dim).

  Returns:
    ``o: [batch, q_len, q_heads, head_dim]`` in q's dtype; with ``return_lse`` also
    ``lse: [batch, q_heads, q_len]`` float32. Rows that see no key (masked out, or
    every score ``-inf``) give zeros and ``lse = -1e30``, never NaN.
  """
  return FLEX(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
              scale=scale, return_lse=return_lse, backend=backend, config=config)
