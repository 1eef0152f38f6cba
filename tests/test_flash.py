"""Flash attention's kernels against the float32 reference: forward, lse and every
gradient (an lse cotangent included), over masks, windows, segments, soft-capping,
head dims and lengths. On CPU the Triton-lowered kernels run in interpret mode on
small tiles; on a GPU the same cases run compiled, plus larger ones for both kernel
families (``gpu``)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jattn
from conftest import ON_GPU, rel_err
from jattn.kernels.flash.config import default_mosaic_config
from jattn.kernels.common.masking import segment_block_ranges
from jattn.reference import flash_attention_reference


# Small tiles so that the short CPU sequences still span several blocks and every
# loop phase (masked / unmasked / masked) of the kernels runs.
SMALL = jattn.BlockConfig(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32,
                          block_q_dq=32, block_k_dq=16)
TOL = {jnp.dtype(jnp.float32): 2e-5 if not ON_GPU else 1e-4,
       jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 1e-2}


def make_inputs(key, b, sq, sk, hq, hk, d, dtype):
  kq, kk, kv, kdo = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, sq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, sk, hk, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, sk, hk, d), jnp.float32).astype(dtype)
  do = jax.random.normal(kdo, (b, sq, hq, d), jnp.float32).astype(dtype)
  return q, k, v, do


def packed_segments(key, batch, length, n_segments=3):
  """Sorted segment ids (packed sequences) ``[batch, length]``."""
  return jnp.sort(jax.random.randint(key, (batch, length), 0, n_segments), axis=1)


def check_against_reference(q, k, v, do, *, config=SMALL, backend="pallas_triton", **kwargs):
  """Forward output, lse, and dq/dk/dv (with an lse cotangent too) vs the fp32 reference."""
  dtype = jnp.dtype(q.dtype)

  def ours(q, k, v):
    return jattn.flash_attention(q, k, v, backend=backend, return_lse=True, config=config,
                                 **kwargs)

  ref_kwargs = {n: x for n, x in kwargs.items() if n != "deterministic"}

  def ref(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    if "kv_lengths" in ref_kwargs:  # the op's own dense path takes per-row lengths
      return jattn.flash_attention(f32(q), f32(k), f32(v), backend="xla", return_lse=True,
                                   **ref_kwargs)
    return flash_attention_reference(f32(q), f32(k), f32(v), **ref_kwargs)

  # jitted: eagerly every op of the kernel (and of the reference) compiles on its own.
  (o, lse), pull = jax.vjp(jax.jit(ours), q, k, v)
  (o_ref, lse_ref), pull_ref = jax.vjp(jax.jit(ref), q, k, v)
  assert o.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  assert o.dtype == q.dtype
  tol = TOL[dtype]
  assert rel_err(o, o_ref) < tol
  live = np.asarray(lse_ref) > -1e29
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(lse_ref)[live],
                             rtol=tol, atol=tol * 10 if dtype == jnp.float32 else 5e-2)
  np.testing.assert_array_equal(np.asarray(lse)[~live], np.float32(jattn.EMPTY_ROW_LSE))
  dlse = jnp.where(live, jax.random.normal(jax.random.PRNGKey(7), lse.shape, jnp.float32), 0.0)
  grads = jax.jit(pull)((do, dlse))
  grads_ref = pull_ref((do.astype(jnp.float32), dlse))
  for name, g, g_ref in zip("qkv", grads, grads_ref):
    assert g.dtype == q.dtype, name
    assert rel_err(g, g_ref) < 2 * tol, name
  return o, lse


# Each case combines features, so that few interpret-mode compiles cover them all:
# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype) and the op's keywords.
CASES = {
    "plain": ((2, 40, 40, 4, 4, 32, jnp.float32), {}),
    "causal-bf16": ((2, 40, 40, 4, 4, 32, jnp.bfloat16), dict(causal=True)),
    "gqa-d30-causal": ((1, 37, 37, 4, 2, 30, jnp.float32), dict(causal=True)),
    "mqa-d96-q20-kv53": ((1, 20, 53, 4, 1, 96, jnp.float32), {}),
    "d128-softcap-causal": ((1, 33, 33, 2, 1, 128, jnp.float32),
                            dict(causal=True, softcap=2.0, scale=0.3)),
    "q53-kv20-causal": ((1, 53, 20, 2, 2, 16, jnp.float32), dict(causal=True)),
    "q1-kv45-causal": ((1, 1, 45, 2, 2, 16, jnp.float32), dict(causal=True)),
    "window-7-3": ((1, 48, 61, 2, 2, 16, jnp.float32), dict(local_window=(7, 3))),
    "window-10-inf-causal": ((1, 48, 61, 2, 2, 16, jnp.float32),
                             dict(local_window=(10, None), causal=True)),
    "window-inf-5-softcap": ((1, 48, 61, 2, 2, 16, jnp.float32),
                             dict(local_window=(None, 5), softcap=2.0, scale=0.3)),
    "window-0-0": ((1, 48, 61, 2, 2, 16, jnp.float32), dict(local_window=(0, 0))),
}


@pytest.mark.parametrize("shape,kwargs", CASES.values(), ids=CASES)
def test_matches_reference(shape, kwargs):
  b, sq, sk, hq, hk, d, dtype = shape
  q, k, v, do = make_inputs(jax.random.PRNGKey(sq + d), b, sq, sk, hq, hk, d, dtype)
  if "softcap" in kwargs:
    q = q * 3.0  # Large logits so the cap matters.
  o, _ = check_against_reference(q, k, v, do, **kwargs)
  if kwargs.get("causal") and sq > sk:
    # Bottom-right alignment: the first sq - sk queries see no key at all.
    assert np.all(np.asarray(o[:, : sq - sk]) == 0.0)


def test_segment_ids_with_empty_rows():
  b, s = 2, 45
  q, k, v, do = make_inputs(jax.random.PRNGKey(4), b, s, s, 2, 1, 16, jnp.bfloat16)
  q_seg = packed_segments(jax.random.PRNGKey(5), b, s)
  kv_seg = packed_segments(jax.random.PRNGKey(6), b, s)
  # Segment 9 exists only among the queries: those rows see nothing.
  q_seg = q_seg.at[:, -5:].set(9)
  o, _ = check_against_reference(q, k, v, do, causal=True, q_segment_ids=q_seg,
                                 kv_segment_ids=kv_seg)
  assert np.all(np.asarray(o[:, -5:]) == 0.0)


SEGMENT_CASES = {
    # Sorted documents of 20 to 30 tokens: tiles inside one run unmasked, cross attention
    # with ids only the queries hold (rows that see nothing), GQA, causal.
    "packed-cross-causal": (48, 64, lambda i, n: i * 3 // n + (i >= n - 4) * 7,
                            dict(causal=True)),
    # Repeating, unsorted ids (0, 1, 0, 1 in runs of 17) with a window and per-row lengths.
    "repeating-window-lengths": (70, 70, lambda i, n: (i // 17) % 2,
                                 dict(local_window=(24, 5),
                                      kv_lengths=jnp.asarray([70, 51], jnp.int32))),
}


@pytest.mark.parametrize("sq,sk,ids_of,kwargs", SEGMENT_CASES.values(), ids=SEGMENT_CASES)
def test_segment_ids_skip_and_unmask_tiles(sq, sk, ids_of, kwargs):
  q, k, v, do = make_inputs(jax.random.PRNGKey(sq), 2, sq, sk, 4, 2, 16, jnp.float32)
  ids = lambda n, shift: jnp.stack([ids_of(jnp.arange(n), n),
                                    ids_of((jnp.arange(n) + shift) % n, n)])
  q_seg, kv_seg = ids(sq, 0), ids(sk, 5)
  # The kernels' path under test: some tiles lie inside one segment (run unmasked).
  pad = lambda x: jnp.pad(x, ((0, 0), (0, -x.shape[1] % 16)))
  ranges = segment_block_ranges(pad(q_seg), pad(kv_seg), sq, sk, 16, 16, uniform=True)
  assert np.any(ranges[..., 2] > ranges[..., 1])
  check_against_reference(q, k, v, do, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)


def test_default_config_and_single_block():
  q, k, v, do = make_inputs(jax.random.PRNGKey(12), 1, 24, 24, 2, 2, 16, jnp.bfloat16)
  check_against_reference(q, k, v, do, config=None, causal=True)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), group=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([8, 20, 32]), causal=st.booleans(), seed=st.integers(0, 99))
def test_random_shapes(sq, sk, group, head_dim, causal, seed):
  q, k, v, do = make_inputs(jax.random.PRNGKey(seed), 1, sq, sk, 2 * group, 2, head_dim,
                            jnp.float32)
  check_against_reference(q, k, v, do, causal=causal)


# --- compiled on a GPU: both kernel families at realistic sizes -------------------------

# (batch, q_len, q_heads, kv_heads, head_dim) and features: lengths off the tiles,
# several tiles per CTA range (Hopper consumers skip blocks the other one needs),
# GQA/MQA, windows, q_len != kv_len both ways, head dims to 256, one key block.
GPU_CASES = [
    dict(shape=(2, 512, 4, 4, 128)),
    dict(shape=(1, 1000, 8, 2, 128), causal=True),
    dict(shape=(2, 300, 4, 1, 64)),
    dict(shape=(1, 777, 4, 2, 64), causal=True),
    dict(shape=(2, 200, 4, 1, 30)),
    dict(shape=(1, 640, 4, 2, 96), local_window=(130, 17)),
    dict(shape=(1, 256, 2, 2, 256), causal=True),
    dict(shape=(1, 160, 4, 4, 64), kv_len=900, causal=True),
    dict(shape=(1, 700, 4, 4, 64), kv_len=200, causal=True),
    dict(shape=(1, 256, 4, 4, 64), kv_len=1000, local_window=(2, 1)),
    dict(shape=(2, 100, 4, 4, 64), kv_len=50),  # one key block: a one-slot Hopper ring
    dict(shape=(2, 192, 4, 2, 64), softcap=5.0, causal=True),
    dict(shape=(1, 1000, 8, 2, 128), softcap=8.0, segments="packed"),
    dict(shape=(1, 256, 2, 2, 256), softcap=6.0),
    dict(shape=(2, 160, 4, 4, 64), segments="packed", causal=True),
    # Hopper packed sequences: key blocks skipped by segment range, GQA, lengths off the
    # tiles, q_len != kv_len, ids unsorted, rows whose segment has no key, head dim 256
    # (its backward is the Triton one).
    dict(shape=(2, 1000, 8, 2, 128), segments="packed"),
    dict(shape=(1, 700, 4, 4, 64), kv_len=900, segments="packed", causal=True),
    dict(shape=(1, 600, 4, 2, 64), segments="unsorted"),
    dict(shape=(2, 640, 4, 4, 128), segments="no keys for segment 2", local_window=(200, 30)),
    dict(shape=(1, 384, 2, 2, 256), segments="packed", causal=True),
]


def _gpu_inputs(case, dtype, seed=0):
  b, s, hq, hk, d = case["shape"]
  q, k, v, do = make_inputs(jax.random.PRNGKey(seed), b, s, case.get("kv_len", s), hq, hk, d,
                            dtype)
  if "dv" in case:  # a value head dim of its own
    kv, kdo = jax.random.split(jax.random.PRNGKey(seed + 2))
    v, do = (jax.random.normal(key, (*x.shape[:-1], case["dv"]), jnp.float32).astype(dtype)
             for key, x in ((kv, v), (kdo, do)))
  kwargs = {n: case[n] for n in ("causal", "local_window", "softcap") if n in case}
  if "softcap" in case:
    q = q * 3.0  # large logits, so that the cap matters
  if "segments" in case:
    kq, kk = jax.random.split(jax.random.PRNGKey(seed + 1))
    q_seg, kv_seg = (packed_segments(key, b, n, 4) for key, n in ((kq, s), (kk, k.shape[1])))
    if case["segments"] == "unsorted":
      q_seg, kv_seg = (jax.random.randint(key, x.shape, 0, 4) for key, x in
                       ((kq, q_seg), (kk, kv_seg)))
    elif case["segments"] == "no keys for segment 2":
      kv_seg = q_seg + (q_seg == 2)
    kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  return (q, k, v, do), kwargs


def _skip_unless_runnable(backend, *arrays, **kwargs):
  try:
    jax.eval_shape(lambda q, k, v: jattn.flash_attention(q, k, v, backend=backend, **kwargs),
                   *arrays[:3])
  except ValueError as e:
    if "cannot run this" not in str(e):
      raise
    pytest.skip(str(e).split(". Backends:")[0])


def _gpu_params():
  """Every case on both families in 16-bit; float32 (Triton only) on an odd head dim and
  on a single key block (float32 tiles compile slowly: the suite is compile-bound)."""
  ids = lambda c: "-".join(f"{k}={v}" for k, v in c.items())
  for case in GPU_CASES:
    for backend, dtype in (("pallas_triton", jnp.float16), ("pallas_mosaic", jnp.bfloat16)):
      yield pytest.param(case, backend, dtype, id=f"{ids(case)}-{backend}-{dtype.__name__}")
    if case["shape"][-1] == 30 or case.get("kv_len") == 50:
      yield pytest.param(case, "pallas_triton", jnp.float32, id=f"{ids(case)}-float32")


@pytest.mark.gpu
@pytest.mark.parametrize("case,backend,dtype", list(_gpu_params()))
def test_kernels_at_gpu_sizes(case, backend, dtype):
  arrays, kwargs = _gpu_inputs(case, dtype)
  _skip_unless_runnable(backend, *arrays, **kwargs)
  check_against_reference(*arrays, config=None, backend=backend, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    jattn.MosaicBlockConfig(block_q=64, block_kv=64, stages=3, block_q_dq=64, block_kv_dq=128,
                            block_q_dkv=128, block_kv_dkv=64, bwd_stages=3),
    jattn.MosaicBlockConfig(block_q=128, block_kv=64, stages=2, block_kv_dq=64, bwd_stages=2),
], ids=["small-deep", "wide-q"])
def test_hopper_kernels_with_other_tiles(config):
  arrays, kwargs = _gpu_inputs(dict(shape=(1, 1100, 4, 2, 64), causal=True), jnp.bfloat16)
  _skip_unless_runnable("pallas_mosaic", *arrays, **kwargs)
  check_against_reference(*arrays, config=config, backend="pallas_mosaic", **kwargs)


# More work items than an H100 has SMs, so that each persistent CTA walks several:
# GQA, segments, head dim 256 and a 3-deep ring (one Q buffer), a causal tail, and
# dk = 192 with dv = 128 (each output written into a view of its Q tile, then the next
# item's Q loaded over it).
PERSISTENT_CASES = [
    (dict(shape=(4, 1100, 16, 4, 64), causal=True), None),
    (dict(shape=(2, 2048, 16, 4, 128), segments="packed"), None),
    (dict(shape=(2, 1024, 32, 8, 256), causal=True), None),
    (dict(shape=(2, 2048, 16, 16, 128)), jattn.MosaicBlockConfig(block_kv=64, stages=3)),
    (dict(shape=(2, 2048, 16, 4, 192), dv=128), None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,config", PERSISTENT_CASES,
                         ids=["d64-causal-gqa", "d128-packed", "d256-causal", "d128-kv64-3-stages",
                              "dk192-dv128"])
def test_hopper_persistent_forward(case, config):
  """The persistent forward (and the default, one CTA per work item) equals the
  reference; the two grids agree bitwise."""
  (q, k, v, _), kwargs = _gpu_inputs(case, jnp.bfloat16)
  config = dataclasses.replace(
      config or default_mosaic_config(case["shape"][-1], case.get("dv")), persistent=True)
  _skip_unless_runnable("pallas_mosaic", q, k, v, **kwargs)
  outs = [jax.jit(lambda q, k, v, c=c: jattn.flash_attention(
      q, k, v, backend="pallas_mosaic", config=c, return_lse=True, **kwargs))(q, k, v)
          for c in (config, dataclasses.replace(config, persistent=False))]
  chex.assert_trees_all_equal(*outs)
  f32 = lambda x: x.astype(jnp.float32)
  o_ref, _ = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, **kwargs))(
      f32(q), f32(k), f32(v))
  assert rel_err(outs[0][0], o_ref) < TOL[jnp.dtype(jnp.bfloat16)]


FUSED_DQ_CASES = [dict(shape=(2, 512, 4, 4, 128)), dict(shape=(1, 1000, 8, 2, 128), causal=True),
                  dict(shape=(1, 777, 4, 2, 64), causal=True),
                  dict(shape=(1, 160, 4, 4, 64), kv_len=900, causal=True),
                  dict(shape=(1, 640, 4, 2, 128), local_window=(130, 17)),
                  dict(shape=(2, 1000, 8, 2, 128), segments="packed")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_DQ_CASES,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_hopper_fused_dq_backward(case):
  """deterministic=False with fused_dq: dQ added atomically inside the dK/dV kernel
  (both consumers share a dQ tile at head dim 128, each its own at 64); also under vmap."""
  arrays, kwargs = _gpu_inputs(case, jnp.bfloat16)
  config = dataclasses.replace(default_mosaic_config(case["shape"][-1]), fused_dq=True)
  kwargs.update(deterministic=False)
  _skip_unless_runnable("pallas_mosaic", *arrays, **kwargs)
  check_against_reference(*arrays, config=config, backend="pallas_mosaic", **kwargs)
  if case is FUSED_DQ_CASES[0]:
    q, k, v, do = arrays
    attend = lambda q, k, v: jattn.flash_attention(q, k, v, backend="pallas_mosaic",
                                                   config=config, **kwargs)
    grads = lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do)
    mapped = jax.jit(jax.vmap(grads))(*(x[:, None] for x in (q, k, v, do)))
    for g_map, g in zip(mapped, jax.jit(grads)(q, k, v, do)):
      assert rel_err(g_map[:, 0], g) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_mosaic"])
def test_backward_is_bitwise_deterministic_at_gpu_sizes(backend):
  (q, k, v, do), _ = _gpu_inputs(dict(shape=(2, 1024, 8, 2, 128)), jnp.bfloat16)
  _skip_unless_runnable(backend, q, k, v, causal=True)
  # A config asking for the fused (atomic) dQ does not apply to a deterministic call.
  config = dataclasses.replace(default_mosaic_config(128), fused_dq=True) if (
      backend == "pallas_mosaic") else None
  attend = lambda *a: jattn.flash_attention(*a, causal=True, backend=backend, config=config)
  f = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))
  for x, y in zip(f(q, k, v), f(q, k, v)):
    assert np.array_equal(np.asarray(x), np.asarray(y))


# --- validation particular to flash attention ------------------------------------------

Q = jnp.ones((2, 8, 4, 16), jnp.float32)
KV = jnp.ones((2, 8, 2, 16), jnp.float32)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k=jnp.ones((3, 8, 2, 16)), v=jnp.ones((3, 8, 2, 16))), ValueError,
     r"k must be \[batch, kv_len, kv_heads, head_dim\] = \[2, \?, \?, 16\]"),
    (dict(v=jnp.ones((2, 9, 2, 16))), ValueError, r"v must be \[batch, kv_len"),
    (dict(k=jnp.ones((2, 8, 3, 16)), v=jnp.ones((2, 8, 3, 16))), ValueError,
     r"q's heads \(4\) must be a multiple of k's heads \(3\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "pass both"),
    (dict(q_segment_ids=jnp.zeros((2, 7), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)),
     ValueError, r"q_segment_ids must be \[batch, q_len\] = \[2, 8\]"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 8))), TypeError,
     "q_segment_ids must be integers"),
    (dict(local_window=(3,)), ValueError, r"local_window must be \(left, right\)"),
    (dict(local_window=(-1, 2)), ValueError, "local_window"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(scale=-0.5), ValueError, "scale must be a finite number > 0"),
    (dict(q=jnp.ones((2, 0, 4, 16))), ValueError, "q has an empty dimension"),
    (dict(q=Q.astype(jnp.int32)), TypeError, "q has dtype int32; supported"),
    (dict(causal="no"), TypeError, "causal must be True or False, got 'no'"),
    (dict(return_lse=1), TypeError, "return_lse must be True or False, got 1"),
])
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
  args = dict(q=Q, k=KV, v=KV, backend="xla")
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jattn.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_flags_are_not_traced():
  with pytest.raises(TypeError, match="causal must be a Python or numpy bool, not a traced"):
    jax.jit(lambda c: jattn.flash_attention(Q, KV, KV, causal=c, backend="xla"))(True)
  with pytest.raises(ValueError, match="scale must be a concrete number > 0 or None .*traced"):
    jax.jit(lambda s: jattn.flash_attention(Q, KV, KV, scale=s, backend="xla"))(0.25)
  with pytest.raises(TypeError, match="return_state must be True or False, got 'yes'"):
    jattn.retention(Q, Q, Q, return_state="yes")


@pytest.mark.parametrize("numbers", [np, jnp])
def test_numpy_scalars_are_taken_as_numbers(numbers):
  """numpy scalars for every option; concrete JAX ones for the scale and softcap (as
  jax.nn takes a scale)."""
  q, k, v = (jax.random.normal(key, x.shape) for key, x in zip(
      jax.random.split(jax.random.PRNGKey(0), 3), (Q, KV, KV)))
  given = dict(causal=np.bool_(True), local_window=(np.int64(2), np.int32(0)),
               softcap=numbers.float32(5.0), scale=1 / numbers.sqrt(numbers.float32(16)),
               dropout_rate=np.float32(0.25))
  plain = dict(causal=True, local_window=(2, 0), softcap=5.0, scale=0.25, dropout_rate=0.25)
  key = jax.random.PRNGKey(1)
  out = jattn.flash_attention(q, k, v, dropout_key=key, backend="xla", **given)
  np.testing.assert_array_equal(out, jattn.flash_attention(q, k, v, dropout_key=key,
                                                           backend="xla", **plain))


def test_head_dim_above_the_kernels_limit():
  q = jnp.ones((1, 4, 1, 272), jnp.float32)
  with pytest.raises(ValueError, match=r"backend='pallas_triton' cannot run this "
                                       r"flash_attention call .* head dims above 256 \(got 272\)"):
    jattn.flash_attention(q, q, q, backend="pallas_triton")
  assert jattn.flash_attention(q, q, q).shape == q.shape  # "auto" takes xla


@pytest.mark.parametrize("field,value", [("block_q", 32), ("block_kv_dkv", 96), ("stages", 1),
                                         ("bwd_stages", 0)])
def test_bad_mosaic_config(field, value):
  with pytest.raises(ValueError, match=f"MosaicBlockConfig.{field} must be"):
    jattn.MosaicBlockConfig(**{field: value})


def test_bad_block_config():
  with pytest.raises(ValueError, match="BlockConfig.block_q must be a power of two"):
    jattn.BlockConfig(block_q=48)
