"""``jattn.retention`` and ``jattn.retention_step``: RetNet retention in its three forms.

Semantics (Sun et al. 2023, "Retentive Network"), per head with decay ``γ``:

- parallel:  ``O = (scale · Q Kᵀ ⊙ D) V`` with ``D[n, m] = γ^(n-m)`` for ``n >= m``, else 0;
- recurrent: ``S_t = γ S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t``;
- chunkwise: the recurrent state carried between chunks of ``chunk_size`` positions,
  the parallel form inside a chunk. All three give the same output, for every decay
  in [0, 1] (γ = 0 keeps only the current position).

Non-finite values stay in the rows that see them: row n sees q_n, the keys and
values at positions up to its own and the initial state; it comes out NaN (or inf)
when one of them holds an inf or NaN, and exact otherwise, in every form and backend
(docs/retention.md, "Non-finite values").

Packed sequences (``cu_seqlens``, RetNet training on packed batches): q, k, v hold
sequences one after another (batch 1), and every form restarts the state at each
sequence's first position, so row n sees only its own sequence. ``retention_step``'s
``reset`` does the same for the slots of a serving batch.

Each form is an op of its own (``retention_parallel``, ``retention_chunkwise``,
``retention_recurrent``, ``retention_step``) sharing one problem class and one
validation; ``retention`` picks the form (``mode``). Implementations:
``pallas_mosaic`` (the parallel form's forward on Hopper, on the flash forward's
pipeline; its backward runs the Triton kernels), ``pallas_triton``
(``jattn.kernels.retention``: a flash-style parallel kernel, the chunk-state and
per-chunk kernels, the decoding step) and ``xla`` (pure jnp, all forms; the only one
of the recurrent form over a whole sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.cache import bucket
from jattn.core.device import shared_memory_limit
from jattn.core.op import MosaicImpl, Op, Problem, TritonImpl, XlaImpl, run
from jattn.core.sharding import PER_Q_HEAD, PER_ROW, Q_HEADS, REPLICATED, Axes, ShardRule
from jattn.core.validation import (check_array, check_choice, check_flag, check_positive_int,
                                   check_same_dtype, check_shape, scale_of)
from jattn.kernels.common.config import over_budget, padded_head_dim
from jattn.kernels.retention import (MIN_CHUNK, ChunkwiseConfig, default_chunkwise_config,
                                     default_parallel_config, fitting_chunk,
                                     retention_chunkwise_backward, retention_chunkwise_forward,
                                     retention_parallel_backward, retention_parallel_forward,
                                     retention_step_backward, retention_step_forward)
from jattn.kernels.flash.config import FORWARD_SEARCH, MosaicBlockConfig, default_mosaic_config
from jattn.kernels.hopper.budget import MOSAIC_REGISTER_BUDGET, mosaic_head_dim
from jattn.kernels.hopper.forward import forward_cost
from jattn.kernels.hopper.inputs import PositionInputs
from jattn.kernels.retention.config import CHUNKWISE_SEARCH, grad_kernel_bytes
from jattn.kernels.retention.mosaic import retention_mosaic_forward
from jattn.kernels.retention.packing import final_states, sequence_bounds, sequence_ids
from jattn.reference import default_decay, retention_reference
from jattn.tuning.spaces import BlockTritonImpl

MODES = ("auto", "parallel", "chunkwise", "recurrent")
NORMALIZERS = (None, "abs_sum")
DEFAULT_CHUNK = 64
# Above this many key positions "auto" runs chunkwise: the parallel form's work grows
# with seq², the chunkwise form's linearly (docs/retention.md has the measured crossover).
PARALLEL_MAX_LEN = 512


@dataclasses.dataclass(frozen=True)
class RetentionProblem(Problem):
  """One retention call (any form), without its arrays. ``q_len <= kv_len``: queries
  are the last ``q_len`` positions; for ``retention_step`` both are 1."""

  batch: int = 1
  q_len: int = 1
  kv_len: int | None = None  # default q_len
  heads: int = 1
  dk: int = 64
  dv: int | None = None  # default dk
  dtype: Any = jnp.float16
  scale: float | None = None  # default dk ** -0.5
  normalize: str | None = None
  chunk_size: int | None = None  # the caller's; None: the config's
  initial_state: bool = False
  sequences: int | None = None  # packed sequences (cu_seqlens, batch 1); None: not packed
  reset: bool = False  # retention_step: a reset flag per slot

  def __post_init__(self):
    self._normalize(self.dk, kv_len=self.q_len, dv=self.dk)

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.dk, self.dv)

  def local(self, batch_shards: int, head_shards: int) -> "RetentionProblem":
    """This problem on one shard of ``batch_shards`` x ``head_shards``."""
    return dataclasses.replace(self, batch=self.batch // batch_shards,
                               heads=self.heads // head_shards)

  def check_fields(self) -> None:
    super().check_fields()
    if self.sequences is not None and (self.batch != 1 or self.kv_len != self.q_len
                                       or self.initial_state):
      raise ValueError("sequences (packed, cu_seqlens) needs batch 1, kv_len == q_len and "
                       "no initial_state")


def _no_grad(packing) -> tuple:
  """The gradient slot of an op's trailing integer array (``cu_seqlens``, ``reset``):
  None where it is given, nothing where it is not."""
  return () if packing is None else (None,)


def _check_decay(decay, heads: int):
  """``decay`` is None or ``[heads]``, and where its values are known (not traced) in
  [0, 1] (γ = 0 keeps only the current position: ``γ^0 = 1``, later powers 0)."""
  if decay is None:
    return
  if tuple(np.shape(decay)) != (heads,):
    raise ValueError(f"decay must have shape [heads] = ({heads},), got {np.shape(decay)}")
  if not isinstance(decay, jax.core.Tracer):
    values = np.asarray(decay, np.float64)
    if not np.all((values >= 0) & (values <= 1)):
      raise ValueError(f"decay must be in [0, 1] for every head, got {values.tolist()}")


def _decay_array(decay, heads: int):
  """The decay the kernels take: float32, NaN for a traced value outside [0, 1] (so
  that head comes out NaN in every form and backend alike), and a constant (no backend
  gives it a gradient, as the Pallas backward kernels do not)."""
  _check_decay(decay, heads)
  if decay is None:
    return default_decay(heads)
  decay = jnp.asarray(decay, jnp.float32)
  return jax.lax.stop_gradient(jnp.where((decay >= 0) & (decay <= 1), decay, jnp.nan))


def _log2_decay(decay):
  """``log2 γ`` as the kernels take it (they compute ``γ^n = exp2(n · log2 γ)``), with
  log2 0 as the most negative finite float32: ``exp2(0 · -inf)`` would make γ^0 NaN for
  γ = 0, and subnormal γ flush to 0 on the way."""
  return jnp.maximum(jnp.log2(decay), -jnp.finfo(jnp.float32).max)


def _decay_powers(decay, exponents):
  """``γ^exponents``, ``[len(exponents), heads]`` float32, as the kernels compute it."""
  return jnp.exp2(exponents[:, None] * _log2_decay(decay)[None, :])


def _state_array(initial_state, batch, heads, dk, dv):
  expected = (batch, heads, dk, dv)
  if initial_state is None:
    return jnp.zeros(expected, jnp.float32)
  check_shape("initial_state", initial_state, expected, "batch, heads, dk, dv")
  return initial_state.astype(jnp.float32)


def _check_cu_seqlens(cu_seqlens, q, k, initial_state):
  """``cu_seqlens`` as the kernels take it (int32 ``[num_seqs + 1]``), after the checks:
  integers, rank 1, at least one sequence, q, k, v of batch 1 and one length, no
  initial state, and, where its values are known (not traced), from 0 to that length,
  non-decreasing."""
  if not hasattr(cu_seqlens, "shape"):
    cu_seqlens = np.asarray(cu_seqlens)
  if not (jnp.issubdtype(cu_seqlens.dtype, jnp.integer) and cu_seqlens.dtype != bool):
    raise TypeError(f"cu_seqlens must be integers [num_seqs + 1], got dtype {cu_seqlens.dtype}")
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError("cu_seqlens must have rank 1 [num_seqs + 1] with at least 2 entries, got "
                     f"shape {tuple(cu_seqlens.shape)}")
  if q.shape[0] != 1:
    raise ValueError("cu_seqlens packs sequences along the length: q, k, v must have batch 1, "
                     f"got q of shape {tuple(q.shape)}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"cu_seqlens needs q_len == kv_len, got {q.shape[1]} and {k.shape[1]}")
  if initial_state is not None:
    raise ValueError("initial_state cannot be given with cu_seqlens: every packed sequence "
                     "starts from a zero state")
  if not isinstance(cu_seqlens, jax.core.Tracer):
    values = np.asarray(cu_seqlens, np.int64)
    if values[0] != 0 or values[-1] != q.shape[1] or np.any(np.diff(values) < 0):
      raise ValueError(f"cu_seqlens must run from 0 to the length ({q.shape[1]}) without "
                       f"decreasing, got {values.tolist()}")
  return jnp.asarray(cu_seqlens).astype(jnp.int32)


def bind_sequence(q, k, v, *, decay=None, scale=None, normalize=None, initial_state=None,
                  chunk_size=None, cu_seqlens=None):
  """The shared validation of the sequence forms: ``(problem, (q, k, v, decay, state))``,
  and ``cu_seqlens`` after them when given."""
  check_array("q", q, "batch, q_len, heads, dk")
  check_array("k", k, "batch, kv_len, heads, dk")
  check_array("v", v, "batch, kv_len, heads, dv")
  check_same_dtype(q=q, k=k, v=v)
  batch, q_len, heads, dk = q.shape
  check_shape("k", k, (batch, None, heads, dk), "batch, kv_len, heads, dk")
  check_shape("v", v, (*k.shape[:3], None), "batch, kv_len, heads, dv")
  if q_len > k.shape[1]:
    raise ValueError(f"q_len ({q_len}) must be <= kv_len ({k.shape[1]}): queries are the "
                     "last q_len positions")
  check_choice("normalize", normalize, NORMALIZERS)
  check_positive_int("chunk_size", chunk_size, optional=True)
  packed = ()
  if cu_seqlens is not None:
    packed = (_check_cu_seqlens(cu_seqlens, q, k, initial_state),)
  problem = RetentionProblem(batch=batch, q_len=q_len, kv_len=k.shape[1], heads=heads, dk=dk,
                             dv=v.shape[-1], dtype=q.dtype, scale=scale_of(scale, dk),
                             normalize=normalize, chunk_size=chunk_size,
                             initial_state=initial_state is not None,
                             sequences=packed[0].shape[0] - 1 if packed else None)
  arrays = (q, k, v, _decay_array(decay, heads),
            _state_array(initial_state, batch, heads, dk, v.shape[-1])) + packed
  return problem, arrays


def _random_packing(key, length: int, sequences: int):
  """``cu_seqlens`` of ``sequences`` random lengths (empty ones too) summing to ``length``."""
  cuts = jnp.sort(jax.random.randint(key, (sequences - 1,), 0, length + 1))
  return jnp.concatenate([jnp.zeros(1, jnp.int32), cuts.astype(jnp.int32),
                          jnp.full(1, length, jnp.int32)])


def _example(p: RetentionProblem, key):
  """Random ``(q, k, v, decay, state)``, and the packing (``cu_seqlens``) of a packed
  problem."""
  kq, kk, kv, ks = jax.random.split(key, 4)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(p.dtype)
  q = normal(kq, (p.batch, p.q_len, p.heads, p.dk))
  k = normal(kk, (p.batch, p.kv_len, p.heads, p.dk))
  v = normal(kv, (p.batch, p.kv_len, p.heads, p.dv))
  # Decays from fast to RetNet-slow, so that γ^(n-m) spans orders of magnitude.
  decay = jnp.linspace(0.7, 0.99, p.heads, dtype=jnp.float32)
  state = (0.1 * jax.random.normal(ks, (p.batch, p.heads, p.dk, p.dv), jnp.float32)
           if p.initial_state else jnp.zeros((p.batch, p.heads, p.dk, p.dv), jnp.float32))
  packed = (_random_packing(ks, p.q_len, p.sequences),) if p.sequences else ()
  return (q, k, v, decay, state) + packed


class _SequenceForm(Op):
  """A sequence form of retention: arrays ``(q, k, v, decay, state)``, then
  ``cu_seqlens`` where the problem is packed."""

  problem_cls = RetentionProblem
  arg_names = ("q", "k", "v", "decay", "initial_state", "cu_seqlens")

  outputs = (Q_HEADS,)  # o; the chunkwise form adds the final state

  def bind(self, q, k, v, **kwargs):
    return bind_sequence(q, k, v, **kwargs)

  def shard_rule(self, p: RetentionProblem) -> ShardRule:
    refusals = (("batch", "packed sequences (cu_seqlens) are one batch row"),) if (
        p.sequences) else ()
    return ShardRule((Q_HEADS, Q_HEADS, Q_HEADS, PER_Q_HEAD, STATES, REPLICATED), self.outputs,
                     refusals=refusals)

  def example(self, p, key):
    return _example(p, key)


# [batch, heads, dk, dv]: initial and final states.
STATES = Axes(batch=0, heads=1)


def _rerun_forward(impl, call, arrays, outputs):
  """``Impl.residuals_of`` for kernels whose residuals (row denominators, chunk
  states) are not among their outputs: the sharded path runs the forward again on
  each shard in the backward."""
  del outputs
  return impl.forward(call, *arrays)[1]


def _cache_fields(p: RetentionProblem) -> tuple[str, ...]:
  return (p.dtype.name, f"dk{padded_head_dim(p.dk)}", f"dv{padded_head_dim(p.dv)}",
          f"s{bucket(p.kv_len)}")


# --- parallel ------------------------------------------------------------------------------

class TritonParallel(BlockTritonImpl):
  residuals_of = _rerun_forward

  def rows(self, p):
    return p.q_len, p.kv_len

  def heuristic_config(self, p, info):
    return default_parallel_config(max(p.dk, p.dv), p.dtype.itemsize)

  def cache_key(self, p):
    return _cache_fields(p) + (str(p.normalize),)

  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    p = call.problem
    log2_decay = _log2_decay(decay)
    o, den = retention_parallel_forward(q, k, v, log2_decay, scale=p.scale,
                                        normalize=p.normalize == "abs_sum", config=call.config,
                                        interpret=call.interpret, cu_seqlens=cu_seqlens)
    return o, (q, k, v, log2_decay, den, cu_seqlens)

  def backward(self, call, residuals, do):
    q, k, v, log2_decay, den, cu_seqlens = residuals
    dq, dk, dv = retention_parallel_backward(q, k, v, log2_decay, den, do,
                                             scale=call.problem.scale, config=call.config,
                                             interpret=call.interpret, cu_seqlens=cu_seqlens)
    return (dq, dk, dv, None, None) + _no_grad(cu_seqlens)


class MosaicParallel(MosaicImpl):
  """The Hopper forward (``jattn.kernels.retention.mosaic``); the backward runs the
  Triton kernels on its row denominators."""

  config_cls = MosaicBlockConfig
  residuals_of = _rerun_forward

  def heuristic_config(self, p, info):
    return default_mosaic_config(p.dk, p.dv)

  def cache_key(self, p):
    return _cache_fields(p) + (str(p.normalize),)

  def tuning_stages(self):
    return FORWARD_SEARCH

  def _misfit(self, config, p, info, registers: bool):
    # The forward kernel alone: the backward runs the Triton kernels. Its rows reduce
    # only for the abs-sum denominator; packed sequences add segment ids.
    cost = forward_cost(config.block_q, config.block_kv, config.stages, mosaic_head_dim(p.dk),
                        mosaic_head_dim(p.dv), p.dtype.itemsize,
                        vectors=PositionInputs(segments=p.sequences is not None).vectors,
                        reduces=p.normalize == "abs_sum")
    return over_budget("forward", cost, shared_memory_limit(info),
                       MOSAIC_REGISTER_BUDGET if registers else None)

  def fits(self, config, p, info, kernels=()):
    return self._misfit(config, p, info, registers=True)

  def compile_misfit(self, config, p, info):
    return self._misfit(config, p, info, registers=False)

  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    p = call.problem
    log2_decay = _log2_decay(decay)
    c = call.config
    o, den = retention_mosaic_forward(q, k, v, log2_decay, scale=p.scale,
                                      normalize=p.normalize == "abs_sum", block_q=c.block_q,
                                      block_kv=c.block_kv, stages=c.stages,
                                      persistent=c.persistent, cu_seqlens=cu_seqlens)
    return o, (q, k, v, log2_decay, den, cu_seqlens)

  def backward(self, call, residuals, do):
    q, k, v, log2_decay, den, cu_seqlens = residuals
    p = call.problem
    dq, dk, dv = retention_parallel_backward(
        q, k, v, log2_decay, den, do, scale=p.scale,
        config=default_parallel_config(max(p.dk, p.dv), p.dtype.itemsize), interpret=False,
        cu_seqlens=cu_seqlens)
    return (dq, dk, dv, None, None) + _no_grad(cu_seqlens)


class XlaParallel(XlaImpl):
  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    p = call.problem
    return retention_reference(q, k, v, decay=decay, scale=p.scale, normalize=p.normalize,
                               cu_seqlens=cu_seqlens).astype(q.dtype), None


class RetentionParallel(_SequenceForm):
  name = "retention_parallel"


# --- chunkwise -----------------------------------------------------------------------------

def _chunk_bytes(chunk: int, p: RetentionProblem) -> int:
  return grad_kernel_bytes(chunk, padded_head_dim(p.dk), padded_head_dim(p.dv), p.dtype.itemsize)


class TritonChunkwise(TritonImpl):
  residuals_of = _rerun_forward

  config_cls = ChunkwiseConfig

  def gaps(self, p):
    chunk = p.chunk_size
    odd = chunk is not None and (chunk < MIN_CHUNK or chunk & (chunk - 1))
    return super().gaps(p) + ((f"chunk_size {chunk} (it takes powers of two >= {MIN_CHUNK})",)
                              if odd else ())

  def heuristic_config(self, p, info):
    """The caller's chunk (default 64), halved until the kernels fit the GPU's shared
    memory (interpret mode has no limit); state tiles by ``default_chunkwise_config``."""
    chunk = p.chunk_size or DEFAULT_CHUNK
    if info.is_gpu and not info.interpret:
      chunk = fitting_chunk(chunk, p.dk, p.dv, p.dtype.itemsize,
                            shared_memory_limit(info)) or MIN_CHUNK
    return default_chunkwise_config(p.batch, p.heads, p.dk, p.dv,
                                    info.sm_count if info.is_gpu else None, chunk=chunk)

  def cache_key(self, p):
    # A caller's chunk_size is kept (its own key): only the rest of the config is tuned.
    chunk = (f"c{p.chunk_size}",) if p.chunk_size else ()
    return _cache_fields(p) + (f"b{p.batch * p.heads}",) + chunk

  def normalize_config(self, config, p):
    return dataclasses.replace(config, chunk=p.chunk_size) if p.chunk_size else config

  def tuning_stages(self):
    return CHUNKWISE_SEARCH

  def fits(self, config, p, info, kernels=()):
    need, limit = _chunk_bytes(config.chunk, p), shared_memory_limit(info)
    if need > limit:
      return (f"shared memory at chunk {config.chunk} (dk={p.dk}, dv={p.dv}, {p.dtype.name}): "
              f"{need // 1024} KiB > {limit // 1024} KiB")
    return None

  # grad_kernel_bytes matches what Triton asks for (docs/backends.md)
  compile_misfit = fits

  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    p = call.problem
    # Keys before the first query: zero queries there give outputs that are dropped.
    prefix = p.kv_len - p.q_len
    q_full = jnp.pad(q, ((0, 0), (prefix, 0), (0, 0), (0, 0))) if prefix else q
    log2_decay = _log2_decay(decay)
    o, final, states = retention_chunkwise_forward(q_full, k, v, state, log2_decay,
                                                   scale=p.scale, config=call.config,
                                                   interpret=call.interpret, cu_seqlens=cu_seqlens)
    return (o[:, prefix:], final), (q_full, k, v, states, log2_decay, cu_seqlens)

  def backward(self, call, residuals, cotangents):
    q_full, k, v, states, log2_decay, cu_seqlens = residuals
    do, dfinal = cotangents
    prefix = call.problem.kv_len - call.problem.q_len
    do = jnp.pad(do, ((0, 0), (prefix, 0), (0, 0), (0, 0))) if prefix else do
    dq, dk, dv, ds0 = retention_chunkwise_backward(q_full, k, v, states, log2_decay, do, dfinal,
                                                   scale=call.problem.scale, config=call.config,
                                                   interpret=call.interpret, cu_seqlens=cu_seqlens)
    return (dq[:, prefix:], dk, dv, None, ds0) + _no_grad(cu_seqlens)


def _chunk_terms(q, k, v, decay, scale, state, packing=None):
  """One chunk of length ``c``: output and the state after it (all float32).

  q, k: ``[batch, c, heads, dk]``; v: ``[batch, c, heads, dv]``; state: ``[batch, heads, dk, dv]``;
  packing: None, or the chunk's packed sequences ``(cu_seqlens, start)``: cu_seqlens
  shifted to the chunk and clipped to it, and each position's sequence start relative
  to the chunk (``[c]``, negative where it began before the chunk).
  """
  c = q.shape[1]
  cu_seqlens, start = (None, None) if packing is None else packing
  # Inside the chunk the parallel form (with its guard against non-finite values past
  # a row); query i sees the carried state through γ^(i+1).
  o = retention_reference(q, k, v, decay=decay, scale=scale, cu_seqlens=cu_seqlens)
  q_decay = _decay_powers(decay, jnp.arange(1, c + 1, dtype=jnp.float32))  # [c, heads]
  from_state = scale * jnp.einsum("bqhk,bhkv->bqhv", q * q_decay[None, :, :, None], state,
                                  precision="highest")
  if start is not None:  # rows whose sequence starts in the chunk: selected, it may hold an inf
    from_state = jnp.where((start < 0)[None, :, None, None], from_state, 0.0)
  return o + from_state, _state_of(k, v, decay, state, None if start is None else start[-1])


def _state_of(k, v, decay, state, last_start=None):
  """The state after keys ``k, v`` (``[batch, c, heads, d]``) from ``state``: key ``j``
  reaches the end through ``γ^(c-1-j)``. ``last_start`` (packed): where the last
  sequence starts, relative to the keys: only its keys reach the end, and ``state``
  only where it began before them."""
  c = k.shape[1]
  k_decay = _decay_powers(decay, c - 1.0 - jnp.arange(c, dtype=jnp.float32))
  carried = jnp.exp2(c * _log2_decay(decay))[None, :, None, None] * state
  if last_start is not None:  # selected, not multiplied: dropped keys may hold an inf
    kept = (jnp.arange(c) >= last_start)[None, :, None, None]
    k, v = jnp.where(kept, k, 0.0), jnp.where(kept, v, 0.0)
    carried = jnp.where(last_start < 0, carried, 0.0)
  return carried + jnp.einsum("bkhd,bkhv->bhdv", k * k_decay[None, :, :, None], v,
                              precision="highest")


def _split_prefix(q, k, v, decay, state):
  """Keys before the first query only feed the state: the state after them, and the
  keys and values from the first query on."""
  prefix = k.shape[1] - q.shape[1]
  if prefix:
    state = _state_of(k[:, :prefix], v[:, :prefix], decay, state)
  return k[:, prefix:], v[:, prefix:], state


def _jnp_chunks(q, k, v, decay, scale, state, chunk: int, cu_seqlens=None):
  """The chunkwise form on float32 ``[batch, length, heads, d]`` arrays: a scan over the
  full chunks, then the remainder. Returns ``(o, the state after, the states before
  every chunk)``, those ``[chunks, batch, heads, dk, dv]`` where packed, else None."""
  length = q.shape[1]
  n_full = length // chunk
  starts = None
  if cu_seqlens is not None:
    starts = sequence_bounds(sequence_ids(cu_seqlens, length))[0]

  def terms(state, q, k, v, c0, start):
    packing = None if start is None else (jnp.clip(cu_seqlens - c0, 0, q.shape[1]), start - c0)
    o, after = _chunk_terms(q, k, v, decay, scale, state, packing)
    return after, (o, None if start is None else state)

  outputs, before = [], []
  if n_full:
    def split(x, axis=1):
      x = jax.lax.slice_in_dim(x, 0, n_full * chunk, axis=axis)
      x = x.reshape(x.shape[:axis] + (n_full, chunk) + x.shape[axis + 1:])
      return jnp.moveaxis(x, axis, 0)

    xs = (split(q), split(k), split(v), jnp.arange(n_full) * chunk,
          None if starts is None else split(starts, 0))
    state, (o, b) = jax.lax.scan(lambda state, x: terms(state, *x), state, xs)
    outputs.append(jnp.moveaxis(o, 0, 1).reshape(q.shape[0], n_full * chunk, *o.shape[3:]))
    before.append(b)
  if length % chunk:
    tail = slice(n_full * chunk, length)
    state, (o, b) = terms(state, q[:, tail], k[:, tail], v[:, tail], n_full * chunk,
                          None if starts is None else starts[tail])
    outputs.append(o)
    before.append(None if b is None else b[None])
  o = jnp.concatenate(outputs, axis=1)
  return o, state, None if starts is None else jnp.concatenate(before)


class XlaChunkwise(XlaImpl):
  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    """``_jnp_chunks``; packed, each sequence's last state from the states before the
    chunks (``final_states``, as the Pallas form)."""
    p = call.problem
    chunk = p.chunk_size or DEFAULT_CHUNK
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v, state = _split_prefix(q, k, v, decay, state)
    o, state, before = _jnp_chunks(q, k, v, decay, p.scale, state, chunk, cu_seqlens)
    if cu_seqlens is not None:
      state = final_states(k, v, _log2_decay(decay), before[:, 0], cu_seqlens, chunk)
    return (o.astype(p.dtype), state), None


class RetentionChunkwise(_SequenceForm):
  name = "retention_chunkwise"
  diff_argnums = (0, 1, 2, 4)
  outputs = (Q_HEADS, STATES)


# --- recurrent -----------------------------------------------------------------------------

def _step(q, k, v, decay, scale, state, reset=None):
  """One position of ``[batch, heads, d]`` arrays: ``(o, new state)``; ``reset``
  (``[batch]`` bool or None): the rows whose old state is taken as zeros (selected: it
  may hold an inf)."""
  state = decay[None, :, None, None] * state
  if reset is not None:
    state = jnp.where(reset[:, None, None, None], 0.0, state)
  state = state + jnp.einsum("bhk,bhv->bhkv", k, v, precision="highest")
  return scale * jnp.einsum("bhk,bhkv->bhv", q, state, precision="highest"), state


class XlaRecurrent(XlaImpl):
  def forward(self, call, q, k, v, decay, state, cu_seqlens=None):
    """A scan over positions; packed, the state restarts at each sequence's first
    position and each sequence's last state is kept (a slot per sequence)."""
    p = call.problem
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v, state = _split_prefix(q, k, v, decay, state)
    finals = resets = ids = None
    if cu_seqlens is not None:
      ids = sequence_ids(cu_seqlens, p.q_len)
      resets = sequence_bounds(ids)[0] == jnp.arange(p.q_len)
      finals = jnp.zeros((p.sequences,) + state.shape[1:], jnp.float32)

    def body(carry, xs):
      state, finals = carry
      q_t, k_t, v_t, reset, seq = xs
      o, state = _step(q_t, k_t, v_t, decay, p.scale, state,
                       None if reset is None else reset[None])
      if finals is not None:
        finals = jax.lax.dynamic_update_index_in_dim(finals, state[0], seq, 0)
      return (state, finals), o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v)) + (resets, ids)
    (state, finals), o = jax.lax.scan(body, (state, finals), xs)
    return (jnp.moveaxis(o, 0, 1).astype(p.dtype), state if finals is None else finals), None


