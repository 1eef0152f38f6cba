"""``jattn.dilated_attention``: LongNet's dilated attention.

For each pair ``(w_i, r_i)`` and head ``h``, the sequence is cut into segments of
``w_i`` positions (the last one may be shorter); within each, the positions ``≡ h
(mod r_i)`` (LongNet's head offsets) attend among themselves (causal: to earlier ones
and themselves). Each pair gives an output ``O_i`` and a log-sum-exp ``lse_i`` per
position it covers (``lse_i = -inf`` elsewhere), and the pairs are mixed as
``O = Σ_i softmax_i(lse_i) · O_i``. Gradients are exact: they flow through the mixing
weights too (torchscale detaches them).
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn.backends import resolve_backend
from jattn.gpu import select_backend
from jattn.reference import dilated_attention_reference
from pallas_kernels.dilated import dilated_attention_triton
from pallas_kernels.flash import FlashBlockConfig

DILATED_BACKENDS = ("auto", "pallas_triton", "xla")
MAX_HEAD_DIM = 256
FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _validate(q, k, v, segment_lengths, dilation_rates, backend):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape}, v {v.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  batch, seq, heads, head_dim = q.shape
  if k.shape[0] != batch or k.shape[1] != seq or k.shape[3] != head_dim:
    raise ValueError(f"k and v must be [batch, seq, kv_heads, head_dim] with q's batch, seq "
                     f"and head_dim {(batch, seq, head_dim)}, got {k.shape}")
  if heads % k.shape[2]:
    raise ValueError(f"q's {heads} heads must be a multiple of k/v's {k.shape[2]} heads "
                     "(grouped-query attention)")
  segment_lengths, dilation_rates = list(segment_lengths), list(dilation_rates)
  if not segment_lengths or len(segment_lengths) != len(dilation_rates):
    raise ValueError(f"segment_lengths {segment_lengths} and dilation_rates {dilation_rates} "
                     "must be non-empty and of the same length (one (w, r) pair each)")
  for w, r in zip(segment_lengths, dilation_rates):
    if int(w) != w or int(r) != r or w < 1 or r < 1 or w % r:
      raise ValueError(f"each pair needs positive integers with the segment length a "
                       f"multiple of the dilation rate, got (w={w}, r={r})")
  if backend not in DILATED_BACKENDS:
    raise ValueError(f"backend must be one of {DILATED_BACKENDS}, got {backend!r}")


def dilated_attention(q, k, v, *, segment_lengths, dilation_rates, causal: bool = False,
                      scale: float | None = None, backend: str = "auto",
                      config: FlashBlockConfig | None = None):
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
      ``"pallas_triton"`` or ``"xla"`` (the float32 reference: gather, dense
      attention per pair, mix).
    config: tiles for the Pallas kernels, a ``jattn.FlashBlockConfig`` (default: the
      flash kernels' default for the head dim and dtype).

  Returns:
    ``[batch, seq, heads, head_dim]`` in q's dtype. Positions that no pair covers for
    a head (possible only without a pair of rate 1) give zeros.

  A single pair ``(seq, 1)`` is exactly full attention.
  """
  _validate(q, k, v, segment_lengths, dilation_rates, backend)
  head_dim = q.shape[-1]
  scale = head_dim ** -0.5 if scale is None else float(scale)
  name, interpret = resolve_backend(
      backend, lambda: select_backend("dilated_attention", head_dim=head_dim))
  if name == "pallas_triton":
    if head_dim > MAX_HEAD_DIM:
      raise ValueError(f"the Pallas dilated kernels take head dims up to {MAX_HEAD_DIM}, got "
                       f"{head_dim}; use backend='xla'")
    return dilated_attention_triton(q, k, v, segment_lengths=segment_lengths,
                                    dilation_rates=dilation_rates, causal=causal, scale=scale,
                                    config=config, interpret=interpret)
  return dilated_attention_reference(q, k, v, segment_lengths=segment_lengths,
                                     dilation_rates=dilation_rates, causal=causal,
                                     scale=scale)[0]
