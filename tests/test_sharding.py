"""Ops under ``jax.jit`` with inputs sharded over batch and heads (a 2 x 4 mesh of 8
simulated CPU devices; 2 x 1, 1 x 2 and 2 x 2 meshes on 2 or 4 GPUs): each shard runs
the kernels on its rows and heads, outputs and gradients equal the unsharded call's,
keep the inputs' sharding, and the compiled program gathers nothing. A sharded
sequence axis is refused, pointing to the ring."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jattn
from jattn.flex import bias_score
from conftest import ON_GPU, rel_err

pytestmark = pytest.mark.kernel  # the GPU suite runs its 2- and 4-GPU meshes

BACKEND = "auto" if ON_GPU else "pallas_triton"  # the kernels, in interpret mode on a CPU


def _mesh(axis_type, shape=(2, 4)):
  devices = jax.devices()
  if len(devices) < shape[0] * shape[1]:
    pytest.skip(f"needs {shape[0] * shape[1]} devices (conftest simulates 8 CPU devices)")
  return jax.sharding.Mesh(np.array(devices[:shape[0] * shape[1]]).reshape(shape),
                           ("data", "model"), axis_types=(axis_type,) * 2)


# On a GPU in bf16, so that the Hopper kernels run where they take the call.
DTYPE, TOL = (jnp.bfloat16, 1e-2) if ON_GPU else (jnp.float32, 1e-5)
SEQ, HEAD_DIM = (128, 64) if ON_GPU else (32, 16)


def _normal(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(DTYPE)


def _put(mesh, x, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _flash(q, k, v, sinks, ids):
  return jattn.flash_attention(q, k, v, causal=True, sinks=sinks, q_segment_ids=ids,
                               kv_segment_ids=ids, backend=BACKEND)


def _flex(q, k, v):  # its functions read no batch or head index: both axes split
  return jattn.flex_attention(q, k, v, mask_mod=jattn.flex.causal_mask(),
                              score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j),
                              backend=BACKEND)


def _dilated(q, k, v):
  return jattn.dilated_attention(q, k, v, segment_lengths=(16, 32), dilation_rates=(1, 2),
                                 backend=BACKEND)


def _window(q, k, v, bias, mask):  # q, k, v: [windows, tokens, heads, d]
  return jattn.window_attention(q, k, v, bias, mask=mask, backend=BACKEND)


def _flex_arrays_at_indices(q, k, v, slopes, ids):  # arrays read at h and at b: both split
  return jattn.flex_attention(q, k, v, score_mod=jattn.flex.alibi_score(slopes),
                              mask_mod=jattn.flex.document_mask(ids), backend=BACKEND)


def _dot_product_bias(q, k, v, bias):  # a bias per batch row and head: split with them
  return jattn.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                     implementation=BACKEND)


def _dot_product_mask(q, k, v, mask):  # a mask per batch row, read at b: split with it
  return jattn.dot_product_attention(q, k, v, mask=mask, implementation=BACKEND)


def _retention(mode):
  return lambda q, k, v: jattn.retention(q, k, v, mode=mode, chunk_size=16, backend=BACKEND)


# (name, function of (q, k, v, *extra), q heads, kv heads, head mesh axis, extra arrays)
CASES = [
    ("window_bias_mask", _window, 8, 8, "model", ("bias", "mask")),
    ("flash_gqa_sinks_segments", _flash, 8, 4, "model", ("sinks", "ids")),
    # MQA split over batch: its one KV head had made Shardy refuse the op's rule
    ("flash_mqa", lambda q, k, v: jattn.flash_attention(q, k, v, causal=True, backend=BACKEND),
     8, 1, None, ()),
    ("flex", _flex, 8, 4, "model", ()),
    ("flex_arrays_at_indices", _flex_arrays_at_indices, 8, 4, "model", ("slopes", "ids")),
    ("dot_product_bias", _dot_product_bias, 8, 4, "model", ("bias4",)),
    ("dot_product_mask", _dot_product_mask, 8, 4, "model", ("mask4",)),
    ("dilated", _dilated, 8, 8, "model", ()),
    ("retention_parallel", _retention("parallel"), 8, 8, "model", ()),
    ("retention_chunkwise", _retention("chunkwise"), 8, 8, "model", ()),
]


# The 2 x 1, 1 x 2 and 2 x 2 meshes are what 2 and 4 GPUs hold; on a CPU the 2 x 4 mesh
# covers them.
GPU_MESH = pytest.mark.skipif(not ON_GPU, reason="on a CPU the 2 x 4 mesh covers it")


@pytest.mark.parametrize("axis_type, mesh_shape", [
    (AxisType.Auto, (2, 4)), (AxisType.Explicit, (2, 4)),
    pytest.param(AxisType.Auto, (2, 1), marks=GPU_MESH),
    pytest.param(AxisType.Auto, (1, 2), marks=GPU_MESH),
    pytest.param(AxisType.Auto, (2, 2), marks=GPU_MESH)],
    ids=["auto-2x4", "explicit-2x4", "auto-2x1", "auto-1x2", "auto-2x2"])
@pytest.mark.parametrize("name, fn, heads, kv_heads, head_axis, extra", CASES,
                         ids=[c[0] for c in CASES])
def test_sharded_call_equals_unsharded_and_gathers_nothing(name, fn, heads, kv_heads, head_axis,
                                                           extra, axis_type, mesh_shape):
  mesh = _mesh(axis_type, mesh_shape)
  batch, seq, d = 4, SEQ, HEAD_DIM
  ks = jax.random.split(jax.random.key(len(name)), 6)
  q, do = _normal(ks[0], (batch, seq, heads, d)), _normal(ks[3], (batch, seq, heads, d))
  k, v = (_normal(key, (batch, seq, kv_heads, d)) for key in ks[1:3])
  arrays = {"sinks": _normal(ks[4], (heads,)), "bias": _normal(ks[4], (heads, seq, seq)),
            "bias4": _normal(ks[4], (batch, heads, seq, seq)),
            "slopes": jattn.flex.alibi_slopes(heads) * (1 + jax.random.uniform(ks[4], (heads,))),
            "mask4": jax.random.bernoulli(ks[5], 0.7, (batch, 1, seq, seq)) | jnp.eye(seq,
                                                                                 dtype=bool),
            "ids": jnp.broadcast_to(jnp.arange(seq) * 3 // seq, (batch, seq)).astype(jnp.int32),
            "mask": jnp.broadcast_to(jnp.arange(seq) % 2 == jnp.arange(seq)[:, None] % 2,
                                     (2, seq, seq))}
  spec = P("data", None, head_axis)
  specs = {"sinks": P(head_axis), "bias": P(head_axis), "bias4": P("data", head_axis),
           "slopes": P(head_axis),
           "mask4": P("data"),
           "ids": P("data"), "mask": P()}
  args = (q, k, v) + tuple(arrays[e] for e in extra)
  sharded = tuple(_put(mesh, x, spec) for x in (q, k, v)) + tuple(
      _put(mesh, arrays[e], specs[e]) for e in extra)
  # q, k, v and a floating first extra (sinks, a bias, slopes) get gradients, summed
  # over the shards that do not split them (sinks and the bias over batch).
  diff = tuple(range(3 + any(e in ("sinks", "bias", "bias4", "slopes") for e in extra)))

  def fwd_bwd(*args):
    out, pull = jax.vjp(lambda *d: fn(*d, *args[len(diff):-1]), *args[:len(diff)])
    return out, pull(args[-1])

  step = jax.jit(fwd_bwd)
  out, grads = step(*sharded, _put(mesh, do, spec))
  out_ref, grads_ref = jax.jit(fwd_bwd)(*args, do)
  assert rel_err(out, out_ref) < TOL
  for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
    assert rel_err(g, g_ref) < TOL, i
  for x in (out,) + tuple(grads[:3]):  # the inputs' sharding
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
  hlo = step.lower(*sharded, _put(mesh, do, spec)).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


def _serving_case(name, ks):
  """``(function, arrays, their specs, how many get gradients)`` of a serving op: batch
  over "data" (where it has a batch axis), heads over "model"."""
  batch, heads, kv_heads, d = 4, 8, 4, HEAD_DIM
  if name == "paged":  # a pool of 16 pages of 8 keys, 4 pages per sequence
    q = _normal(ks[0], (batch, 2, heads, d))
    pages = [_normal(key, (16, 8, kv_heads, d)) for key in ks[1:3]]
    tables = jax.random.permutation(ks[3], 16).reshape(batch, 4).astype(jnp.int32)
    lengths = jnp.array([32, 9, 20, 2], jnp.int32)
    fn = lambda q, kp, vp, t, n: jattn.paged_attention(q, kp, vp, t, n, causal=True,
                                                       backend=BACKEND)
    return fn, (q, *pages, tables, lengths), (P("data", None, "model"), P(None, None, "model"),
                                              P(None, None, "model"), P("data"), P("data")), 0
  if name == "varlen":  # 3 sequences packed in 40 rows
    q = _normal(ks[0], (40, heads, d))
    k, v = (_normal(key, (40, kv_heads, d)) for key in ks[1:3])
    cu = jnp.array([0, 13, 30, 40], jnp.int32)
    fn = lambda q, k, v, cu: jattn.flash_attention_varlen(
        q, k, v, cu, cu, max_seqlen_q=17, max_seqlen_k=17, causal=True, backend=BACKEND)
    head = P(None, "model")
    return fn, (q, k, v, cu), (head, head, head, P()), 3
  if name == "retention_state":  # chunkwise from given states, returning the final ones
    q, k, v = (_normal(key, (batch, SEQ, heads, d)) for key in ks[:3])
    state = 0.1 * jax.random.normal(ks[3], (batch, heads, d, d))
    fn = lambda q, k, v, state: jattn.retention(q, k, v, mode="chunkwise", chunk_size=16,
                                                initial_state=state, return_state=True,
                                                backend=BACKEND)
    rows = P("data", None, "model")
    return fn, (q, k, v, state), (rows, rows, rows, P("data", "model")), 4
  # retention_step: [batch, heads, d] slots and their states
  q, k, v = (_normal(key, (batch, heads, d)) for key in ks[:3])
  state = jax.random.normal(ks[3], (batch, heads, d, d))
  fn = lambda q, k, v, state: jattn.retention_step(q, k, v, state, backend=BACKEND)
  return fn, (q, k, v, state), (P("data", "model"),) * 3 + (P("data", "model"),), 4


@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((1, 2), marks=GPU_MESH),
                                        pytest.param((2, 2), marks=GPU_MESH)])
@pytest.mark.parametrize("name", ["paged", "varlen", "retention_state", "retention_step"])
def test_serving_ops_run_per_shard(name, mesh_shape):
  """Paged attention (its pool split over KV heads only), packed varlen rows (split
  over heads), retention from given states returning its final ones, and the
  retention step: outputs (and gradients) equal the unsharded call's, with no gather."""
  mesh = _mesh(AxisType.Auto, mesh_shape)
  fn, arrays, specs, n_diff = _serving_case(name, jax.random.split(jax.random.key(7), 4))
  sharded = tuple(_put(mesh, x, spec) for x, spec in zip(arrays, specs))

  def loss(*args):  # a sum of every output (and, where they exist, the gradients)
    out = fn(*args)
    return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in jax.tree.leaves(out)), out

  step = jax.jit(lambda *a: jax.value_and_grad(loss, argnums=tuple(range(n_diff)),
                                               has_aux=True)(*a) if n_diff else loss(*a))
  got, want = step(*sharded), jax.jit(step)(*arrays)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(a, b) < TOL
  out = fn(*sharded)
  first = jax.tree.leaves(out)[0]
  assert first.sharding.is_equivalent_to(NamedSharding(mesh, specs[0]), first.ndim)
  hlo = step.lower(*sharded).compile().as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((1, 2), marks=GPU_MESH),
                                        pytest.param((2, 2), marks=GPU_MESH)])
