"""Non-finite inputs and extreme logits, for every public op on every backend here.

The rule (docs/flash_attention.md, "Non-finite inputs"): a NaN or an infinity that an
output row sees makes the row non-finite, as the dense formula does (an infinite logit
that comes out -inf is a weight of 0, as in softmax); one it does not see (another batch
row, head or window, a key its mask refuses, a later position) never reaches it; the
backends agree on which rows those are. Rows that see no non-finite value match a float64
reference, at any scale of the logits. Gradients are exact where the softmax saturates.

The property test draws where the non-finite values go and how large the logits are;
each case's shapes are fixed, so each (case, backend) compiles once.
"""

import dataclasses
from typing import Callable

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from conftest import ON_GPU, rel_err
from jattn.kernels.common.softmax import EMPTY_ROW_LSE
from jattn import reference
from jattn.core.op import OPS

pytestmark = pytest.mark.kernel

KERNELS = ("pallas_triton", "pallas_mosaic") if ON_GPU else ("pallas_triton",)
BACKENDS = ("xla",) + KERNELS + (("cudnn",) if ON_GPU else ())
# Their tiles' value rows sit in shared memory that rows on both sides of a mask read:
# a non-finite value at a masked key reaches the rows of its tile (0 * inf), the one
# exception to the rule (docs/flash_attention.md).
UNGUARDED_VALUES = ("pallas_mosaic", "cudnn")


@dataclasses.dataclass(frozen=True)
class Case:
  """An op call on fixed shapes, with who sees what.

  ``shapes``: of q, k, v, ``[batch, seq, heads, d]``. ``call(q, k, v, backend)``: the
  output ``[batch, q_len, heads, dv]``; ``oracle(q, k, v)``: the same from the float64
  references. ``sees``: bool ``[batch, q_len, heads, kv_len]``, which keys (of kv head
  ``h // group``, same batch row) each output row attends to."""

  name: str
  op: str
  shapes: tuple
  call: Callable
  oracle: Callable
  sees: np.ndarray

  @property
  def masked(self) -> bool:
    """Whether some rows do not see some keys."""
    return not self.sees.all()


def _causal(q_len, kv_len):
  return np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)


def _every_row(batch, heads, pattern):
  """``pattern [q_len, kv_len]`` for every batch row and head."""
  return np.broadcast_to(pattern[None, :, None, :],
                         (batch, pattern.shape[0], heads, pattern.shape[1]))


def _flash_causal():  # (cuDNN runs calls that allow a backward not bitwise repeatable)
  call = lambda q, k, v, backend: jattn.flash_attention(q, k, v, causal=True, backend=backend,
                                                        deterministic=backend != "cudnn")
  oracle = lambda q, k, v: reference.flash_attention_reference(q, k, v, causal=True)[0]
  return Case("flash-causal-gqa", "flash_attention", ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)),
              call, oracle, _every_row(2, 4, _causal(6, 6)))


SEGMENTS_Q = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 2]], np.int32)
SEGMENTS_KV = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]], np.int32)


def _flash_window_segments():
  kw = dict(local_window=(2, 1), q_segment_ids=jnp.asarray(SEGMENTS_Q),
            kv_segment_ids=jnp.asarray(SEGMENTS_KV))
  call = lambda q, k, v, backend: jattn.flash_attention(q, k, v, backend=backend, **kw)
  oracle = lambda q, k, v: reference.flash_attention_reference(q, k, v, **kw)[0]
  pos = np.arange(5)[:, None] + 2  # bottom-right: query i at key position i + 2
  window = (np.arange(7)[None, :] >= pos - 2) & (np.arange(7)[None, :] <= pos + 1)
  sees = window[None] & (SEGMENTS_Q[:, :, None] == SEGMENTS_KV[:, None, :])
  return Case("flash-window-segments", "flash_attention",
              ((2, 5, 2, 8), (2, 7, 1, 8), (2, 7, 1, 8)), call, oracle,
              np.broadcast_to(sees[:, :, None, :], (2, 5, 2, 7)))


def _flash_sinks():  # no mask: every row sees every key
  sinks = jnp.array([0.5, -1.0], jnp.float32)
  call = lambda q, k, v, backend: jattn.flash_attention(q, k, v, sinks=sinks, backend=backend)
  oracle = lambda q, k, v: reference.flash_attention_reference(q, k, v, sinks=sinks)[0]
  return Case("flash-sinks", "flash_attention", ((1, 5, 2, 8), (1, 7, 2, 8), (1, 7, 2, 8)),
              call, oracle, np.ones((1, 5, 2, 7), bool))


