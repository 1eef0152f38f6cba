"""RMS normalisation, shared by the RetNet and Llama-family models: the statistic in
float32, the result cast back to the input's dtype before the weight multiplies it (as
torchscale's and Hugging Face's ``RMSNorm``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x, eps: float):
  """``x * rsqrt(mean(x²) + eps)`` over the last axis, in float32, back in x's dtype."""
  y = x.astype(jnp.float32)
  return (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
  """``weight * rms_normalize(x)`` (torchscale's and Hugging Face's ``RMSNorm``):
  ``[..., dim] -> [..., dim]``."""

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x):
    return rms_normalize(x, self.eps) * self.weight[...].astype(x.dtype)
