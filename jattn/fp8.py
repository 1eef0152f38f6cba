"""FP8 attention (issue 41): quantising q, k, v to ``float8_e4m3fn``
with float32 descales, the block-wise incoherent processing of FlashAttention-3 (a
random Hadamard rotation of q and k per head, which leaves ``q kᵀ`` unchanged but
spreads outliers before they are rounded), and the recipe's numerics as a float32
reference: ``q kᵀ`` of the FP8 values scaled by the descales, the softmax in float32,
its probabilities rounded to FP8 for the ``p v`` product (as the FP8 matmul takes
them), normalised by the float32 row sums.

The op ``flash_attention_fp8`` (what ``jattn.flash_attention`` hands FP8 inputs to) runs
forward only: on a Hopper GPU the 8-bit wgmma kernel (``MosaicFp8``), which rounds its
weights against the running row max (the reference against the final one: the values
differ by that rounding), elsewhere that reference on ``xla``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jattn.core.device import shared_memory_limit
from jattn.core.op import AttentionProblem, MosaicImpl, Op, XlaImpl
from jattn.core.sharding import KV_HEADS, PER_KV_HEAD, PER_ROW, Q_HEADS, ShardRule
from jattn.core.validation import (FLOAT_DTYPES, check_flag, check_heads, check_same_dtype,
                                   check_shape, scale_of, segment_ids_arg, window_arg)
from jattn.kernels.flash.config import MosaicBlockConfig, default_fp8_config, fp8_misfit
from jattn.kernels.flash.mosaic import flash_mosaic_forward_fp8
from jattn.kernels.hopper.budget import MOSAIC_REGISTER_BUDGET, mosaic_head_dim
from jattn.kernels.hopper.inputs import PositionInputs
from jattn.reference import attention_mask, guarded_values

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def hadamard_rotation(head_dim: int, key=None):
  """``[head_dim, head_dim]`` float32 orthonormal matrix: the Sylvester Hadamard matrix
  over ``sqrt(head_dim)``, its rows' signs flipped at random by ``key`` (None: no
  flips). ``head_dim`` must be a power of two."""
  if type(head_dim) is not int or head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(f"head_dim must be a power of two for a Hadamard rotation, got "
                     f"{head_dim!r}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < head_dim:
    h = np.block([[h, h], [h, -h]])
  h = jnp.asarray(h / np.sqrt(head_dim, dtype=np.float32))
  if key is None:
    return h
  signs = jnp.where(jax.random.bernoulli(key, 0.5, (head_dim,)), 1.0, -1.0)
  return signs[:, None] * h


def quantize_fp8(x, *, group: int = 1, per_head: bool = True):
  """``x: [batch, seq, heads, d]`` -> ``(x8, descale)``: ``x8`` in ``float8_e4m3fn``
  with ``x ≈ x8 * descale``, each scale taking its block's largest magnitude to the
  format's largest value. ``per_head``: one descale per ``group`` consecutive heads
  (``[heads // group]``: for queries, ``group`` = query heads per KV head, so the
  descale is per KV head); otherwise one for the tensor (``[]``). A block of zeros
  gets descale 1."""
  if x.ndim != 4:
    raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {x.shape}")
  batch, seq, heads, d = x.shape
  if heads % group:
    raise ValueError(f"group ({group}) must divide the heads ({heads})")
  x32 = x.astype(jnp.float32)
  blocks = x32.reshape(batch, seq, heads // group, group, d)
  amax = jnp.max(jnp.abs(blocks), axis=(0, 1, 3, 4)) if per_head else jnp.max(jnp.abs(x32))
  descale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
  per = descale[None, None, :, None, None] if per_head else descale
  x8 = (blocks / per).reshape(x.shape).astype(E4M3)
  return x8, descale


def quantize_attention_inputs(q, k, v, *, per_head: bool = True, rotation=None):
  """``(q8, k8, v8, q_descale, k_descale, v_descale)`` for FP8 attention, descales per
  KV head (``[kv_heads]``) or per tensor (``[]``). ``rotation``: an orthonormal
  ``[head_dim, head_dim]`` (``hadamard_rotation(d, key)``) applied to q and k first,
  which leaves the attention unchanged and spreads outliers over the head dims."""
  if rotation is not None:
    q = jnp.einsum("bshd,de->bshe", q.astype(jnp.float32), rotation)
    k = jnp.einsum("bshd,de->bshe", k.astype(jnp.float32), rotation)
  group = q.shape[2] // k.shape[2]
  q8, qd = quantize_fp8(q, group=group, per_head=per_head)
  k8, kd = quantize_fp8(k, per_head=per_head)
  v8, vd = quantize_fp8(v, per_head=per_head)
  return q8, k8, v8, qd, kd, vd


def _per_kv_head(descale, kv_heads: int, name: str):
  descale = jnp.asarray(descale, jnp.float32)
  if descale.shape not in ((), (1,), (kv_heads,)):
    raise ValueError(f"{name} must be a float32 scalar or [kv_heads] = [{kv_heads}], got "
                     f"shape {descale.shape}")
  return jnp.broadcast_to(descale.reshape(-1), (kv_heads,))


def fp8_attention_reference(q8, k8, v8, q_descale=1.0, k_descale=1.0, v_descale=1.0, *,
                            causal: bool = False, scale: float | None = None,
                            local_window=None, q_segment_ids=None, kv_segment_ids=None,
                            out_dtype=jnp.bfloat16, quantize_probs: bool = True):
  """The FP8 recipe's attention in float32: ``q8 [batch, q_len, q_heads, d]``, ``k8
  [batch, kv_len, kv_heads, d]``, ``v8 [batch, kv_len, kv_heads, dv]`` in
  ``float8_e4m3fn``; descales float32 scalars or ``[kv_heads]``; ``causal``,
  ``local_window`` and the segment ids (``[batch, q_len]`` / ``[batch, kv_len]``) as
  ``flash_attention``'s. ``quantize_probs=False`` keeps the
  probabilities in float32 (the dequantised inputs' exact attention). Rows that see
  no key give zeros. Returns ``[batch, q_len, q_heads, dv]`` in ``out_dtype``."""
  for name, x in (("q", q8), ("k", k8), ("v", v8)):
    if x.dtype != E4M3 or x.ndim != 4:
      raise ValueError(f"{name} must be a 4-d float8_e4m3fn array, got {x.dtype} of shape "
                       f"{x.shape}")
  batch, q_len, q_heads, d = q8.shape
  kv_len, kv_heads = k8.shape[1], k8.shape[2]
  if q_heads % kv_heads or k8.shape[:3] != v8.shape[:3]:
    raise ValueError(f"q {q8.shape}, k {k8.shape}, v {v8.shape}: q_heads must be a "
                     "multiple of kv_heads, and k and v agree on batch, length and heads")
  group = q_heads // kv_heads
  qd, kd, vd = (_per_kv_head(x, kv_heads, n) for x, n in
                ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))
  scale = d ** -0.5 if scale is None else float(scale)
  qf = q8.astype(jnp.float32).reshape(batch, q_len, kv_heads, group, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k8.astype(jnp.float32))
  s = s * (qd * kd * scale)[None, :, None, None, None]
  # A key whose value row is not finite makes the rows that see it NaN and no other
  # (the references' and kernels' shared rule: jattn.reference.guarded_values).
  bad, v = guarded_values(v8.astype(jnp.float32))
  s = jnp.where(jnp.moveaxis(bad, 1, 2)[:, :, None, None, :], jnp.nan, s)
  mask = attention_mask(q_len, kv_len, causal=causal, local_window=local_window,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)[:, :, None]
  row_max = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
  total = p.sum(-1, keepdims=True)
  if quantize_probs:
    p = p.astype(E4M3).astype(jnp.float32)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v)
  o = o * vd[None, None, :, None, None] / jnp.where(total > 0, total, 1.0).transpose(
      0, 3, 1, 2, 4)
  return o.reshape(batch, q_len, q_heads, v8.shape[-1]).astype(out_dtype)


# --- the op: flash_attention on FP8 inputs ---------------------------------------------

NO_FP8_GRADIENT = ("FP8 inputs have no backward: differentiate a 16-bit copy (flash_attention "
                   "on bfloat16 q, k, v) and quantise only for the forward")


@dataclasses.dataclass(frozen=True)
class Fp8Problem(AttentionProblem):
  """An FP8 flash-attention call (``dtype`` is the inputs', ``out_dtype`` the
  output's)."""

  input_dtypes: ClassVar[tuple] = (jnp.dtype(E4M3),)

  dtype: Any = E4M3
  causal: bool = False
  local_window: tuple | None = None
  segment_ids: bool = False
  value_head_dim: int | None = None  # default head_dim
  out_dtype: Any = jnp.bfloat16

  def __post_init__(self):
    super().__post_init__()
    self._set(out_dtype=jnp.dtype(self.out_dtype))
    if self.value_head_dim is None:
      self._set(value_head_dim=self.head_dim)
    if self.local_window is not None:
      self._set(local_window=tuple(self.local_window))

  def check_fields(self) -> None:
    """As every problem's, and ``out_dtype`` one of the 16- and 32-bit float types."""
    if self.out_dtype not in FLOAT_DTYPES:
      raise ValueError(f"out_dtype must be one of {', '.join(d.name for d in FLOAT_DTYPES)}, "
                       f"got {self.out_dtype.name}")
    super().check_fields()

  @property
  def head_dims(self) -> tuple[int, ...]:
    return (self.head_dim, self.value_head_dim)


class _ForwardOnly:
  """The FP8 implementations' backward: a clear error (``has_backward``, so that
  differentiating reaches it rather than autodiff of the forward)."""

  has_backward = True

  def backward(self, call, residuals, cotangents):
    raise NotImplementedError(NO_FP8_GRADIENT)


class XlaFp8(_ForwardOnly, XlaImpl):
  """``fp8_attention_reference``: the recipe's values, dense, in float32."""

  def forward(self, call, q, k, v, q_descale, k_descale, v_descale, q_seg, kv_seg):
    p = call.problem
    out = fp8_attention_reference(q, k, v, q_descale, k_descale, v_descale, causal=p.causal,
                                  scale=p.scale, local_window=p.local_window,
                                  q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                  out_dtype=p.out_dtype)
    return out, None


class MosaicFp8(_ForwardOnly, MosaicImpl):
  """The Hopper forward kernel on 8-bit wgmma (``flash_mosaic_forward_fp8``)."""

  config_cls = MosaicBlockConfig

  def heuristic_config(self, p: Fp8Problem, info):
    return default_fp8_config(*p.head_dims, out_nbytes=p.out_dtype.itemsize,
                              masked=p.causal or p.local_window is not None,
                              kv_len=p.kv_len)

  def gaps(self, p: Fp8Problem):
    # Q and K tiles' rows are one 128-byte swizzle wide (or 64): a padded head dim of
    # 192 splits into neither (V's tiles are transposed: their rows run over keys).
    odd = mosaic_head_dim(p.head_dim) == 192
    return super().gaps(p) + ((f"a head dim that pads to 192 (got {p.head_dim}): 8-bit Q "
                               f"and K tiles take 64 or multiples of 128",) if odd else ())

  def _misfit(self, config, p: Fp8Problem, info, registers: bool):
    return fp8_misfit(config, p.head_dims, p.out_dtype.itemsize, shared_memory_limit(info),
                      PositionInputs(segments=p.segment_ids).vectors,
                      MOSAIC_REGISTER_BUDGET if registers else None)

  def fits(self, config, p: Fp8Problem, info, kernels=()):
    return self._misfit(config, p, info, registers=True)

  def compile_misfit(self, config, p: Fp8Problem, info):
    return self._misfit(config, p, info, registers=False)

  def forward(self, call, q, k, v, q_descale, k_descale, v_descale, q_seg, kv_seg):
    p = call.problem
    out = flash_mosaic_forward_fp8(q, k, v, q_descale, k_descale, v_descale, q_seg, kv_seg,
                                   causal=p.causal,
                                   scale=p.scale, local_window=p.local_window,
                                   config=call.config, out_dtype=p.out_dtype)
    return out, None


def _descale(name: str, value, kv_heads: int):
  if value is None:
    return jnp.ones((kv_heads,), jnp.float32)
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"{name} must be float32, got {value.dtype}")
  return _per_kv_head(value, kv_heads, name)


class Fp8Attention(Op):
  name = "flash_attention_fp8"
  problem_cls = Fp8Problem
  arg_names = ("q", "k", "v", "q_descale", "k_descale", "v_descale", "q_segment_ids",
               "kv_segment_ids")
  diff_argnums = ()  # no backward: NO_FP8_GRADIENT

  def bind(self, q, k, v, *, q_descale=None, k_descale=None, v_descale=None, causal=False,
           scale=None, local_window=None, q_segment_ids=None, kv_segment_ids=None,
           out_dtype=jnp.bfloat16):
    for name, x, layout in (("q", q, "batch, q_len, q_heads, head_dim"),
                            ("k", k, "batch, kv_len, kv_heads, head_dim"),
                            ("v", v, "batch, kv_len, kv_heads, head_dim_v")):
      if not hasattr(x, "ndim") or x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 [{layout}], got shape "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    check_same_dtype(q=q, k=k, v=v)
    if jnp.dtype(q.dtype) != E4M3:
      raise TypeError(f"q has dtype {q.dtype}; FP8 attention takes float8_e4m3fn q, k, v "
                      "(jattn.fp8.quantize_attention_inputs makes them)")
    batch, _, q_heads, head_dim = q.shape
    check_shape("k", k, (batch, None, None, head_dim), "batch, kv_len, kv_heads, head_dim")
    kv_len, kv_heads = k.shape[1], k.shape[2]
    check_shape("v", v, (batch, kv_len, kv_heads, None), "batch, kv_len, kv_heads, head_dim_v")
    check_heads(q_heads, kv_heads)
    if 0 in q.shape + k.shape + v.shape:
      raise ValueError(f"q, k, v have an empty dimension: {q.shape}, {k.shape}, {v.shape}")
    q_segment_ids, kv_segment_ids = segment_ids_arg(q_segment_ids, kv_segment_ids, batch,
                                                    q.shape[1], kv_len)
    problem = Fp8Problem.of(
        q, k, scale=scale_of(scale, head_dim), causal=check_flag("causal", causal),
        local_window=None if local_window is None else window_arg(local_window),
        segment_ids=q_segment_ids is not None, value_head_dim=v.shape[-1],
        out_dtype=out_dtype)
    problem.check_fields()
    return problem, (q, k, v, *(_descale(n, d, kv_heads) for n, d in (
        ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))),
                     q_segment_ids, kv_segment_ids)

  def shard_rule(self, p: Fp8Problem) -> ShardRule:
    return ShardRule((Q_HEADS, KV_HEADS, KV_HEADS, PER_KV_HEAD, PER_KV_HEAD, PER_KV_HEAD,
                      PER_ROW, PER_ROW), (Q_HEADS,), p.q_heads // p.kv_heads)

  def example(self, p: Fp8Problem, key):
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (p.batch, p.q_len, p.q_heads, p.head_dim))
    k = jax.random.normal(ks[1], (p.batch, p.kv_len, p.kv_heads, p.head_dim))
    v = jax.random.normal(ks[2], (p.batch, p.kv_len, p.kv_heads, p.value_head_dim))
    segments = (None, None)
    if p.segment_ids:  # three packed sequences per row
      segments = tuple(jnp.broadcast_to(jnp.arange(n) * 3 // n, (p.batch, n)).astype(jnp.int32)
                       for n in (p.q_len, p.kv_len))
    return (*quantize_attention_inputs(q, k, v), *segments)


FP8_FLASH = Fp8Attention(MosaicFp8(), XlaFp8())