def _flex():
  score = lambda s, b, h, i, j: s - 0.25 * (h + 1) * (i - j)
  call = lambda q, k, v, backend: jattn.flex_attention(
      q, k, v, score_mod=score, mask_mod=jattn.flex.causal_mask(), backend=backend)
  oracle = lambda q, k, v: reference.flex_attention_reference(
      q, k, v, score_mod=score, mask_mod=lambda b, h, i, j: j <= i)[0]
  return Case("flex-alibi-causal", "flex_attention", ((2, 6, 2, 8), (2, 6, 1, 8), (2, 6, 1, 8)),
              call, oracle, _every_row(2, 2, _causal(6, 6)))


WINDOW_MASK = np.random.default_rng(0).random((2, 6, 6)) < 0.7
WINDOW_BIAS = jnp.asarray(np.random.default_rng(1).normal(size=(2, 6, 6)), jnp.float32)


def _window():
  mask = jnp.asarray(WINDOW_MASK)
  call = lambda q, k, v, backend: jattn.window_attention(q, k, v, WINDOW_BIAS, mask=mask,
                                                         backend=backend)
  oracle = lambda q, k, v: reference.window_attention_reference(
      q, k, v, WINDOW_BIAS.astype(q.dtype), mask=mask)
  sees = WINDOW_MASK[np.arange(4) % 2]  # [windows, q, k]
  return Case("window-masked", "window_attention", ((4, 6, 2, 8),) * 3, call, oracle,
              np.broadcast_to(sees[:, :, None, :], (4, 6, 2, 6)))


PAIRS = ((4, 1), (8, 2))


def _dilated():
  kw = dict(segment_lengths=[w for w, _ in PAIRS], dilation_rates=[r for _, r in PAIRS],
            causal=True)
  call = lambda q, k, v, backend: jattn.dilated_attention(q, k, v, backend=backend, **kw)
  oracle = lambda q, k, v: reference.dilated_attention_reference(q, k, v, **kw)[0]
  seq, heads = 10, 2
  i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
  sees = np.zeros((seq, heads, seq), bool)
  for h in range(heads):  # head h, pair (w, r): the positions = h (mod r) of i's segment
    for w, r in PAIRS:
      sees[:, h] |= (i // w == j // w) & (i % r == h % r) & (j % r == h % r) & (j <= i)
  return Case("dilated-causal", "dilated_attention", ((1, seq, heads, 8),) * 3, call, oracle,
              sees[None])


CASES = [_flash_causal(), _flash_window_segments(), _flash_sinks(), _flex(), _window(),
         _dilated()]


def _dtype(backend):
  return jnp.bfloat16 if backend in ("pallas_mosaic", "cudnn") else jnp.float32


def _inputs(case: Case, scale: float, dtype):
  """q and k times ``scale`` (the logits times its square), v as drawn."""
  keys = jax.random.split(jax.random.PRNGKey(len(case.name)), 3)
  q, k, v = (jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, case.shapes))
  return tuple(x.astype(dtype) for x in (q * scale, k * scale, v))


def _inject(arrays, injections):
  """The arrays with ``(array, row, column, value)`` written in, and per array the
  rows ``[batch, seq, heads]`` holding a NaN, and holding any non-finite value."""
  arrays = [np.array(x, np.float32) for x in arrays]
  nan_rows = [np.zeros(x.shape[:3], bool) for x in arrays]
  bad_rows = [np.zeros(x.shape[:3], bool) for x in arrays]
  for which, row, col, value in injections:
    x = arrays[which]
    index = np.unravel_index(row % nan_rows[which].size, x.shape[:3])
    x[index + (col % x.shape[3],)] = value
    nan_rows[which][index] |= np.isnan(value)
    bad_rows[which][index] = True
  return arrays, nan_rows, bad_rows


def _seen(case: Case, rows):
  """For kv rows ``[batch, kv_len, kv_heads]``: which output rows see one of them."""
  group = case.shapes[0][2] // case.shapes[1][2]
  per_head = np.repeat(rows, group, axis=2)  # [batch, kv_len, heads]
  return np.any(case.sees & np.moveaxis(per_head, 1, 2)[:, None], axis=-1)


_CALLS = {}


def _runs(case: Case, backend: str) -> bool:
  """Whether ``backend`` takes the case's call here (cuDNN declines segment ids, sinks)."""
  if backend not in OPS[case.op].backends:
    return False
  shapes = [jax.ShapeDtypeStruct(s, _dtype(backend)) for s in case.shapes]
  try:
    jax.eval_shape(lambda *a: case.call(*a, backend), *shapes)
  except ValueError as e:
    if "cannot run this" in str(e):
      return False
    raise
  return True


def _run(case: Case, backend: str, arrays):
  key = (case.name, backend)
  if key not in _CALLS:
    _CALLS[key] = jax.jit(lambda *a: case.call(*a, backend))
  return np.asarray(_CALLS[key](*arrays), np.float64)


