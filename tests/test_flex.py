"""flex_attention: the ready functions against the ops that fix the same pattern
(flash_attention's masks, window_attention's bias), gradients of closed-over arrays
against dense formulas written without any function, block masks against brute
force, and the errors. (The op-wide guarantees are tests/test_contract.py's.)"""

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax import lax
import numpy as np
import pytest

import jattn
from conftest import rel_err
from jattn import flex
from jattn.kernels.common.elementwise import dense_indices, elementwise
from jattn.reference import flash_attention_reference

B, SQ, SK, HQ, HK, D = 2, 11, 13, 4, 2, 8


def _inputs(seed=0, sq=SQ, sk=SK, hq=HQ, hk=HK, batch=B, d=D):
  kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(kq, (batch, sq, hq, d)), jax.random.normal(kk, (batch, sk, hk, d)),
          jax.random.normal(kv, (batch, sk, hk, d)), jax.random.normal(kd, (batch, sq, hq, d)))


def _out_and_grads(f, q, k, v, do, *extra):
  """``(o, lse)`` and the gradients of ``<o, do> + sum(lse')`` for q, k, v and ``extra``."""
  def loss(*args):
    o, lse = f(*args)
    return jnp.sum(o * do) + jnp.sum(jnp.where(lse > -1e29, lse, 0.0) * 0.1), (o, lse)
  argnums = tuple(range(3 + len(extra)))
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
      q, k, v, *extra)
  return out, grads


def _assert_close(ours, ref, tol=1e-5):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert a.shape == b.shape and rel_err(a, b) < tol


DOCS = np.repeat(np.arange(4), 4)[:SK]  # documents of 4 keys, the last one cut


@pytest.mark.parametrize("mods,flash_kwargs", [
    (dict(mask_mod=flex.causal_mask(offset=SK - SQ)), dict(causal=True)),
    (dict(mask_mod=flex.sliding_window_mask(3, 1, offset=SK - SQ)), dict(local_window=(3, 1))),
    (dict(score_mod=flex.softcap_score(2.0)), dict(softcap=2.0)),
    (dict(mask_mod=flex.document_mask(DOCS[:SQ], DOCS)),
     dict(q_segment_ids=jnp.tile(DOCS[:SQ], (B, 1)), kv_segment_ids=jnp.tile(DOCS, (B, 1)))),
], ids=["causal", "sliding-window", "softcap", "documents"])
def test_ready_functions_equal_flash_attention(mods, flash_kwargs):
  q, k, v, do = _inputs()
  ours = _out_and_grads(
      lambda q, k, v: jattn.flex_attention(q, k, v, return_lse=True, **mods), q, k, v, do)
  ref = _out_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **flash_kwargs),
                       q, k, v, do)
  _assert_close(ours, ref)


