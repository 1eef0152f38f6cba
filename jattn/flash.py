"""``jattn.flash_attention``: the op, its problem, and its four implementations.

- ``pallas_mosaic``: the Hopper kernels (``jattn.kernels.flash.mosaic``);
- ``pallas_triton``: the Triton-lowered kernels (``jattn.kernels.flash.triton``);
- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
- ``xla``: the float32 reference (``jattn.reference.flash_attention_reference``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn.core.cache import bucket
from jattn.core.device import CUDNN, GPUInfo, current_device, shared_memory_limit
from jattn.core.op import AttentionProblem, Impl, MosaicImpl, SoftmaxOp, XlaImpl
from jattn.core.sharding import (KV_HEADS, PER_Q_HEAD, PER_ROW, Q_HEADS, REPLICATED, ROW_STATS,
                                 ShardRule)
from jattn.core.validation import (check_attention_inputs, check_flag, check_integer_array,
                                   check_shape, is_number, positive_number, scale_of,
                                   segment_ids_arg, window_arg)
from jattn.fp8 import FP8_FLASH
from jattn.kernels.common.config import (BlockConfig, default_block_config,
                                         padded_head_dim)
from jattn.kernels.flash import (MosaicBlockConfig, default_mosaic_config,
                                 flash_mosaic_backward, flash_mosaic_forward,
                                 flash_triton_backward, flash_triton_forward)
from jattn.kernels.common.dropout import seed_of
from jattn.kernels.common.softmax import EMPTY_ROW_LSE, backward_delta, exact_empty_rows
from jattn.kernels.flash.mosaic_bwd import FUSED_DQ_SUPPORTED
from jattn.kernels.flash.decode_config import (DECODE_MAX_Q_LEN, decode_config,
                                               mosaic_decode_config)
from jattn.kernels.flash.mosaic_decode import (flash_mosaic_decode, mosaic_decode_preferred,
                                               mosaic_decode_runs)
from jattn.kernels.flash.triton_decode import flash_triton_decode
from jattn.kernels.flash.config import (BACKWARD_SEARCH, FORWARD_SEARCH, backward_kernels,
                                        backward_modelled, mosaic_backward_runs, mosaic_misfit)
from jattn.kernels.hopper.budget import MOSAIC_REGISTER_BUDGET
from jattn.kernels.hopper.inputs import PositionInputs
from jattn.reference import flash_attention_reference
from jattn.tuning.spaces import BlockTritonImpl



@dataclasses.dataclass(frozen=True)
class FlashProblem(AttentionProblem):
  """One flash-attention call, without its arrays. From keywords (``select_backend``,
  tuning) ``softcap=True`` / ``local_window=True`` stand for "some cap / window".
  ``deterministic``: the gradients must be bitwise repeatable."""

  causal: bool = False
  local_window: tuple | None = None
  softcap: float | None = None
  segment_ids: bool = False
  return_lse: bool = False
  deterministic: bool = True
  value_head_dim: int | None = None  # default head_dim
  sinks: bool = False
  dropout_rate: float = 0.0
  lengths: bool = False  # per-row q_lengths / kv_lengths

  def __post_init__(self):
    super().__post_init__()
    if self.value_head_dim is None:
      self._set(value_head_dim=self.head_dim)
    if self.local_window is True:
      self._set(local_window=(None, None))
    elif self.local_window is False:
      self._set(local_window=None)
    elif self.local_window is not None:
      self._set(local_window=tuple(self.local_window))
    if isinstance(self.softcap, bool):
      self._set(softcap=1.0 if self.softcap else None)

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim, self.value_head_dim)

  def random_qkv(self, keys) -> tuple:
    q, k, v = super().random_qkv(keys)
    shape = (self.batch, self.kv_len, self.kv_heads, self.value_head_dim)
    return q, k, jax.random.normal(keys[2], shape, jnp.float32).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class ServingProblem(AttentionProblem):
  """The fields the serving ops (``paged_attention``, ``flash_attention_varlen``) share
  with flash attention's problem: its mask and score features, the value head dim
  (default ``head_dim``) and ``return_lse``."""

  causal: bool = False
  local_window: tuple | None = None
  softcap: float | None = None
  sinks: bool = False
  value_head_dim: int | None = None
  return_lse: bool = False

  def __post_init__(self):
    super().__post_init__()
    if self.value_head_dim is None:
      self._set(value_head_dim=self.head_dim)

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim, self.value_head_dim)


def _dropout_seed(rate, key):
  """The kernels' ``[2]`` int32 seed words of a dropout call (None without dropout)."""
  if not (is_number(rate) and 0 <= rate < 1):
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}")
  if not rate:
    return None
  if key is None:
    raise ValueError("dropout_rate > 0 needs dropout_key (a jax.random key)")
  try:
    return seed_of(key)
  except (TypeError, ValueError) as e:
    raise TypeError(f"dropout_key must be a jax.random key, got {key!r}") from e


