"""The torch side of ``crosscheck`` and ``jattn check``: each op's torch reference
(``TORCH_REFERENCES``), run on a JAX run's inputs, handed over through the DLPack
bridge.

This module imports torch; ``jattn.interop.harness`` and ``jattn.interop.check``
import it only when the torch reference is asked for (``jattn.interop.torch_import``).
It imports neither of them: they compare what it computes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jattn.interop.dlpack import to_torch
from jattn.interop.longnet_torch import dilated_attention_torch
from jattn.interop.torch_reference import (flash_attention_torch, flex_attention_torch,
                                           fp8_attention_torch, retention_step_torch,
                                           retention_torch, window_attention_torch)
from jattn.kernels.common.dropout import keep_mask


def _retention(p, q, k, v, decay, state):
  if p.initial_state:
    raise ValueError("the torch retention reference starts from a zero state")
  return retention_torch(q, k, v, decay=decay, scale=p.scale, normalize=p.normalize)


def _flex(p, q, k, v, *arrays):
  if p.example is None:
    raise ValueError("the torch reference of flex_attention covers the named examples "
                     "(jattn.flex.examples) only")
  return flex_attention_torch(q, k, v, example=p.example, scale=p.scale)


def _dilated(p, q, k, v):
  return dilated_attention_torch(q, k, v, p.segment_lengths, p.dilation_rates,
                                 causal=p.causal, scale=p.scale)


def _dropout_keep(p, seed, device):
  """jattn's dropout keep-mask of a flash problem as a torch tensor (None without
  dropout): torch's own RNG could not draw the same one."""
  if not p.dropout_rate:
    return None
  b, h, q, k = (np.arange(n).reshape(shape) for n, shape in (
      (p.batch, (-1, 1, 1, 1)), (p.q_heads, (1, -1, 1, 1)), (p.q_len, (1, 1, -1, 1)),
      (p.kv_len, (1, 1, 1, -1))))
  keep = keep_mask(jnp.asarray(seed.cpu().numpy()), p.dropout_rate, b, h, q, k)
  return torch.as_tensor(np.array(keep)).to(device)


def _varlen(p, q, k, v, cu_q, cu_k, sinks):
  """Packed sequences in torch: one dense call per sequence, zeros past the last."""
  cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
  out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
  parts = []
  for s in range(len(cu_q) - 1):
    (a, b), (c, d) = (cu_q[s], min(cu_q[s + 1], cu_q[s] + p.q_len)), (
        cu_k[s], min(cu_k[s + 1], cu_k[s] + p.kv_len))
    if b > a and d > c:
      o = flash_attention_torch(q[None, a:b], k[None, c:d], v[None, c:d], causal=p.causal,
                                scale=p.scale, local_window=p.local_window, softcap=p.softcap,
                                sinks=sinks)[0]
      parts.append((a, b, o))
  for a, b, o in parts:  # (out of place: autograd through the copies)
    out = torch.cat([out[:a], o, out[b:]])
  return out


def _gathered(pages, tables):
  """A paged cache ``[num_pages, page_size, heads, d]`` as ``[batch, pages_per_seq *
  page_size, heads, d]`` through the block table (ids clamped into the pool)."""
  pages_of = pages[tables.long().clamp(0, pages.shape[0] - 1)]
  return pages_of.reshape(tables.shape[0], -1, *pages.shape[2:])


# op name -> ``fn(problem, *tensors)`` giving the op's primary output in torch; the
# tensors are the op's arrays (``Op.arg_names``), None where the op has none.
TORCH_REFERENCES: dict[str, Callable[..., Any]] = {
    "flash_attention": lambda p, q, k, v, q_seg, kv_seg, sinks, seed, lengths: (
        flash_attention_torch(
            q, k, v, causal=p.causal, scale=p.scale, q_segment_ids=q_seg,
            kv_segment_ids=kv_seg, local_window=p.local_window, softcap=p.softcap,
            sinks=sinks, dropout_keep=_dropout_keep(p, seed, q.device),
            dropout_rate=p.dropout_rate, lengths=lengths)),
    "window_attention": lambda p, q, k, v, bias, mask: window_attention_torch(
        q, k, v, bias, mask=mask, scale=p.scale),
    "dilated_attention": _dilated,
    "flex_attention": _flex,
    "retention_parallel": _retention,
    "retention_chunkwise": _retention,
    "retention_recurrent": _retention,
    "retention_step": lambda p, q, k, v, state, decay: retention_step_torch(
        q, k, v, state, decay=decay, scale=p.scale)[0],
    "flash_attention_varlen": _varlen,
    "flash_attention_fp8": lambda p, q, k, v, q_descale, k_descale, v_descale, q_seg, kv_seg: (
        fp8_attention_torch(q, k, v, q_descale, k_descale, v_descale, causal=p.causal,
                            scale=p.scale, local_window=p.local_window, q_segment_ids=q_seg,
                            kv_segment_ids=kv_seg, out_dtype=getattr(torch, p.out_dtype.name))),
    "paged_attention": lambda p, q, k_pages, v_pages, tables, lengths, sinks: (
        flash_attention_torch(q, _gathered(k_pages, tables), _gathered(v_pages, tables),
                              causal=p.causal, scale=p.scale, local_window=p.local_window,
                              softcap=p.softcap, sinks=sinks, lengths=lengths)),
}


def _as_numpy(tensor) -> np.ndarray:
  return tensor.detach().float().cpu().numpy()


def torch_reference(run, torch_device: str):
  """The op's torch reference on a JAX run's inputs (``harness.JaxRun``), on
  ``torch_device``, forward and backward with the run's cotangent: ``(output, grads)``
  as numpy arrays, a gradient per ``op.diff_argnums``, None where the reference gives
  none (``harness.torch_reference_errors`` compares them)."""

  def tensor(x):
    if x is None:
      return None
    return (to_torch(x) if isinstance(x, jax.Array) else torch.as_tensor(np.asarray(x))).to(
        torch_device)

  tensors = [tensor(x) for x in run.arrays]
  for i in run.op.diff_argnums:
    if tensors[i] is not None:  # (an optional array the case does not use)
      tensors[i] = tensors[i].clone().requires_grad_(True)
  out = TORCH_REFERENCES[run.op.name](run.problem, *tensors)
  if out.requires_grad:  # (torch's FlexAttention has no backward on the CPU)
    out.backward(tensor(run.cotangent))
  # A torch reference that does not model an input (retention's state when it starts
  # from zeros) gives it no gradient: that one is not compared.
  return _as_numpy(out), [None if tensors[i] is None or tensors[i].grad is None
                          else _as_numpy(tensors[i].grad) for i in run.op.diff_argnums]


def default_torch_device() -> str:
  return "cuda" if torch.cuda.is_available() else "cpu"


__all__ = ["TORCH_REFERENCES", "default_torch_device", "torch_reference"]