def _bias_ref(bias_of):
  """Dense attention with an explicit bias ``[B, HQ, SQ, SK]`` made by ``bias_of(*params)``."""
  def f(q, k, v, *params):
    kg, vg = (jnp.repeat(x, HQ // HK, axis=2) for x in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kg, precision="highest") * D ** -0.5
    logits = logits + bias_of(*params)
    lse = jax.nn.logsumexp(logits, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(logits - lse[..., None]), vg,
                   precision="highest")
    return o, lse
  return f


DIST = jnp.arange(SK)[None, :] - jnp.arange(SQ)[:, None]  # kv_idx - q_idx


@pytest.mark.parametrize("name,x64", [("alibi", False), ("relative-table", False),
                                      ("bias", False), ("alibi", True)],
                         ids=["alibi", "relative-table", "bias", "alibi-x64"])
def test_closed_over_arrays_get_the_gradients_of_the_dense_bias(name, x64, monkeypatch):
  # The arrays' gradient pass walks blocks of 3 query rows, the last one partly padding
  # (traced afresh: a program compiled before the patch would walk one block), but for
  # a dense bias.
  grads = jattn.flex.array_grads
  monkeypatch.setattr(grads, "_STEP_ELEMENTS", B * HQ * SK * 3)
  steps, scan = [], grads._RowBlocks._scan
  monkeypatch.setattr(grads._RowBlocks, "_scan",
                      lambda self, *a: steps.append(self.steps) or scan(self, *a))
  jax.clear_caches()
  q, k, v, do = _inputs(1)
  key = jax.random.PRNGKey(5)
  if name == "alibi":
    param = flex.alibi_slopes(HQ)
    make, dense = flex.alibi_score, lambda s: jnp.broadcast_to(
        s[:, None, None] * DIST, (B, HQ, SQ, SK))
  elif name == "relative-table":
    param = jax.random.normal(key, (HQ, 9))
    make, dense = flex.relative_position_score, lambda t: jnp.broadcast_to(
        t[:, jnp.clip(DIST, -4, 4) + 4], (B, HQ, SQ, SK))
  else:
    param = jax.random.normal(key, (B, HQ, SQ, SK))
    make, dense = flex.bias_score, lambda b: b
  with jax.enable_x64(x64):  # the arrays' backward walks tiles with int32 indices then too
    ours = _out_and_grads(lambda q, k, v, p: jattn.flex_attention(
        q, k, v, score_mod=make(p), return_lse=True), q, k, v, do, param)
  ref = _out_and_grads(_bias_ref(dense), q, k, v, do, param)
  _assert_close(ours, ref, 2e-5)
  # A dense bias's gradient is the kernels' dS summed: no pass of its own.
  assert steps == [] if name == "bias" else steps and min(steps) == 4


def test_a_bias_broadcast_far_takes_the_row_blocks_pass(monkeypatch):
  # dS [batch, heads, q, kv] would be 88 times this [1, 1, 1, kv] bias (and "large": the
  # small-dS allowance patched to 0): its gradient comes from the pass over row blocks.
  monkeypatch.setattr(jattn.flex.attention, "_DS_SMALL_BYTES", 0)
  steps, scan = [], jattn.flex.array_grads._RowBlocks._scan
  monkeypatch.setattr(jattn.flex.array_grads._RowBlocks, "_scan",
                      lambda self, *a: steps.append(self.steps) or scan(self, *a))
  jax.clear_caches()
  q, k, v, do = _inputs(3)
  bias = jax.random.normal(jax.random.PRNGKey(8), (1, 1, 1, SK))
  ours = _out_and_grads(lambda q, k, v, b: jattn.flex_attention(
      q, k, v, score_mod=flex.bias_score(b), return_lse=True), q, k, v, do, bias)
  ref = _out_and_grads(_bias_ref(lambda b: b), q, k, v, do, bias)
  _assert_close(ours, ref, 2e-5)
  assert steps


@pytest.mark.parametrize("name", ["alibi", "bias"])
def test_arrays_that_are_not_differentiated_cost_no_gradient_work(name, monkeypatch):
  # Differentiating q, k, v only: no arrays' pass, and no dS written for a dense bias
  # (it would be a [batch, heads, q, kv] output of the backward kernels, padded to tiles).
  steps, scan = [], jattn.flex.array_grads._RowBlocks._scan
  monkeypatch.setattr(jattn.flex.array_grads._RowBlocks, "_scan",
                      lambda self, *a: steps.append(self.steps) or scan(self, *a))
  jax.clear_caches()
  q, k, v, do = _inputs(2)
  if name == "alibi":
    param, make = flex.alibi_slopes(HQ), flex.alibi_score
    dense = lambda s: jnp.broadcast_to(s[:, None, None] * DIST, (B, HQ, SQ, SK))
  else:
    param, make = jax.random.normal(jax.random.PRNGKey(6), (1, HQ, SQ, SK)), flex.bias_score
    dense = lambda b: b
  f = lambda q, k, v: jattn.flex_attention(q, k, v, score_mod=make(param), return_lse=True)
  ours = _out_and_grads(f, q, k, v, do)
  ref = _out_and_grads(lambda q, k, v: _bias_ref(dense)(q, k, v, param), q, k, v, do)
  _assert_close(ours, ref, 2e-5)
  assert steps == []
  jaxpr = jax.make_jaxpr(lambda *a: _out_and_grads(f, *a))(q, k, v, do)
  shapes = [o.aval.shape for eqn in _all_eqns(jaxpr.jaxpr)
            if eqn.primitive.name == "pallas_call" for o in eqn.outvars]
  assert shapes and not any(len(s) == 4 and s[:2] == (B, HQ) for s in shapes)  # dS: padded


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _all_eqns(getattr(sub, "jaxpr", sub))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 5e-3), (jnp.bfloat16, 2e-2)],
                         ids=["fp16", "bf16"])
def test_closed_over_array_gradients_in_16_bit_on_the_gpu(dtype, tol):
  """The kernels with 16-bit q, k, v against the float32 dense reference on the same
  (rounded) values: every gradient, the closed-over slopes and table included."""
  sq, hq, hk, d = 512, 8, 4, 64
  q, k, v, do = (x.astype(dtype) for x in _inputs(13, sq, sq, hq, hk, d=d))
  slopes = flex.alibi_slopes(hq)
  table = jax.random.normal(jax.random.PRNGKey(14), (hq, 33)) * 0.1
  def score(slopes, table):
    return lambda s, b, h, i, j: (flex.alibi_score(slopes)(s, b, h, i, j)
                                  + flex.relative_position_score(table)(0.0, b, h, i, j))
  def run(backend, *arrays):
    return _out_and_grads(lambda q, k, v, s, t: jattn.flex_attention(
        q, k, v, score_mod=score(s, t), mask_mod=flex.causal_mask(), return_lse=True,
        backend=backend), *arrays, slopes, table)
  ours = run("pallas_triton", q, k, v, do)
  ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v, do)))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert rel_err(a, b) < tol


def _hopper_cases():
  docs = np.sort(np.random.default_rng(0).integers(0, 4, (2, 384)), axis=1).astype(np.int32)
  windows = jnp.array([40, 90, 170, 300])  # per query head: the dK/dV kernel's group unions
  yield pytest.param(dict(shape=(2, 320, 4, 2, 64), score=lambda s: flex.alibi_score(s),
                          mask=flex.causal_mask(), slopes=True), id="alibi-causal-gqa-padded")
  yield pytest.param(dict(shape=(2, 384, 2, 2, 128), mask=flex.document_mask(docs)),
                     id="documents-d128")
  yield pytest.param(dict(shape=(1, 200, 2, 1, 64), kv_len=328,
                          score=lambda s: flex.softcap_score(20.0),
                          mask=flex.sliding_window_mask(60, 0, offset=128)),
                     id="softcap-window-shorter-queries")
  yield pytest.param(dict(shape=(1, 384, 4, 2, 64),
                          mask=lambda b, h, i, j: (j <= i) & (i - j < windows[h]) & (i % 7 != 3)),
                     id="per-head-windows-empty-rows")
  yield pytest.param(dict(shape=(2, 256, 2, 2, 64), mask=flex.prefix_lm_mask(jnp.array([30, 130])),
                          score=lambda s: lambda x, b, h, i, j: x * (1.0 + 0.25 * b) - 0.01 * h),
                     id="prefix-lm-batch-score")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_hopper_cases()))
