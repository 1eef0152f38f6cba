"""jattn.retention: the parallel, chunkwise and recurrent forms agree with the references
and each other, with gradients (initial states included); the Pallas kernels run in
interpret mode on CPU and compiled, at larger sizes, on a GPU; the chunk size fits
the GPU's shared memory."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jattn
from conftest import rel_err
from jattn.core.device import describe
from jattn.kernels.retention import ChunkwiseConfig, default_chunkwise_config, fitting_chunk
from jattn.reference import default_decay, retention_recurrent_reference, retention_reference
from jattn.retention import RETENTION_CHUNKWISE, RETENTION_PARALLEL, RetentionProblem



def _inputs(batch=2, q_len=37, kv_len=None, heads=3, dk=8, dv=6, dtype=jnp.float32, seed=0):
  kv_len = q_len if kv_len is None else kv_len
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  q = normal(ks[0], (batch, q_len, heads, dk))
  k = normal(ks[1], (batch, kv_len, heads, dk))
  v = normal(ks[2], (batch, kv_len, heads, dv))
  state = jax.random.normal(ks[3], (batch, heads, dk, dv), jnp.float32)
  # Faster decays than the default too, so that γ^n spans orders of magnitude.
  decay = jnp.linspace(0.6, 0.99, heads, dtype=jnp.float32)
  return q, k, v, state, decay


def test_default_decay_is_retnets():
  np.testing.assert_allclose(default_decay(4), [1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7, 1 - 2 ** -8])


def test_parallel_matches_an_explicit_loop():
  q, k, v, _, decay = _inputs(batch=1, q_len=9, heads=2)
  o = retention_reference(q, k, v, decay=decay, scale=0.3)
  qn, kn, vn, g = (np.asarray(x, np.float64) for x in (q, k, v, decay))
  expected = np.zeros(o.shape)
  for h in range(2):
    for n in range(9):
      for m in range(n + 1):
        expected[0, n, h] += 0.3 * (qn[0, n, h] @ kn[0, m, h]) * g[h] ** (n - m) * vn[0, m, h]
  np.testing.assert_allclose(o, expected, rtol=1e-5, atol=1e-5)


def test_recurrent_reference_takes_the_queries_at_the_end():
  q, k, v, _, decay = _inputs(q_len=11, kv_len=19)
  o, _ = jax.jit(lambda q, k, v: retention_recurrent_reference(q, k, v, decay=decay))(q, k, v)
  o_ref = jax.jit(lambda q, k, v: retention_reference(q, k, v, decay=decay))(q, k, v)
  chex.assert_trees_all_close(o, o_ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=3, deadline=None)
@given(q_len=st.integers(1, 40), prefix=st.integers(0, 9), chunk=st.sampled_from([1, 4, 16, 64]))
def test_modes_agree(q_len, prefix, chunk):
  q, k, v, _, decay = _inputs(q_len=q_len, kv_len=q_len + prefix, seed=q_len)
  run = jax.jit(lambda q, k, v: (
      jattn.retention(q, k, v, decay=decay, mode="parallel"),
      jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=chunk),
      jattn.retention(q, k, v, decay=decay, mode="recurrent")))
  par, chunked, rec = run(q, k, v)
  chex.assert_trees_all_close(chunked, par, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(rec, par, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", ["chunkwise", "recurrent"])
def test_state_in_and_out_with_gradients(mode):
  q, k, v, state, decay = _inputs(q_len=21)

  def ours(q, k, v, state):
    o, s = jattn.retention(q, k, v, decay=decay, mode=mode, chunk_size=16, initial_state=state,
                           return_state=True)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * jnp.sin(s))

  def ref(q, k, v, state):
    o, s = retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * jnp.sin(s))

  grads = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, state)
  grads_ref = jax.jit(jax.grad(ref, argnums=(0, 1, 2, 3)))(q, k, v, state)
  chex.assert_trees_all_close(grads, grads_ref, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(grads[3]).max()) > 0  # the state really gets a gradient


def test_a_split_sequence_continues_from_the_state():
  q, k, v, _, decay = _inputs(q_len=30)

  @jax.jit
  def split(q, k, v):
    whole = jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=16)
    first, state = jattn.retention(q[:, :13], k[:, :13], v[:, :13], decay=decay,
                                   mode="chunkwise", return_state=True, chunk_size=16)
    second = jattn.retention(q[:, 13:], k[:, 13:], v[:, 13:], decay=decay, mode="chunkwise",
                             initial_state=state, chunk_size=16)
    return whole, first, second

  whole, first, second = split(q, k, v)
  chex.assert_trees_all_close(jnp.concatenate([first, second], 1), whole, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_retention_step_decodes_like_the_recurrent_form(backend):
  q, k, v, state, decay = _inputs(q_len=5, dk=8, dv=70)  # dv spans two state tiles
  o_ref, s_ref = retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)

  def decode(q, k, v, state):
    outs = []
    for t in range(q.shape[1]):
      o, state = jattn.retention_step(q[:, t], k[:, t], v[:, t], state, decay=decay,
                                      backend=backend)
      outs.append(o)
    return jnp.stack(outs, 1), state

  (o, s), pull = jax.vjp(jax.jit(decode), q, k, v, state)
  chex.assert_trees_all_close((o, s), (o_ref, s_ref), atol=1e-5, rtol=1e-5)
  cot = tuple(jax.random.normal(jax.random.PRNGKey(i), x.shape) for i, x in enumerate((o, s)))
  _, pull_ref = jax.vjp(jax.jit(lambda q, k, v, state: retention_recurrent_reference(
      q, k, v, decay=decay, initial_state=state)), q, k, v, state)
  chex.assert_trees_all_close(pull(cot), pull_ref(cot), atol=1e-4, rtol=1e-4)


def test_abs_sum_normalisation_and_its_constant_denominator():
  q, k, v, _, decay = _inputs(q_len=12, kv_len=15)
  scale = 0.1  # some rows have Σ|S| > 1 and some not
  s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
       * jattn.reference.retention_decay_mask(12, 15, decay)[None])
  den = jnp.maximum(jnp.abs(s).sum(-1, keepdims=True), 1.0)
  assert bool((den > 1).any()) and bool((den == 1).any())
  # The gradient holds the denominator constant.
  loss = lambda q: jnp.sum(jnp.sin(jattn.retention(q, k, v, decay=decay, scale=scale,
                                                   normalize="abs_sum")))
  fixed = lambda q: jnp.sum(jnp.sin(jnp.einsum(
      "bhqk,bkhd->bqhd", jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
      * jattn.reference.retention_decay_mask(12, 15, decay)[None] / den, v)))
  chex.assert_trees_all_close(jax.jit(jax.grad(loss))(q), jax.jit(jax.grad(fixed))(q),
                              atol=1e-4, rtol=1e-4)


def test_auto_mode_choice():
  q, k, v, state, decay = _inputs(q_len=16)
  # A state in or out forces chunkwise; short sequences otherwise run parallel.
  o, s = jax.jit(lambda q, k, v: jattn.retention(q, k, v, decay=decay, return_state=True))(q, k, v)
  chex.assert_shape(s, (2, 3, 8, 6))
  with pytest.raises(ValueError, match="mode='parallel' has no state"):
    jattn.retention(q, k, v, mode="parallel", return_state=True)


# --- the kernels against the references ------------------------------------------------

def check_parallel(shape, normalize, dtype, tol, scale=None, config=None,
                   backend="pallas_triton"):
  b, sq, sk, h, dk, dv = shape
  q, k, v, _, decay = _inputs(b, sq, sk, h, dk, dv, dtype=dtype, seed=sq)
  do = jax.random.normal(jax.random.PRNGKey(9), q.shape[:3] + (dv,), jnp.float32)
  kw = dict(decay=decay, scale=scale, normalize=normalize)
  o, pull = jax.vjp(jax.jit(lambda q, k, v: RETENTION_PARALLEL(
      q, k, v, backend=backend, config=config, **kw)), q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  o_ref, pull_ref = jax.vjp(jax.jit(lambda q, k, v: retention_reference(q, k, v, **kw)), *f32)
  assert o.dtype == dtype and rel_err(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do.astype(dtype)), pull_ref(do)):
    assert rel_err(g, g_ref) < 2 * tol, name


def check_chunkwise(shape, config, dtype, tol, decay=None):
  b, sq, sk, h, dk, dv = shape
  q, k, v, state, default = _inputs(b, sq, sk, h, dk, dv, dtype=dtype, seed=sq)
  decay = default if decay is None else decay
  keys = jax.random.split(jax.random.PRNGKey(11), 2)
  do = jax.random.normal(keys[0], q.shape[:3] + (dv,), jnp.float32)
  dstate = jax.random.normal(keys[1], state.shape, jnp.float32)
  (o, s), pull = jax.vjp(jax.jit(lambda q, k, v, state: RETENTION_CHUNKWISE(
      q, k, v, decay=decay, initial_state=state, backend="pallas_triton", config=config)),
      q, k, v, state)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (o_ref, s_ref), pull_ref = jax.vjp(jax.jit(lambda q, k, v, state: retention_recurrent_reference(
      q, k, v, decay=decay, initial_state=state)), *f32, state)
  assert o.dtype == dtype and rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol
  grads = pull((do.astype(dtype), dstate))
  for name, g, g_ref in zip(["q", "k", "v", "initial_state"], grads, pull_ref((do, dstate))):
    assert rel_err(g, g_ref) < 2 * tol, name


@pytest.mark.parametrize("shape,normalize,dtype,tol", [
    ((2, 37, 37, 2, 8, 12), None, jnp.float32, 1e-5),
    ((2, 20, 45, 2, 16, 16), "abs_sum", jnp.bfloat16, 2e-2),
], ids=["s37", "q20-kv45-abs_sum-bf16"])
def test_parallel_kernel(shape, normalize, dtype, tol):
  check_parallel(shape, normalize, dtype, tol)


@pytest.mark.parametrize("normalize", [None, "abs_sum"])
def test_parallel_kernel_with_many_small_tiles(normalize):
  # Several key/query blocks per tile, so both the factored (off-diagonal) decay and the
  # masked (diagonal) decay run, with tiles of different sizes per pass.
  config = jattn.BlockConfig(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16,
                             block_q_dq=16, block_k_dq=16)
  check_parallel((1, 50, 83, 3, 16, 16), normalize, jnp.float32, 2e-5, scale=0.2, config=config)


@pytest.mark.parametrize("shape,chunk,dtype,tol", [
    ((2, 37, 37, 2, 8, 12), 16, jnp.float32, 1e-5),
    ((1, 20, 45, 2, 16, 16), 16, jnp.bfloat16, 3e-2),
], ids=["s37", "q20-kv45-bf16"])
def test_chunkwise_kernel_with_states(shape, chunk, dtype, tol):
  check_chunkwise(shape, ChunkwiseConfig(chunk=chunk), dtype, tol)


def test_chunkwise_kernel_with_tiled_state():
  # dk, dv above the state tile: the scans run one program per state tile; a decay of 1.
  check_chunkwise((1, 45, 45, 2, 48, 40), ChunkwiseConfig(chunk=16, state_block=16),
                  jnp.float32, 2e-5, decay=jnp.array([0.3, 1.0], jnp.float32))


# Each shape in one dtype and each dtype once: the GPU suite is compile-bound.
@pytest.mark.gpu
@pytest.mark.parametrize("shape,normalize,dtype,tol", [
    ((1, 700, 1000, 2, 128, 128), None, jnp.float16, 4e-3),
    ((2, 333, 333, 2, 96, 40), "abs_sum", jnp.float32, 2e-5),
    ((1, 257, 257, 2, 256, 256), None, jnp.bfloat16, 3e-2),
], ids=["q700-kv1000-d128-fp16", "d96-dv40-abs_sum-fp32", "d256-bf16"])
def test_parallel_kernel_at_gpu_sizes(shape, normalize, dtype, tol):
  check_parallel(shape, normalize, dtype, tol)


# Consumers of 64 rows over blocks of 64 keys: many key blocks per consumer, factored
# and diagonal.
HOPPER_TILES = jattn.MosaicBlockConfig(block_q=64, block_kv=64, stages=3)


def _skip_without_hopper():
  if RETENTION_PARALLEL.choices(RetentionProblem(dtype=jnp.bfloat16))[0][1] is not None:
    pytest.skip("needs a Hopper GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,normalize,dtype,tol,config", [
    ((1, 700, 1000, 2, 128, 128), None, jnp.float16, 4e-3, None),
    ((2, 333, 333, 2, 96, 40), "abs_sum", jnp.bfloat16, 3e-2, None),
    ((1, 257, 257, 2, 256, 256), None, jnp.bfloat16, 3e-2, None),
    # Many key blocks per consumer (factored and diagonal decay), dv > dk, small tiles.
    ((2, 1100, 1100, 3, 64, 128), "abs_sum", jnp.float16, 4e-3, HOPPER_TILES),
    # More work items than SMs: each persistent CTA walks several.
    ((4, 1024, 1024, 40, 64, 64), "abs_sum", jnp.bfloat16, 3e-2,
     jattn.MosaicBlockConfig(block_q=128, block_kv=128, persistent=True)),
    # One query, at the last key, which ends a key block: no diagonal block to visit.
    ((2, 1, 1024, 2, 128, 64), None, jnp.bfloat16, 3e-2, None),
], ids=["q700-kv1000-d128-fp16", "d96-dv40-abs_sum-bf16", "d256-bf16",
        "s1100-dv128-abs_sum-small-tiles", "persistent-1280-items", "q1-kv1024"])
def test_hopper_parallel_forward(shape, normalize, dtype, tol, config):
  _skip_without_hopper()
  check_parallel(shape, normalize, dtype, tol, config=config, backend="pallas_mosaic")


# Each non-finite entry sits in the diagonal block of some consumers and in full blocks
# of later ones. The Hopper kernel does not guard V (a non-finite value reaches the
# earlier rows of its diagonal block: pallas_kernels/retention/mosaic.py), so V stays clean.
@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [None, "abs_sum"])
def test_hopper_parallel_forward_keeps_a_nonfinite_value_in_the_rows_that_see_it(normalize):
  _skip_without_hopper()
  check_nonfinite("parallel", "pallas_mosaic", normalize, shape=(300, 333, 64, 64),
                  bad=(40, 150, 230), dtype=jnp.bfloat16, tol=3e-2, config=HOPPER_TILES,
                  bad_value=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["decay-edges-jit", "large-inputs-jit"])
def test_hopper_parallel_forward_matches_a_float64_oracle(case):
  _skip_without_hopper()
  forward = lambda q, k, v, decay: RETENTION_PARALLEL(q, k, v, decay=decay,
                                                      backend="pallas_mosaic",
                                                      config=HOPPER_TILES)
  check_against_oracle({"parallel-pallas_mosaic": forward}, case, batch=2, length=300, dk=64,
                       dv=64, dtype=jnp.bfloat16, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,config,dtype,tol", [
    # the default config: float32 fits the H100 at chunk 32
    ((2, 333, 333, 4, 128, 128), None, jnp.float32, 2e-5),
    ((1, 200, 300, 2, 64, 96), ChunkwiseConfig(chunk=32, state_block=32), jnp.bfloat16, 3e-2),
    ((1, 1000, 1000, 2, 256, 64), ChunkwiseConfig(chunk=64, state_block=16), jnp.float16, 4e-3),
], ids=["s333-fp32", "q200-kv300-c32-s32-bf16", "d256-c64-s16-fp16"])
def test_chunkwise_kernel_at_gpu_sizes(shape, config, dtype, tol):
  check_chunkwise(shape, config, dtype, tol)


@pytest.mark.gpu
def test_auto_runs_the_chunkwise_kernels_for_long_sequences():
  q, k, v, *_ = _inputs(1, 4096, 4096, 2, 64, 64, jnp.bfloat16)
  problem = RetentionProblem(q_len=4096, heads=2, dk=64, dtype=jnp.bfloat16)
  assert RETENTION_CHUNKWISE.select(problem) == "pallas_triton"
  o = jax.jit(lambda q, k, v: jattn.retention(q, k, v))(q, k, v)
  assert rel_err(o, jattn.retention(q, k, v, mode="chunkwise", backend="xla")) < 3e-2


# --- non-finite values, decays at the ends of their range, large inputs -------------------

SMALL_TILES = jattn.BlockConfig(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                                block_q_dq=16, block_k_dq=16)


def check_nonfinite(form, backend, normalize=None, *, shape=(18, 21, 8, 6), bad=(5, 11, 18),
                    dtype=jnp.float32, tol=1e-5, config=None, bad_value=True):
  """One non-finite entry in each of four (batch, head) slices: q at query row
  ``bad[0]`` (-inf), k at key position ``bad[1]`` (inf), v at ``bad[2]`` (NaN, unless
  not ``bad_value``), and (stateful forms) the initial state (inf); the others stay clean. Row n sits at
  position ``n + kv_len - q_len`` and sees q_n, the keys and values up to it and the
  state: exactly those rows come out non-finite, the others match a float64 oracle
  on the clean inputs. With a zero cotangent on the rows that see a non-finite value,
  the gradients w.r.t. q of the other rows, and w.r.t. every k, v (and state) no such
  row feeds through a non-finite q, match too (the non-finite entries' own are not
  asked)."""
  q_len, kv_len, dk, dv = shape
  (q_row, k_pos, v_pos), prefix = bad, kv_len - q_len
  stateful = form != "parallel"
  q, k, v, state, decay = _inputs(2, q_len, kv_len, 3, dk, dv, dtype=dtype)
  state = 0.1 * state
  dirty = (q.at[1, q_row, 0, 3].set(-jnp.inf), k.at[0, k_pos, 0, 2].set(jnp.inf),
           v.at[0, v_pos, 1, 4].set(jnp.nan) if bad_value else v,
           state.at[1, 1, 2, 3].set(jnp.inf))
  seen = np.zeros((2, q_len, 3), bool)
  seen[0, k_pos - prefix:, 0] = seen[0, v_pos - prefix:, 1] = seen[1, q_row, 0] = True
  seen[0, :, 1] &= bad_value
  seen[1, :, 1] = stateful
  sure_kv = np.ones((2, kv_len, 3), bool)
  sure_kv[0, k_pos, 0] = sure_kv[0, v_pos, 1] = False
  sure_kv[1, :q_row + prefix + 1, 0] = False  # keys the non-finite query sees
  sure = (~seen, sure_kv, sure_kv, np.array([[True] * 3, [False, True, True]]))
  cot = jax.random.normal(jax.random.PRNGKey(5), (2, q_len, 3, dv)) * ~seen[..., None]

  def ours(q, k, v, state):
    if form == "parallel":
      return RETENTION_PARALLEL(q, k, v, decay=decay, normalize=normalize, backend=backend,
                                config=config)
    return jattn.retention(q, k, v, decay=decay, mode=form, chunk_size=16, initial_state=state,
                           return_state=True, backend=backend)[0]

  def oracle(q, k, v, state):
    if form == "parallel":
      return retention_reference(q, k, v, decay=decay.astype(q.dtype), normalize=normalize)
    return retention_recurrent_reference(q, k, v, decay=decay.astype(q.dtype),
                                         initial_state=state)[0]

  o, pull = jax.vjp(jax.jit(ours), *dirty)
  grads = pull(cot.astype(o.dtype))
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, state, cot)]
    o_ref, pull_ref = jax.vjp(jax.jit(oracle), *f64[:4])
    grads_ref = pull_ref(f64[4])
  o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref)
  np.testing.assert_array_equal(~np.isfinite(o).all(-1), seen)
  assert rel_err(o[~seen], o_ref[~seen]) < tol
  for name, g, g_ref, mask in zip(("q", "k", "v", "initial_state"), grads, grads_ref, sure):
    if name != "initial_state" or stateful:
      g, g_ref = np.asarray(g, np.float64)[mask], np.asarray(g_ref)[mask]
      assert np.isfinite(g).all() and rel_err(g, g_ref) < 2 * tol, name


@pytest.mark.kernel
@pytest.mark.parametrize("form,backend,normalize,config", [
    ("parallel", "xla", None, None),
    ("parallel", "xla", "abs_sum", None),
    ("parallel", "pallas_triton", None, SMALL_TILES),
    ("parallel", "pallas_triton", "abs_sum", SMALL_TILES),
    ("chunkwise", "xla", None, None),
    ("chunkwise", "pallas_triton", None, None),
    ("recurrent", "xla", None, None),
], ids=["parallel-xla", "parallel-xla-abs_sum", "parallel-pallas_triton",
        "parallel-pallas_triton-abs_sum", "chunkwise-xla", "chunkwise-pallas_triton",
        "recurrent-xla"])
def test_a_nonfinite_value_reaches_only_the_rows_that_see_it(form, backend, normalize, config):
  check_nonfinite(form, backend, normalize, config=config)


# γ = 0 (γ^0 = 1, later powers 0), tiny and subnormal γ, γ = 1.
EDGE_DECAYS = (0.0, 1e-30, float(np.finfo(np.float32).tiny), 1e-40, 1.0)


def _every_form(n_steps: int):
  """Every form and backend as ``f(q, k, v, decay) -> o`` (q_len = kv_len); the
  decoding step decodes the first ``n_steps`` positions."""
  def decode(backend):
    def f(q, k, v, decay):
      state = jnp.zeros(q.shape[:1] + q.shape[2:] + v.shape[-1:], jnp.float32)
      outs = []
      for t in range(n_steps):
        o, state = jattn.retention_step(q[:, t], k[:, t], v[:, t], state, decay=decay,
                                        backend=backend)
        outs.append(o)
      return jnp.stack(outs, 1)
    return f

  forms = {f"{mode}-{backend}": functools.partial(
      lambda q, k, v, decay, mode, backend: jattn.retention(
          q, k, v, decay=decay, mode=mode, chunk_size=16, backend=backend),
      mode=mode, backend=backend)
      for mode, backend in [("parallel", "xla"), ("chunkwise", "xla"),
                            ("chunkwise", "pallas_triton"), ("recurrent", "xla")]}
  forms["parallel-pallas_triton"] = lambda q, k, v, decay: RETENTION_PARALLEL(
      q, k, v, decay=decay, backend="pallas_triton", config=SMALL_TILES)
  forms.update({f"step-{b}": decode(b) for b in ("xla", "pallas_triton")})
  return forms


def check_against_oracle(forms, case, *, batch=1, length=21, dk=8, dv=6, dtype=jnp.float32,
                         tol=1e-5):
  """``forms``' outputs against a float64 oracle. ``case``: ``decay-edges`` (γ at the
  ends of [0, 1]; under jit also traced decays outside it, whose heads must come out
  NaN in every form alike) or ``large-inputs`` (q, k scaled by 1e3 and 1e4), each
  ``-eager`` (the decay's values are checked) or ``-jit`` (the decay is traced)."""
  jit = case.endswith("-jit")
  if case.startswith("large-inputs"):
    decay = (0.5, 0.9, 1.0)
  else:
    decay = EDGE_DECAYS + ((-0.1, 1.5, np.nan) if jit else ())
  q, k, v, *_ = _inputs(batch, length, length, len(decay), dk, dv, dtype=dtype)
  if case.startswith("large-inputs"):
    q, k = (1e3 * q).astype(dtype), (1e4 * k).astype(dtype)
  valid = np.asarray([0 <= d <= 1 for d in decay])
  with jax.enable_x64(True):
    o_ref = np.asarray(retention_reference(
        *(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)),
        decay=jnp.asarray(np.where(valid, decay, 0.5), np.float64)))
  for name, f in forms.items():
    o = np.asarray((jax.jit(f) if jit else f)(q, k, v, jnp.asarray(decay)), np.float64)
    assert np.isnan(o[:, :, ~valid]).all(), name
    assert rel_err(o[:, :, valid], o_ref[:, :o.shape[1], valid]) < tol, name


