"""jattn.parallel: ring attention over 4 simulated CPU devices (see conftest; one case
over 8) equals single-device attention, forward and gradients, in both layouts and
with both K/V exchanges (the ring, and one all-gather)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

from jattn.parallel import (ring_attention, segment_zigzag_order, segment_zigzag_restore,
                            sharded_ring_attention, zigzag_order, zigzag_restore)
from jattn.reference import flash_attention_reference
from conftest import rel_err, ring_mesh


def _inputs(batch, seq, heads, kv_heads, head_dim, seed=0, kv_len=None, value_head_dim=None):
  kv_len, value_head_dim = kv_len or seq, value_head_dim or head_dim
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim))
  k = jax.random.normal(ks[1], (batch, kv_len, kv_heads, head_dim))
  v = jax.random.normal(ks[2], (batch, kv_len, kv_heads, value_head_dim))
  return q, k, v, jax.random.normal(ks[3], (batch, seq, heads, value_head_dim))


def _check(fn, q, k, v, do, causal, tol=1e-5):
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  o_ref, pull_ref = jax.vjp(  # jitted: eagerly every op compiles on its own
      jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal)[0]), q, k, v)
  assert rel_err(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < tol, name


EXCHANGES = pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])


@EXCHANGES
@pytest.mark.parametrize("devices,causal,layout", [(4, False, "contiguous"),
                                                   (4, True, "contiguous"), (4, True, "zigzag"),
                                                   (8, True, "zigzag")])
def test_ring_equals_single_device(devices, causal, layout, kv_exchange):
  q, k, v, do = _inputs(2, 64, 4, 2, 16, seed=int(causal))
  fn = functools.partial(sharded_ring_attention, mesh=ring_mesh(devices), axis_name="sp",
                         causal=causal, layout=layout, backend="xla", kv_exchange=kv_exchange)
  _check(fn, q, k, v, do, causal)


# v narrower than q and k (the rows a step skips take v's width); without causal, k and v
# may be longer than q.
@pytest.mark.parametrize("causal,layout,kv_len", [(True, "contiguous", 32), (True, "zigzag", 32),
                                                  (False, "contiguous", 64)])
def test_value_head_dim_and_kv_len(mesh, causal, layout, kv_len):
  q, k, v, do = _inputs(1, 32, 2, 1, 16, seed=5, kv_len=kv_len, value_head_dim=8)
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=causal,
                         layout=layout, backend="xla")
  _check(fn, q, k, v, do, causal)


# Packed sequences: documents of several lengths (one spans device boundaries), and a
# query segment no key has (those rows are zeros). Segments that cannot meet skip a step.
# The segment zig-zag cuts each document in 2 * 4 chunks: lengths multiples of 8.
# One case on the Triton blocks (the kernels' tile ranges from ids a causal segment
# zig-zag step passes, diagonal and off it): what the ring adds around its blocks is the
# same on every backend, and the all-gather's per-source steps are the ring's calls.
@pytest.mark.parametrize("causal,layout,backend,kv_exchange", [
    *[(*case, exchange) for case in [(False, "contiguous", "xla"), (True, "contiguous", "xla"),
                                     (True, "zigzag", "xla"), (False, "segment_zigzag", "xla"),
                                     (True, "segment_zigzag", "xla")]
      for exchange in ("ring", "allgather")],
    (True, "segment_zigzag", "pallas_triton", "ring")])
def test_ring_with_segment_ids(mesh, causal, layout, backend, kv_exchange):
  q, k, v, do = _inputs(2, 64, 4, 2, 16, seed=7)
  ends = ([[8, 40, 48, 64], [16, 24, 56, 64]] if layout == "segment_zigzag" else
          [[5, 30, 41, 64], [16, 17, 50, 64]])  # documents' ends per row
  ids = jnp.sum(jnp.arange(64)[None, :, None] >= jnp.array(ends)[:, None, :],
                axis=-1).astype(jnp.int32)
  q_ids = ids.at[1, 56 if layout == "segment_zigzag" else 60:].set(9)  # no key has 9
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=causal,
                         layout=layout, backend=backend, q_segment_ids=q_ids,
                         kv_segment_ids=ids, kv_exchange=kv_exchange)
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  reference = lambda q, k, v: flash_attention_reference(
      q, k, v, causal=causal, q_segment_ids=q_ids, kv_segment_ids=ids)[0]
  o_ref, pull_ref = jax.vjp(jax.jit(reference), q, k, v)
  assert rel_err(o, o_ref) < 1e-5 and not np.asarray(o[1, 60:]).any()
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < 1e-5, name


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "segment_zigzag"])
def test_outputs_and_gradients_stay_sequence_sharded_at_batch_1(mesh, layout):
  """XLA's propagation lost the sharding through the segment zig-zag's gathers at batch
  1 (every device got the whole output and dq); the ring's spec is now imposed."""
  spec = NamedSharding(mesh, PartitionSpec(None, "sp", None, None))
  x = jax.device_put(_inputs(1, 32, 1, 1, 8, seed=4)[0], spec)
  ids = jnp.zeros((1, 32), jnp.int32)
  fn = jax.jit(lambda q: sharded_ring_attention(q, x, x, mesh=mesh, axis_name="sp",
                                                layout=layout, backend="xla",
                                                q_segment_ids=ids, kv_segment_ids=ids))
  o, pull = jax.vjp(fn, x)
  for out in (o, pull(o)[0]):
    assert out.sharding.is_equivalent_to(spec, out.ndim), (layout, out.sharding)