def test_hopper_kernels_equal_the_xla_backend(case):
  """The Hopper kernels (functions split into parts, block ranges) with bf16 inputs
  against the float32 dense computation on the same values: o, lse and every
  gradient, ALiBi's slopes included."""
  batch, sq, hq, hk, d = case["shape"]
  q, k, v, do = (x.astype(jnp.bfloat16)
                 for x in _inputs(21, sq, case.get("kv_len", sq), hq, hk, batch, d))
  slopes = flex.alibi_slopes(hq)
  score = case.get("score")
  def run(backend, *arrays):
    def attend(q, k, v, slopes):
      return jattn.flex_attention(q, k, v, score_mod=score and score(slopes),
                                  mask_mod=case.get("mask"), return_lse=True, backend=backend)
    return _out_and_grads(attend, *arrays, slopes)
  problem, _ = flex.FLEX.bind(q, k, v, score_mod=score and score(slopes),
                              mask_mod=case.get("mask"))
  assert dict(flex.FLEX.choices(problem))["pallas_mosaic"] is None
  (o, lse), grads = run("pallas_mosaic", q, k, v, do)
  (o_ref, lse_ref), grads_ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v, do)))
  assert rel_err(o, o_ref) < 1e-2 and rel_err(lse, lse_ref) < 1e-3
  n = 4 if case.get("slopes") else 3  # q, k, v (and the slopes)
  for g, g_ref in zip(grads[:n], grads_ref[:n]):
    assert rel_err(g, g_ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, shape, kv_len, causal, large_rows, bias_grad", [
    (jnp.bfloat16, (2, 320, 4, 2, 128), 320, True, None, True),
    (jnp.float16, (2, 256, 2, 2, 64), 384, False, "every head", True),
    (jnp.bfloat16, (2, 256, 4, 2, 64), 256, True, "one head", True),
    (jnp.bfloat16, (1, 256, 2, 1, 128), 256, False, None, False),
], ids=["bf16-causal-gqa-padded-d128", "fp16-longer-keys-large-rows-d64",
        "bf16-large-rows-of-one-head", "fixed-bias"])
def test_hopper_kernels_read_a_dense_bias(dtype, shape, kv_len, causal, large_rows, bias_grad):
  """A 16-bit dense bias over every position, read by the Hopper kernels tile by tile
  (the dQ kernel writing dS for its gradient), against the float32 dense computation
  on the same values: o, lse and every gradient, the bias's included (a fixed bias:
  no dS). Rows of large values (+5e4, -1e9) take the kernels with each row's shift,
  also where only one head's row is large (a shift shared by the heads was 0 there,
  and that row lost q·k to the bias's float32 rounding)."""
  batch, sq, hq, hk, d = shape
  q, k, v, do = (x.astype(dtype) for x in _inputs(31, sq, kv_len, hq, hk, batch, d))
  bias = jax.random.normal(jax.random.PRNGKey(32), (1 if causal else batch, hq, sq, kv_len))
  if large_rows == "every head":
    bias = bias.at[0, :, 5].add(5e4).at[1, :, 9].add(-1e9)
  elif large_rows == "one head":
    bias = bias.at[0, 1, 30].add(-1e9).at[0, 2, 70].add(5e4)
  bias = bias.astype(dtype)
  mask = flex.causal_mask() if causal else None
  problem, _ = flex.FLEX.bind(q, k, v, score_mod=flex.bias_score(bias), mask_mod=mask)
  assert flex.FLEX.select(problem) == "pallas_mosaic"

  def run(backend, q, k, v, do, bias):
    held = bias if bias_grad else jax.lax.stop_gradient(bias)
    return _out_and_grads(lambda q, k, v, b: jattn.flex_attention(
        q, k, v, score_mod=flex.bias_score(b if bias_grad else held), mask_mod=mask,
        return_lse=True, backend=backend), q, k, v, do, bias)

  (o, lse), grads = run("pallas_mosaic", q, k, v, do, bias)
  (o_ref, lse_ref), grads_ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v, do, bias)))
  assert rel_err(o, o_ref) < 1e-2 and rel_err(lse, lse_ref) < 1e-3
  for g, g_ref in zip(grads[:4 if bias_grad else 3], grads_ref):
    assert rel_err(g, g_ref) < 2e-2


def _dense_parts(split, parts):
  """A split function's parts (``[B', H']``, ``[B', q]``, ``[B', kv]``) broadcast to
  ``[batch, heads, q, kv]``."""
  at = {"scalar": lambda x: x[:, :, None, None], "row": lambda x: x[:, None, :, None],
        "col": lambda x: x[:, None, None, :]}
  return [at[p.kind](x) for p, x in zip(split.parts, parts)]