@pytest.mark.kernel
@pytest.mark.parametrize("case", ["decay-edges-eager", "decay-edges-jit", "large-inputs-jit"])
def test_every_form_matches_a_float64_oracle(case):
  check_against_oracle(_every_form(n_steps=3), case)


# --- the chunk size against shared memory ------------------------------------------------

H100_SMEM = 232448  # the opt-in shared memory per block the fit runs reported
H100 = describe("H100", (9, 0), shared_memory_per_block_bytes=H100_SMEM, sm_count=132,
                interpret=False)


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("fp16", 2)])
def test_chunk_cap_model_agrees_with_the_h100_compile_results(dtype, itemsize):
  # bench/retention.py --fit on an H100: every configuration Triton refused must be
  # predicted not to fit (at the bytes it asked for), every one predicted to fit compiled.
  import json
  import pathlib

  from jattn.kernels.retention.config import grad_kernel_bytes

  path = pathlib.Path(__file__).parents[1] / "bench" / "results" / f"retention_fit_{dtype}.json"
  rows = json.loads(path.read_text())["rows"]
  assert any(not r["ok"] for r in rows) and any(r["ok"] for r in rows)
  for r in rows:
    model = grad_kernel_bytes(r["chunk"], r["dk"], r["dv"], itemsize)
    if not r["ok"]:
      assert model == int(r["error"].split("requested ")[1].split(",")[0]) > H100_SMEM, r
    if model <= H100_SMEM:
      assert r["ok"], r


