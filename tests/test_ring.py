"""jattn.parallel: ring attention over 4 simulated CPU devices (see conftest; one case
over 8) equals single-device attention, forward and gradients, in both layouts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jattn.parallel import ring_attention, sharded_ring_attention, zigzag_order, zigzag_restore
from jattn.reference import flash_attention_reference
from conftest import rel_err, ring_mesh


def _inputs(batch, seq, heads, kv_heads, head_dim, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (batch, seq, heads, head_dim))
  k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim))
  v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim))
  return q, k, v, jax.random.normal(ks[3], q.shape)


def _check(fn, q, k, v, do, causal, tol=1e-5):
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  o_ref, pull_ref = jax.vjp(  # jitted: eagerly every op compiles on its own
      jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, causal=causal)[0]), q, k, v)
  assert rel_err(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < tol, name


@pytest.mark.parametrize("devices,causal,layout", [(4, False, "contiguous"),
                                                   (4, True, "contiguous"), (4, True, "zigzag"),
                                                   (8, True, "zigzag")])
def test_ring_equals_single_device(devices, causal, layout):
  q, k, v, do = _inputs(2, 64, 4, 2, 16, seed=int(causal))
  fn = functools.partial(sharded_ring_attention, mesh=ring_mesh(devices), axis_name="sp",
                         causal=causal, layout=layout, backend="xla")
  _check(fn, q, k, v, do, causal)


def test_ring_with_pallas_blocks(mesh):
  q, k, v, do = _inputs(1, 64, 2, 1, 16, seed=3)
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=True,
                         layout="zigzag", backend="pallas_triton")
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


def test_errors(mesh):
  q, k, v, _ = _inputs(1, 36, 2, 2, 8)
  with pytest.raises(ValueError, match="multiple of 8"):
    sharded_ring_attention(q, k, v, mesh=mesh, axis_name="sp", layout="zigzag")
  with pytest.raises(ValueError, match="layout must be one of"):
    ring_attention(q, k, v, axis_name="sp", layout="striped")