def test_hopper_split_of_the_ready_functions():
  """What the Hopper kernels compute outside (parts per head, row or column) and on
  the tiles (the rest) gives the function itself; what reads arrays at positions of
  both axes is their gap."""
  from jattn.flex.functions import trace
  docs = jnp.asarray(np.random.default_rng(1).integers(0, 3, (B, SK)), jnp.int32)
  cases = [(flex.alibi_score(flex.alibi_slopes(HQ)), "score_mod", ["scalar"]),
           (flex.softcap_score(5.0), "score_mod", []),
           (flex.document_mask(docs[:, :SQ], docs), "mask_mod", ["row", "col"]),
           (flex.prefix_lm_mask(jnp.array([3, 5])), "mask_mod", ["col"]),
           (flex.sliding_window_mask(3, 1), "mask_mod", [])]
  index = dense_indices(B, HQ, SQ, SK)
  score = jax.random.normal(jax.random.PRNGKey(2), (B, HQ, SQ, SK))
  for fn, kind, kinds in cases:
    traced, consts = trace(fn, kind)
    split = traced.factored
    assert split.gap is None and [p.kind for p in split.parts] == kinds
    parts = split.part_arrays(traced.tile_arrays(consts), B, HQ, SQ, SK)
    args = ((score,) if kind == "score_mod" else ()) + index
    got = split(_dense_parts(split, parts), *args)
    assert rel_err(got, traced(consts, *args)) < 1e-6
  for fn in (flex.relative_position_score(jnp.ones((HQ, 5))),
             flex.bias_score(jnp.ones((HQ, SQ, SK)))):
    assert "both q_idx and kv_idx" in trace(fn, "score_mod")[0].factored.gap
  per_head_rows = lambda b, h, i, j: docs[h % B, i] == 0
  assert "per head and per sequence position" in trace(per_head_rows, "mask_mod")[0].factored.gap
  bias = jnp.ones((B, SQ, SK))
  sliced = lambda s, b, h, i, j: s + bias[b][i, j]  # a slice computed outside, indexed inside
  assert "a slice of a closed-over array" in trace(sliced, "score_mod")[0].factored.gap
  stacked = lambda s, b, h, i, j: s + jnp.max(jnp.stack([i, j]))  # whole arrays on the tiles
  assert "on whole arrays" in trace(stacked, "score_mod")[0].factored.gap


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, HQ, 1, 1), (B, 1, SQ, 1), (B, 1, 1, SK)])
def test_hopper_kernels_split_the_shifted_bias(shape):
  """A dense bias the Hopper kernels can split stays split with its rows' shift taken
  off (one per batch row and query position, or the bias itself where it is constant
  along the keys): the shifted function had read an array per head and position, and
  the kernels' trace failed on every such bias (a one-element one included)."""
  from jattn.flex.attention import _row_shifted, _shift_of
  bias = 1e4 * jax.random.normal(jax.random.PRNGKey(3), shape)
  lse = 1e4 * jax.random.normal(jax.random.PRNGKey(4), (B, HQ, SQ))
  q, k, v = _inputs(5, SQ, SK, HQ, HK, B, D)[:3]
  problem, _ = flex.FLEX.bind(q, k, v, score_mod=flex.bias_score(bias))
  assert problem.score_mod.factored.gap is None
  shift = _shift_of(lse, bias, heads_share=True)
  shifted, arrays = _row_shifted(problem, bias, shift)
  split = shifted.score_mod.factored
  assert split.gap is None
  parts = split.part_arrays(shifted.score_mod.tile_arrays(arrays), B, HQ, SQ, SK)
  score = jax.random.normal(jax.random.PRNGKey(2), (B, HQ, SQ, SK))
  args = (score,) + dense_indices(B, HQ, SQ, SK)
  got = split(_dense_parts(split, parts), *args)
  np.testing.assert_allclose(got, score + (bias - shift), rtol=0, atol=1e-3)


@pytest.mark.parametrize("kv_len, mask, warps", [(8192, False, 8), (4096, False, 4),
                                                 (8192, True, 4)])
def test_triton_config_for_a_dense_bias_over_long_key_loops(kv_len, mask, warps):
  """A 16-bit dense bias alone over 8192 keys or more takes 8 warps and 3 stages
  (bench/results/dot_product_bias_configs_ab_h100.md); with fewer keys or a mask, the
  flash default."""
  from jattn.flex.attention import TritonFlex
  x = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
  kv = jnp.zeros((1, kv_len, 2, 128), jnp.bfloat16)
  problem, _ = flex.FLEX.bind(x, kv, kv, score_mod=flex.bias_score(jnp.zeros((1, 2, 1, kv_len))),
                              mask_mod=flex.causal_mask() if mask else None)
  config = TritonFlex().heuristic_config(problem, None)
  assert (config.num_warps, config.num_stages) == ((8, 3) if warps == 8 else (4, 2))


def test_hopper_parts_are_padded_with_their_last_value_and_flex_tiles_fit():
  """Padded query rows compute what the last real row does (a zero could make 0/0 there,
  and the dK/dV kernel's last tile reads them); the Hopper cost model takes flex calls."""
  from jattn.core.device import describe
  from jattn.flex.attention import FLEX, MosaicFlex
  from jattn.kernels.flash import default_mosaic_config
  from jattn.kernels.hopper.inputs import as_vector_array
  padded = as_vector_array(jnp.array([[1.0, 2.0, 4.0]], jnp.bfloat16), 6)
  assert padded.dtype == jnp.float32 and padded.tolist() == [[1.0, 2.0, 4.0, 4.0, 4.0, 4.0]]
  h100 = describe("NVIDIA H100 80GB HBM3", (9, 0), shared_memory_per_block_bytes=232448,
                  interpret=False)
  q, k, v, _ = _inputs()
  problem, _ = FLEX.bind(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                         mask_mod=flex.causal_mask())
  assert MosaicFlex().fits(default_mosaic_config(D), problem, h100) is None
  # Each per-row or per-column part is a vector in shared memory per tile: 20 products
  # of them at head dim 128 pass the 227 KiB a CTA has in the dQ kernel, and "auto"
  # takes Triton.
  x = jnp.ones((1, 256, 2, 128), jnp.bfloat16)

  def products(n):
    rows, cols = (jax.random.normal(jax.random.PRNGKey(i), (n, 1, 256)) for i in (0, 1))

    def score_mod(s, b, h, q_idx, kv_idx):
      for i in range(n):
        s = s + rows[i][b, q_idx] * cols[i][b, kv_idx]
      return s
    return FLEX.bind(x, x, x, score_mod=score_mod)[0]

  assert FLEX.prepare(products(4), info=h100).impl.backend.name == "pallas_mosaic"
  assert MosaicFlex().compile_misfit(default_mosaic_config(128), products(20), h100) == (
      "dQ shared memory: 239,696 B > 232,448 B")
  assert FLEX.prepare(products(20), info=h100).impl.backend.name == "pallas_triton"
  # A dense bias's shifted kernels (compiled beside the others) read the shift as one
  # more row part.
  from jattn.kernels.hopper.inputs import PositionInputs
  bias = FLEX.bind(x, x, x, score_mod=flex.bias_score(jnp.ones((1, 1, 1, 256))))[0]
  plain = PositionInputs(score=bias.score_mod.factored).vectors
  assert MosaicFlex._vectors(bias) == (plain[0] + 1, plain[1])