def test_fitting_chunk_halves_until_the_kernels_fit():
  assert fitting_chunk(64, 128, 128, 2, H100_SMEM) == 64
  assert fitting_chunk(64, 128, 128, 4, H100_SMEM) == 32
  assert fitting_chunk(128, 100, 70, 4, H100_SMEM) == 32  # padded to 128 x 128
  assert fitting_chunk(64, 128, 256, 4, H100_SMEM) is None
  assert fitting_chunk(128, 64, 64, 4, 99 * 1024) == 32  # a smaller GPU gets smaller chunks


def test_chunkwise_on_a_gpu_runs_the_chunk_that_fits():
  # On an H100, float32 dk = dv = 128 runs the kernels at chunk 32 (64 would not fit);
  # a problem that fits at no chunk is an error naming the dims for the Pallas backend
  # and goes to jnp under "auto". Interpret mode keeps the chunk asked for.
  problem = lambda dk, dtype, chunk=None: RetentionProblem(q_len=20, dk=dk, dtype=dtype,
                                                           chunk_size=chunk)
  prepare = lambda p, backend="pallas_triton": RETENTION_CHUNKWISE.prepare(p, backend, info=H100)
  assert prepare(problem(128, jnp.float32)).config.chunk == 32
  assert prepare(problem(128, jnp.bfloat16)).config.chunk == 64
  assert prepare(problem(64, jnp.float32, chunk=128)).config.chunk == 128
  with pytest.raises(ValueError, match=r"it needs more than the device has with its config "
                                       r"\(shared memory at chunk 16 \(dk=256, dv=256, "
                                       r"float32\): \d+ KiB > 227 KiB\)"):
    prepare(problem(256, jnp.float32))
  assert prepare(problem(256, jnp.float32), "auto").impl.backend.name == "xla"
  with pytest.raises(ValueError, match="chunk_size 48 .it takes powers of two >= 16"):
    prepare(problem(64, jnp.float32, chunk=48))
  interpret = RETENTION_CHUNKWISE.prepare(problem(128, jnp.float32), "pallas_triton")
  assert interpret.config.chunk == 64