def _oracle(case: Case, arrays):
  with jax.enable_x64(True):
    return np.asarray(jax.jit(case.oracle)(*(jnp.asarray(x, jnp.float64) for x in arrays)))


# The float32 logits' rounding: at |logit| ~ scale^2 a probability moves by about
# 1e-7 |logit| (saturated rows, at 1e4, have one weight of 1 and are exact).
TOLERANCE = {1.0: 2e-5, 30.0: 2e-3, 1e4: 2e-5}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    scale=st.sampled_from(sorted(TOLERANCE)),
    injections=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10**6), st.integers(0, 7),
                                  st.sampled_from([np.nan, np.inf, -np.inf])),
                        min_size=1, max_size=3))
def test_non_finite_values_reach_exactly_the_rows_that_see_them(case, scale, injections):
  outs = {}
  for backend in filter(lambda b: _runs(case, b), BACKENDS):
    dtype = _dtype(backend)
    clean = _inputs(case, scale, dtype)
    arrays, nan_rows, bad_rows = _inject(clean, injections)
    arrays = tuple(jnp.asarray(x, dtype) for x in arrays)
    out = _run(case, backend, arrays)
    finite = np.all(np.isfinite(out), axis=-1)
    sees_any = case.sees.any(-1)
    # NaN anywhere a row sees, or any non-finite value: the row is not finite.
    must = (nan_rows[0] & sees_any) | _seen(case, nan_rows[1]) | _seen(case, bad_rows[2])
    assert not np.any(finite & must), (backend, np.argwhere(finite & must))
    if backend in UNGUARDED_VALUES and case.masked and bad_rows[2].any():
      continue
    # Rows that see nothing non-finite are finite and right, at any scale.
    untouched = ~((bad_rows[0] & sees_any) | _seen(case, bad_rows[1]) | _seen(case, bad_rows[2]))
    expected = _oracle(case, clean)
    assert np.all(finite[untouched]), (backend, np.argwhere(untouched & ~finite))
    tol = TOLERANCE[scale] if dtype == jnp.float32 else 3e-2
    assert rel_err(out[untouched], expected[untouched], floor=1.0) < tol, backend
    outs[backend] = finite
  # Rows that see an infinite logit, and nothing else: the backends agree on them.
  first = next(iter(outs.values()))
  for backend, finite in outs.items():
    assert np.array_equal(finite, first), backend


def test_xla_mixes_dilated_pairs_exactly_at_large_logits():
  # Weights exp(lse_i - logsumexp) did not sum to 1 at lse ~ 1e8 in float32: outputs
  # left the convex hull of v (2.67 off at scale 1e4).
  case = _dilated()
  q, k, v = _inputs(case, 1e2, jnp.float32)
  expected = _oracle(case, (q, k, v))
  for backend in ("xla", "pallas_triton"):
    out = _run(case, backend, (q, k, v))
    assert np.max(np.abs(out - expected)) < 1e-5, backend


# --- attention sinks of +inf, -inf and NaN ------------------------------------------------

@pytest.mark.parametrize("backend", ("xla",) + KERNELS)
def test_sinks_follow_the_dense_formula(backend):
  """-inf is no sink; +inf and NaN make every row of their head NaN (exp(inf) / exp(inf))."""
  dtype = _dtype(backend)
  q, k, v = _inputs(_flash_sinks(), 1.0, dtype)
  q = jnp.concatenate([q, q], axis=2)  # heads: +inf, -inf, NaN, finite
  k, v = (jnp.concatenate([x, x], axis=2) for x in (k, v))
  sinks = jnp.array([np.inf, -np.inf, np.nan, 0.5], jnp.float32)
  out = np.asarray(jattn.flash_attention(q, k, v, sinks=sinks, backend=backend), np.float32)
  assert np.isnan(out[:, :, [0, 2]]).all()
  no_sink = jattn.flash_attention(q[:, :, 1:2], k[:, :, 1:2], v[:, :, 1:2], backend="xla")
  np.testing.assert_allclose(out[:, :, 1], np.asarray(no_sink, np.float32)[:, :, 0],
                             atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
  assert np.isfinite(out[:, :, 3]).all()


@pytest.mark.parametrize("backend", ("xla",) + KERNELS)
def test_sinks_of_rows_that_see_no_key(backend):
  """Rows that see no key (``kv_lengths`` 0), a scale that is no power of two: a sink at
  the floor (-1e30, -inf) is no sink, with no gradient and ``lse`` exactly
  ``EMPTY_ROW_LSE``; another sink is the row's whole softmax: ``lse = sink``, weight 1
  (the kernels' lse of a sink of 1e6 is an ulp off it, and the weight exp(sink - lse)
  was 1.06)."""
  dtype = _dtype(backend)
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 2, 4, 64), dtype) for i in range(3))
  sinks = jnp.array([-1e30, -np.inf, 1e6, -20.0], jnp.float32)
  f = lambda s: jattn.flash_attention(q, k, v, sinks=s, kv_lengths=jnp.array([0]), scale=0.557,
                                      return_lse=True, backend=backend)
  (o, lse), pull = jax.vjp(f, sinks)
  (dsinks,) = pull((jnp.zeros_like(o), jnp.ones_like(lse)))
  assert not np.asarray(o, np.float32).any()
  np.testing.assert_array_equal(np.asarray(lse[0, :2]), np.float32(EMPTY_ROW_LSE))
  np.testing.assert_allclose(np.asarray(lse[0, 2:, 0]), [1e6, -20.0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dsinks), [0.0, 0.0, 2.0, 2.0], atol=1e-4)


