"""jattn.parallel.dilated_ring_attention on 4 simulated CPU devices (see conftest; one
case on 8) equals single-device dilated attention, forward and gradients: pairs whose
segments stay on a device, span a group of devices, a short last group, and the whole
sequence; causal; GQA / MQA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jattn
from jattn.parallel import dilated_ring_attention, sharded_dilated_ring_attention
from jattn.parallel.dilated_ring import plan_pair
from jattn.reference import dilated_attention_reference
from conftest import rel_err, ring_mesh


def _inputs(batch, seq, heads, kv_heads, head_dim, seed):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim))
  k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim))
  v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim))
  return q, k, v, jax.random.normal(ks[3], q.shape)


def _check(mesh, pairs, causal, heads, kv_heads, backend, seq=64, seed=0, tol=1e-5):
  q, k, v, do = _inputs(2, seq, heads, kv_heads, 8, seed)
  ws, rs = zip(*pairs)
  fn = functools.partial(sharded_dilated_ring_attention, mesh=mesh, axis_name="sp",
                         segment_lengths=ws, dilation_rates=rs, causal=causal, backend=backend)
  ref = lambda q, k, v: dilated_attention_reference(q, k, v, segment_lengths=ws,
                                                    dilation_rates=rs, causal=causal)[0]
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  o_ref, pull_ref = jax.vjp(jax.jit(ref), q, k, v)  # jitted: eagerly every op compiles alone
  assert rel_err(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < tol, name


# 64 positions on 4 devices (16 each): w=8 and 16 stay local, 32 spans 2 devices,
# 48 spans 3 (the last group is device 3 alone: a partial segment), 64 and 128 span all.
# One case runs the Pallas kernels (the on-device pairs in the dilated kernels, the
# group rings' blocks in the flash kernels), the others the XLA blocks.
# On 8 devices (8 positions each): w=16 spans 2 devices, 64 all 8.
@pytest.mark.parametrize("devices,pairs,causal,heads,kv_heads,backend", [
    (4, [(8, 1), (32, 2), (64, 4)], False, 4, 4, "xla"),
    (4, [(16, 2), (32, 4)], True, 4, 2, "pallas_triton"),
    (4, [(48, 2), (128, 4)], True, 4, 1, "xla"),
    (8, [(16, 2), (64, 4)], True, 4, 2, "xla"),
])
def test_dilated_ring_equals_single_device(devices, pairs, causal, heads, kv_heads, backend):
  _check(ring_mesh(devices), pairs, causal, heads, kv_heads, backend,
         seed=len(pairs) + int(causal))


def test_inside_user_shard_map_on_sharded_inputs(mesh):
  """With shard_map's varying-axes check on (its default; XLA blocks), forward and
  backward: the spanning pair's transposed gathers vary over the axis as their arrays."""
  q, k, v, do = _inputs(1, 64, 4, 4, 8, seed=11)
  spec = PartitionSpec(None, "sp", None, None)
  sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  fn = jax.jit(jax.shard_map(
      functools.partial(dilated_ring_attention, axis_name="sp", segment_lengths=(16, 64),
                        dilation_rates=(1, 4), backend="xla"),
      mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
  o, pull = jax.vjp(fn, *sharded)
  o_ref, pull_ref = jax.vjp(jax.jit(lambda q, k, v: dilated_attention_reference(
      q, k, v, segment_lengths=(16, 64), dilation_rates=(1, 4))[0]), q, k, v)
  assert rel_err(o, o_ref) < 1e-5
  assert o.sharding.spec == spec
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < 1e-5, name


def test_pairs_given_as_arrays_of_ints(mesh):
  # As the single-device op takes them (the compiled program is keyed on Python ints).
  pairs = dict(segment_lengths=np.array([4, 16]), dilation_rates=jnp.array([1, 2]))
  o = _dilated(mesh, **pairs)(_X, _X, _X)
  assert rel_err(o, jattn.dilated_attention(_X, _X, _X, backend="xla", **pairs)) < 1e-5


def test_sparsified_rows_sent():
  mha = plan_pair(32, 4, local=16, devices=4, heads=8, kv_heads=8)
  assert (mha.group, len(mha.combos)) == (2, 8)  # 8 heads x 1/4 of the rows
  mqa = plan_pair(32, 4, local=16, devices=4, heads=8, kv_heads=1)
  assert len(mqa.combos) == 4  # the one kv head's 4 slots, shared by the 8 query heads
  local = plan_pair(8, 2, local=16, devices=4, heads=2, kv_heads=2)
  assert local.group == 1  # stays on the device


@pytest.mark.parametrize("w,r,local,match", [
    (24, 1, 16, "must divide the local sequence length"),
    (16, 3, 16, "multiple of every dilation rate"),
])
def test_unsupported_layouts_are_explained(w, r, local, match):
  with pytest.raises(ValueError, match=match):
    plan_pair(w, r, local=local, devices=4, heads=2, kv_heads=2)


def _dilated(mesh, *, inside=False, **kwargs):
  """The dilated ring with pairs (4, 1), (16, 2) and ``kwargs``: sharded over ``mesh``,
  or inside a user's ``shard_map`` over axis "sp"."""
  kwargs = {"axis_name": "sp", "segment_lengths": (4, 16), "dilation_rates": (1, 2),
            "backend": "xla", **kwargs}
  if not inside:
    return functools.partial(sharded_dilated_ring_attention, mesh=mesh, **kwargs)
  spec = PartitionSpec(None, "sp", None, None)
  return jax.shard_map(functools.partial(dilated_ring_attention, **kwargs), mesh=mesh,
                       in_specs=(spec,) * 3, out_specs=spec)


_X = _inputs(1, 32, 2, 2, 8, seed=0)[0]


@pytest.mark.parametrize("call,error,match", [
    (lambda m: _dilated(m, axis_name="tp")(_X, _X, _X), ValueError,
     r"axis_name 'tp' is not an axis of the mesh; its axes are \('sp',\)"),
    (lambda m: _dilated(m, inside=True, axis_name="tp")(_X, _X, _X), ValueError,
     r"axis_name 'tp' is not a mesh axis that shard_map maps here \(mapped: \('sp',\)"),
    (lambda m: _dilated(m, causal=1)(_X, _X, _X), TypeError, r"causal must be True or False, got 1"),
    (lambda m: _dilated(m)(_X[:, :16], _X, _X), ValueError,
     r"k must be \[batch, seq, kv_heads, head_dim\] = \[1, 16, \?, 8\], got \(1, 32, 2, 8\)"),
], ids=["axis", "axis-in-shard_map", "causal-int", "k-length"])
def test_argument_errors_name_the_argument(mesh, call, error, match):
  with pytest.raises(error, match=match):
    call(mesh)