def test_default_config_cuts_the_state_finer_for_few_heads():
  assert default_chunkwise_config(8, 16, 128, 128, 132).state_block == 64  # 512 scan programs
  assert default_chunkwise_config(2, 16, 128, 128, 132).state_block == 32  # 128 < 132 SMs
  assert default_chunkwise_config(1, 8, 128, 128, 132).state_block == 16
  assert default_chunkwise_config(1, 1, 16, 16, 132).state_block == 16  # nothing finer to cut
  assert default_chunkwise_config(1, 8, 128, 128, None).state_block == 64  # SM count unknown


# --- validation particular to retention --------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=jnp.ones((2, 9, 3, 8))), ValueError, r"q_len \(9\) must be <= kv_len \(5\)"),
    (dict(v=jnp.ones((2, 4, 3, 6))), ValueError, r"v must be \[batch, kv_len, heads, dv\]"),
    (dict(decay=jnp.ones((2,))), ValueError, r"decay must have shape \[heads\] = \(3,\)"),
    (dict(decay=jnp.array([0.9, -0.1, 0.5])), ValueError, r"decay must be in \[0, 1\]"),
    (dict(decay=[0.9, 1.5, 0.5]), ValueError, r"decay must be in \[0, 1\]"),
    (dict(decay=np.array([0.9, np.nan, 0.5])), ValueError, r"decay must be in \[0, 1\]"),
    (dict(normalize="l2"), ValueError, "normalize must be one of"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(backend="pallas_triton", mode="recurrent"), ValueError, "has no recurrent kernel"),
    (dict(backend="pallas_triton", mode="chunkwise", chunk_size=24), ValueError,
     "it does not support chunk_size 24"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(initial_state=jnp.ones((2, 3, 8, 5))), ValueError, r"initial_state must be \[batch"),
    (dict(normalize="abs_sum", mode="chunkwise"), ValueError, "needs the whole row"),
])
def test_bad_inputs(kwargs, error, match):
  args = dict(q=jnp.ones((2, 5, 3, 8)), k=jnp.ones((2, 5, 3, 8)), v=jnp.ones((2, 5, 3, 6)))
  args.update(kwargs)
  q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
  with pytest.raises(error, match=match):
    jattn.retention(q, k, v, **args)


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_no_backend_gives_the_decay_a_gradient(backend):
  """The Pallas backward kernels give none, so neither does autodiff of the XLA forms:
  a model trains the same on every backend."""
  q, k, v, state, decay = _inputs(batch=1, q_len=8, heads=2)
  loss = lambda d: (jattn.retention(q, k, v, decay=d, mode="parallel", backend=backend).sum()
                    + jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=d,
                                           backend=backend)[0].sum())
  assert not np.asarray(jax.grad(loss)(decay)).any()


