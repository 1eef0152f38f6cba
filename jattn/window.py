"""``jattn.window_attention``: many small windows of attention with a shared learned
bias and optional shift masks (the attention inside Swin-style and DAT blocks).

Per window ``w`` and head ``h``:
``o = softmax(scale · q kᵀ + bias[h] + mask[w % mask_windows]) v``.
Implementations: ``pallas_triton`` (``jattn.kernels.window``: forward, dQ, dK/dV and
d(bias) kernels) and ``xla`` (the float32 reference, by autodiff).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jattn.core.op import Problem, SoftmaxOp, XlaImpl
from jattn.core.validation import FLOAT_DTYPES, check_array, check_same_dtype, check_shape, scale_of
from jattn.kernels.common.config import BlockConfig, padded_head_dim
from jattn.kernels.common.softmax import shared_row_shift
from jattn.kernels.window import (default_window_config, window_triton_backward,
                                  window_triton_forward)
from jattn.reference import additive_window_mask, window_attention_reference
from jattn.core.cache import bucket
from jattn.core.sharding import PER_Q_HEAD, Q_HEADS, REPLICATED, ROW_STATS, ShardRule
from jattn.tuning.spaces import BlockTritonImpl

LAYOUT = "windows, tokens, heads, head_dim"


def _row_shift(bias, mask):
  """What ``bias [heads, tokens, tokens]`` takes off its rows (``shared_row_shift``, in
  its dtype), from each row's largest value over the keys the additive ``mask
  [mask_windows, tokens, tokens]`` (or None) leaves it, in every window."""
  logits = bias.astype(jnp.float32)[None]  # [mask_windows or 1, heads, tokens, tokens]
  if mask is not None:
    logits = logits + mask[:, None]
  peaks = jnp.max(logits, axis=-1, keepdims=True)
  return shared_row_shift(peaks, (0,))[0].astype(bias.dtype)


@dataclasses.dataclass(frozen=True)
class WindowProblem(Problem):
  """One window-attention call, without its arrays."""

  windows: int = 1
  tokens: int = 64
  heads: int = 1
  head_dim: int = 32
  dtype: Any = jnp.float16
  scale: float | None = None  # default head_dim ** -0.5
  mask_windows: int | None = None  # None: no mask

  def __post_init__(self):
    self._normalize(self.head_dim)

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim,)

  def local(self, batch_shards: int, head_shards: int) -> "WindowProblem":
    """This problem on one shard of ``batch_shards`` x ``head_shards`` (its windows
    split like a batch). Window ``w`` takes mask ``w % mask_windows``: a shard's windows,
    numbered from 0, keep their masks only where each holds a multiple of them."""
    windows = self.windows // batch_shards
    if self.mask_windows and windows % self.mask_windows:
      raise ValueError(f"window_attention split over windows needs a multiple of the mask's "
                       f"{self.mask_windows} windows per shard, got {windows} "
                       f"({self.windows} over {batch_shards})")
    return dataclasses.replace(self, windows=windows, heads=self.heads // head_shards)


class TritonWindow(BlockTritonImpl):
  def rows(self, p):
    return p.tokens, p.tokens

  def heuristic_config(self, p, info):
    return default_window_config(p.head_dim, p.dtype.itemsize)

  def cache_key(self, p):
    return (p.dtype.name, f"d{padded_head_dim(p.head_dim)}", f"t{p.tokens}",
            f"w{bucket(p.windows)}")

  def forward(self, call, q, k, v, bias, mask):
    o, lse = window_triton_forward(q, k, v, bias, mask, scale=call.problem.scale,
                                   config=call.config, interpret=call.interpret)
    return (o, lse), ((q, k, v, bias, mask), o, lse)

  def backward(self, call, residuals, cotangents):
    (q, k, v, bias, mask), o, lse = residuals
    do, _ = cotangents  # lse is never returned: its cotangent is zero
    dq, dk, dv, dbias = window_triton_backward(q, k, v, bias, mask, o, lse, do,
                                               scale=call.problem.scale, config=call.config,
                                               interpret=call.interpret)
    return dq, dk, dv, dbias, None if mask is None else jnp.zeros_like(mask)


class XlaWindow(XlaImpl):
  def forward(self, call, q, k, v, bias, mask):
    return window_attention_reference(q, k, v, bias, mask=mask, scale=call.problem.scale,
                                      return_lse=True), None


class WindowAttention(SoftmaxOp):
  name = "window_attention"
  problem_cls = WindowProblem
  arg_names = ("q", "k", "v", "bias", "mask")
  diff_argnums = (0, 1, 2, 3)

  def bind(self, q, k, v, bias, *, mask=None, scale=None):
    for name, x in (("q", q), ("k", k), ("v", v)):
      check_array(name, x, LAYOUT)
    check_same_dtype(q=q, k=k, v=v)
    check_shape("k", k, tuple(q.shape), LAYOUT)
    check_shape("v", v, tuple(q.shape), LAYOUT)
    windows, tokens, heads, head_dim = q.shape
    check_shape("bias", bias, (heads, tokens, tokens), "heads, tokens, tokens")
    if jnp.dtype(bias.dtype) not in FLOAT_DTYPES:
      raise TypeError(f"bias has dtype {bias.dtype}; supported: float32, float16, bfloat16")
    mask_windows = None
    if mask is not None:
      check_shape("mask", mask, (None, tokens, tokens), "mask_windows, tokens, tokens")
      mask_windows = mask.shape[0]
      if mask_windows < 1 or windows % mask_windows:
        raise ValueError(f"mask has {mask_windows} windows, which must divide the {windows} "
                         "windows of q (window w takes mask[w % mask_windows])")
      if jnp.result_type(mask) not in (jnp.bool_, *FLOAT_DTYPES):
        raise TypeError(f"mask has dtype {jnp.result_type(mask)}; expected bool (True = may "
                        "attend) or an additive float mask")
      # A constant: no gradient flows to it.
      mask = jax.lax.stop_gradient(additive_window_mask(mask))
    # Rows of large bias (-1e9 padding rows) keep their log-sum-exp small.
    bias = bias - _row_shift(bias, mask)
    problem = WindowProblem(windows=windows, tokens=tokens, heads=heads, head_dim=head_dim,
                            dtype=q.dtype, scale=scale_of(scale, head_dim),
                            mask_windows=mask_windows)
    return problem, (q, k, v, bias, mask)

  def finish(self, problem, outputs):
    return outputs[0]

  def shard_rule(self, p: WindowProblem) -> ShardRule:
    # Windows split like a batch; the bias is per head, the mask shared.
    return ShardRule((Q_HEADS, Q_HEADS, Q_HEADS, PER_Q_HEAD, REPLICATED), (Q_HEADS, ROW_STATS))

  def example(self, p: WindowProblem, key):
    keys = jax.random.split(key, 5)
    q, k, v = (jax.random.normal(kk, (p.windows, p.tokens, p.heads, p.head_dim),
                                 jnp.float32).astype(p.dtype) for kk in keys[:3])
    bias = jax.random.normal(keys[3], (p.heads, p.tokens, p.tokens), jnp.float32)
    mask = None
    if p.mask_windows:  # shifted-window style: 0 within a region, -100 across regions
      region = jax.random.randint(keys[4], (p.mask_windows, p.tokens), 0, 3)
      mask = jnp.where(region[:, :, None] == region[:, None, :], 0.0, -100.0)
    return q, k, v, bias, mask


WINDOW = WindowAttention(TritonWindow(), XlaWindow())


def window_attention(q, k, v, bias, *, mask=None, scale: float | None = None,
                     backend: str = "auto", config: BlockConfig | None = None):
  """Attention within each window, with a bias shared by all windows.

  Args:
    q, k, v: ``[windows, tokens, heads, head_dim]`` (float32, float16 or bfloat16);
      ``windows`` is batch times windows per image.
    bias: ``[heads, tokens, tokens]`` additive relative-position bias, shared by all
      windows; it gets a gradient (e.g. from DAT's dynamic position-bias MLP).
    mask: ``[mask_windows, tokens, tokens]`` or None; ``mask_windows`` divides
      ``windows`` and window ``w`` adds ``mask[w % mask_windows]`` (shifted-window
      masks). Boolean (True = may attend) or additive float (e.g. 0 / -100). A
      constant: no gradient flows to it.
    scale: default ``head_dim ** -0.5``.
    backend: ``"auto"`` (the Pallas kernels where usable, else ``"xla"``),
      ``"pallas_triton"`` or ``"xla"``.
    config: tiles for the Pallas kernels, a ``BlockConfig`` (default: the tuning
      cache, else ``default_window_config``).

  Returns:
    ``[windows, tokens, heads, head_dim]`` in q's dtype. Rows that see no key (every
    logit ``-inf``) give zeros.
  """
  return WINDOW(q, k, v, bias, mask=mask, scale=scale, backend=backend, config=config)