def test_fp8_forward_runs_per_shard(mesh_shape):
  from jattn.fp8 import quantize_attention_inputs

  mesh = _mesh(AxisType.Auto, mesh_shape)
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (2, SEQ, 8, max(HEAD_DIM, 64)))
  k, v = (jax.random.normal(key, (2, SEQ, 4, max(HEAD_DIM, 64))) for key in ks[1:])
  q8, k8, v8, qd, kd, vd = quantize_attention_inputs(q, k, v)
  spec = P("data", None, "model")
  sharded = [_put(mesh, x, spec) for x in (q8, k8, v8)] + [_put(mesh, d, P("model"))
                                                            for d in (qd, kd, vd)]
  fp8 = jax.jit(lambda q, k, v, qd, kd, vd: jattn.flash_attention(
      q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True))
  out = fp8(*sharded)
  assert rel_err(out, fp8(q8, k8, v8, qd, kd, vd)) < 1e-2
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
  assert "all-gather" not in fp8.lower(*sharded).compile().as_text()


def _flex_alibi(q, k, v, slopes):  # reads h: split over batch only
  return jattn.flex_attention(q, k, v, score_mod=jattn.flex.alibi_score(slopes),
                              mask_mod=jattn.flex.causal_mask(), backend=BACKEND)


@pytest.mark.parametrize("case", [
    "flex_grad_set_mesh", "table_grad_set_mesh", "user_array_set_mesh", "kv_lengths_set_mesh",
    "sharded_slopes",
    "ids_split_by_position", "ids_of_one_row"])