def sink_arg(sinks, q_heads: int):
  """``sinks`` checked: ``[q_heads]`` floats, or None."""
  if sinks is not None:
    check_shape("sinks", sinks, (q_heads,), "q_heads")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise TypeError(f"sinks must be floats, got dtype {sinks.dtype}")
  return sinks


def row_lengths(q_lengths, kv_lengths, batch: int, q_len: int, kv_len: int):
  """``[batch, 2]`` int32 ``(q_len, kv_len)`` of each batch row, each clipped to the
  arrays' length (None when neither is given)."""
  if q_lengths is None and kv_lengths is None:
    return None
  columns = {}
  for name, given, full in (("q_lengths", q_lengths, q_len), ("kv_lengths", kv_lengths, kv_len)):
    if given is not None:
      check_integer_array(name, given, (batch,), "batch")
      columns[name] = jnp.clip(given, 0, full).astype(jnp.int32)
  # The missing one like the given one (full_like): on a mesh of Explicit axes it takes
  # the given one's sharding, and the two stack.
  like = next(iter(columns.values()))
  return jnp.stack([columns.get("q_lengths", jnp.full_like(like, q_len)),
                    columns.get("kv_lengths", jnp.full_like(like, kv_len))], axis=1)


def has_mask(p: FlashProblem) -> bool:
  """Whether some rows of ``p`` do not see some keys (beyond padding)."""
  return p.causal or p.local_window is not None or p.segment_ids or p.lengths


# --- implementations ---------------------------------------------------------------------

def flash_cache_key(p: FlashProblem) -> tuple[str, ...]:
  """The fields a tuned flash config is stored under: dtype, head dims, ``causal`` and
  the arrays' lengths (bucketed; per-row lengths do not count) of any problem that has
  flash's fields."""
  dv = () if p.value_head_dim == p.head_dim else (f"dv{padded_head_dim(p.value_head_dim)}",)
  return (p.dtype.name, f"d{padded_head_dim(p.head_dim)}", *dv,
          "causal" if p.causal else "noncausal", f"s{bucket(max(p.q_len, p.kv_len))}")


def sink_grad(sinks, lse, delta):
  """d loss / d sinks ``[q_heads]`` float32: a sink's weight in row ``(b, h, q)`` is
  ``exp(sink[h] - lse)``, and it attends to nothing, so it takes ``-weight * delta``
  (``delta = rowsum(o * do) - dlse``, ``[batch, q_heads, q_len]``). A sink at or below
  ``EMPTY_ROW_LSE`` is no sink (``floor_sinks``): no gradient. The weight is at most 1:
  the kernels' lse of a row the sink dominates is rounded through their base-2 units
  (off by an ulp of the sink), and exp of a large sink less it is not."""
  sinks = sinks.astype(jnp.float32)[None, :, None]
  weight = jnp.where(sinks <= EMPTY_ROW_LSE, 0.0, jnp.minimum(jnp.exp(sinks - lse), 1.0))
  return -jnp.sum(weight * delta, axis=(0, 2))


def softmax_outputs(problem, outputs):
  """What a flash-family op returns from its ``(o, lse)``: ``o``, with ``problem.return_lse``
  also ``lse`` (its rows that saw no key at exactly ``EMPTY_ROW_LSE``)."""
  o, lse = outputs
  return (o, exact_empty_rows(lse)) if problem.return_lse else o


def _feature_grads(p: FlashProblem, sinks, o, lse, cotangents) -> tuple:
  """The gradients after dq, dk, dv: segment ids, sinks, dropout seed, lengths."""
  dsinks = None
  if sinks is not None:
    dsinks = sink_grad(sinks, lse, backward_delta(o, *cotangents))
  return None, None, dsinks, None, None