def test_block_ranges_cover_every_nonempty_tile():
  """Each row's Hopper range holds all its nonempty tiles, and its unmasked run only
  full ones; rows without any get an empty range that unions ignore."""
  from jattn.kernels.hopper.inputs import mask_ranges
  kinds = jax.random.randint(jax.random.PRNGKey(3), (2, 3, 6, 7), 0, 3).astype(jnp.int8)
  kinds = kinds.at[0, 0, 2].set(flex.EMPTY).at[1, 2, 4].set(flex.FULL)
  for transpose in (False, True):
    ranges = np.asarray(mask_ranges(kinds, (8, 8), (8, 8), (48, 56), (48, 56), transpose))
    per_row = np.swapaxes(np.asarray(kinds), -1, -2) if transpose else np.asarray(kinds)
    for idx in np.ndindex(per_row.shape[:-1]):
      lo, full_lo, full_hi, hi = ranges[idx]
      nonempty = np.flatnonzero(per_row[idx] != flex.EMPTY)
      if not nonempty.size:
        assert (lo, full_lo, full_hi, hi) == (per_row.shape[-1],) * 3 + (0,)
        continue
      assert lo == nonempty[0] and hi == nonempty[-1] + 1 and lo <= full_lo <= full_hi <= hi
      assert (per_row[idx][full_lo:full_hi] == flex.FULL).all()


def test_window_attention_through_flex():
  """DAT's shifted-window attention: a bias shared by the windows and a mask per window."""
  windows, tokens, heads = 4, 6, 2
  q, k, v, do = _inputs(2, tokens, tokens, heads, heads, windows)
  bias = jax.random.normal(jax.random.PRNGKey(8), (heads, tokens, tokens))
  mask = np.ones((2, tokens, tokens), bool)
  mask[1, :3, 3:] = mask[1, 3:, :3] = False  # odd windows: two regions that don't mix
  mask_table = jnp.asarray(mask)

  def through_flex(q, k, v, bias):
    o = jattn.flex_attention(q, k, v, score_mod=flex.bias_score(bias),
                             mask_mod=lambda b, h, i, j: mask_table[b % 2, i, j])
    return o, jnp.zeros((windows, heads, tokens))  # window_attention gives no lse

  def window(q, k, v, bias):
    o = jattn.window_attention(q, k, v, bias, mask=mask)
    return o, jnp.zeros((windows, heads, tokens))

  ours = _out_and_grads(through_flex, q, k, v, do, bias)
  ref = _out_and_grads(window, q, k, v, do, bias)
  _assert_close(ours, ref, 2e-5)


def test_composed_masks_and_prefix_lm():
  q, k, v, do = _inputs(3, SQ, SQ, HQ, HQ)
  prefix = jnp.array([3, 6])
  mods = flex.and_masks(flex.prefix_lm_mask(prefix),
                        flex.or_masks(flex.sliding_window_mask(4), lambda b, h, i, j: j == 0))
  i, j, b = np.arange(SQ)[:, None], np.arange(SQ)[None, :], np.asarray(prefix)[:, None, None]
  allowed = ((j < b) | (j <= i)) & (((j >= i - 4) & (j <= i)) | (j == 0))
  bias = jnp.where(jnp.asarray(allowed)[:, None], 0.0, -jnp.inf)
  ours = _out_and_grads(lambda q, k, v: jattn.flex_attention(q, k, v, mask_mod=mods,
                                                             return_lse=True), q, k, v, do)
  ref = _out_and_grads(lambda q, k, v: jattn.flex_attention(
      q, k, v, score_mod=flex.bias_score(bias), return_lse=True), q, k, v, do)
  _assert_close(ours, ref)


def test_scores_of_minus_infinity_empty_rows_without_nan():
  q, k, v, do = _inputs(4)
  minus_inf = lambda s, b, h, i, j: jnp.where(i == 2, -jnp.inf, s)
  (o, lse), grads = _out_and_grads(
      lambda q, k, v: jattn.flex_attention(q, k, v, score_mod=minus_inf, return_lse=True),
      q, k, v, do)
  assert np.all(np.asarray(o[:, 2]) == 0) and np.all(np.asarray(lse[:, :, 2]) == -1e30)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
def test_masked_scores_that_overflow_keep_gradients_finite(backend):
  """A score that grows toward the masked keys (exp overflows there) is refused
  without NaN in any gradient."""
  q, k, v, do = _inputs(15, 96, 96, 2, 2)
  growing = lambda s, b, h, i, j: s + 2.0 * (j - i)
  (o, _), grads = _out_and_grads(lambda q, k, v: jattn.flex_attention(
      q, k, v, score_mod=growing, mask_mod=flex.causal_mask(), return_lse=True,
      backend=backend), q, k, v, do)
  assert all(np.isfinite(np.asarray(x)).all() for x in (o, *grads))