class RetentionRecurrent(_SequenceForm):
  name = "retention_recurrent"
  diff_argnums = (0, 1, 2, 4)


# --- the decoding step ---------------------------------------------------------------------

class TritonStep(TritonImpl):
  def residuals_of(self, call, arrays, outputs):
    q, k, v, _, decay, *reset = arrays
    return (q, k, v, outputs[1], _log2_decay(decay), reset[0] if reset else None)

  def forward(self, call, q, k, v, state, decay, reset=None):
    log2_decay = _log2_decay(decay)
    o, new_state = retention_step_forward(q, k, v, state, log2_decay, scale=call.problem.scale,
                                          interpret=call.interpret, reset=reset)
    return (o, new_state), (q, k, v, new_state, log2_decay, reset)

  def backward(self, call, residuals, cotangents):
    q, k, v, new_state, log2_decay, reset = residuals
    dq, dk, dv, dstate = retention_step_backward(q, k, v, new_state, log2_decay, *cotangents,
                                                 scale=call.problem.scale, reset=reset)
    return (dq, dk, dv, dstate, None) + _no_grad(reset)


class XlaStep(XlaImpl):
  def forward(self, call, q, k, v, state, decay, reset=None):
    o, state = _step(*(x.astype(jnp.float32) for x in (q, k, v)), decay, call.problem.scale,
                     state, reset)
    return (o.astype(q.dtype), state), None