def test_retention_step_checks_its_decay():
  q, k, v, state, _ = _inputs(q_len=1)
  with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
    jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=jnp.array([0.5, -0.1, 0.9]))
  # Under jit the values are unknown: the decay is taken as given.
  o, _ = jax.jit(lambda d: jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=d))(
      jnp.array([0.5, 0.7, 0.9]))
  chex.assert_shape(o, (2, 3, 6))


# --- packed sequences (cu_seqlens) and the serving step's reset ---------------------------

# 56 positions in chunks (and tiles) of 16: an empty sequence first and between others,
# sequences of length 1 (one at position 0, one mid-chunk), one that ends at a chunk
# boundary and one that starts there and fills its chunk, one that starts mid-chunk
# and crosses the next boundary.
EDGE_PACKING = np.array([0, 0, 1, 1, 7, 16, 40, 40, 41, 56], np.int32)


def _random_packing(total: int, sequences: int, seed: int):
  """``cu_seqlens`` of ``sequences`` random lengths summing to ``total`` (empty ones
  likely: the cuts may repeat)."""
  cuts = np.sort(np.random.default_rng(seed).integers(0, total + 1, sequences - 1))
  return np.concatenate([[0], cuts, [total]]).astype(np.int32)


def _explicit_packed(q, k, v, decay, scale, cu_seqlens):
  """Packed retention by its definition, in float64: each sequence on its own, the
  recurrence from a zero state. ``(o [total, heads, dv], last states [seqs, heads, dk, dv])``."""
  q, k, v, g = (np.asarray(x, np.float64) for x in (q[0], k[0], v[0], decay))
  o = np.zeros(q.shape[:2] + v.shape[-1:])
  finals = np.zeros((len(cu_seqlens) - 1,) + q.shape[1:] + v.shape[-1:])
  for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
    state = np.zeros(finals.shape[1:])
    for t in range(lo, hi):
      state = g[:, None, None] * state + k[t, :, :, None] * v[t, :, None, :]
      o[t] = scale * np.einsum("hk,hkv->hv", q[t], state)
    finals[i] = state
  return o, finals