# --- gradients where the softmax saturates -----------------------------------------------

def _grads(f, args, do):
  return jax.vjp(jax.jit(f), *args)[1](do)  # jitted: eagerly, every op compiles on its own


# bf16 at 1e4: logits up to about 2^29.6 in base-2 units, where the Hopper bf16
# forward's FFMA exponent puts its top weight up to about 2^29 from 1 (within bf16's
# range, and the row sums of the same weights cancel it: exact).
SATURATED = [(jnp.float16, 100.0), (jnp.bfloat16, 1e3), (jnp.float32, 1e4), (jnp.float16, 1e4),
             (jnp.bfloat16, 1e4)]


@pytest.mark.parametrize("dtype,scale,backend", [
    pytest.param(d, s, b, id=f"{jnp.dtype(d).name}-{s:g}-{b}") for b in KERNELS
    for d, s in SATURATED if not (b == "pallas_mosaic" and d == jnp.float32)])
def test_flash_gradients_are_exact_where_the_softmax_saturates(dtype, scale, backend):
  # q and k times 1e2-1e4: every row's softmax is one-hot, the logits' gradients are 0.
  # The Triton backward was 0.1-48 off (Inf in fp16) recomputing the weights.
  shapes = ((1, 64, 2, 32), (1, 64, 1, 32), (1, 64, 1, 32))
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(key, s, jnp.float32) for key, s in zip(keys, shapes))
  args = tuple(x.astype(dtype) for x in (q * scale, k * scale, v))
  do = jax.random.normal(keys[3], shapes[0], jnp.float32).astype(dtype)
  ours = _grads(lambda *a: jattn.flash_attention(*a, causal=True, backend=backend), args, do)
  with jax.enable_x64(True):
    wide = tuple(jnp.asarray(x, jnp.float64) for x in args)
    exact = _grads(lambda *a: reference.flash_attention_reference(*a, causal=True)[0], wide,
                   jnp.asarray(do, jnp.float64))
  size = lambda x: float(np.abs(np.asarray(x, np.float64)).max())
  # dq and dk are 0 here but for float32 rounding of terms of size |k| |v| |dO| (resp.
  # |q| ...): allow a few epsilons of those. dv is as large as dO; at logits of 1e6 a
  # row that is not quite one-hot (a second key within a few units) has its weights
  # only to float32's resolution of the lse (an ulp there is 0.06).
  rounding = {"q": size(args[1]), "k": size(args[0]), "v": 0.0}
  for name, g, g_ref in zip("qkv", ours, exact):
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref)
    bound = 2e-2 * max(np.abs(g_ref).max(), 1.0) + 1e-6 * rounding[name] * size(v) * size(do)
    assert np.abs(g - g_ref).max() < bound, (name, np.abs(g - g_ref).max(), bound)


@pytest.mark.parametrize("op", ["window", "dilated", "flex"])
def test_other_backwards_are_exact_where_the_softmax_saturates(op):
  # Logits of 1e4 (at 1e6 the dilated mixture's lse has float32's resolution of 0.06,
  # and a key two pairs share takes its two weights to within a few percent).
  case = {"window": _window, "dilated": _dilated, "flex": _flex}[op]()
  args = _inputs(case, 100.0, jnp.bfloat16)
  do = jax.random.normal(jax.random.PRNGKey(9), case.shapes[0][:3] + (case.shapes[2][3],))
  ours = _grads(lambda *a: case.call(*a, "pallas_triton"), args, do.astype(jnp.bfloat16))
  with jax.enable_x64(True):
    exact = _grads(case.oracle, tuple(jnp.asarray(x, jnp.float64) for x in args),
                   jnp.asarray(do.astype(jnp.bfloat16), jnp.float64))
  for name, g, g_ref in zip("qkv", ours, exact):
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref)
    assert np.abs(g - g_ref).max() < 2e-2 * max(np.abs(g_ref).max(), 1.0), name