def _check_reset(reset, batch: int):
  """``reset`` as ``[batch]`` bool (a list or a numpy array too)."""
  if not hasattr(reset, "shape"):
    reset = np.asarray(reset)
  check_shape("reset", reset, (batch,), "batch")
  if reset.dtype != bool:
    raise TypeError(f"reset must be bool [batch], got dtype {reset.dtype}")
  return jnp.asarray(reset)


class RetentionStep(Op):
  name = "retention_step"
  problem_cls = RetentionProblem
  arg_names = ("q", "k", "v", "state", "decay", "reset")
  diff_argnums = (0, 1, 2, 3)

  def shard_rule(self, p: RetentionProblem) -> ShardRule:
    per_head = Axes(batch=0, heads=1)  # [batch, heads, d] and the states
    return ShardRule((per_head, per_head, per_head, STATES, PER_Q_HEAD, PER_ROW),
                     (per_head, STATES))

  def bind(self, q, k, v, state, *, decay=None, scale=None, reset=None):
    check_array("q", q, "batch, heads, dk")
    check_array("k", k, "batch, heads, dk")
    check_array("v", v, "batch, heads, dv")
    check_same_dtype(q=q, k=k, v=v)
    batch, heads, dk = q.shape
    check_shape("k", k, tuple(q.shape), "batch, heads, dk")
    check_shape("v", v, (batch, heads, None), "batch, heads, dv")
    dv = v.shape[-1]
    check_shape("state", state, (batch, heads, dk, dv), "batch, heads, dk, dv")
    resets = () if reset is None else (_check_reset(reset, batch),)
    problem = RetentionProblem(batch=batch, heads=heads, dk=dk, dv=dv, dtype=q.dtype,
                               scale=scale_of(scale, dk), initial_state=True,
                               reset=reset is not None)
    return problem, (q, k, v, state.astype(jnp.float32), _decay_array(decay, heads)) + resets

  def example(self, p, key):
    q, k, v, decay, state = _example(p, key)[:5]
    resets = (jax.random.bernoulli(key, 0.5, (p.batch,)),) if p.reset else ()
    return (q[:, 0], k[:, 0], v[:, 0], state, decay) + resets