def test_allgather_with_pallas_blocks(mesh):
  """The all-gather's causal chunk calls (bounded by ``kv_lengths``) on the Triton
  kernels; the ring's Triton blocks: ``test_ring_with_segment_ids``."""
  q, k, v, do = _inputs(1, 64, 2, 1, 16, seed=3)
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=True,
                         layout="zigzag", backend="pallas_triton", kv_exchange="allgather")
  _check(fn, q, k, v, do, True)


def test_inside_a_users_shard_map_on_sharded_input(mesh):
  q, k, v, do = _inputs(1, 32, 2, 2, 8, seed=4)
  spec = PartitionSpec(None, "sp", None, None)
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
  fn = jax.shard_map(functools.partial(ring_attention, axis_name="sp", causal=True,
                                       backend="xla"),
                     mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  _check(fn, q, k, v, do, True)


def test_zigzag_order_is_a_permutation_and_inverts():
  x = jnp.arange(2 * 24).reshape(2, 24)
  y = zigzag_order(x, 3)
  assert sorted(np.asarray(y[0]).tolist()) == list(range(24))
  assert np.asarray(y[0, :8]).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5
  np.testing.assert_array_equal(zigzag_restore(y, 3), x)


def test_segment_zigzag_order_puts_two_chunks_of_every_segment_on_each_device():
  ids = np.stack([np.repeat([3, 1, 4], [8, 4, 12]), np.repeat([7, 2], [4, 20])])
  x = np.arange(2 * 24).reshape(2, 24) * 10
  y = np.asarray(segment_zigzag_order(x, ids, 2))
  for b in range(2):  # built again from each segment's 4 chunks
    docs = [x[b][ids[b] == i] for i in dict.fromkeys(ids[b])]
    chunks = [np.split(d, 4) for d in docs]
    device = lambda i: np.concatenate([np.concatenate([c[i], c[3 - i]]) for c in chunks])
    np.testing.assert_array_equal(y[b], np.concatenate([device(0), device(1)]))
  np.testing.assert_array_equal(segment_zigzag_restore(y, ids, 2), x)
  pair = segment_zigzag_order((x, ids), ids, 2)  # a tuple: each by the same permutation
  np.testing.assert_array_equal(pair[0], y)
  np.testing.assert_array_equal(pair[1], segment_zigzag_order(ids, ids, 2))


def _inside(mesh, **kwargs):
  """``ring_attention`` with ``kwargs`` inside a user's ``shard_map`` over axis "sp"."""
  spec = PartitionSpec(None, "sp", None, None)
  return jax.shard_map(functools.partial(ring_attention, backend="xla", **kwargs), mesh=mesh,
                       in_specs=(spec,) * 3, out_specs=spec)


def _sharded(mesh, **kwargs):
  return functools.partial(sharded_ring_attention, mesh=mesh, backend="xla",
                           **{"axis_name": "sp", **kwargs})


# Each case misuses the API on the 4-device mesh; the error's type and what it says.
_Q, _K = _inputs(1, 32, 2, 2, 8)[:2]
_K_LONG = _inputs(1, 64, 2, 2, 8)[1]


@pytest.mark.parametrize("call,error,match", [
    (lambda m: _sharded(m, axis_name="tp")(_Q, _Q, _Q), ValueError,
     r"axis_name 'tp' is not an axis of the mesh; its axes are \('sp',\)"),
    (lambda m: _inside(m, axis_name="tp")(_Q, _Q, _Q), ValueError,
     r"axis_name 'tp' is not a mesh axis that shard_map maps here \(mapped: \('sp',\)"),
    (lambda m: _sharded(m, causal=True)(_Q, _K_LONG, _K_LONG), ValueError,
     r"causal=True needs q and k of one sequence length, got q \(1, 32, 2, 8\) and k "
     r"\(1, 64, 2, 8\).*bottom-right alignment of kv_len != q_len is not supported"),
    (lambda m: _inside(m, axis_name="sp", causal=True, layout="zigzag")(_Q, _K_LONG, _K_LONG),
     ValueError, r"one sequence length \(here: the local shards\), got q \(1, 8, 2, 8\)"),
    (lambda m: _sharded(m, causal="yes")(_Q, _Q, _Q), TypeError,
     r"causal must be True or False, got 'yes'"),
    (lambda m: _sharded(m)(_Q[0], _Q[0], _Q[0]), ValueError, r"q must have rank 4"),
    (lambda m: _sharded(m)(_Q, _K[:, :30], _K[:, :30]), ValueError,
     r"k's sequence length 30 must be a multiple of 4 \(4 devices on axis 'sp'\)"),
    (lambda m: _sharded(m, layout="zigzag")(_Q[:, :28], _K[:, :28], _K[:, :28]), ValueError,
     r"q's sequence length 28 must be a multiple of 8 \(4 devices on axis 'sp', 2 chunks"),
    (lambda m: _sharded(m, layout="striped")(_Q, _Q, _Q), ValueError,
     r"layout must be one of \('contiguous', 'zigzag', 'segment_zigzag'\), got 'striped'"),
    (lambda m: _sharded(m, layout="segment_zigzag")(_Q, _Q, _Q), ValueError,
     r"layout='segment_zigzag' needs q_segment_ids and kv_segment_ids"),
    (lambda m: segment_zigzag_order(_Q, np.repeat([[0, 1]], [16, 16], axis=1), 3),
     ValueError, r"segment_ids: row 0's segment 0 \(tokens 0..15\) has length 16, not a "
     r"multiple of 2 \* devices = 6"),
    (lambda m: _sharded(m, layout="segment_zigzag", q_segment_ids=np.repeat(
        [[0, 1, 0]], [8, 16, 8], axis=1), kv_segment_ids=np.zeros((1, 32), int))(_Q, _Q, _Q),
     ValueError, r"q_segment_ids: row 0 has a segment id in more than one run"),
    (lambda m: _sharded(m, layout="segment_zigzag", causal=True,
                        q_segment_ids=np.repeat([[0, 1]], [8, 24], axis=1),
                        kv_segment_ids=np.repeat([[0, 1]], [16, 16], axis=1))(_Q, _Q, _Q),
     ValueError, r"causal=True needs kv_segment_ids cut into the same segments as q_segment_ids"),
    (lambda m: _sharded(m, layout="segment_zigzag", causal=True,
                        q_segment_ids=np.repeat([[0, 1]], [16, 16], axis=1),
                        kv_segment_ids=np.repeat([[1, 0]], [16, 16], axis=1))(_Q, _Q, _Q),
     ValueError, r"row 0's query segment at token 0 has id 0, which names another segment"),
    (lambda m: _sharded(m, layout="segment_zigzag", q_segment_ids=np.zeros((1, 32), int),
                        kv_segment_ids=np.zeros((1, 32), int))(_Q, _K_LONG, _K_LONG),
     ValueError, r"kv_segment_ids must be \[batch, kv_len\] = \[1, 64\], got \(1, 32\)"),
    (lambda m: segment_zigzag_order(_Q, np.full((1, 32), 2 ** 30), 2), ValueError,
     r"segment_ids must lie in \[-2\*\*30, 2\*\*30\) .*got \[1073741824, 1073741824\]"),
    (lambda m: _inside(m, axis_name="sp", kv_exchange="all_gather")(_Q, _Q, _Q), ValueError,
     r"kv_exchange must be one of \('ring', 'allgather'\), got 'all_gather'"),
    (lambda m: sharded_ring_attention(_Q, _Q, _Q, mesh="sp", axis_name="sp"), TypeError,
     r"mesh must be a jax.sharding.Mesh, got str"),
    (lambda m: zigzag_order(_Q, 3), ValueError,
     r"x's length 32 along axis 1 must be a multiple of 2 \* devices = 6"),
], ids=["axis", "axis-in-shard_map", "causal-kv_len", "causal-kv_len-in-shard_map",
        "causal-str", "rank", "k-split", "zigzag-split", "layout", "segment_zigzag-no-ids",
        "segment-length", "segment-twice", "segment-causal-ids", "segment-causal-labels",
        "segment-ids-shape", "segment-id-range", "kv_exchange", "mesh", "zigzag_order"])
def test_argument_errors_name_the_argument(mesh, call, error, match):
  with pytest.raises(error, match=match):
    call(mesh)


def test_each_hop_is_one_transfer(mesh):
  """K, V and the key segment ids cross as one buffer, and in the backward a hop also
  carries the accumulators of the step before (sent as separate arrays, XLA ran one of
  them synchronously, before the step's work). 4 devices: 3 forward hops, then
  3 hops of the blocks (2 carrying accumulators; XLA may reuse the forward's first),
  one of the last accumulators, one home."""
  q, k, v, do = _inputs(1, 32, 2, 2, 8, seed=5)
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 8)[None]
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", backend="xla",
                         q_segment_ids=ids, kv_segment_ids=ids)
  step = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
  hlo = step.lower(q, k, v, do).compile().as_text()
  hops = hlo.count(" collective-permute(") + hlo.count(" collective-permute-start(")
  assert 3 + 4 <= hops <= 3 + 5