def test_odd_placements_run_per_shard(case):
  """Under ``jax.set_mesh`` of Explicit axes, a flex backward (the kernels' slope check
  had computed eagerly there, and failed in the partitioner's manual axes), one through
  a function with an inner ``jax.jit`` (binding it there made an Explicit-typed
  constant that JAX's shard_map transpose refuses to close over), a user's function of
  an array given split by head (``jattn.flex.from_arrays``: traced from it) and key
  lengths split by batch (stacked with a replicated column: a sharding mismatch); on
  an Auto mesh, ALiBi's slopes given split by heads where q, k and v split by batch
  alone (once refused as a sharded sequence): read at h, they split the heads too; and
  per-row document ids given split by position (read at b: split by batch, the
  positions gathered), or one row of ids for all. Values and gradients as unsharded."""
  explicit = not (case == "sharded_slopes" or case.startswith("ids_"))
  mesh = _mesh(AxisType.Explicit if explicit else AxisType.Auto)
  ks = jax.random.split(jax.random.key(7), 4)
  q = _normal(ks[0], (4, SEQ, 8, HEAD_DIM))
  k, v = (_normal(key, (4, SEQ, 4, HEAD_DIM)) for key in ks[1:3])
  if case == "kv_lengths_set_mesh":
    extra, extra_spec = jnp.array([SEQ, 9, 20, 2], jnp.int32), P("data")
    fn = lambda q, k, v, n: jattn.flash_attention(q, k, v, kv_lengths=n, backend=BACKEND)
  elif case.startswith("ids_"):  # read at b: split with the rows, the rest gathered; one
    # row (the same ids for every batch row) stays whole
    rows = (1, 2, 3, 5) if case == "ids_split_by_position" else (3,)
    extra = jnp.stack([jnp.arange(SEQ) * n // SEQ for n in rows]).astype(jnp.int32)
    extra_spec = P(None, "model") if case == "ids_split_by_position" else P()
    fn = lambda q, k, v, ids: jattn.flex_attention(
        q, k, v, mask_mod=jattn.flex.document_mask(ids), backend=BACKEND)
  elif case == "user_array_set_mesh":  # a user's function of an array split by head
    extra, extra_spec = jax.random.normal(ks[3], (8,)), P("model")
    fn = lambda q, k, v, x: jattn.flex_attention(q, k, v, score_mod=jattn.flex.from_arrays(
        lambda x: lambda s, b, h, i, j: s + x[h], x), backend=BACKEND)
  elif case == "table_grad_set_mesh":  # an inner jit (clip) bound in the transposed shard_map
    extra, extra_spec = jax.random.normal(ks[3], (8, 9)), P()
    fn = lambda q, k, v, t: jattn.flex_attention(
        q, k, v, score_mod=jattn.flex.relative_position_score(t), backend=BACKEND)
  else:
    extra = jattn.flex.alibi_slopes(8) * (1 + jax.random.uniform(ks[3], (8,)))
    extra_spec = P() if explicit else P("model")
    fn = _flex_alibi
  args = (q, k, v, extra)
  sharded = tuple(_put(mesh, x, P("data")) for x in (q, k, v)) + (_put(mesh, extra, extra_spec),)
  wanted = (0, 1, 2) + ((3,) if jnp.issubdtype(extra.dtype, jnp.floating) else ())
  step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))),
                                    argnums=wanted))
  with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
    value, grads = step(*sharded)
  value_ref, grads_ref = step(*args)
  # a float32 sum of 16k terms, added in another order by the split program (jax 0.11
  # on a CPU: 1.02e-5 apart)
  assert rel_err(value, value_ref) < 10 * TOL
  for g, g_ref in zip(grads, grads_ref):
    assert rel_err(g, g_ref) < TOL
  # slopes given split by "model" split the heads too (a slice: nothing gathered)
  heads = "model" if case == "sharded_slopes" else None
  assert grads[0].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, heads)), 4)


