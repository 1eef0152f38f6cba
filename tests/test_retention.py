"""jattn.retention: the parallel, chunkwise and recurrent forms agree, with gradients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jattn
from jattn.reference import default_decay, retention_recurrent_reference, retention_reference


def _inputs(batch=2, q_len=37, kv_len=None, heads=3, dk=8, dv=6, dtype=jnp.float32, seed=0):
  kv_len = q_len if kv_len is None else kv_len
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, q_len, heads, dk), dtype)
  k = jax.random.normal(ks[1], (batch, kv_len, heads, dk), dtype)
  v = jax.random.normal(ks[2], (batch, kv_len, heads, dv), dtype)
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


@settings(max_examples=6, deadline=None)
@given(q_len=st.integers(1, 40), prefix=st.integers(0, 9), chunk=st.sampled_from([1, 4, 8, 16, 64]))
def test_modes_agree(q_len, prefix, chunk):
  q, k, v, _, decay = _inputs(q_len=q_len, kv_len=q_len + prefix, seed=q_len)
  par = jattn.retention(q, k, v, decay=decay, mode="parallel")
  chunked = jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=chunk)
  rec = jattn.retention(q, k, v, decay=decay, mode="recurrent")
  chex.assert_trees_all_close(chunked, par, atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_close(rec, par, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", ["chunkwise", "recurrent"])
def test_state_in_and_out_with_gradients(mode):
  q, k, v, state, decay = _inputs(q_len=21)

  def ours(q, k, v, state):
    o, s = jattn.retention(q, k, v, decay=decay, mode=mode, chunk_size=8, initial_state=state,
                           return_state=True)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * jnp.sin(s))

  def ref(q, k, v, state):
    o, s = retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * jnp.sin(s))

  chex.assert_trees_all_close(ours(q, k, v, state), ref(q, k, v, state), rtol=1e-5)
  grads = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, state)
  grads_ref = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, state)
  chex.assert_trees_all_close(grads, grads_ref, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(grads[3]).max()) > 0  # the state really gets a gradient


def test_a_split_sequence_continues_from_the_state():
  q, k, v, _, decay = _inputs(q_len=30)
  whole = jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=8)
  first, state = jattn.retention(q[:, :13], k[:, :13], v[:, :13], decay=decay,
                                 mode="chunkwise", return_state=True, chunk_size=8)
  second = jattn.retention(q[:, 13:], k[:, 13:], v[:, 13:], decay=decay, mode="chunkwise",
                           initial_state=state, chunk_size=8)
  chex.assert_trees_all_close(jnp.concatenate([first, second], 1), whole, atol=2e-5, rtol=2e-5)


def test_retention_step_checks_its_decay():
  q, k, v, state, _ = _inputs(q_len=1)
  with pytest.raises(ValueError, match=r"decay must be in \(0, 1\]"):
    jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=jnp.array([0.5, -0.1, 0.9]))
  # Under jit the values are unknown: the decay is taken as given.
  o, _ = jax.jit(lambda d: jattn.retention_step(q[:, 0], k[:, 0], v[:, 0], state, decay=d))(
      jnp.array([0.5, 0.7, 0.9]))
  chex.assert_shape(o, (2, 3, 6))


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_retention_step_decodes_like_the_recurrent_form(backend, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  q, k, v, state, decay = _inputs(q_len=7, dk=8, dv=70)  # dv spans two state tiles
  o_ref, s_ref = retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)

  def decode(q, k, v, state):
    outs = []
    for t in range(q.shape[1]):
      o, state = jattn.retention_step(q[:, t], k[:, t], v[:, t], state, decay=decay,
                                      backend=backend)
      outs.append(o)
    return jnp.stack(outs, 1), state

  (o, s), pull = jax.vjp(decode, q, k, v, state)
  chex.assert_trees_all_close((o, s), (o_ref, s_ref), atol=1e-5, rtol=1e-5)
  cot = tuple(jax.random.normal(jax.random.PRNGKey(i), x.shape) for i, x in enumerate((o, s)))
  _, pull_ref = jax.vjp(lambda q, k, v, state: retention_recurrent_reference(
      q, k, v, decay=decay, initial_state=state), q, k, v, state)
  chex.assert_trees_all_close(pull(cot), pull_ref(cot), atol=1e-4, rtol=1e-4)


def test_abs_sum_normalisation_and_its_constant_denominator():
  q, k, v, _, decay = _inputs(q_len=12, kv_len=15)
  scale = 0.1  # some rows have Σ|S| > 1 and some not
  s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
       * jattn.reference.retention_decay_mask(12, 15, decay)[None])
  den = jnp.maximum(jnp.abs(s).sum(-1, keepdims=True), 1.0)
  assert bool((den > 1).any()) and bool((den == 1).any())
  o = jattn.retention(q, k, v, decay=decay, scale=scale, normalize="abs_sum")
  chex.assert_trees_all_close(o, jnp.einsum("bhqk,bkhd->bqhd", s / den, v), atol=1e-5, rtol=1e-5)
  # The gradient holds the denominator constant.
  loss = lambda q: jnp.sum(jnp.sin(jattn.retention(q, k, v, decay=decay, scale=scale,
                                                   normalize="abs_sum")))
  fixed = lambda q: jnp.sum(jnp.sin(jnp.einsum(
      "bhqk,bkhd->bqhd", jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
      * jattn.reference.retention_decay_mask(12, 15, decay)[None] / den, v)))
  chex.assert_trees_all_close(jax.grad(loss)(q), jax.grad(fixed)(q), atol=1e-4, rtol=1e-4)


def test_low_precision_inputs_match_fp32():
  q, k, v, _, decay = _inputs(q_len=33, dtype=jnp.bfloat16)
  expected = retention_reference(q, k, v, decay=decay)
  for mode in ("parallel", "chunkwise", "recurrent"):
    o = jattn.retention(q, k, v, decay=decay, mode=mode, chunk_size=16)
    assert o.dtype == jnp.bfloat16
    err = jnp.linalg.norm(o.astype(jnp.float32) - expected) / jnp.linalg.norm(expected)
    assert float(err) < 1e-2, mode


def test_auto_mode_choice():
  q, k, v, state, decay = _inputs(q_len=16)
  # A state in or out forces chunkwise; short sequences otherwise run parallel.
  o, s = jattn.retention(q, k, v, decay=decay, return_state=True)
  chex.assert_shape(s, (2, 3, 8, 6))
  with pytest.raises(ValueError, match="mode='parallel' has no state"):
    jattn.retention(q, k, v, mode="parallel", return_state=True)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q=jnp.ones((2, 4, 3))), ValueError, "q must have rank 4"),
    (dict(q=jnp.ones((2, 9, 3, 8))), ValueError, r"q_len \(9\) must be <= kv_len \(5\)"),
    (dict(k=jnp.ones((2, 5, 3, 7))), ValueError, "k must be"),
    (dict(v=jnp.ones((2, 4, 3, 6))), ValueError, "v must be"),
    (dict(decay=jnp.ones((2,))), ValueError, r"decay must have shape \[heads\] = \(3,\)"),
    (dict(decay=jnp.array([0.9, 0.0, 0.5])), ValueError, r"decay must be in \(0, 1\]"),
    (dict(decay=[0.9, 1.5, 0.5]), ValueError, r"decay must be in \(0, 1\]"),
    (dict(normalize="l2"), ValueError, "normalize must be one of"),
    (dict(mode="fast"), ValueError, "mode must be one of"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
    (dict(backend="pallas_triton", mode="recurrent"), ValueError, "has no recurrent kernel"),
    (dict(backend="pallas_triton", mode="chunkwise", chunk_size=24), ValueError,
     "must be a power of two >= 16"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(initial_state=jnp.ones((2, 3, 8, 5))), ValueError, "initial_state must be"),
    (dict(normalize="abs_sum", mode="chunkwise"), ValueError, "needs the whole row"),
    (dict(q=jnp.ones((2, 5, 3, 8), jnp.int32)), TypeError, "q has dtype int32"),
])
def test_bad_inputs(kwargs, error, match):
  args = dict(q=jnp.ones((2, 5, 3, 8)), k=jnp.ones((2, 5, 3, 8)), v=jnp.ones((2, 5, 3, 6)))
  args.update(kwargs)
  q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
  with pytest.raises(error, match=match):
    jattn.retention(q, k, v, **args)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", [
    dict(q_len=37, dk=8, dv=12),
    dict(q_len=20, kv_len=45, dk=16, dv=16, normalize="abs_sum"),
    dict(q_len=70, dk=32, dv=8, normalize="abs_sum", scale=0.05),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_pallas_parallel_kernel_matches_reference(case, dtype, tol, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  case = dict(case)
  normalize, scale = case.pop("normalize", None), case.pop("scale", None)
  q, k, v, _, decay = _inputs(dtype=dtype, heads=2, **case)
  do = jax.random.normal(jax.random.PRNGKey(9), q.shape[:3] + (v.shape[-1],), jnp.float32)
  kw = dict(decay=decay, scale=scale, normalize=normalize)
  o, pull = jax.vjp(lambda q, k, v: jattn.retention(q, k, v, backend="pallas_triton",
                                                    mode="parallel", **kw), q, k, v)
  o_ref, pull_ref = jax.vjp(lambda q, k, v: retention_reference(q, k, v, **kw), q, k, v)
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
  assert o.dtype == dtype and rel(o, o_ref) < tol
  for name, g, gr in zip("qkv", pull(do.astype(dtype)), pull_ref(do)):
    assert rel(g, gr) < 2 * tol, name


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", [
    dict(q_len=37, dk=8, dv=12, chunk=16),
    dict(q_len=20, kv_len=45, dk=16, dv=16, chunk=16),
    dict(q_len=64, dk=32, dv=8, chunk=32),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_pallas_chunkwise_kernel_with_states_matches_reference(case, dtype, tol, monkeypatch):
  monkeypatch.setenv("JATTN_INTERPRET", "1")
  case = dict(case)
  chunk = case.pop("chunk")
  q, k, v, state, decay = _inputs(dtype=dtype, heads=2, **case)
  keys = jax.random.split(jax.random.PRNGKey(11), 2)
  do = jax.random.normal(keys[0], q.shape[:3] + (v.shape[-1],), jnp.float32)
  dstate = jax.random.normal(keys[1], state.shape, jnp.float32)

  def ours(q, k, v, state):
    return jattn.retention(q, k, v, decay=decay, mode="chunkwise", chunk_size=chunk,
                           initial_state=state, return_state=True, backend="pallas_triton")

  def ref(q, k, v, state):
    return retention_recurrent_reference(q, k, v, decay=decay, initial_state=state)

  (o, s), pull = jax.vjp(ours, q, k, v, state)
  (o_ref, s_ref), pull_ref = jax.vjp(ref, q, k, v, state)
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
  assert o.dtype == dtype and rel(o, o_ref) < tol and rel(s, s_ref) < tol
  grads = pull((do.astype(dtype), dstate))
  for name, g, gr in zip(["q", "k", "v", "initial_state"], grads, pull_ref((do, dstate))):
    assert rel(g, gr) < 2 * tol, name


@pytest.mark.parametrize("normalize", [None, "abs_sum"])
def test_pallas_parallel_kernel_with_many_small_tiles(normalize, monkeypatch):
  # Several key/query blocks per tile, so both the factored (off-diagonal) decay and the
  # masked (diagonal) decay run, with tiles of different sizes per pass.
  from pallas_kernels.flash import FlashBlockConfig
  from pallas_kernels.retention import retention_parallel_triton

  q, k, v, _, _ = _inputs(batch=1, q_len=50, kv_len=83, heads=3, dk=16, dv=16)
  decay = jnp.array([0.3, 0.95, 1.0], jnp.float32)
  config = FlashBlockConfig(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16,
                            block_q_dq=16, block_k_dq=16)
  do = jax.random.normal(jax.random.PRNGKey(5), v.shape[:1] + q.shape[1:3] + v.shape[3:])

  def ours(q, k, v):
    return retention_parallel_triton(q, k, v, decay, scale=0.2, normalize=normalize is not None,
                                     config=config, interpret=True)

  o, pull = jax.vjp(ours, q, k, v)
  o_ref, pull_ref = jax.vjp(lambda q, k, v: retention_reference(
      q, k, v, decay=decay, scale=0.2, normalize=normalize), q, k, v)
  chex.assert_trees_all_close(o, o_ref, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(pull(do), pull_ref(do), rtol=1e-4, atol=1e-4)


def test_pallas_chunkwise_kernel_with_tiled_state(monkeypatch):
  # dk, dv above the state tile: the scans run one program per state tile.
  from pallas_kernels.retention import ChunkwiseLaunch, retention_chunkwise_triton

  q, k, v, state, decay = _inputs(batch=1, q_len=45, heads=2, dk=48, dv=40)
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  do = jax.random.normal(keys[0], v.shape)
  dstate = jax.random.normal(keys[1], state.shape)

  def ours(q, k, v, state):
    return retention_chunkwise_triton(q, k, v, decay, state, scale=0.3, chunk=16,
                                      launch=ChunkwiseLaunch(state_block=16), interpret=True)

  (o, s), pull = jax.vjp(ours, q, k, v, state)
  (o_ref, s_ref), pull_ref = jax.vjp(lambda q, k, v, state: retention_recurrent_reference(
      q, k, v, decay=decay, scale=0.3, initial_state=state), q, k, v, state)
  chex.assert_trees_all_close((o, s), (o_ref, s_ref), rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(pull((do, dstate)), pull_ref((do, dstate)), rtol=1e-4, atol=1e-4)


H100_SMEM = 232448  # the opt-in shared memory per block the fit runs reported


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("fp16", 2)])
def test_chunk_cap_model_agrees_with_the_h100_compile_results(dtype, itemsize):
  # bench/retention.py --fit on an H100: every configuration Triton refused must be
  # predicted not to fit (at the bytes it asked for), every one predicted to fit compiled.
  import json
  import pathlib

  from pallas_kernels.retention.chunkwise import grad_kernel_bytes

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
  from pallas_kernels.retention import fitting_chunk

  assert fitting_chunk(64, 128, 128, 2, H100_SMEM) == 64
  assert fitting_chunk(64, 128, 128, 4, H100_SMEM) == 32
  assert fitting_chunk(128, 100, 70, 4, H100_SMEM) == 32  # padded to 128 x 128
  assert fitting_chunk(64, 128, 256, 4, H100_SMEM) is None
  assert fitting_chunk(128, 64, 64, 4, 99 * 1024) == 32  # a smaller GPU gets smaller chunks


def test_chunkwise_on_a_gpu_runs_the_chunk_that_fits(monkeypatch):
  # On a (faked) H100, float32 dk = dv = 128 runs the kernels at chunk 32 (64 would
  # not fit); a problem that fits nowhere is an error naming the dims for the Pallas
  # backend and falls back to jnp under "auto". Interpret mode keeps the chunk asked for.
  import importlib

  from jattn.gpu import describe

  jr = importlib.import_module("jattn.retention")  # the module, not the function jattn.retention

  assert jr._kernel_chunk(64, 128, 128, jnp.float32) == 64
  monkeypatch.setenv("JATTN_INTERPRET", "0")
  monkeypatch.setattr(jr, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(jr, "gpu_info", lambda: describe(
      "H100", (9, 0), shared_memory_per_block_bytes=H100_SMEM, interpret=False))
  assert jr._kernel_chunk(64, 128, 128, jnp.float32) == 32
  assert jr._kernel_chunk(64, 128, 128, jnp.bfloat16) == 64
  assert jr._kernel_chunk(64, 256, 256, jnp.float32) is None
  assert jr._kernel_chunk(48, 64, 64, jnp.float32) is None  # no power of two
  monkeypatch.setattr(jr, "usable_backends", lambda: ("pallas_triton", "xla"))
  monkeypatch.setattr(jr, "resolve_backend", lambda backend, choose: (
      choose() if backend == "auto" else backend, False))
  q, k, v, _, _ = _inputs(batch=1, q_len=20, heads=1, dk=256, dv=256)
  with pytest.raises(ValueError, match="dk=256, dv=256 in float32"):
    jattn.retention(q, k, v, mode="chunkwise", backend="pallas_triton")
  o = jattn.retention(q, k, v, mode="chunkwise")  # auto: the jnp form
  chex.assert_trees_all_close(o, retention_reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_default_launch_cuts_the_state_finer_for_few_heads():
  from pallas_kernels.retention import default_launch

  assert default_launch(8, 16, 128, 128, 132).state_block == 64  # 512 scan programs
  assert default_launch(2, 16, 128, 128, 132).state_block == 32  # 128 at 64 < 132 SMs
  assert default_launch(1, 8, 128, 128, 132).state_block == 16
  assert default_launch(1, 1, 16, 16, 132).state_block == 16  # nothing finer to cut
  assert default_launch(1, 8, 128, 128, None).state_block == 64  # SM count unknown


def test_recurrent_reference_takes_the_queries_at_the_end():
  q, k, v, _, decay = _inputs(q_len=11, kv_len=19)
  o, _ = retention_recurrent_reference(q, k, v, decay=decay)
  chex.assert_trees_all_close(o, retention_reference(q, k, v, decay=decay), atol=1e-5, rtol=1e-5)