def test_segment_zigzag_keeps_constant_ids_out_of_constant_folding(mesh):
  """Segment ids a caller's jit closes over reach the layout as constants; XLA's GPU
  compiler spent over 3 minutes folding its sort and scans over them (2 H100s, 8192
  tokens). They pass an optimization barrier first: the lowered program keeps it."""
  q = _inputs(1, 32, 2, 2, 8)[0]
  ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 16)[None]
  fn = _sharded(mesh, layout="segment_zigzag", q_segment_ids=ids, kv_segment_ids=ids)
  assert "optimization_barrier" in jax.jit(lambda q: fn(q, q, q)).lower(q).as_text()


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_allgather_exchange_gathers_once_and_reduce_scatters_home(mesh, causal, layout):
  """kv_exchange="allgather": no hop; the forward gathers K, V and the key ids once
  each, the backward gathers them again (XLA may reuse the forward's) and
  reduce-scatters dK and dV."""
  q, k, v, do = _inputs(1, 32, 2, 2, 8, seed=6)
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 8)[None]
  spec, ids_spec = PartitionSpec(None, "sp", None, None), PartitionSpec(None, "sp")
  # Inside shard_map on inputs already laid out (the sharded wrapper's zig-zag
  # reordering of whole arrays would add transfers of its own).
  fn = jax.shard_map(lambda q, k, v, ids: ring_attention(
      q, k, v, axis_name="sp", backend="xla", causal=causal, layout=layout, q_segment_ids=ids,
      kv_segment_ids=ids, kv_exchange="allgather"),
      mesh=mesh, in_specs=(spec,) * 3 + (ids_spec,), out_specs=spec)
  step = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: fn(*a, ids), q, k, v)[1](do))
  hlo = step.lower(q, k, v, do).compile().as_text()
  count = lambda op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(")
  assert count("collective-permute") == 0
  assert 3 <= count("all-gather") <= 5 and count("reduce-scatter") == 2


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(devices=st.sampled_from([2, 4]), causal=st.booleans(),
       layout=st.sampled_from(["contiguous", "zigzag", "segment_zigzag"]),
       group=st.sampled_from([1, 2]), dims=st.sampled_from([(8, 8), (16, 8)]),
       chunk=st.sampled_from([2, 3]), longer_kv=st.booleans(), documents=st.integers(0, 3),
       kv_exchange=st.sampled_from(["ring", "allgather"]), seed=st.integers(0, 99))
def test_random_rings_equal_single_device(devices, causal, layout, group, dims, chunk,
                                          longer_kv, documents, kv_exchange, seed):
  """Random meshes, layouts, head groupings, head dims, lengths and packed documents
  (random cut points, multiples of 2 * devices for the segment zig-zag; 0: no ids),
  either exchange: outputs and gradients equal single-device attention."""
  seq = 2 * devices * chunk  # zig-zag needs 2 chunks per device
  grain = 2 * devices if layout == "segment_zigzag" else 1
  documents = max(documents, int(layout == "segment_zigzag"))
  kv_len = 2 * seq if longer_kv and not causal else seq
  q, k, v, do = _inputs(1, seq, 2 * group, 2, dims[0], seed=seed, kv_len=kv_len,
                        value_head_dim=dims[1])
  ids = {}
  if documents:
    rng = np.random.default_rng(seed)
    cuts = lambda n: jnp.asarray(np.searchsorted(
        np.sort(rng.integers(0, n // grain, documents)) * grain, np.arange(n),
        side="right")[None], jnp.int32)
    q_ids = cuts(seq)  # a causal segment zig-zag lays keys out by the queries' segments
    same = causal and layout == "segment_zigzag"
    ids = dict(q_segment_ids=q_ids, kv_segment_ids=q_ids if same else cuts(kv_len))
  fn = functools.partial(sharded_ring_attention, mesh=ring_mesh(devices), axis_name="sp",
                         causal=causal, layout=layout, backend="xla", kv_exchange=kv_exchange,
                         **ids)
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  reference = lambda q, k, v: flash_attention_reference(q, k, v, causal=causal, **ids)[0]
  o_ref, pull_ref = jax.vjp(jax.jit(reference), q, k, v)
  assert rel_err(o, o_ref) < 1e-5
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < 1e-5, name
