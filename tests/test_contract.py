"""One contract for every public op on every backend this machine runs: it composes with
``jit``, ``grad``, ``vmap`` (over an extra leading axis) and ``checkpoint``; runs with
``jax_enable_x64`` on; takes single-token sequences; gives zeros, never NaN, for rows
that see no key; has bitwise-deterministic gradients (but cuDNN's); and rejects mixed dtypes, wrong
ranks, mismatched shapes and unknown backends with errors that name the argument; the
rings' block computations give the op's own results.

On CPU the Pallas kernels run in interpret mode; on a GPU (``-m gpu``) every backend
the GPU has runs, the Hopper and cuDNN ones in 16-bit.
"""

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from conftest import rel_err
from jattn.core.op import OPS

pytestmark = pytest.mark.kernel


@dataclasses.dataclass(frozen=True)
class Spec:
  """A public op as the contract calls it: ``inputs(key, dtype, length)`` gives the
  differentiable arrays for a sequence (or window) length, ``call(*arrays, backend=)``
  runs the op; ``masked`` gives arrays and the ``[.., rows, ..]`` index of output rows
  that see nothing (None: the op has no mask); ``forward_only``: the op has no
  gradient, and what the contract asks of gradients it asks of the outputs."""

  op: str
  inputs: Callable
  call: Callable
  masked: Callable | None = None
  forward_only: bool = False  # no gradient (a serving op): outputs are checked instead
  # The op's keywords, for the tests that call it otherwise (the rings' blocks, a
  # variant that masks rows): ``((name, value), ...)``.
  keywords: tuple = ()
  # A kernel's minimum sizes: the one sequence length every test uses (none then runs
  # single tokens), and the backends it is for (None: every backend of the op).
  length: int | None = None
  backends: tuple | None = None


def _normal(key, shapes, dtype):
  keys = jax.random.split(key, len(shapes))
  return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))


def _packing(n: int):
  """``cu_seqlens`` of ``n`` packed positions: an empty sequence, one of length 1, and
  (from 24 positions on) one that starts inside a chunk of 16 and crosses into the next."""
  third = n // 3
  return np.array([0, third, third, third + 1, n], np.int32)


WINDOW_MASK = np.ones((2, 6, 6), bool)
WINDOW_MASK[1, 2] = False  # row 2 of odd windows sees no key
RETENTION_FORMS = ("parallel", "chunkwise", "recurrent")

# flash attention's features beside the mask: a value head dim of its own, sinks, dropout
FLASH_FEATURES = Spec(
    "flash_attention",
    lambda key, dtype, n: _normal(key, [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 24)], dtype)
    + _normal(key, [(4,)], jnp.float32),
    lambda q, k, v, sinks, backend: jattn.flash_attention(
        q, k, v, causal=True, sinks=sinks, dropout_rate=0.25, dropout_key=jax.random.PRNGKey(3),
        backend=backend),
    lambda key, dtype: (_normal(key, [(1, 6, 2, 16), (1, 4, 2, 16), (1, 4, 2, 24)], dtype)
                        + _normal(key, [(2,)], jnp.float32), np.s_[:, :2]))