def test_packed_references_match_the_definition():
  q, k, v, _, decay = _inputs(batch=1, q_len=56, heads=2)
  o_def, finals_def = _explicit_packed(q, k, v, decay, 0.3, EDGE_PACKING)
  o = retention_reference(q, k, v, decay=decay, scale=0.3, cu_seqlens=EDGE_PACKING)
  o_rec, finals = retention_recurrent_reference(q, k, v, decay=decay, scale=0.3,
                                                cu_seqlens=EDGE_PACKING)
  for ours in (o[0], o_rec[0]):
    np.testing.assert_allclose(ours, o_def, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(finals, finals_def, rtol=1e-5, atol=1e-5)
  assert not np.asarray(finals)[[0, 2]].any()  # the empty sequences


def _packed_form(form, backend):
  """``f(q, k, v, cu_seqlens) -> (o, last states or None)`` of a form and backend."""
  def f(q, k, v, cu_seqlens):
    if form == "parallel":
      config = SMALL_TILES_MIXED if backend == "pallas_triton" else None
      return RETENTION_PARALLEL(q, k, v, decay=DECAY, cu_seqlens=cu_seqlens, backend=backend,
                                config=config), None
    return jattn.retention(q, k, v, decay=DECAY, mode=form, chunk_size=16, return_state=True,
                           cu_seqlens=cu_seqlens, backend=backend)
  return f


DECAY = jnp.array([0.6, 0.99], jnp.float32)
# Tiles of different sizes per pass: the dK/dV and dQ passes see other block ranges.
SMALL_TILES_MIXED = jattn.BlockConfig(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16,
                                      block_q_dq=16, block_k_dq=16)
PACKED_FORMS = [("parallel", "xla"), ("parallel", "pallas_triton"), ("chunkwise", "xla"),
                ("chunkwise", "pallas_triton"), ("recurrent", "xla")]


@pytest.mark.kernel
@pytest.mark.parametrize("form,backend", PACKED_FORMS, ids=[f"{f}-{b}" for f, b in PACKED_FORMS])
def test_packed_sequences_match_the_reference_with_gradients(form, backend):
  """Two packings (one with empty, length-1 and mid-chunk sequences, one random)
  through one compiled program (cu_seqlens is traced: one compile per number of
  sequences): outputs, each sequence's last state and the gradients of q, k, v
  against the references."""
  q, k, v, _, _ = _inputs(batch=1, q_len=56, heads=2, dk=8, dv=6, seed=3)

  @jax.jit
  def run(q, k, v, cu, cot):
    out, pull = jax.vjp(lambda q, k, v: _packed_form(form, backend)(q, k, v, cu), q, k, v)
    return out, pull((cot[0], None if out[1] is None else cot[1]))

  for seed, cu in enumerate([EDGE_PACKING, _random_packing(56, 9, seed=1)]):
    (o_ref, finals_ref), pull_ref = jax.vjp(jax.jit(lambda q, k, v: retention_recurrent_reference(
        q, k, v, decay=DECAY, cu_seqlens=cu)), q, k, v)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    cot = (jax.random.normal(keys[0], o_ref.shape), jax.random.normal(keys[1], finals_ref.shape))
    (o, finals), grads = run(q, k, v, cu, cot)
    assert rel_err(o, o_ref) < 1e-5
    if finals is None:  # the parallel form: no state, its gradient from o alone
      cot = (cot[0], jnp.zeros_like(cot[1]))
    else:
      assert finals.shape == (len(cu) - 1, 2, 8, 6) and rel_err(finals, finals_ref) < 1e-5
    for name, g, g_ref in zip("qkv", grads, pull_ref(cot)):
      assert rel_err(g, g_ref) < 2e-5, name
  assert run._cache_size() == 1  # one compile, every packing


@pytest.mark.kernel
def test_vmap_over_packings(form="chunkwise"):
  """A batch of packed rows, each with a packing of its own, through ``vmap``."""
  q, k, v, _, _ = _inputs(batch=3, q_len=40, heads=2, dk=8, dv=6, seed=6)
  cus = np.stack([_random_packing(40, 4, seed) for seed in range(3)])
  f = _packed_form(form, "pallas_triton")
  o, finals = jax.jit(jax.vmap(lambda q, k, v, cu: f(q[None], k[None], v[None], cu)))(
      q, k, v, cus)
  for row, cu in enumerate(cus):
    o_ref, finals_ref = retention_recurrent_reference(q[row:row + 1], k[row:row + 1],
                                                      v[row:row + 1], decay=DECAY, cu_seqlens=cu)
    assert rel_err(o[row], o_ref) < 1e-5
    assert finals is None or rel_err(finals[row], finals_ref) < 1e-5


@pytest.mark.kernel
def test_packed_abs_sum_normalisation():
  """``normalize="abs_sum"`` sums each row over its own sequence (the Triton kernels
  against the reference, gradients with the denominator held constant)."""
  q, k, v, _, _ = _inputs(batch=1, q_len=56, heads=2, dk=8, dv=6, seed=7)
  kw = dict(decay=DECAY, scale=0.1, normalize="abs_sum", cu_seqlens=EDGE_PACKING)
  o, pull = jax.vjp(jax.jit(lambda q, k, v: RETENTION_PARALLEL(
      q, k, v, backend="pallas_triton", config=SMALL_TILES_MIXED, **kw)), q, k, v)
  o_ref, pull_ref = jax.vjp(jax.jit(lambda q, k, v: retention_reference(q, k, v, **kw)), q, k, v)
  assert rel_err(o, o_ref) < 1e-5
  cot = jax.random.normal(jax.random.PRNGKey(8), o.shape)
  for name, g, g_ref in zip("qkv", pull(cot), pull_ref(cot)):
    assert rel_err(g, g_ref) < 2e-5, name


def test_packed_block_ranges_skip_earlier_sequences():
  """The parallel kernels' block ranges: a query tile visits exactly the key blocks
  its rows see (the first one its first row's sequence holds, up to the diagonal), and
  runs unmasked only blocks every row sees whole; the dK/dV ranges likewise."""
  from jattn.kernels.common.masking import MaskSpec
  from jattn.kernels.retention.packing import sequence_bounds, sequence_ids
  from jattn.kernels.retention.triton_parallel import _key_runs, _query_runs

  total, bq, bk = 96, 16, 32
  spec = MaskSpec.build(total, total, causal=True, local_window=None, kv_padded=False,
                        segments=False)
  for cu in (np.array([0, 3, 3, 40, 41, 70, 96]), _random_packing(total, 5, seed=2)):
    start, end = (np.asarray(x) for x in sequence_bounds(sequence_ids(cu, total)))
    n, m = np.arange(total)[:, None], np.arange(total)[None, :]
    sees = (m <= n) & (m >= start[:, None])  # [query, key]
    for tiles, runs_of, view in ((
        (bq, bk), lambda i: _key_runs(spec, start[i * bq:], i * bq, bq, bk), sees),
        ((bk, bq), lambda i: _query_runs(spec, end[i * bk:], i * bk, bk, bq), sees.T)):
      rows, cols = tiles
      for i in range(total // rows):
        (u_lo, u_hi), masked = runs_of(i)
        blocks = view[i * rows:(i + 1) * rows].reshape(rows, -1, cols)
        needed = np.flatnonzero(blocks.any(axis=(0, 2)))
        visited = set(range(int(u_lo), int(u_hi)))
        for lo, hi in masked:
          visited |= set(range(int(lo), int(hi)))
        assert visited == set(range(needed[0], needed[-1] + 1)), (cu, tiles, i)
        assert all(blocks[:, j].all() for j in range(int(u_lo), int(u_hi))), (cu, tiles, i)


# (the xla forms are the references' own formulas, or built on them)
@pytest.mark.kernel
@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_a_nonfinite_value_stays_in_its_packed_sequence(form, backend="pallas_triton"):
  """An inf key and a NaN value in the middle sequence (which starts and ends mid-chunk):
  its rows at and after them come out non-finite, the other sequences' rows, their last
  states and the gradients they send back are exact."""
  cu = np.array([0, 12, 27, 45], np.int32)
  q, k, v, _, _ = _inputs(batch=1, q_len=45, heads=2, dk=8, dv=6, seed=4)
  dirty_k, dirty_v = k.at[0, 15, 0, 1].set(jnp.inf), v.at[0, 20, 1, 2].set(jnp.nan)
  f = _packed_form(form, backend)
  (o, finals), pull = jax.vjp(lambda k, v: f(q, k, v, cu), dirty_k, dirty_v)
  o_ref, finals_ref = retention_recurrent_reference(q, k, v, decay=DECAY, cu_seqlens=cu)
  seen = np.zeros((45, 2), bool)
  seen[15:27, 0] = seen[20:27, 1] = True
  o = np.asarray(o[0])
  np.testing.assert_array_equal(~np.isfinite(o).all(-1), seen)
  assert rel_err(o[~seen], np.asarray(o_ref[0])[~seen]) < 1e-5
  if finals is not None:
    assert rel_err(np.asarray(finals)[[0, 2]], np.asarray(finals_ref)[[0, 2]]) < 1e-5
  cot = jnp.where(jnp.asarray(seen)[None, :, :, None], 0.0, 1.0) * jnp.ones_like(o_ref)
  dk, dv = pull((cot, None if finals is None else
                 jnp.zeros_like(finals).at[0].set(1.0).at[2].set(1.0)))
  for g in (dk, dv):  # the other sequences' keys and values
    assert np.isfinite(np.asarray(g)[0, np.r_[0:12, 27:45]]).all()


@pytest.mark.kernel
def test_packed_prefill_then_a_serving_batch_with_resets(backend="pallas_triton"):
  """Three prompts prefilled packed give each one's state; the step serves them as a
  batch of three slots, and slot 1's request is replaced by a new one (reset, its old
  state holding an inf): every slot decodes as its own sequence would."""
  cu = np.array([0, 5, 6, 19], np.int32)
  q, k, v, _, _ = _inputs(batch=1, q_len=19 + 9, heads=2, dk=8, dv=6, seed=5)
  _, states = jattn.retention(q[:, :19], k[:, :19], v[:, :19], decay=DECAY, mode="chunkwise",
                              chunk_size=16, return_state=True, cu_seqlens=cu, backend=backend)
  states = states.at[1, 0, 0, 0].set(jnp.inf)  # what a blown-up request leaves behind
  step = jax.jit(lambda q, k, v, state, reset: jattn.retention_step(
      q, k, v, state, decay=DECAY, reset=reset, backend=backend))
  # Slot inputs per step: 3 steps x 3 slots from the 9 positions after the prompts.
  tokens = [x[0, 19:].reshape(3, 3, *x.shape[2:]) for x in (q, k, v)]
  outs = []
  for t in range(3):
    reset = np.array([False, t == 0, False])
    o, states = step(*(x[t] for x in tokens), states, reset)
    outs.append(o)
  for slot, (lo, hi) in enumerate([(0, 5), (None, None), (6, 19)]):
    # Slot 1 starts afresh at step 0; the others continue their prompts.
    keep = np.arange(19)[lo:hi] if lo is not None else np.arange(0)
    seq = [jnp.concatenate([x[:, keep], x[:, 19 + slot::3]], 1) for x in (q, k, v)]
    o_ref, s_ref = retention_recurrent_reference(*seq, decay=DECAY)
    got = jnp.stack([o[slot] for o in outs])
    assert rel_err(got, o_ref[0, len(keep):]) < 1e-5, slot
    assert rel_err(states[slot], s_ref[0]) < 1e-5, slot
  assert step._cache_size() == 1


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_retention_step_reset_gradients(backend):
  """Reset slots start from zeros and send no gradient to their old state; the others
  are the plain step's, gradients included."""
  q, k, v, state, _ = _inputs(batch=3, q_len=1, heads=2, dk=8, dv=70)  # two state tiles
  q, k, v = q[:, 0], k[:, 0], v[:, 0]
  reset = jnp.array([True, False, True])
  (o, s), pull = jax.vjp(lambda *a: jattn.retention_step(*a, decay=DECAY, reset=reset,
                                                          backend=backend), q, k, v, state)
  fresh = jnp.where(reset[:, None, None, None], 0.0, state)
  (o_ref, s_ref), pull_ref = jax.vjp(lambda *a: jattn.retention_step(
      *a, decay=DECAY, backend="xla"), q, k, v, fresh)
  chex.assert_trees_all_close((o, s), (o_ref, s_ref), atol=1e-5, rtol=1e-5)
  cot = (jax.random.normal(jax.random.PRNGKey(0), o.shape),
         jax.random.normal(jax.random.PRNGKey(1), s.shape))
  grads, grads_ref = pull(cot), pull_ref(cot)
  chex.assert_trees_all_close(grads[:3], grads_ref[:3], atol=1e-5, rtol=1e-5)
  dstate = np.asarray(grads[3])
  assert not dstate[[0, 2]].any() and rel_err(dstate[1], grads_ref[3][1]) < 1e-5


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cu_seqlens=jnp.array([0.0, 5.0])), TypeError, "cu_seqlens must be integers"),
    (dict(cu_seqlens=jnp.array([True, False])), TypeError, "cu_seqlens must be integers"),
    (dict(cu_seqlens=jnp.array([[0, 5]])), ValueError, r"cu_seqlens must have rank 1"),
    (dict(cu_seqlens=jnp.array([5])), ValueError, "with at least 2 entries"),
    (dict(cu_seqlens=[0, 3, 6]), ValueError, r"cu_seqlens must run from 0 to the length \(5\)"),
    (dict(cu_seqlens=np.array([0, 4, 3, 5])), ValueError, "without decreasing"),
    (dict(cu_seqlens=[1, 5]), ValueError, "cu_seqlens must run from 0"),
    (dict(cu_seqlens=[0, 5], q=jnp.ones((2, 5, 3, 8)), k=jnp.ones((2, 5, 3, 8)),
          v=jnp.ones((2, 5, 3, 6))), ValueError,
     "cu_seqlens packs sequences along the length: q, k, v must have batch 1"),
    (dict(cu_seqlens=[0, 5], q=jnp.ones((1, 4, 3, 8))), ValueError, "cu_seqlens needs q_len"),
    (dict(cu_seqlens=[0, 5], initial_state=jnp.ones((1, 3, 8, 6))), ValueError,
     "initial_state cannot be given with cu_seqlens"),
    (dict(cu_seqlens=[0, 5], mode="parallel", return_state=True), ValueError,
     "mode='parallel' has no state"),
])
def test_bad_packings(kwargs, error, match):
  args = dict(q=jnp.ones((1, 5, 3, 8)), k=jnp.ones((1, 5, 3, 8)), v=jnp.ones((1, 5, 3, 6)))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jattn.retention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("reset,error,match", [
    (jnp.array([1, 0]), TypeError, r"reset must be bool \[batch\], got dtype int32"),
    (jnp.array([True, False, True]), ValueError, r"reset must be \[batch\] = \[2\]"),
    (jnp.array([[True, False]]), ValueError, r"reset must be \[batch\]"),
])
def test_bad_resets(reset, error, match):
  q, k, v, state, _ = _inputs(q_len=1)
  with pytest.raises(error, match=match):
    jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, reset=reset)