def test_a_mask_array_as_hopper_bias_tiles_splits_with_its_rows(hopper_mask_choice):
  """dot_product_attention's mask array as Hopper runs it (an additive bias beside a
  block mask classified per batch row; chosen here as on Hopper) split over
  batch and heads: the bias and the classification split with the rows they hold."""
  taken = hopper_mask_choice
  mesh = _mesh(AxisType.Auto)
  ks = jax.random.split(jax.random.key(11), 4)
  bf16 = lambda key, shape: jax.random.normal(key, shape).astype(jnp.bfloat16)  # as Hopper's
  q, do = (bf16(key, (4, SEQ, 8, HEAD_DIM)) for key in ks[::3])
  k, v = (bf16(key, (4, SEQ, 4, HEAD_DIM)) for key in ks[1:3])
  ids = jnp.stack([jnp.arange(SEQ) * n // SEQ for n in (1, 2, 3, 5)])  # documents per row
  mask = ids[:, None, :, None] == ids[:, None, None, :]

  def fwd_bwd(q, k, v, mask, do):
    out, pull = jax.vjp(lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=mask),
                        q, k, v)
    return out, pull(do)

  spec = P("data", None, "model")
  sharded = (*(_put(mesh, x, spec) for x in (q, k, v)), _put(mesh, mask, P("data")),
             _put(mesh, do, spec))
  step = jax.jit(fwd_bwd)
  out, grads = step(*sharded)
  assert taken and taken[-1] is not None  # the mask ran as a bias
  out_ref, grads_ref = jax.jit(fwd_bwd)(q, k, v, mask, do)
  for x, ref in zip((out,) + grads, (out_ref,) + grads_ref):
    assert rel_err(x, ref) < 1e-2
  assert "all-gather" not in step.lower(*sharded).compile().as_text()


def test_unsplit_queries_with_sinks_split_by_head():
  """On a mesh of Explicit axes, q, k and v whole and the sinks split by head (the
  kernels had indexed a split array): the sinks are gathered, the values unsharded."""
  mesh = _mesh(AxisType.Explicit)
  ks = jax.random.split(jax.random.key(13), 4)
  q, k, v = (_normal(key, (2, SEQ, 8, HEAD_DIM)) for key in ks[:3])
  sinks = jax.random.normal(ks[3], (8,))
  step = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(jnp.sin(jattn.flash_attention(
      q, k, v, sinks=s, backend=BACKEND).astype(jnp.float32))), argnums=(0, 3)))
  with jax.set_mesh(mesh):
    grads = step(*(_put(mesh, x, P()) for x in (q, k, v)), _put(mesh, sinks, P("model")))
  for g, g_ref in zip(grads, step(q, k, v, sinks)):
    assert rel_err(g, g_ref) < TOL