def _cache_lengths(k):
  """Per-row cache lengths of a ``[batch=2, kv_len, ...]`` cache: full, and a third
  (none for fewer than 3 keys: that row's queries see nothing)."""
  return jnp.array([k.shape[1], k.shape[1] // 3])


def _paged(k):
  """``[2, n, heads, d]`` keys as pages of 4 in reversed order and their block table."""
  per_seq = -(-k.shape[1] // 4)
  pages = jnp.pad(k, [(0, 0), (0, 4 * per_seq - k.shape[1]), (0, 0), (0, 0)])
  pages = pages.reshape(2 * per_seq, 4, *k.shape[2:])[::-1]
  return pages, (2 * per_seq - 1 - jnp.arange(2 * per_seq)).reshape(2, per_seq)


def _paged_call(q, k, v, backend):
  (k_pages, table), (v_pages, _) = _paged(k), _paged(v)
  return jattn.paged_attention(q, k_pages, v_pages, table, _cache_lengths(k), causal=True,
                               backend=backend)


def _varlen_call(q, k, v, backend):
  """Two packed sequences: the first a third of the rows, with half as many keys (its
  first queries, causal bottom-right, see none)."""
  total = q.shape[0]
  cu_q = jnp.array([0, total // 3, total])
  cu_k = jnp.array([0, total // 6, total])
  return jattn.flash_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=total,
                                      max_seqlen_k=total, causal=True, backend=backend)


VARLEN_SHAPES = lambda key, dtype, n: _normal(key, [(2 * n, 4, 16), (2 * n, 2, 16),
                                                    (2 * n, 2, 16)], dtype)


def _fp8(key, shapes):
  """Normal q, k, v rounded to FP8 (far inside its range: the contract scales them by
  1.5) and descales per KV head."""
  arrays = _normal(key, shapes, jnp.float8_e4m3fn)
  return arrays + (jnp.array([0.5, 2.0]), jnp.array([1.5, 0.25]), jnp.array([2.0, 0.75]))


def _fp8_inputs(key, dtype, n):  # (dtype is the other ops')
  return _fp8(key, [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 16)])


def _fp8_call(q, k, v, q_descale, k_descale, v_descale, backend):
  return jattn.flash_attention(q, k, v, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale, causal=True, backend=backend)


def _fp8_masked(key, dtype):
  """Causal with q_len > kv_len: the first two queries see no key."""
  return _fp8(key, [(1, 6, 4, 16), (1, 4, 2, 16), (1, 4, 2, 16)]), np.s_[:, :2]


# decoding: two query positions against a cache of per-row lengths
def _dilated(w: int, r: int, head_dim: int = 16, **options) -> Spec:
  """One causal pair ``(w, r)`` (mixing pairs is test_dilated's; here the op's plumbing
  is tested); its masked rows: a pair of rate 2 covers the even positions of head 0."""
  keywords = (("segment_lengths", (w,)), ("dilation_rates", (r,)), ("causal", True))
  return Spec(
      "dilated_attention",
      lambda key, dtype, n: _normal(
          key, [(2, n, 4, head_dim), (2, n, 2, head_dim), (2, n, 2, head_dim)], dtype),
      lambda q, k, v, backend: jattn.dilated_attention(q, k, v, backend=backend,
                                                       **dict(keywords)),
      lambda key, dtype: (_normal(key, [(1, w, 1, head_dim)] * 3, dtype), np.s_[:, 1::2]),
      keywords=keywords, **options)


DECODE_SHAPES = lambda key, dtype, n: _normal(key, [(2, 2, 4, 16), (2, n, 2, 16),
                                                    (2, n, 2, 16)], dtype)
DECODE_MASKED = lambda key, dtype: (DECODE_SHAPES(key, dtype, 2), np.s_[1])

FLASH_DECODE = Spec("flash_attention", DECODE_SHAPES,
                    lambda q, k, v, backend: jattn.flash_attention(
                        q, k, v, causal=True, kv_lengths=_cache_lengths(k), backend=backend),
                    DECODE_MASKED)

SPECS = [
    Spec("flash_attention",
         lambda key, dtype, n: _normal(key, [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 16)], dtype),
         # cuDNN runs only calls that allow a backward that is not bitwise repeatable
         lambda q, k, v, backend: jattn.flash_attention(q, k, v, causal=True, backend=backend,
                                                        deterministic=backend != "cudnn"),
         # causal with q_len > kv_len: the first two queries come before every key
         lambda key, dtype: (_normal(key, [(1, 6, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16)], dtype),
                             np.s_[:, :2])),
    FLASH_FEATURES,
    FLASH_DECODE,
    Spec("paged_attention", DECODE_SHAPES, _paged_call, DECODE_MASKED, forward_only=True),
    Spec("flash_attention_fp8", _fp8_inputs, _fp8_call, _fp8_masked, forward_only=True),
    Spec("flash_attention_varlen", VARLEN_SHAPES, _varlen_call,
         lambda key, dtype: (VARLEN_SHAPES(key, dtype, 3), np.s_[:1])),
    Spec("flex_attention",
         lambda key, dtype, n: _normal(key, [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 16)], dtype),
         # an ALiBi-like distance penalty under a causal mask (closing over no array:
         # both backends run it; closed-over arrays are tests/test_flex.py's)
         lambda q, k, v, backend: jattn.flex_attention(
             q, k, v, score_mod=lambda s, b, h, i, j: s + 0.25 * (h + 1) * (j - i),
             mask_mod=jattn.flex.causal_mask(), backend=backend),
         # keys strictly before the query: row 0 sees none
         lambda key, dtype: (_normal(key, [(1, 6, 2, 16)] * 3, dtype), np.s_[:, :1])),
    Spec("window_attention",
         lambda key, dtype, n: _normal(key, [(2, n, 2, 16)] * 3, dtype)
         + _normal(key, [(2, n, n)], jnp.float32),
         lambda q, k, v, bias, backend: jattn.window_attention(q, k, v, bias, backend=backend),
         lambda key, dtype: (_normal(key, [(4, 6, 2, 16)] * 3, dtype)
                             + _normal(key, [(2, 6, 6)], jnp.float32), np.s_[1::2, 2])),
    _dilated(8, 2),
    # the Hopper kernels' pairs: w / r a whole number of their tiles (256 rows)
    _dilated(512, 2, head_dim=64, length=1024, backends=("pallas_mosaic",)),
] + [
    Spec(f"retention_{form}",
         lambda key, dtype, n: _normal(key, [(2, n, 2, 16), (2, n, 2, 16), (2, n, 2, 8)], dtype),
         lambda q, k, v, backend, form=form: jattn.retention(q, k, v, mode=form, chunk_size=16,
                                                             backend=backend))
    for form in RETENTION_FORMS
] + [
    # packed sequences (cu_seqlens fixed per length: vmap runs over q, k, v) and each
    # sequence's last state, in the forms that have one (the parallel form's packing is
    # tests/test_retention.py's, vmap included)
    Spec(f"retention_{form}",
         lambda key, dtype, n: _normal(key, [(1, n, 1, 16), (1, n, 1, 16), (1, n, 1, 8)], dtype),
         lambda q, k, v, backend, form=form: jattn.retention(
             q, k, v, mode=form, chunk_size=16, cu_seqlens=_packing(q.shape[1]),
             return_state=True, backend=backend))
    for form in ("chunkwise", "recurrent")
] + [
    Spec("retention_step",
         lambda key, dtype, n: _normal(key, [(2, 2, 16), (2, 2, 16), (2, 2, 8), (2, 2, 16, 8)],
                                       dtype),
         lambda q, k, v, state, backend: jattn.retention_step(q, k, v, state, backend=backend)),
    # a serving batch: slot 0 starts a new sequence
    Spec("retention_step",
         lambda key, dtype, n: _normal(key, [(2, 2, 16), (2, 2, 16), (2, 2, 8), (2, 2, 16, 8)],
                                       dtype),
         lambda q, k, v, state, backend: jattn.retention_step(
             q, k, v, state, reset=np.array([True, False]), backend=backend)),
]
BACKENDS = ("pallas_mosaic", "pallas_triton", "cudnn", "xla")
# Backends without float32: the contract runs them in bfloat16.
SIXTEEN_BIT = ("pallas_mosaic", "cudnn")
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def _cases():
  for spec in SPECS:
    for backend in BACKENDS:
      if backend not in (spec.backends or OPS[spec.op].backends):
        continue
      marks = [pytest.mark.gpu] if backend in SIXTEEN_BIT else []
      sizes = f"-seq{spec.length}" if spec.length else ""
      yield pytest.param(spec, backend, id=f"{spec.op}{sizes}-{backend}", marks=marks)


CASES = list(_cases())


def _dtype(backend):
  return jnp.bfloat16 if backend in SIXTEEN_BIT else jnp.float32


def _runnable(spec, backend, *args):
  """Skips (never passes) where this machine or this problem rules the backend out."""
  try:
    jax.eval_shape(lambda *a: spec.call(*a, backend=backend), *args)
  except ValueError as e:
    if "cannot run this" in str(e):
      pytest.skip(str(e).split(". Backends:")[0])
    raise


def _loss(out):
  return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(out))


@functools.cache
def _compiled(spec):
  """The op's jitted ``(outputs, gradients)`` and its gradients through ``vmap`` and
  ``checkpoint``, with the backend static: each (backend, shapes) compiles once in a
  process, so the xla references serve every backend's case."""

  def out_and_grads(backend, *args):
    if spec.forward_only:
      return spec.call(*args, backend=backend), ()
    loss = lambda *a: (lambda out: (_loss(out), out))(spec.call(*a, backend=backend))
    (_, out), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                         has_aux=True)(*args)
    return out, grads

  def composed_grads(backend, *stacked):
    f = jax.checkpoint(lambda *b: spec.call(*b, backend=backend))
    if spec.forward_only:  # (the outputs, in the gradients' place)
      return tuple(jax.tree.leaves(jax.vmap(f)(*stacked)))
    loss = lambda *a: _loss(jax.vmap(f)(*a))
    return jax.grad(loss, argnums=tuple(range(len(stacked))))(*stacked)

  return jax.jit(out_and_grads, static_argnums=0), jax.jit(composed_grads, static_argnums=0)


@pytest.mark.parametrize("spec,backend", CASES)
def test_composes_with_jit_grad_vmap_checkpoint_and_repeats_bitwise(spec, backend):
  dtype = _dtype(backend)
  args = spec.inputs(jax.random.PRNGKey(0), dtype, spec.length or 24)
  _runnable(spec, backend, *args)
  stacked = tuple(jnp.stack([x, (1.5 * x).astype(x.dtype)]) for x in args)
  grad = _compiled(spec)[1]
  ours, ref = grad(backend, *stacked), grad("xla", *stacked)
  for g, g_ref in zip(ours, ref):
    assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
    assert rel_err(g, g_ref, floor=1e-2) < TOL[dtype]
  if backend == "cudnn":  # it promises no bitwise repeatable backward
    return
  # The gradients are bitwise deterministic: a second run gives the same bits.
  for g, again in zip(ours, grad(backend, *stacked)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(again, np.float32))


@pytest.mark.parametrize("spec,backend", CASES)
def test_runs_with_x64_enabled(spec, backend):
  dtype = _dtype(backend)
  run = _compiled(spec)[0]
  with jax.enable_x64(True):
    args = spec.inputs(jax.random.PRNGKey(1), dtype, spec.length or 20)
    _runnable(spec, backend, *args)
    out, grads = run(backend, *args)
  ref, _ = run(backend, *args)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert a.dtype == b.dtype and rel_err(a, b) < TOL[dtype]
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


@pytest.mark.parametrize("spec,backend", [c for c in CASES if c.values[0].length is None])
def test_single_token_sequences(spec, backend):
  dtype = _dtype(backend)
  args = spec.inputs(jax.random.PRNGKey(2), dtype, 1)
  _runnable(spec, backend, *args)
  run = _compiled(spec)[0]
  (out, grads), (ref, grads_ref) = run(backend, *args), run("xla", *args)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert rel_err(a, b) < TOL[dtype]
  # Against one key the softmax has no logit gradient: dq, dk are exactly 0 in the
  # reference, and a 16-bit kernel leaves rounding there, measured on the inputs' scale.
  for g, g_ref in zip(grads, grads_ref):
    assert rel_err(g, g_ref, floor=1.0) < TOL[dtype]


@pytest.mark.parametrize("spec,backend", [c for c in CASES if c.values[0].masked])
def test_rows_that_see_no_key_give_zeros(spec, backend):
  args, rows = spec.masked(jax.random.PRNGKey(3), _dtype(backend))
  call = spec.call
  if spec.op == "window_attention":  # the mask is what empties the rows
    call = lambda *a, backend: jattn.window_attention(*a, mask=WINDOW_MASK, backend=backend)
  if spec.op == "dilated_attention":
    call = lambda q, k, v, backend: jattn.dilated_attention(
        q, k, v, backend=backend, **dict(spec.keywords, causal=False))
  if spec.op == "flex_attention":
    call = lambda q, k, v, backend: jattn.flex_attention(
        q, k, v, mask_mod=lambda b, h, i, j: j < i, backend=backend)
  masked = dataclasses.replace(spec, call=call)
  _runnable(masked, backend, *args)
  out, grads = _compiled(masked)[0](backend, *args)
  out = np.asarray(out, np.float32)
  assert np.all(out[rows] == 0.0)
  assert np.isfinite(out).all() and np.abs(out).max() > 0
  for g in grads:
    assert np.isfinite(np.asarray(g, np.float32)).all()


def _mixed(args):
  return (args[0], args[1].astype(jnp.bfloat16)) + args[2:]


def _wrong_rank(args):
  return (args[0][0],) + args[1:]


def _mismatched(args):
  return (args[0], args[1][..., :-1]) + args[2:]


# (the input checks, once per op's own spec)
CHECKED_SPECS = [s for s in SPECS if s.length is None]


@pytest.mark.parametrize("spec", CHECKED_SPECS, ids=lambda s: s.op)
@pytest.mark.parametrize("bad,error,named", [
    (_mixed, TypeError, "k(_pages)? bfloat16"), (_wrong_rank, ValueError, r"^q must have rank"),
    (_mismatched, ValueError, r"^k(_pages)? must be \["),
], ids=["mixed-dtypes", "wrong-rank", "mismatched-shapes"])
def test_bad_inputs_raise_errors_naming_the_argument(spec, bad, error, named):
  args = spec.inputs(jax.random.PRNGKey(5), jnp.float32, 8)
  with pytest.raises(error, match=named):
    spec.call(*bad(args), backend="xla")


@pytest.mark.parametrize("spec", CHECKED_SPECS, ids=lambda s: s.op)
def test_unknown_backend_is_named(spec):
  args = spec.inputs(jax.random.PRNGKey(6), jnp.float32, 8)
  with pytest.raises(ValueError, match=r"^backend must be one of \('auto'.*got 'tpu'"):
    spec.call(*args, backend="tpu")


# (the rings' blocks run without sinks, dropout or per-row lengths)
SOFTMAX_OPS = [c for c in CASES if c.values[0].op in ("flash_attention", "window_attention",
                                                      "dilated_attention")
               and c.values[0] not in (FLASH_FEATURES, FLASH_DECODE)]


@pytest.mark.parametrize("spec,backend", SOFTMAX_OPS)
def test_block_computations_of_the_rings(spec, backend):
  """``partial`` / ``partial_backward`` (what the rings run their blocks with): with the
  block's own statistics they give the op's output and gradients."""
  op = OPS[spec.op]
  dtype = _dtype(backend)
  args = spec.inputs(jax.random.PRNGKey(7), dtype, spec.length or 24)
  _runnable(spec, backend, *args)
  kwargs = dict(causal=True) if spec.op == "flash_attention" else dict(spec.keywords)
  problem, arrays = op.bind(*args, **kwargs)
  if spec.op == "flash_attention":
    problem = dataclasses.replace(problem, return_lse=True)  # what a ring's blocks ask for
  try:
    call = op.prepare(problem, backend)
  except ValueError as e:
    pytest.skip(str(e).split(". Backends:")[0])
  do = jax.random.normal(jax.random.PRNGKey(8), args[0].shape, jnp.float32).astype(dtype)
  o, lse = jax.jit(lambda a: op.partial(call, a))(arrays)
  grads = jax.jit(lambda a, o, lse: op.partial_backward(call, a, o, lse, do))(arrays, o, lse)
  out, pull = jax.vjp(lambda *d: spec.call(*d, backend=backend), *args)
  assert rel_err(o, out) < TOL[dtype]
  for g, g_ref in zip(grads, pull(do)):
    assert g.dtype == jnp.float32 and rel_err(g, g_ref, floor=1e-2) < 2 * TOL[dtype]