RETENTION_PARALLEL = RetentionParallel(MosaicParallel(), TritonParallel(), XlaParallel())
RETENTION_CHUNKWISE = RetentionChunkwise(TritonChunkwise(), XlaChunkwise())
RETENTION_RECURRENT = RetentionRecurrent(XlaRecurrent())
RETENTION_STEP = RetentionStep(TritonStep(), XlaStep())
FORMS = {"parallel": RETENTION_PARALLEL, "chunkwise": RETENTION_CHUNKWISE,
         "recurrent": RETENTION_RECURRENT}


def retention(q, k, v, *, decay=None, scale: float | None = None, mode: str = "auto",
              normalize: str | None = None, initial_state=None, return_state: bool = False,
              chunk_size: int | None = None, cu_seqlens=None, backend: str = "auto"):
  """Multi-head retention (RetNet), differentiable.

  Args:
    q, k: ``[batch, q_len, heads, dk]`` / ``[batch, kv_len, heads, dk]``; v:
      ``[batch, kv_len, heads, dv]``. ``q_len <= kv_len``: queries are the last
      ``q_len`` positions. float32, float16 or bfloat16, all one dtype; computed in
      float32.
    decay: ``[heads]`` γ per head in [0, 1] (default RetNet's ``1 - 2**(-5 - arange(heads))``;
      γ = 0 keeps only the current position). Checked where its values are known;
      under ``jit`` a head whose γ is outside [0, 1] (or NaN) comes out NaN.
    scale: default ``dk ** -0.5``.
    mode: ``"parallel"``, ``"chunkwise"``, ``"recurrent"`` or ``"auto"`` (chunkwise
      above ``PARALLEL_MAX_LEN`` key positions or with a state in or out, else parallel).
    normalize: None or ``"abs_sum"`` (parallel only): each row of
      ``S = scale · Q Kᵀ ⊙ D`` is divided by ``max(Σ_m |S[n, m]|, 1)``, held constant
      in the backward as torchscale does.
    initial_state: ``[batch, heads, dk, dv]`` state before the first position.
    return_state: also return the state after the last position.
    chunk_size: positions per chunk in chunkwise mode (default: the tuned or default
      64). It changes speed, not the result; the Pallas kernels take powers of two
      >= 16 and lower it where their tiles would not fit the GPU's shared memory (e.g.
      to 32 for float32 with dk = dv = 128 on an H100).
    cu_seqlens: ``[num_seqs + 1]`` ints, or None: packed sequences (training on packed
      batches). q, k, v are ``[1, total, heads, d]`` and hold sequence ``i`` at
      positions ``[cu_seqlens[i], cu_seqlens[i + 1])``, from 0 to ``total``,
      non-decreasing (checked where the values are known; under ``jit`` positions
      outside the range join the first or last sequence); empty sequences are allowed.
      Each sequence is independent: its state starts from zero at its first position
      (``initial_state`` is refused), ``D[n, m] = 0`` across sequences. A traced array:
      one compiled program serves every packing of ``total`` positions into
      ``num_seqs`` sequences. Every form and backend takes it.
    backend: ``"auto"`` (the Pallas kernels where usable, else jnp),
      ``"pallas_mosaic"`` (parallel, Hopper, 16-bit inputs), ``"pallas_triton"``
      (parallel and chunkwise) or ``"xla"`` (pure jnp).

  Returns:
    ``o: [batch, q_len, heads, dv]`` in q's dtype, and with ``return_state`` the final
    state ``[batch, heads, dk, dv]`` float32 (with ``cu_seqlens``: each sequence's
    last state, ``[num_seqs, heads, dk, dv]``, zeros for an empty one: what decoding
    each sequence on with ``retention_step`` starts from). A row that sees an inf or
    NaN (in q at its own position, k or v at or before it in its sequence, or the
    initial state) is non-finite; the other rows, and the gradients they send back,
    are exact.
  """
  check_choice("mode", mode, MODES)
  return_state = check_flag("return_state", return_state)
  problem, arrays = bind_sequence(q, k, v, decay=decay, scale=scale, normalize=normalize,
                                  initial_state=initial_state, chunk_size=chunk_size,
                                  cu_seqlens=cu_seqlens)
  stateful = return_state or initial_state is not None
  if mode == "auto":
    mode = "chunkwise" if stateful or problem.kv_len > PARALLEL_MAX_LEN else "parallel"
  if mode == "parallel" and stateful:
    raise ValueError("mode='parallel' has no state: use 'chunkwise' or 'recurrent' with "
                     "initial_state / return_state")
  if normalize is not None and mode != "parallel":
    raise ValueError("normalize='abs_sum' needs the whole row of scores: use "
                     "mode='parallel' without initial_state")
  if mode == "recurrent" and backend == "pallas_triton":
    raise ValueError("backend='pallas_triton' has no recurrent kernel over a sequence (use "
                     "retention_step for decoding, or mode='chunkwise')")
  op = FORMS[mode]
  outputs = run(op.prepare(problem, backend), arrays)
  if mode == "parallel":
    return outputs
  return outputs if return_state else outputs[0]