def test_a_sharded_sequence_axis_is_refused_with_a_pointer_to_the_ring():
  mesh = _mesh(AxisType.Explicit)
  q = _put(mesh, _normal(jax.random.key(0), (2, 32, 4, 16)), P(None, "model"))
  with pytest.raises(ValueError, match="q of shape .* is sharded over its axis 1 .*ring"):
    jax.jit(functools.partial(jattn.flash_attention, backend=BACKEND))(q, q, q)


TABLE = jnp.ones((8, 3))


@pytest.mark.parametrize("fn, reads", [
    (lambda s, b, h, i, j: s + TABLE[h, 1], {0: 0}),
    (lambda s, b, h, i, j: s + TABLE[h, 1] + TABLE[h, 2], {0: 0}),
    (lambda s, b, h, i, j: s * 2, {}),
    (lambda s, b, h, i, j: s + 0.1 * h, None),            # arithmetic on the index
    (lambda s, b, h, i, j: s + TABLE[h // 2, 0], None),   # another row than h's
    (lambda s, b, h, i, j: s + TABLE[h, 0] + TABLE[0, 0], None),  # the array read elsewhere
    (lambda s, b, h, i, j: s + TABLE[h, 0] * jnp.sum(TABLE), None),
    (lambda s, b, h, i, j: s + TABLE[1, h % 3], None),
    (lambda s, b, h, i, j: s + jnp.take(TABLE[:, 0], h), None),  # a gather
    (lambda s, b, h, i, j: jnp.where(h < 4, s, 0.0), None),
    (lambda s, b, h, i, j: s / (1 + h), None),              # the index second in an add
    (lambda s, b, h, i, j: s + TABLE[h, 0] - jax.lax.dynamic_slice(TABLE, (0, 0), (1, 1))[0, 0],
     None),                                                # the array read at a literal
], ids=["row", "two-reads", "unused", "arithmetic", "other-row", "read-elsewhere", "reduced",
        "modulo", "take", "compare", "literal-first", "literal-read"])
def test_only_arrays_read_at_the_index_alone_split_with_it(fn, reads):
  """A split may follow an index into the arrays read at it only when nothing else sees
  the index or those arrays: anything else would see the shard's numbering."""
  from jattn.flex.functions import trace
  assert trace(fn, "score_mod")[0].index_reads("h") == reads


def test_a_function_reading_the_batch_index_refuses_a_batch_split():
  mesh = _mesh(AxisType.Explicit)
  x = _put(mesh, _normal(jax.random.key(0), (2, 32, 4, 16)), P("data"))
  score_mod = lambda s, b, h, i, j: s + 0.5 * b  # (an array read at b would split with it)
  with pytest.raises(ValueError, match="cannot run split over batch .*reads the batch index"):
    jattn.flex_attention(x, x, x, score_mod=score_mod, backend=BACKEND)
  # With shardings XLA chooses, the refusal comes when it partitions the program.
  y = _put(_mesh(AxisType.Auto), _normal(jax.random.key(0), (2, 32, 4, 16)), P("data"))
  with pytest.raises(jax.errors.JaxRuntimeError, match="cannot run split over batch"):
    jax.jit(lambda x: jattn.flex_attention(x, x, x, score_mod=score_mod, backend=BACKEND))(y)


def test_unsplittable_heads_are_named():
  mesh = _mesh(AxisType.Explicit)
  x = _put(mesh, _normal(jax.random.key(0), (2, 32, 4, 16)), P(None, None, "model"))
  with pytest.raises(ValueError, match="multiple of every dilation rate"):
    jattn.dilated_attention(x, x, x, segment_lengths=(16,), dilation_rates=(2,),
                            backend=BACKEND)
  kv = _put(mesh, _normal(jax.random.key(1), (2, 32, 1, 16)), P())  # MQA: one KV head
  with pytest.raises(ValueError, match="k of shape .* cannot be split evenly over 4 shards"):
    jattn.flash_attention(x, kv, kv, backend=BACKEND)


def test_dropout_refuses_a_split():
  mesh = _mesh(AxisType.Explicit)
  x = _put(mesh, _normal(jax.random.key(0), (2, 32, 4, 16)), P("data"))
  with pytest.raises(ValueError, match="dropout"):
    jattn.flash_attention(x, x, x, dropout_rate=0.1, dropout_key=jax.random.key(1),
                          backend=BACKEND)


def test_inside_a_users_shard_map():
  """The kernels run per shard in a user's ``shard_map`` with ``check_vma=False``; with
  its default (varying axes checked, which Pallas calls do not declare) the call says so."""
  mesh = _mesh(AxisType.Auto)
  x = _normal(jax.random.key(0), (2, SEQ, 4, HEAD_DIM))
  attend = functools.partial(jattn.flash_attention, causal=True, backend=BACKEND)
  mapped = lambda **kw: jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=P("data"),
                                              out_specs=P("data"), **kw))
  assert rel_err(mapped(check_vma=False)(x, x, x), attend(x, x, x)) < TOL
  with pytest.raises(ValueError, match=r"inside a jax.shard_map that checks varying axes "
                                       r"\(here \['data'\].*Pass check_vma=False"):
    mapped()(x, x, x)