class AttentionTritonImpl(BlockTritonImpl):
  """The Triton flash kernels' tiles for an ``AttentionProblem`` (flash and flex)."""

  def rows(self, p):
    return p.q_len, p.kv_len

  def heuristic_config(self, p, info):
    return default_block_config(p.head_dim, p.dtype.itemsize)


def runs_decode(p: FlashProblem) -> bool:
  """Whether the forward of ``p`` runs the split-KV decode kernels: few query positions
  against a longer cache, with no segment ids or dropout."""
  return (p.q_len <= DECODE_MAX_Q_LEN and p.kv_len >= 4 * p.q_len and not p.segment_ids
          and not p.dropout_rate)


def hopper_decodes(p, page_size: int | None = None) -> bool:
  """Whether ``p``'s decoding runs the Hopper decode kernel (it takes the problem and is
  the faster of the two there) rather than the Triton one."""
  return (mosaic_decode_runs(p.q_heads, p.kv_heads, p.head_dims, page_size)
          and mosaic_decode_preferred(p.q_len, p.q_heads // p.kv_heads, p.head_dims))


def decode_forward(p, q, k, v, lengths, sinks, *, hopper: bool, interpret: bool,
                   block_tables=None):
  """``(o, lse)`` of a problem with flash's shape, mask and score fields (flash
  attention's, paged attention's) by a split-KV decode kernel: the Hopper one
  (``hopper``) or the Triton one, with its config for this device's SMs; K/V contiguous
  or paged through ``block_tables``."""
  sizes = (p.batch, p.q_len, p.q_heads, p.kv_heads, p.kv_len, p.head_dim, p.value_head_dim,
           p.dtype.itemsize, current_device().sm_count)
  options = dict(causal=p.causal, scale=p.scale, local_window=p.local_window,
                 softcap=p.softcap, sinks=sinks, block_tables=block_tables)
  if hopper:
    return flash_mosaic_decode(q, k, v, lengths, config=mosaic_decode_config(*sizes),
                               **options)
  return flash_triton_decode(q, k, v, lengths, config=decode_config(*sizes),
                             interpret=interpret, **options)


def _decode(call, q, k, v, q_seg, kv_seg, sinks, seed, lengths, hopper: bool = False):
  """The forward by a split-KV decode kernel, with the residuals either backward takes."""
  o, lse = decode_forward(call.problem, q, k, v, lengths, sinks, hopper=hopper,
                          interpret=call.interpret)
  return (o, lse), ((q, k, v, q_seg, kv_seg, sinks, seed, lengths), o, lse)


class TritonFlash(AttentionTritonImpl):
  def cache_key(self, p):
    return flash_cache_key(p)

  def heuristic_config(self, p, info):
    return default_block_config(max(p.head_dims), p.dtype.itemsize)

  def forward(self, call, q, k, v, q_seg, kv_seg, sinks, seed, lengths):
    p = call.problem
    if runs_decode(p):
      return _decode(call, q, k, v, q_seg, kv_seg, sinks, seed, lengths)
    o, lse = flash_triton_forward(q, k, v, q_seg, kv_seg, causal=p.causal, scale=p.scale,
                                  local_window=p.local_window, softcap=p.softcap,
                                  config=call.config, interpret=call.interpret, sinks=sinks,
                                  dropout_rate=p.dropout_rate, dropout_seed=seed,
                                  lengths=lengths)
    return (o, lse), ((q, k, v, q_seg, kv_seg, sinks, seed, lengths), o, lse)

  def backward(self, call, residuals, cotangents):
    return _triton_gradients(call.problem, residuals, cotangents, call.config, call.interpret)


def _triton_gradients(p: FlashProblem, residuals, cotangents, config: BlockConfig,
                      interpret: bool) -> tuple:
  """Every input's gradient by the Triton backward kernels, from the residuals of
  either forward (their ``(o, lse)`` are the same)."""
  (q, k, v, q_seg, kv_seg, sinks, seed, lengths), o, lse = residuals
  dq, dk, dv = flash_triton_backward(
      q, k, v, q_seg, kv_seg, o, lse, *cotangents, causal=p.causal, scale=p.scale,
      local_window=p.local_window, softcap=p.softcap, config=config, interpret=interpret,
      dropout_rate=p.dropout_rate, dropout_seed=seed, lengths=lengths)
  return (dq, dk, dv) + _feature_grads(p, sinks, o, lse, cotangents)


def mosaic_budget(c: MosaicBlockConfig, head_dims: tuple[int, int], nbytes: int,
                  kernels: tuple[str, ...], info: GPUInfo, vectors: tuple[int, int] = (0, 0),
                  registers: bool = True, bias_nbytes: int = 0) -> str | None:
  """Why the Hopper ``kernels`` of config ``c`` do not fit ``info``'s device at head
  dims ``(dk, dv)`` with ``vectors``, the ``(row, col)`` counts of per-position vectors
  (``PositionInputs.vectors``), and a dense bias of ``bias_nbytes`` per value (0: none)
  (None: they fit); the cost model is ``kernels.flash.config``'s. ``registers=False``:
  shared memory only, the limit the compiler enforces (``Impl.compile_misfit``)."""
  return mosaic_misfit(c, head_dims, nbytes, kernels, shared_memory_limit(info), vectors,
                       MOSAIC_REGISTER_BUDGET if registers else None, bias_nbytes)


class MosaicFlash(MosaicImpl):
  config_cls = MosaicBlockConfig

  def heuristic_config(self, p, info):
    return default_mosaic_config(*p.head_dims)

  def cache_key(self, p):
    return flash_cache_key(p)

  def tuning_stages(self):
    return FORWARD_SEARCH + BACKWARD_SEARCH

  def backward_backend(self, p) -> str:
    """Which kernels run the backward: the Hopper ones, or for heads wider than those
    take (``mosaic_backward_runs``) the Triton-lowered ones, on the Hopper forward's
    ``(o, lse)`` with the Triton heuristic's tiles."""
    return "pallas_mosaic" if mosaic_backward_runs(*p.head_dims) else "pallas_triton"

  def normalize_config(self, config, p):
    # Deterministic calls never run the fused dQ (its reduce-adds vary the sum order);
    # nor does jax before 0.11.
    return dataclasses.replace(config, fused_dq=(config.fused_dq and not p.deterministic
                                                 and FUSED_DQ_SUPPORTED))

  def _vectors(self, p) -> tuple[int, int]:
    return PositionInputs(segments=p.segment_ids, dropout=p.dropout_rate).vectors

  def fits(self, config, p, info, kernels=()):
    config = self.normalize_config(config, p)
    if not kernels:
      if self.backward_backend(p) == "pallas_mosaic" and backward_modelled(*p.head_dims):
        kernels = ("forward", *backward_kernels(config, p.deterministic))
      else:  # the model's register counts do not hold for the wide heads' backward
        kernels = ("forward",)
    return mosaic_budget(config, p.head_dims, p.dtype.itemsize, kernels, info,
                         self._vectors(p))

  def compile_misfit(self, config, p, info):
    config = self.normalize_config(config, p)
    # A decoding forward runs a decode kernel, which fits by its own ring depth
    # (``mosaic_decode_stages``), or the Triton one; the backward takes the config.
    forward = () if runs_decode(p) else ("forward",)
    backward = (backward_kernels(config, p.deterministic)
                if self.backward_backend(p) == "pallas_mosaic" else ())
    return mosaic_budget(config, p.head_dims, p.dtype.itemsize, forward + backward, info,
                         self._vectors(p), registers=False)

  def forward(self, call, q, k, v, q_seg, kv_seg, sinks, seed, lengths):
    p = call.problem
    if runs_decode(p):
      return _decode(call, q, k, v, q_seg, kv_seg, sinks, seed, lengths,
                     hopper=hopper_decodes(p))
    o, lse = flash_mosaic_forward(q, k, v, q_seg, kv_seg, causal=p.causal, scale=p.scale,
                                  local_window=p.local_window, softcap=p.softcap,
                                  config=call.config, sinks=sinks,
                                  dropout_rate=p.dropout_rate, dropout_seed=seed,
                                  lengths=lengths)
    return (o, lse), ((q, k, v, q_seg, kv_seg, sinks, seed, lengths), o, lse)

  def backward(self, call, residuals, cotangents):
    p = call.problem
    if self.backward_backend(p) == "pallas_triton":
      return _triton_gradients(p, residuals, cotangents,
                               default_block_config(max(p.head_dims), p.dtype.itemsize), False)
    (q, k, v, q_seg, kv_seg, sinks, seed, lengths), o, lse = residuals
    dq, dk, dv = flash_mosaic_backward(q, k, v, q_seg, kv_seg, o, lse, *cotangents,
                                       causal=p.causal, scale=p.scale,
                                       local_window=p.local_window, softcap=p.softcap,
                                       config=self.normalize_config(call.config, p),
                                       dropout_rate=p.dropout_rate, dropout_seed=seed,
                                       lengths=lengths)
    return (dq, dk, dv) + _feature_grads(p, sinks, o, lse, cotangents)


class CudnnFlash(Impl):
  """cuDNN's fused attention through ``jax.nn.dot_product_attention`` (its own VJP)."""

  backend = CUDNN

  def gaps(self, p):
    return tuple(name for name, used in (
        ("head dims above 256 or not a multiple of 8", p.head_dim > 256 or p.head_dim % 8),
        ("segment ids", p.segment_ids), ("softcap", p.softcap is not None),
        ("return_lse", p.return_lse), ("float32 inputs", p.dtype == jnp.float32),
        ("causal with q_len != kv_len (cuDNN aligns causal masks top-left)",
         p.causal and p.q_len != p.kv_len),
        # jax 0.11.2 refused a (1, 1) causal backward: "Unsupported sequence length".
        ("odd sequence lengths", p.q_len % 2 or p.kv_len % 2),
        # Measured on the H100 (jax 0.11.2): its gradients differ from run to run.
        ("deterministic=True (its backward is not bitwise repeatable)",
         p.deterministic),
        ("a value head dim other than the head dim", p.value_head_dim != p.head_dim),
        ("sinks", p.sinks), ("dropout", p.dropout_rate),
        ("q_lengths / kv_lengths", p.lengths)) if used)

  def forward(self, call, q, k, v, q_seg, kv_seg, sinks, seed, lengths):
    p = call.problem
    window = None if p.local_window is None else tuple(
        -1 if w is None else w for w in p.local_window)
    o = jax.nn.dot_product_attention(q, k, v, scale=p.scale, is_causal=p.causal,
                                      local_window_size=window, implementation="cudnn")
    return (o, None), None


class XlaFlash(XlaImpl):
  def forward(self, call, q, k, v, q_seg, kv_seg, sinks, seed, lengths):
    p = call.problem
    return flash_attention_reference(q, k, v, causal=p.causal, scale=p.scale,
                                     q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                     local_window=p.local_window, softcap=p.softcap,
                                     sinks=sinks, dropout_rate=p.dropout_rate,
                                     dropout_seed=seed, guard_values=has_mask(p),
                                     lengths=lengths), None


# --- the op --------------------------------------------------------------------------------

class FlashAttention(SoftmaxOp):
  name = "flash_attention"
  problem_cls = FlashProblem
  arg_names = ("q", "k", "v", "q_segment_ids", "kv_segment_ids", "sinks", "dropout_seed",
               "lengths")
  diff_argnums = (0, 1, 2, 5)

  def bind(self, q, k, v, *, causal=False, scale=None, q_segment_ids=None, kv_segment_ids=None,
           local_window=None, softcap=None, deterministic=True, return_lse=False, sinks=None,
           dropout_rate=0.0, dropout_key=None, q_lengths=None, kv_lengths=None):
    check_attention_inputs(q, k, v, value_head_dim=True)
    batch, q_len, q_heads, head_dim = q.shape
    q_segment_ids, kv_segment_ids = segment_ids_arg(q_segment_ids, kv_segment_ids, batch,
                                                    q_len, k.shape[1])
    if local_window is not None:
      local_window = window_arg(local_window)
    if softcap is not None:
      softcap = positive_number("softcap", softcap)
    sinks = sink_arg(sinks, q_heads)
    seed = _dropout_seed(dropout_rate, dropout_key)
    lengths = row_lengths(q_lengths, kv_lengths, batch, q_len, k.shape[1])
    problem = FlashProblem.of(
        q, k, causal=check_flag("causal", causal), scale=scale_of(scale, head_dim),
        local_window=local_window, softcap=softcap, segment_ids=q_segment_ids is not None,
        return_lse=check_flag("return_lse", return_lse),
        deterministic=check_flag("deterministic", deterministic), value_head_dim=v.shape[-1],
        sinks=sinks is not None, dropout_rate=float(dropout_rate), lengths=lengths is not None)
    return problem, (q, k, v, q_segment_ids, kv_segment_ids, sinks, seed, lengths)

  def finish(self, problem, outputs):
    return softmax_outputs(problem, outputs)

  def shard_rule(self, p: FlashProblem) -> ShardRule:
    refusals = ()
    if p.dropout_rate:
      why = "dropout's mask hashes each weight's batch row and head, which a shard numbers from 0"
      refusals = (("batch", why), ("heads", why))
    return ShardRule((Q_HEADS, KV_HEADS, KV_HEADS, PER_ROW, PER_ROW, PER_Q_HEAD, REPLICATED,
                      PER_ROW), (Q_HEADS, ROW_STATS), p.q_heads // p.kv_heads, refusals)

  def example(self, p: FlashProblem, key):
    kq, kk, kv, ks, kd = jax.random.split(key, 5)
    q, k, v = p.random_qkv((kq, kk, kv))
    sinks = jax.random.normal(kd, (p.q_heads,), jnp.float32) if p.sinks else None
    seed = seed_of(kd) if p.dropout_rate else None
    lengths = None
    if p.lengths:  # every row full but the first, which is shorter (not empty)
      lengths = jnp.array([[p.q_len, p.kv_len]] * p.batch, jnp.int32)
      lengths = lengths.at[0].set([max(1, p.q_len // 2),
                                   min(p.kv_len, max(p.q_len // 2, p.kv_len * 2 // 3))])
    if not p.segment_ids:
      return q, k, v, None, None, sinks, seed, lengths
    # Packed sequences: sorted ids, kv ids shifted so that some queries see nothing.
    ids = jnp.sort(jax.random.randint(ks, (p.batch, max(p.q_len, p.kv_len)), 0, 3), axis=1)
    return (q, k, v, ids[:, :p.q_len], ids[:, :p.kv_len] + (ids[:, :p.kv_len] == 2), sinks,
            seed, lengths)


FLASH = FlashAttention(MosaicFlash(), TritonFlash(), CudnnFlash(), XlaFlash())


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                    q_segment_ids=None, kv_segment_ids=None, local_window=None,
                    softcap: float | None = None, deterministic: bool = True,
                    return_lse: bool = False, sinks=None, dropout_rate: float = 0.0,
                    dropout_key=None, q_lengths=None, kv_lengths=None, backend: str = "auto",
                    config: BlockConfig | MosaicBlockConfig | None = None, q_descale=None,
                    k_descale=None, v_descale=None, out_dtype=None):
  """Memory-efficient exact attention, differentiable (custom VJP on Pallas backends).

  ``softmax(softcap(q kᵀ · scale) + mask) v`` computed tile by tile in fp32,
  never materialising the ``[q_len, kv_len]`` matrix on the Pallas backends.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``.
    k: ``[batch, kv_len, kv_heads, head_dim]``; v: ``[batch, kv_len, kv_heads,
      head_dim_v]`` (``head_dim_v`` independent of ``head_dim``, e.g. 192 and 128).
      ``q_heads`` must be a multiple of ``kv_heads`` (grouped-query / multi-query
      attention). float32, float16 or bfloat16, all the same dtype; any lengths;
      head dims up to 256 on the Pallas backends (any on ``xla``).
    causal: mask keys after the query. With ``q_len != kv_len`` the mask is
      aligned at the bottom-right (as flash-attn does): query ``i`` sits at key
      position ``i + kv_len - q_len``, so with ``q_len > kv_len`` the first rows
      see no key.
    scale: logit scale (> 0), default ``head_dim ** -0.5``.
    q_segment_ids, kv_segment_ids: ``[batch, q_len]`` / ``[batch, kv_len]``
      integers for packed sequences: a query attends only to keys of its segment.
    local_window: ``(left, right)``: query at position ``a`` sees keys in
      ``[a - left, a + right]`` (same alignment as ``causal``); ``None`` on a side
      means unbounded. Combined with ``causal``, ``right`` becomes 0.
    softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    deterministic: gradients bitwise repeatable from run to run (default). The
      Pallas backward kernels are, unless a ``MosaicBlockConfig(fused_dq=True)``
      (atomic dQ adds) is chosen; cuDNN's backward is not. ``deterministic=False``
      is what lets ``backend="cudnn"`` and ``fused_dq`` run, and lets ``"auto"``
      take cuDNN where it measured faster.
    return_lse: also return the log-sum-exp of each row.
    sinks: ``[q_heads]`` float logits (attention sinks): each row's softmax counts
      ``exp(sinks[h])`` in its denominator, a weight that attends to nothing. They
      get gradients; ``lse`` includes them. A sink at or below ``EMPTY_ROW_LSE``
      (-1e30; -inf too) counts as that: no sink, and no gradient.
    dropout_rate: drop each attention weight with this probability (in [0, 1)) and
      scale the kept ones by ``1 / (1 - rate)``; the mask is a hash of
      ``dropout_key`` (a ``jax.random`` key) and the position, so the backward
      rebuilds it and the same key gives bitwise the same outputs and gradients.
      Every backend but ``cudnn``; 0 runs the kernels without it.
    q_lengths, kv_lengths: ``[batch]`` integers (traced: one compile serves every
      length), each batch row's own query and key counts (clipped to ``[0, q_len]``
      and ``[0, kv_len]``; None: the whole axis). Keys at or past ``kv_lengths[b]``
      are not attended; query rows at or past ``q_lengths[b]`` are padding and give
      zeros (and no gradient). ``causal`` and ``local_window`` align each row on its
      own lengths: query ``i`` sits at key position ``i + kv_lengths[b] -
      q_lengths[b]``. What a KV cache (decode, speculative decoding, chunked prefill)
      needs; the Pallas backends read them in the kernels and skip the tiles past
      them.
    backend: ``"auto"``, ``"pallas_mosaic"``, ``"pallas_triton"``, ``"cudnn"`` or
      ``"xla"``. ``"auto"``: of the backends this device runs that support the
      call, the measured fastest for it where jattn's shipped table or your cache
      has times (``jattn.gpu.benchmark_backends(..., save=True)``), else the first
      in that order (``jattn.gpu.select_backend(..., explain=True)`` says which and
      why; docs/backends.md).
    config: tiles for the Pallas kernels: a ``BlockConfig`` for ``pallas_triton``,
      a ``MosaicBlockConfig`` for ``pallas_mosaic`` (with ``"auto"``, only the
      backend that takes it is considered). Default: the autotuner's cache
      (``jattn.autotune``), else a heuristic by head_dim.
    q_descale, k_descale, v_descale, out_dtype: FP8 inputs (q, k, v in
      ``float8_e4m3fn``, ``jattn.fp8.quantize_attention_inputs``): each array's values
      times its descale (float32, a scalar or ``[kv_heads]``; default 1) are the real
      ones; the output is ``out_dtype`` (default bfloat16). The FP8 recipe (FP8
      probabilities in ``p v``; ``jattn.fp8``) with ``causal``, ``scale``,
      ``local_window``, segment ids and ``config`` only, and no backward: the Hopper kernel
      (``pallas_mosaic``, 8-bit wgmma; its ``MosaicBlockConfig`` forward tiles, key
      tiles of 64, 128 or 256) or the ``xla`` reference.

  Returns:
    ``o: [batch, q_len, q_heads, head_dim_v]`` in q's dtype; with ``return_lse``
    also ``lse: [batch, q_heads, q_len]`` float32 (without dropout). A query row
    that sees no key gives zeros and ``lse = -1e30`` (finite; the sink's logit with
    ``sinks``), never NaN. Gradients flow to q, k, v and sinks (and through ``lse``
    when it is used); segment ids get none.
  """
  fp8 = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale,
         "out_dtype": out_dtype}
  if jnp.dtype(getattr(q, "dtype", jnp.float32)) == jnp.float8_e4m3fn or any(
      x is not None for x in fp8.values()):
    extra = {"softcap": softcap, "return_lse": return_lse or None, "sinks": sinks,
             "dropout_rate": dropout_rate or None, "q_lengths": q_lengths,
             "kv_lengths": kv_lengths}
    given = [name for name, value in extra.items() if value is not None]
    if given:
      raise ValueError(f"FP8 attention takes causal, scale, local_window, segment ids and "
                       f"config, not {given[0]}")
    return FP8_FLASH(q, k, v, causal=causal, scale=scale, local_window=local_window,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     backend=backend, config=config,
                     **{n: x for n, x in fp8.items() if x is not None})
  return FLASH(q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
               kv_segment_ids=kv_segment_ids, local_window=local_window, softcap=softcap,
               deterministic=deterministic, return_lse=return_lse, sinks=sinks,
               dropout_rate=dropout_rate, dropout_key=dropout_key, q_lengths=q_lengths,
               kv_lengths=kv_lengths, backend=backend, config=config)