def retention_step(q, k, v, state, *, decay=None, scale: float | None = None, reset=None,
                   backend: str = "auto"):
  """One recurrent (decoding) step: ``S' = γ S + kᵀ v``, ``o = scale · q S'``.

  Each batch row is a slot of a serving batch with a sequence of its own.

  Args:
    q, k: ``[batch, heads, dk]``; v: ``[batch, heads, dv]``; state ``[batch, heads, dk, dv]``
      (zeros before the first position).
    decay, scale: as ``retention``.
    reset: ``[batch]`` bool, or None: True where the slot starts a new sequence at this
      step (its request finished and another took the slot): its ``state`` is taken
      as zeros (whatever it holds, inf or NaN included) and gets a zero gradient. A
      traced array: one compiled step serves every pattern of resets.
    backend: ``"auto"`` (the Pallas step kernel where usable, else jnp),
      ``"pallas_triton"`` or ``"xla"``. Both are differentiable.

  Returns:
    ``(o, new_state)``: ``o: [batch, heads, dv]`` in q's dtype, the state float32;
    non-finite for a (batch, head) whose q, k, v or (not reset) state holds an inf or
    NaN.
  """
  return RETENTION_STEP(q, k, v, state, decay=decay, scale=scale, reset=reset,
                        backend=backend)
