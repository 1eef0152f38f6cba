"""``jattn.window_attention``: many small windows of attention with a shared learned
bias and optional shift masks (the attention inside Swin-style and DAT blocks).

Per window ``w`` and head ``h``:
``o = softmax(scale · q kᵀ + bias[h] + mask[w % mask_windows]) v``.
Backends: ``"pallas_triton"`` (``pallas_kernels/window``: forward, dQ, dK/dV and
d(bias) kernels, custom VJP) and ``"xla"`` (the float32 reference, by autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn.backends import resolve_backend, usable_backends
from jattn.reference import additive_window_mask, window_attention_reference
from pallas_kernels.flash import FlashBlockConfig
from pallas_kernels.window import window_attention_triton

WINDOW_BACKENDS = ("auto", "pallas_triton", "xla")
MAX_HEAD_DIM = 256
FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _validate(q, k, v, bias, mask, backend):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [windows, tokens, heads, head_dim], "
                       f"got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(f"k and v must have q's shape [windows, tokens, heads, head_dim] = "
                     f"{q.shape}, got k {k.shape}, v {v.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  _, tokens, heads, _ = q.shape
  if not hasattr(bias, "ndim") or tuple(bias.shape) != (heads, tokens, tokens):
    raise ValueError(f"bias must be [heads, tokens, tokens] = {(heads, tokens, tokens)}, "
                     f"got {getattr(bias, 'shape', type(bias).__name__)}")
  if bias.dtype not in FLOAT_DTYPES:
    raise TypeError(f"bias has dtype {bias.dtype}; supported: float32, float16, bfloat16")
  if mask is not None:
    shape = tuple(jnp.shape(mask))
    if len(shape) != 3 or shape[1:] != (tokens, tokens) or shape[0] < 1:
      raise ValueError(f"mask must be [mask_windows, tokens, tokens] with tokens = {tokens}, "
                       f"got {shape}")
    if jnp.result_type(mask) not in (jnp.bool_, *FLOAT_DTYPES):
      raise TypeError(f"mask has dtype {jnp.result_type(mask)}; expected bool (True = may "
                      "attend) or an additive float mask")
  if backend not in WINDOW_BACKENDS:
    raise ValueError(f"backend must be one of {WINDOW_BACKENDS}, got {backend!r}")


def window_attention(q, k, v, bias, *, mask=None, scale: float | None = None,
                     backend: str = "auto", config: FlashBlockConfig | None = None):
  """Attention within each window, with a bias shared by all windows.

  Args:
    q, k, v: ``[windows, tokens, heads, head_dim]`` (float32, float16 or bfloat16);
      ``windows`` is batch times windows per image.
    bias: ``[heads, tokens, tokens]`` additive relative-position bias, shared by all
      windows; it gets a gradient (e.g. from DAT's dynamic position-bias MLP).
    mask: ``[mask_windows, tokens, tokens]`` or None; window ``w`` adds
      ``mask[w % mask_windows]`` (shifted-window masks). Boolean (True = may attend)
      or additive float (e.g. 0 / -100). A constant: no gradient flows to it.
    scale: default ``head_dim ** -0.5``.
    backend: ``"auto"`` (the Pallas kernels where usable, else ``"xla"``),
      ``"pallas_triton"`` or ``"xla"``.
    config: tiles for the Pallas kernels (default ``default_window_config``).

  Returns:
    ``[windows, tokens, heads, head_dim]`` in q's dtype. Rows that see no key (every
    logit ``-inf``) give zeros.
  """
  _validate(q, k, v, bias, mask, backend)
  head_dim = q.shape[-1]
  scale = head_dim ** -0.5 if scale is None else float(scale)
  pallas_ok = head_dim <= MAX_HEAD_DIM
  name, interpret = resolve_backend(backend, lambda: (
      "pallas_triton" if "pallas_triton" in usable_backends() and pallas_ok else "xla"))
  mask = None if mask is None else jax.lax.stop_gradient(additive_window_mask(mask))
  if name == "pallas_triton":
    if not pallas_ok:
      raise ValueError(f"the Pallas window kernels take head dims up to {MAX_HEAD_DIM}, got "
                       f"{head_dim}; use backend='xla'")
    return window_attention_triton(q, k, v, bias, mask, scale=scale, config=config,
                                   interpret=interpret)
  return window_attention_reference(q, k, v, bias, mask=mask, scale=scale)
