"""``jattn.retention`` and ``jattn.retention_step``: RetNet retention in its three forms.

Semantics (Sun et al. 2023, "Retentive Network"), per head with decay ``γ``:

- parallel:  ``O = (scale · Q Kᵀ ⊙ D) V`` with ``D[n, m] = γ^(n-m)`` for ``n >= m``, else 0;
- recurrent: ``S_t = γ S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t``;
- chunkwise: the recurrent state carried between chunks of ``chunk_size`` positions,
  the parallel form inside a chunk. All three give the same output.

Backends: ``"pallas_triton"`` runs the parallel form (a flash-style kernel), the
chunkwise form (a state kernel and a per-chunk kernel) and the decoding step
(``retention_step``) in Pallas with custom VJPs (``pallas_kernels/retention``);
``"xla"`` is pure jnp (all modes). ``mode="recurrent"`` over a whole sequence runs in jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn.backends import gpu_compute_capability, interpret_mode, resolve_backend, usable_backends
from jattn.gpu import gpu_info, shared_memory_limit
from jattn.reference import default_decay, retention_decay_mask, retention_reference
from pallas_kernels.retention import (MIN_CHUNK, default_launch, default_parallel_config,
                                      fitting_chunk, retention_chunkwise_triton,
                                      retention_parallel_triton, retention_step_triton)

MODES = ("auto", "parallel", "chunkwise", "recurrent")
NORMALIZERS = (None, "abs_sum")
RETENTION_BACKENDS = ("auto", "pallas_triton", "xla")
DEFAULT_CHUNK = 64
# Above this many key positions "auto" runs chunkwise: the parallel form's work grows
# with seq², the chunkwise form's linearly. On an H100 (bench/results/
# retention_crossover.md) the two kernels tie at 512 and chunkwise wins fwd+bwd from 1024.
PARALLEL_MAX_LEN = 512


def _check_decay(decay, heads: int):
  """``decay`` is None or ``[heads]``, and where its values are known (not traced)
  in (0, 1]: the kernels work with log2 γ and factor γ^(n-m) into parts <= 1."""
  if decay is None:
    return
  if tuple(np.shape(decay)) != (heads,):
    raise ValueError(f"decay must have shape [heads] = ({heads},), got {np.shape(decay)}")
  if not isinstance(decay, jax.core.Tracer):
    values = np.asarray(decay, np.float64)
    if not np.all((values > 0) & (values <= 1)):
      raise ValueError(f"decay must be in (0, 1] for every head, got {values.tolist()}")


def _validate(q, k, v, decay, initial_state, normalize, mode, chunk_size, backend):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, dim], "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
  batch, q_len, heads, dk = q.shape
  if k.shape[0] != batch or k.shape[2:] != (heads, dk):
    raise ValueError(f"k must be [batch, kv_len, heads, dk] = [{batch}, kv_len, {heads}, {dk}], "
                     f"got {k.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v must be [batch, kv_len, heads, dv] matching k {k.shape[:3]}, "
                     f"got {v.shape}")
  if q_len > k.shape[1]:
    raise ValueError(f"q_len ({q_len}) must be <= kv_len ({k.shape[1]}): queries are the "
                     "last q_len positions")
  _check_decay(decay, heads)
  if normalize not in NORMALIZERS:
    raise ValueError(f"normalize must be one of {NORMALIZERS}, got {normalize!r}")
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if backend not in RETENTION_BACKENDS:
    raise ValueError(f"backend must be one of {RETENTION_BACKENDS}, got {backend!r}")
  if backend == "pallas_triton" and mode == "recurrent":
    raise ValueError("backend='pallas_triton' has no recurrent kernel (use "
                     "retention_step for decoding, or mode='chunkwise')")
  if chunk_size is not None and backend == "pallas_triton" and (
      chunk_size < 16 or chunk_size & (chunk_size - 1)):
    raise ValueError(f"chunk_size for backend='pallas_triton' must be a power of two >= 16, "
                     f"got {chunk_size}")
  if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
  if initial_state is not None:
    expected = (batch, heads, dk, v.shape[-1])
    if tuple(initial_state.shape) != expected:
      raise ValueError(f"initial_state must be [batch, heads, dk, dv] = {expected}, "
                       f"got {tuple(initial_state.shape)}")
  if normalize is not None and (mode in ("chunkwise", "recurrent") or initial_state is not None):
    raise ValueError("normalize='abs_sum' needs the whole row of scores: use "
                     "mode='parallel' without initial_state")


def _kernel_chunk(chunk: int, dk: int, dv: int, dtype) -> int | None:
  """The chunk the Pallas kernels run: ``chunk`` lowered (halved) until the kernels fit
  the GPU's shared memory; None if ``chunk`` is no power of two >= 16 or nothing fits.
  The result does not depend on it. Interpret mode has no limit."""
  if chunk < MIN_CHUNK or chunk & (chunk - 1):
    return None
  if interpret_mode() or gpu_compute_capability() is None:
    return chunk
  return fitting_chunk(chunk, dk, dv, jnp.dtype(dtype).itemsize, shared_memory_limit(gpu_info()))


def _chunk_terms(q, k, v, decay, scale, state):
  """One chunk of length ``c``: output and the state after it (all float32).

  q, k: ``[batch, c, heads, dk]``; v: ``[batch, c, heads, dv]``; state: ``[batch, heads, dk, dv]``.
  """
  c = q.shape[1]
  pos = jnp.arange(c, dtype=jnp.float32)
  log_decay = jnp.log(decay)
  inner = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
  inner = inner * retention_decay_mask(c, c, decay)[None]
  o = jnp.einsum("bhqk,bkhd->bqhd", inner, v, precision="highest")
  # Query i of the chunk sees the carried state through γ^(i+1).
  q_decay = jnp.exp((pos[:, None] + 1.0) * log_decay[None, :])  # [c, heads]
  o = o + scale * jnp.einsum("bqhk,bhkv->bqhv", q * q_decay[None, :, :, None], state,
                             precision="highest")
  return o, _state_of(k, v, decay, state)


def _state_of(k, v, decay, state):
  """The state after keys ``k, v`` (``[batch, c, heads, d]``) from ``state``: key ``j``
  reaches the end through ``γ^(c-1-j)``."""
  c = k.shape[1]
  log_decay = jnp.log(decay)
  k_decay = jnp.exp((c - 1.0 - jnp.arange(c, dtype=jnp.float32))[:, None] * log_decay[None, :])
  return (jnp.exp(c * log_decay)[None, :, None, None] * state
          + jnp.einsum("bkhd,bkhv->bhdv", k * k_decay[None, :, :, None], v,
                       precision="highest"))


def _chunkwise_xla(q, k, v, decay, scale, state, chunk):
  """Chunkwise retention in jnp: a scan over full chunks, then the remainder."""
  q_len, kv_len = q.shape[1], k.shape[1]
  prefix = kv_len - q_len  # keys before the first query only feed the state
  if prefix:
    state = _state_of(k[:, :prefix], v[:, :prefix], decay, state)
    k, v = k[:, prefix:], v[:, prefix:]
  n_full = q_len // chunk
  outputs = []
  if n_full:
    def split(x):
      return jnp.moveaxis(x[:, :n_full * chunk].reshape(x.shape[0], n_full, chunk, *x.shape[2:]), 1, 0)

    def body(state, qkv):
      o, state = _chunk_terms(*qkv, decay, scale, state)
      return state, o

    state, o = jax.lax.scan(body, state, (split(q), split(k), split(v)))
    outputs.append(jnp.moveaxis(o, 0, 1).reshape(q.shape[0], n_full * chunk, *o.shape[3:]))
  if q_len % chunk:
    tail = slice(n_full * chunk, q_len)
    o, state = _chunk_terms(q[:, tail], k[:, tail], v[:, tail], decay, scale, state)
    outputs.append(o)
  return jnp.concatenate(outputs, axis=1), state


def retention(q, k, v, *, decay=None, scale: float | None = None, mode: str = "auto",
              normalize: str | None = None, initial_state=None, return_state: bool = False,
              chunk_size: int | None = None, backend: str = "auto"):
  """Multi-head retention (RetNet), differentiable.

  Args:
    q, k: ``[batch, q_len, heads, dk]`` / ``[batch, kv_len, heads, dk]``; v:
      ``[batch, kv_len, heads, dv]``. ``q_len <= kv_len``: queries are the last
      ``q_len`` positions. float32, float16 or bfloat16; computed in float32.
    decay: ``[heads]`` γ per head in (0, 1] (default RetNet's ``1 - 2**(-5 - arange(heads))``).
    scale: default ``dk ** -0.5``.
    mode: ``"parallel"``, ``"chunkwise"``, ``"recurrent"`` or ``"auto"`` (chunkwise
      above ``PARALLEL_MAX_LEN`` key positions or with a state in or out, else parallel).
    normalize: None or ``"abs_sum"`` (parallel only): each row of
      ``S = scale · Q Kᵀ ⊙ D`` is divided by ``max(Σ_m |S[n, m]|, 1)``, held constant
      in the backward as torchscale does.
    initial_state: ``[batch, heads, dk, dv]`` state before the first position.
    return_state: also return the state after the last position.
    chunk_size: positions per chunk in chunkwise mode (default 64). It changes speed,
      not the result; the Pallas kernels lower it where their tiles would not fit the
      GPU's shared memory (e.g. to 32 for float32 with dk = dv = 128 on an H100).
    backend: ``"auto"`` (the Pallas kernels where usable, else jnp),
      ``"pallas_triton"`` (parallel and chunkwise) or ``"xla"`` (pure jnp).

  Returns:
    ``o: [batch, q_len, heads, dv]`` in q's dtype, and with ``return_state`` the final
    state ``[batch, heads, dk, dv]`` float32.
  """
  _validate(q, k, v, decay, initial_state, normalize, mode, chunk_size, backend)
  batch, q_len, heads, dk = q.shape
  dtype = q.dtype
  decay = default_decay(heads) if decay is None else jnp.asarray(decay, jnp.float32)
  scale = dk ** -0.5 if scale is None else float(scale)
  stateful = return_state or initial_state is not None
  if mode == "auto":
    mode = "chunkwise" if stateful or k.shape[1] > PARALLEL_MAX_LEN else "parallel"
  if mode == "parallel" and stateful:
    raise ValueError("mode='parallel' has no state: use 'chunkwise' or 'recurrent' with "
                     "initial_state / return_state")
  chunk = chunk_size or DEFAULT_CHUNK
  kernel_chunk = _kernel_chunk(chunk, dk, v.shape[-1], dtype) if mode == "chunkwise" else None
  pallas_ok = max(dk, v.shape[-1]) <= 256 and (mode == "parallel" or kernel_chunk is not None)
  name, interpret = resolve_backend(backend, lambda: (
      "pallas_triton" if "pallas_triton" in usable_backends() and pallas_ok
      and mode != "recurrent" else "xla"))
  if name == "pallas_triton" and max(dk, v.shape[-1]) > 256:
    raise ValueError(f"the Pallas retention kernels take head dims up to 256, got "
                     f"dk={dk}, dv={v.shape[-1]}; use backend='xla'")
  if name == "pallas_triton" and mode == "chunkwise" and kernel_chunk is None:
    raise ValueError(f"the chunkwise Pallas kernels do not fit this GPU's shared memory with "
                     f"dk={dk}, dv={v.shape[-1]} in {jnp.dtype(dtype).name} at any chunk size; "
                     "use backend='xla' or a 2-byte dtype")
  if mode == "parallel":
    if name == "pallas_triton":
      return retention_parallel_triton(q, k, v, decay, scale=scale,
                                       normalize=normalize == "abs_sum",
                                       config=default_parallel_config(
                                           max(dk, v.shape[-1]), jnp.dtype(dtype).itemsize),
                                       interpret=interpret)
    return retention_reference(q, k, v, decay=decay, scale=scale, normalize=normalize).astype(dtype)
  state = (jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if initial_state is None
           else initial_state.astype(jnp.float32))
  if name == "pallas_triton":
    # Keys before the first query: zero queries there give outputs we drop.
    prefix = k.shape[1] - q_len
    q_full = jnp.pad(q, ((0, 0), (prefix, 0), (0, 0), (0, 0))) if prefix else q
    sm_count = None if interpret else gpu_info().sm_count
    o, state = retention_chunkwise_triton(
        q_full, k, v, decay, state, scale=scale, chunk=kernel_chunk, interpret=interpret,
        launch=default_launch(batch, heads, dk, v.shape[-1], sm_count))
    o = o[:, prefix:]
    return (o, state) if return_state else o
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  if mode == "recurrent":
    prefix = k.shape[1] - q_len
    if prefix:
      state = _state_of(k[:, :prefix], v[:, :prefix], decay, state)
    o, state = _recurrent_xla(q, k[:, prefix:], v[:, prefix:], decay, scale, state)
  else:
    o, state = _chunkwise_xla(q, k, v, decay, scale, state, chunk)
  o = o.astype(dtype)
  return (o, state) if return_state else o


def _recurrent_xla(q, k, v, decay, scale, state):
  def step(state, qkv):
    o, state = _step(*qkv, decay, scale, state)
    return state, o

  state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v)))
  return jnp.moveaxis(o, 0, 1), state


def _step(q, k, v, decay, scale, state):
  state = decay[None, :, None, None] * state + jnp.einsum("bhk,bhv->bhkv", k, v,
                                                         precision="highest")
  return scale * jnp.einsum("bhk,bhkv->bhv", q, state, precision="highest"), state


def retention_step(q, k, v, state, *, decay=None, scale: float | None = None,
                   backend: str = "auto"):
  """One recurrent (decoding) step: ``S' = γ S + kᵀ v``, ``o = scale · q S'``.

  Args:
    q, k: ``[batch, heads, dk]``; v: ``[batch, heads, dv]``; state ``[batch, heads, dk, dv]``
      (zeros before the first position).
    backend: ``"auto"`` (the Pallas step kernel where usable, else jnp),
      ``"pallas_triton"`` or ``"xla"``. Both are differentiable.

  Returns:
    ``(o, new_state)``: ``o: [batch, heads, dv]`` in q's dtype, the state float32.
  """
  if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
    raise ValueError(f"q, k must be [batch, heads, dk] and v [batch, heads, dv], got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
  expected = (*q.shape, v.shape[-1])
  if tuple(state.shape) != expected:
    raise ValueError(f"state must be [batch, heads, dk, dv] = {expected}, got {state.shape}")
  if backend not in RETENTION_BACKENDS:
    raise ValueError(f"backend must be one of {RETENTION_BACKENDS}, got {backend!r}")
  heads, dk = q.shape[1], q.shape[2]
  _check_decay(decay, heads)
  decay = default_decay(heads) if decay is None else jnp.asarray(decay, jnp.float32)
  scale = dk ** -0.5 if scale is None else float(scale)
  pallas_ok = max(dk, v.shape[-1]) <= 256
  name, interpret = resolve_backend(backend, lambda: (
      "pallas_triton" if "pallas_triton" in usable_backends() and pallas_ok else "xla"))
  if name == "pallas_triton":
    if not pallas_ok:
      raise ValueError(f"the Pallas retention kernels take head dims up to 256, got "
                       f"dk={dk}, dv={v.shape[-1]}; use backend='xla'")
    return retention_step_triton(q, k, v, state, decay, scale=scale, interpret=interpret)
  o, state = _step(*(x.astype(jnp.float32) for x in (q, k, v)), decay, scale,
                   state.astype(jnp.float32))
  return o.astype(q.dtype), state