def test_functions_of_one_trace_share_a_problem_and_new_arrays_are_used():
  q, k, v, _ = _inputs(5)
  p1, _ = flex.FLEX.bind(q, k, v, score_mod=lambda s, b, h, i, j: s * 2.0)
  p2, _ = flex.FLEX.bind(q, k, v, score_mod=lambda s, b, h, i, j: s * 2.0)
  p3, _ = flex.FLEX.bind(q, k, v, score_mod=lambda s, b, h, i, j: s * 3.0)
  assert p1 == p2 and hash(p1) == hash(p2) and p1 != p3
  for slopes in (flex.alibi_slopes(HQ), -flex.alibi_slopes(HQ)):  # one trace, two arrays
    ours = jattn.flex_attention(q, k, v, score_mod=flex.alibi_score(slopes))
    ref = jattn.flex_attention_reference(q, k, v, score_mod=flex.alibi_score(slopes))[0]
    assert rel_err(ours, ref) < 1e-6


def test_a_wrapper_of_a_helpers_function_is_traced_as_the_wrapper():
  """jattn.flex's helpers mark their functions to be traced from their arrays; a
  wrapper that copies the marks (functools.wraps, jax.jit) keeps its own body, also
  a wrapped bias_score (whose gradient is otherwise taken as the bias's)."""
  import functools
  q, k, v, _ = _inputs(6)
  alibi = flex.alibi_score(flex.alibi_slopes(HQ))
  bias = jax.random.normal(jax.random.key(1), (HQ, q.shape[1], k.shape[1]))
  plain = flex.bias_score(bias)
  for inner in (alibi, plain):
    wrapped = functools.wraps(inner)(lambda s, b, h, i, j, f=inner: 0.5 * f(s, b, h, i, j))
    ours = jattn.flex_attention(q, k, v, score_mod=wrapped)
    ref = jattn.flex_attention_reference(q, k, v, score_mod=wrapped)[0]
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("batch,heads,block", [(None, None, 4), (B, HQ, (3, 5))])
def test_block_masks_classify_tiles_like_brute_force(batch, heads, block):
  docs = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (B, SK)), axis=1))
  mask_mod = flex.and_masks(flex.causal_mask(SK - SQ), lambda b, h, i, j: (h < 3) | (j % 2 == 0))
  if batch:
    mask_mod = flex.and_masks(mask_mod, flex.document_mask(docs[:, -SQ:], docs))
  bm = jattn.create_block_mask(mask_mod, batch, heads, SQ, SK, block=block)
  bq, bk = (block, block) if isinstance(block, int) else block
  allowed = np.asarray(elementwise(mask_mod, *dense_indices(batch or 1, heads or 1, SQ, SK)))
  kinds = np.asarray(bm.kinds)
  assert kinds.shape == (batch or 1, heads or 1, -(-SQ // bq), -(-SK // bk))
  for (b, h, i, j), kind in np.ndenumerate(kinds):
    tile = allowed[b, h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
    assert kind == (flex.EMPTY if not tile.any() else flex.FULL if tile.all() else flex.PARTIAL)
  # The same mask given as an array: classified alike by one reduction.
  np.testing.assert_array_equal(flex.block_mask_from_array(mask_mod, allowed, block).kinds,
                                kinds)
  q, k, v, _ = _inputs(6)
  out = jattn.flex_attention(q, k, v, block_mask=bm)
  assert rel_err(out, jattn.flex_attention(q, k, v, mask_mod=mask_mod)) == 0
  assert 0 < bm.sparsity() < 1


@pytest.mark.kernel
@pytest.mark.parametrize("sq,sk,hq,hk,d", [(37, 45, 4, 2, 16), (20, 12, 2, 2, 40)],
                         ids=["gqa-longer-keys", "shorter-keys-d40"])
def test_triton_kernels_equal_the_xla_backend(sq, sk, hq, hk, d):
  """The functions traced into the forward, dQ and dK/dV tiles: a score depending on
  every index and a mask with fully masked rows, against the dense computation."""
  q, k, v, do = _inputs(9, sq, sk, hq, hk, d=d)
  score = lambda s, b, h, i, j: 2.0 * jnp.tanh(s / 2.0) + 0.05 * (h + 1) * (j - i) + 0.1 * b
  mask = lambda b, h, i, j: ((j <= i + 3) & (i % 5 != 4)) | ((h == 1) & (j == 0))
  def run(backend):
    return _out_and_grads(lambda q, k, v: jattn.flex_attention(
        q, k, v, score_mod=score, mask_mod=mask, return_lse=True, backend=backend), q, k, v, do)
  ours, ref = run("pallas_triton"), run("xla")
  _assert_close(ours, ref, 1e-5)


@pytest.mark.kernel
def test_block_mask_tiles_are_skipped_and_full_tiles_unmasked():
  """With the kernels' tiles equal to a caller's block mask's blocks, the block mask is
  what they follow: tiles it calls empty are never visited, tiles it calls full skip
  the element mask (both unlike mask_mod here)."""
  sq, sk, block = 32, 48, 16
  q, k, v, do = _inputs(10, sq, sk, 2, 2)
  mask_mod = flex.sliding_window_mask(20, 0, offset=sk - sq)
  bm = jattn.create_block_mask(mask_mod, None, None, sq, sk, block=block)
  kinds = np.asarray(bm.kinds).copy()
  kinds[0, 0, 1, 0] = flex.EMPTY  # allowed pairs in it: dropped
  kinds[0, 0, 0, 2] = flex.FULL   # partly refused by the window: all taken
  edited = flex.BlockMask(jnp.asarray(kinds), mask_mod, sq, sk, block, block)
  allowed = np.array(elementwise(mask_mod, *dense_indices(1, 1, sq, sk)))[0, 0]
  allowed[block:2 * block, :block] = False
  allowed[:block, 2 * block:] = True
  bias = jnp.broadcast_to(jnp.where(jnp.asarray(allowed), 0.0, -jnp.inf), (2, sq, sk))
  ours = _out_and_grads(lambda q, k, v: jattn.flex_attention(
      q, k, v, block_mask=edited, return_lse=True, backend="pallas_triton",
      config=jattn.BlockConfig(*(block,) * 2, 4, 1, *(block,) * 4)), q, k, v, do)
  ref = _out_and_grads(lambda q, k, v: jattn.flex_attention(
      q, k, v, score_mod=flex.bias_score(bias), return_lse=True, backend="xla"), q, k, v, do)
  _assert_close(ours, ref, 1e-5)


SLOPES = flex.alibi_slopes(HQ)


@jax.custom_jvp
def _half_slope(x):
  return x


_half_slope.defjvp(lambda primals, tangents: (primals[0], 0.5 * tangents[0]))


@pytest.mark.parametrize("score_mod,gap", [
    (lambda s, b, h, i, j: s + jnp.sum(SLOPES * h), "computes mul on whole"),
    # Loops and branches: their inner jaxprs run n times or one of several, never once.
    (lambda s, b, h, i, j: lax.fori_loop(0, 3, lambda _, x: x * 0.9, s), "runs a scan"),
    (lambda s, b, h, i, j: lax.cond(h > 0, lambda x: x * 0.5, lambda x: x, s), "runs a cond"),
    # The kernels differentiate the tiles forward-mode, past a rule of the user's.
    (lambda s, b, h, i, j: _half_slope(s), "custom derivative rule"),
], ids=["whole-array", "fori-loop", "cond", "custom-jvp"])
def test_functions_the_tiles_cannot_evaluate_go_to_xla(score_mod, gap):
  q, k, v, _ = _inputs()
  problem, _ = flex.FLEX.bind(q, k, v, score_mod=score_mod)
  assert gap in dict(flex.FLEX.choices(problem))["pallas_triton"]
  assert flex.FLEX.select(problem) == "xla"
  problem, _ = flex.FLEX.bind(q, k, v, score_mod=flex.alibi_score(SLOPES))
  assert flex.FLEX.select(problem) == "pallas_triton"


TABLE = jax.random.normal(jax.random.PRNGKey(11), (3, 5, 6))
FLAGS = jnp.array([True, False, True])


@pytest.mark.parametrize("fn", [
    lambda s, b, h, i, j: s * TABLE[h, i, j] + TABLE[0, 0, 0],           # dynamic_slice, scalar read
    lambda s, b, h, i, j: s + jnp.take(TABLE[0, 0], j - i, mode="clip"),  # gather, clipped
    lambda s, b, h, i, j: s + TABLE.at[h, i + 2, j].get(mode="fill", fill_value=-2.0),
    lambda s, b, h, i, j: jnp.where(FLAGS[h], s, jax.nn.softplus(TABLE * 2.0)[h, i, j]),
    lambda s, b, h, i, j: s + TABLE[-1, -i, j - 9],                       # negative indices
    lambda s, b, h, i, j: s + TABLE[h, jnp.minimum(i + 3, 4), j - i],      # partly provable
    lambda s, b, h, i, j: jnp.float32(1.5),                               # constant
], ids=["slice", "take-clip", "get-fill", "bool-and-outside-math", "negative", "partial",
        "constant"])
@pytest.mark.parametrize("inline_constants", [False, True], ids=["constants", "inlined"])
def test_tile_evaluator_equals_vmap(fn, inline_constants):
  """What the kernels evaluate on tiles (arrays read by index, math on the arrays
  alone done outside) equals the function vmapped over the dense grid; also where JAX
  inlines concrete arrays into jaxprs (``jax_use_simplified_jaxpr_constants``, the
  default of newer JAX)."""
  from jax._src import config
  flag = getattr(config, "use_simplified_jaxpr_constants", None)
  if flag is None:
    pytest.skip("this JAX has no jax_use_simplified_jaxpr_constants")
  with flag(inline_constants):
    traced, consts = jattn.flex.functions.trace(fn, "score_mod")
  assert traced.kernel_gap is None
  s = jax.random.normal(jax.random.PRNGKey(12), (2, 3, 5, 6))
  index = dense_indices(2, 3, 5, 6)
  tiles = traced.tile_function(traced.kernel_arrays(consts), s, *index)
  dense = np.asarray(traced(consts, s, *index))
  np.testing.assert_array_equal(np.asarray(tiles), dense)
  # Inside a kernel the arrays are refs, read at the indices (out of bounds: clamped,
  # filled or normalised as above).
  index = [jnp.broadcast_to(i, s.shape) for i in index]

  def kernel(*refs, fn=traced.tile_function):
    *arrays, s_ref, b_ref, h_ref, i_ref, j_ref, o_ref = refs
    o_ref[...] = fn(arrays, s_ref[...], b_ref[...], h_ref[...], i_ref[...], j_ref[...])

  arrays = traced.kernel_arrays(consts)
  out_shape = jax.ShapeDtypeStruct(s.shape, jnp.float32)
  in_kernel = pl.pallas_call(kernel, out_shape=out_shape, interpret=True)
  np.testing.assert_array_equal(np.asarray(in_kernel(*arrays, s, *index)), dense)
  # Told the arguments' true bounds, it reads unclamped what it proves in bounds only.
  bounded = traced.tile_function.with_bounds([None] + [(0, n - 1) for n in s.shape])
  kernel_bounded = lambda *refs: kernel(*refs, fn=bounded)
  in_kernel = pl.pallas_call(kernel_bounded, out_shape=out_shape, interpret=True)
  np.testing.assert_array_equal(np.asarray(in_kernel(*arrays, s, *index)), dense)



@pytest.mark.parametrize("fn, unit", [
    (lambda s, b, h, i, j: s + TABLE[h, i, j], True),                       # a dense bias
    (lambda s, b, h, i, j: (s - 0.5 * (i - j)).astype(jnp.float32), True),  # ALiBi-like
    (lambda s, b, h, i, j: 2.0 * jnp.tanh(s / 2.0), False),                 # soft-cap
    (lambda s, b, h, i, j: s * TABLE[h, i, j], False),
    (lambda s, b, h, i, j: jnp.float32(1.5), False),                        # slope 0
], ids=["bias", "alibi", "softcap", "scaled", "constant"])
def test_unit_slope_spares_the_kernels_a_forward_mode_pass(fn, unit):
  assert jattn.flex.functions.trace(fn, "score_mod")[0].tile_function.unit_slope is unit

def test_functions_differing_in_an_inner_constant_are_different_functions():
  """An inner ``jax.jit``'s constants are not in the jaxpr's text; two such functions
  must not share a compiled call."""
  table = jnp.arange(13, dtype=jnp.float32) * 0.5

  def make(c):
    c0 = jnp.array(c, jnp.int32)
    return lambda s, b, h, i, j: s + table[jax.jit(lambda a: a - c0)(j + 5)]

  q, k, v, _ = _inputs()
  first, second = make(5), make(9)
  assert jattn.flex.functions.trace(first, "score_mod")[0] != jattn.flex.functions.trace(
      second, "score_mod")[0]
  for fn in (first, second):
    ours = jattn.flex_attention(q, k, v, score_mod=fn, backend="xla")
    assert rel_err(ours, jattn.flex_attention_reference(q, k, v, score_mod=fn)[0]) < 1e-6
    kernels = jattn.flex_attention(q, k, v, score_mod=fn, backend="pallas_triton")
    assert rel_err(kernels, ours) < 1e-5


def _bad_mask_mod(b, h, i, j):
  return (j <= i).astype(jnp.float32)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(score_mod="alibi"), TypeError, r"score_mod must be a function \(score, b, h, q_idx"),
    (dict(score_mod=lambda s, b, h: s), TypeError, "score_mod must be a function"),
    (dict(mask_mod=_bad_mask_mod), TypeError, "mask_mod must return a boolean per element"),
    (dict(score_mod=lambda s, b, h, i, j: jnp.stack([s, s])), TypeError,
     "score_mod must return a float score per element"),
    (dict(block_mask="causal"), TypeError, "block_mask must be a BlockMask"),
    (dict(block_mask=jattn.create_block_mask(flex.causal_mask(), None, None, SQ, SQ)),
     ValueError, f"made for q_len {SQ}, kv_len {SQ}; this call has q_len {SQ}, kv_len {SK}"),
    (dict(block_mask=jattn.create_block_mask(flex.causal_mask(), 3, None, SQ, SK)),
     ValueError, "made for batch 3, heads 1"),
    (dict(mask_mod=flex.causal_mask(),
          block_mask=jattn.create_block_mask(flex.causal_mask(), None, None, SQ, SK)),
     ValueError, "pass mask_mod or a block_mask made from it"),
    (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    # jattn.flex's functions check the arrays they index (a read past the end is clamped)
    (dict(score_mod=flex.bias_score(jnp.zeros((HQ, SQ - 3, SK)))), ValueError,
     r"bias_score's bias must be \[1 or heads = 4, 1 or q_len = 11, 1 or kv_len = 13\]"),
    (dict(mask_mod=flex.document_mask(DOCS[:5], DOCS)), ValueError,
     r"document_mask's q_documents must be \[q_len = 11\] for this call, got shape \(5,\)"),
    (dict(score_mod=flex.alibi_score(flex.alibi_slopes(HQ - 1))), ValueError,
     r"alibi_score's slopes must be \[heads = 4\]"),
], ids=["score-not-callable", "score-arity", "mask-not-bool", "score-not-elementwise",
        "block-mask-type", "block-mask-lengths", "block-mask-batch", "two-masks", "scale",
        "bias-shape", "document-ids-length", "alibi-heads"])
def test_errors_name_the_argument(kwargs, error, match):
  q, k, v, _ = _inputs()
  with pytest.raises(error, match=match):
    jattn.flex_attention(q, k, v, **kwargs)


def test_create_block_mask_errors():
  with pytest.raises(ValueError, match="block must be a positive int"):
    jattn.create_block_mask(flex.causal_mask(), None, None, 8, 8, block=0)
  with pytest.raises(ValueError, match="heads must be a positive int or None"):
    jattn.create_block_mask(flex.causal_mask(), None, 0, 8, 8)
  with pytest.raises(TypeError, match="mask_mod must be a function"):
    jattn.create_block_mask(None, None, None, 8, 8)
  with pytest.raises(ValueError, match=r"table must be \[heads, 2 m \+ 1\]"):
    flex.relative_position_score(jnp.zeros((2, 4)))
