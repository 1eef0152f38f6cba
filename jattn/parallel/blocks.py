"""Pieces shared by the rings (``ring``, ``dilated_ring``): one block's attention as
``(o float32, lse)`` and its gradients given the final row statistics, the
online-softmax merge of partial results, and the one-hop shift around a ring."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash.common import EMPTY_ROW_LSE


BLOCK_BACKENDS = ("auto", "pallas_triton", "xla")


def resolve_block_backend(backend: str) -> str:
  """The blocks' backend: ``"auto"`` takes the Triton-lowered Pallas kernels where
  usable (a GPU, or interpret mode), else XLA."""
  from jattn.backends import resolve_backend, usable_backends

  if backend not in BLOCK_BACKENDS:
    raise ValueError(f"backend must be one of {BLOCK_BACKENDS}, got {backend!r}")
  name, _ = resolve_backend(backend, lambda: "pallas_triton" if "pallas_triton" in
                            usable_backends() else "xla")
  return name


def block_forward(q, k, v, *, causal: bool, scale: float, backend: str):
  """``(o float32, lse)`` of ``q [b, sq, h, d]`` against ``k, v [b, sk, hk, d]``."""
  from jattn.flash import flash_attention

  o, lse = flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                           backend=backend)
  return o.astype(jnp.float32), lse


def block_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, backend: str):
  """Gradients of one block given the final ``o``, ``lse`` of the whole row."""
  if backend == "pallas_triton":
    from jattn.backends import interpret_mode
    from pallas_kernels.flash import default_config
    from pallas_kernels.flash.triton import backward_triton

    config = default_config(q.shape[-1], jnp.dtype(q.dtype).itemsize)
    dq, dk, dv = backward_triton(q, k, v, o.astype(q.dtype), lse, do.astype(q.dtype),
                                 jnp.zeros_like(lse), causal=causal, scale=scale,
                                 config=config, interpret=interpret_mode())
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)
  batch, sq, heads, d = q.shape
  kv_heads = k.shape[2]
  f32 = lambda x: x.astype(jnp.float32)
  qg = f32(q).reshape(batch, sq, kv_heads, heads // kv_heads, d)
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, f32(k), precision=hi) * scale
  lse_g = lse.reshape(batch, kv_heads, heads // kv_heads, sq)[..., None]
  p = jnp.exp(s - lse_g)
  if causal:
    keep = jnp.arange(k.shape[1])[None, :] <= jnp.arange(sq)[:, None]
    p = jnp.where(keep, p, 0.0)
  dog = f32(do).reshape(qg.shape)
  delta = jnp.einsum("bqhgd,bqhgd->bhgq", f32(o).reshape(qg.shape), dog)[..., None]
  dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dog, precision=hi)
  ds = p * (jnp.einsum("bqhgd,bkhd->bhgqk", dog, f32(v), precision=hi) - delta)
  dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, f32(k), precision=hi).reshape(q.shape) * scale
  dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=hi) * scale
  return dq, dk, dv


def merge(acc, block):
  """Online-softmax merge of two ``(o float32, lse)`` partial results of the same rows."""
  (o1, l1), (o2, l2) = acc, block
  top = jnp.maximum(l1, l2)
  w1, w2 = jnp.exp(l1 - top), jnp.exp(l2 - top)
  total = w1 + w2
  weight = lambda w: jnp.moveaxis(w / total, 1, 2)[..., None]  # [b, h, s] -> [b, s, h, 1]
  return o1 * weight(w1) + o2 * weight(w2), top + jnp.log(total)


def empty_rows(q):
  """``(0, EMPTY_ROW_LSE)`` for q's rows; built from q so that inside ``shard_map``
  they vary over the mesh axis as q does (``lax.cond`` branches must agree)."""
  o = jnp.zeros_like(q, jnp.float32)
  return o, jnp.moveaxis(o[..., 0], 1, 2) + EMPTY_ROW_LSE


def shift(x, axis_name: str, perm):
  """Sends ``x`` one hop along ``perm`` (``[(src, dst), ...]``) over ``axis_name``."""
  return lax.ppermute(x, axis_name, perm)