def test_packed_problems_from_keywords():
  assert RETENTION_CHUNKWISE.problem(q_len=40, heads=2, dk=16, sequences=3).sequences == 3
  with pytest.raises(ValueError, match="sequences .packed, cu_seqlens. needs batch 1"):
    RETENTION_CHUNKWISE.problem(batch=2, q_len=40, sequences=3)
  # The examples a problem draws (tuning, crosscheck) are packings of its length.
  arrays = RETENTION_CHUNKWISE.example(RETENTION_CHUNKWISE.problem(q_len=40, sequences=3),
                                       jax.random.PRNGKey(0))
  cu = np.asarray(arrays[5])
  assert cu.shape == (4,) and cu[0] == 0 and cu[-1] == 40 and (np.diff(cu) >= 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 3e-2), (jnp.float16, 4e-3)])
def test_hopper_parallel_forward_packed(dtype, tol):
  _skip_without_hopper()
  total = 1100
  q, k, v, _, decay = _inputs(1, total, total, 3, 64, 128, dtype=dtype)
  cu = np.array([0, 1, 1, 70, 64 * 5 + 3, 700, 1099, 1100], np.int32)
  for normalize in (None, "abs_sum"):
    o = RETENTION_PARALLEL(q, k, v, decay=decay, cu_seqlens=cu, normalize=normalize,
                           backend="pallas_mosaic", config=HOPPER_TILES)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o_ref = retention_reference(*f32, decay=decay, normalize=normalize, cu_seqlens=cu)
    assert rel_err(o, o_ref) < tol, normalize
