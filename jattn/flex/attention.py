"""``jattn.flex_attention``: attention with user score and mask functions, on the op core.

Backends:
- ``pallas_triton``: flash attention's Triton-lowered kernels with the functions
  traced into the tiles (``jattn.kernels.flash.triton``), for functions that close
  over no array;
- ``xla``: the dense float32 computation of ``jattn.reference.flex_attention_reference``,
  differentiated by autodiff, the closed-over arrays included.
"""

from __future__ import annotations

import dataclasses

import jax

from jattn.core.op import AttentionProblem, SoftmaxOp, XlaImpl
from jattn.core.validation import check_attention_inputs, scale_of
from jattn.flex.block_mask import BlockMask
from jattn.flex.functions import ElementFunction, trace
from jattn.flash import AttentionTritonImpl
from jattn.kernels.flash import flash_triton_backward, flash_triton_forward
from jattn.reference import flex_attention_reference


@dataclasses.dataclass(frozen=True)
class FlexProblem(AttentionProblem):
  """One flex-attention call without its arrays: shapes, dtype and the traced
  functions (whose closed-over arrays follow q, k, v among the op's arrays)."""

  score_mod: ElementFunction | None = None
  mask_mod: ElementFunction | None = None
  return_lse: bool = False

  @property
  def num_consts(self) -> int:
    """How many arrays the functions close over (the op's arrays after q, k, v)."""
    return sum(f.num_consts for f in (self.score_mod, self.mask_mod) if f is not None)

  def split_consts(self, consts: tuple) -> tuple[tuple, tuple]:
    """The op's arrays after q, k, v: ``(score_mod's, mask_mod's)``."""
    n = self.score_mod.num_consts if self.score_mod is not None else 0
    return tuple(consts[:n]), tuple(consts[n:])


class TritonFlex(AttentionTritonImpl):
  """Flash attention's Triton kernels with the functions traced into the tiles: the
  score transform and its derivative in the forward, dQ and dK/dV kernels, the mask
  with the padding mask (every tile masked; block masks do not skip tiles yet)."""

  def gaps(self, p):
    closed = ("score_mod or mask_mod closing over arrays",) if p.num_consts else ()
    return super().gaps(p) + closed

  def tuning_stages(self):
    # Not tuned yet: a cached config would have to be keyed by the functions too.
    return ()

  def _functions(self, p):
    return dict(score_fn=None if p.score_mod is None else p.score_mod.bind(()),
                mask_fn=None if p.mask_mod is None else p.mask_mod.bind(()))

  def forward(self, call, q, k, v):
    p = call.problem
    o, lse = flash_triton_forward(q, k, v, None, None, causal=False, scale=p.scale,
                                  local_window=None, softcap=None, config=call.config,
                                  interpret=call.interpret, **self._functions(p))
    return (o, lse), ((q, k, v), o, lse)

  def backward(self, call, residuals, cotangents):
    (q, k, v), o, lse = residuals
    p = call.problem
    return flash_triton_backward(q, k, v, None, None, o, lse, *cotangents, causal=False,
                                 scale=p.scale, local_window=None, softcap=None,
                                 config=call.config, interpret=call.interpret,
                                 **self._functions(p))


class XlaFlex(XlaImpl):
  def forward(self, call, q, k, v, *consts):
    p = call.problem
    score_consts, mask_consts = p.split_consts(consts)
    score = None if p.score_mod is None else p.score_mod.bind(score_consts)
    mask = None if p.mask_mod is None else p.mask_mod.bind(mask_consts)
    return flex_attention_reference(q, k, v, score_mod=score, mask_mod=mask, scale=p.scale), None


class FlexAttention(SoftmaxOp):
  name = "flex_attention"
  problem_cls = FlexProblem
  arg_names = ("q", "k", "v")  # then the arrays the functions close over

  def bind(self, q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None,
           return_lse=False):
    check_attention_inputs(q, k, v)
    batch, q_len, q_heads, head_dim = q.shape
    if block_mask is not None:
      mask_mod = _check_block_mask(block_mask, mask_mod, batch, q_heads, q_len, k.shape[1])
    score_fn, score_consts = trace(score_mod, "score_mod")
    mask_fn, mask_consts = trace(mask_mod, "mask_mod")
    problem = FlexProblem.of(q, k, scale=scale_of(scale, head_dim), score_mod=score_fn,
                             mask_mod=mask_fn, return_lse=bool(return_lse))
    return problem, (q, k, v) + score_consts + mask_consts

  def finish(self, problem, outputs):
    o, lse = outputs
    return (o, lse) if problem.return_lse else o

  def example(self, p: FlexProblem, key):
    if p.score_mod is not None or p.mask_mod is not None:
      raise ValueError("an example of flex_attention is of a problem without functions")
    return p.random_qkv(jax.random.split(key, 3))


def _check_block_mask(block_mask, mask_mod, batch, heads, q_len, kv_len):
  """The mask function a valid ``block_mask`` stands for."""
  if not isinstance(block_mask, BlockMask):
    raise TypeError("block_mask must be a BlockMask (jattn.create_block_mask), got "
                    f"{type(block_mask).__name__}")
  if mask_mod is not None and mask_mod is not block_mask.mask_mod:
    raise ValueError("pass mask_mod or a block_mask made from it, not two different masks")
  if (block_mask.q_len, block_mask.kv_len) != (q_len, kv_len):
    raise ValueError(f"block_mask was made for q_len {block_mask.q_len}, kv_len "
                     f"{block_mask.kv_len}; this call has q_len {q_len}, kv_len {kv_len}")
  b, h = block_mask.kinds.shape[:2]
  if b not in (1, batch) or h not in (1, heads):
    raise ValueError(f"block_mask was made for batch {b}, heads {h}; this call has batch "
                     f"{batch}, q heads {heads} (make it with these, or None for 'any')")
  return block_mask.mask_mod


FLEX = FlexAttention(TritonFlex(), XlaFlex())


def flex_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask: BlockMask | None = None,
                   scale: float | None = None, return_lse: bool = False, backend: str = "auto",
                   config=None):
  """Attention with a user score function and mask, PyTorch FlexAttention's semantics.

  ``softmax(where(mask_mod, score_mod(scale · q kᵀ, b, h, q_idx, kv_idx), -inf)) v``.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``q_heads`` a multiple of
      ``kv_heads``. float32, float16 or bfloat16, all the same dtype; any lengths.
    score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, called elementwise (as by
      ``vmap``) with a float32 score and int32 indices; ``h`` is the query head.
    mask_mod: ``(b, h, q_idx, kv_idx) -> bool``: True where the query may attend.
      Both functions are written with ``jnp`` and may close over arrays (slopes,
      tables, biases, document ids): those arrays get gradients. Ready ones:
      ``jattn.flex``.
    block_mask: a ``BlockMask`` from ``jattn.create_block_mask`` (instead of, or made
      from, ``mask_mod``).
    scale: logit scale (> 0), default ``head_dim ** -0.5``.
    return_lse: also return the log-sum-exp of each row.
    backend: ``"auto"``, ``"pallas_triton"`` (functions that close over no array) or
      ``"xla"``.
    config: a ``BlockConfig`` for ``pallas_triton`` (default: the heuristic by head dim).

  Returns:
    ``o: [batch, q_len, q_heads, head_dim]`` in q's dtype; with ``return_lse`` also
    ``lse: [batch, q_heads, q_len]`` float32. Rows that see no key (masked out, or
    every score ``-inf``) give zeros and ``lse = -1e30``, never NaN.
  """
  return FLEX(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
              scale=scale, return_lse=return_lse, backend=backend, config=config)