# Score functions inside a shard_map that checks varying axes: a table that varies over
# no axis meets scores that do; jnp.where, jax.nn and an inner jit (inner jaxprs traced
# as varying over nothing); a table passed in sharded, so varying itself.
_CHECKED_SCORES = {
    "table": lambda table: bias_score(table),
    "where-nn-jit": lambda table: lambda s, b, h, i, j: jnp.where(
        i >= j, jax.jit(lambda x: 2.0 * x)(s), jax.nn.softplus(s) + table[h, i, j]),
    "sharded-table": None,
}


@pytest.mark.parametrize("case", list(_CHECKED_SCORES))
def test_xla_flex_inside_a_shard_map_that_checks_varying_axes(case):
  """The xla backend runs flex functions inside a ``shard_map`` that checks varying
  axes: outputs and the gradients of q and the closed-over table, against the
  unsharded call."""
  mesh = _mesh(AxisType.Auto)
  x = _normal(jax.random.key(0), (2, SEQ, 4, HEAD_DIM))
  table = _normal(jax.random.key(1), (2, 4, SEQ, SEQ) if case == "sharded-table"
                  else (4, SEQ, SEQ))
  score = _CHECKED_SCORES[case] or (lambda t: lambda s, b, h, i, j: s * t[b, h, i, j])

  def loss(q, table, map_it):
    attend = lambda q, k, v, t: jattn.flex_attention(q, k, v, score_mod=score(t),
                                                     backend="xla")
    if map_it:  # the sharded table's batch axis splits over "data" with q's
      attend = jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 3 + (
          P("data") if case == "sharded-table" else P(),), out_specs=P("data"))
    return jnp.sum(jnp.sin(attend(q, x, x, table)))

  ours = jax.jit(jax.value_and_grad(functools.partial(loss, map_it=True), (0, 1)))(x, table)
  ref = jax.value_and_grad(functools.partial(loss, map_it=False), (0, 1))(x, table)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert rel_err(a, b) < TOL


def test_one_device_runs_as_before():
  x = _normal(jax.random.key(0), (2, SEQ, 4, HEAD_DIM))
  ref = jattn.flash_attention(x, x, x, backend="xla")
  assert rel_err(jax.jit(functools.partial(jattn.flash_attention, backend=BACKEND))(x, x, x),
                 ref) < TOL
