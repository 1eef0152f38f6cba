"""Ring and dilated ring attention over every local GPU (needs at least 2) with the
Triton blocks and with "auto"'s (the Hopper ones on an H100), against single-device
attention on the Triton kernels, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jattn
from jattn.parallel import sharded_dilated_ring_attention, sharded_ring_attention
from conftest import rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 2:
    pytest.skip("needs at least 2 GPUs")
  return Mesh(np.array(jax.devices()), ("sp",))


def _inputs(seq, heads, kv_heads, head_dim, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (1, seq, heads, head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (1, seq, kv_heads, head_dim), jnp.bfloat16) for kk in ks[1:3])
  return q, k, v, jax.random.normal(ks[3], q.shape, jnp.bfloat16)


def _compare(fn, ref, q, k, v, do, tol=2e-2):
  o, pull = jax.vjp(jax.jit(fn), q, k, v)
  o_ref, pull_ref = jax.vjp(jax.jit(ref), q, k, v)
  assert rel_err(o, o_ref) < tol
  for name, g, g_ref in zip("qkv", pull(do), pull_ref(do)):
    assert rel_err(g, g_ref) < tol, name


@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
@pytest.mark.parametrize("backend", ["pallas_triton", "auto"])  # auto: Hopper blocks on an H100
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_ring(mesh, causal, layout, backend, kv_exchange):
  q, k, v, do = _inputs(8192 * mesh.size, 8, 2, 128)
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=causal,
                         layout=layout, backend=backend, kv_exchange=kv_exchange)
  ref = functools.partial(jattn.flash_attention, causal=causal, backend="pallas_triton")
  _compare(fn, ref, q, k, v, do)


@pytest.mark.parametrize("kv_exchange", ["ring", "allgather"])
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag"),
                                           (False, "segment_zigzag"), (True, "segment_zigzag")])
def test_ring_documents(mesh, causal, layout, kv_exchange):
  """Packed sequences: uneven documents that cross shard boundaries (for the segment
  zig-zag, of lengths multiples of 2P)."""
  seq = 4096 * mesh.size
  q, k, v, do = _inputs(seq, 8, 2, 128, seed=2)
  grain = 2 * mesh.size if layout == "segment_zigzag" else 1
  cuts = grain * np.sort(np.random.default_rng(0).choice(np.arange(1, seq // grain), 7,
                                                         replace=False))
  ids = jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right")[None], jnp.int32)
  fn = functools.partial(sharded_ring_attention, mesh=mesh, axis_name="sp", causal=causal,
                         layout=layout, backend="auto", kv_exchange=kv_exchange,
                         q_segment_ids=ids, kv_segment_ids=ids)
  ref = functools.partial(jattn.flash_attention, causal=causal, backend="pallas_triton",
                          q_segment_ids=ids, kv_segment_ids=ids)
  _compare(fn, ref, q, k, v, do)


@pytest.mark.parametrize("backend", ["pallas_triton", "auto"])  # auto: Hopper's on an H100
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_ring(mesh, causal, backend):
  seq = 4096 * mesh.size
  q, k, v, do = _inputs(seq, 8, 8, 64, seed=1)
  pairs = dict(segment_lengths=(1024, 4096, 8192, seq), dilation_rates=(1, 2, 4, 8))
  fn = functools.partial(sharded_dilated_ring_attention, mesh=mesh, axis_name="sp",
                         causal=causal, backend=backend, **pairs)
  ref = functools.partial(jattn.dilated_attention, causal=causal, backend="pallas_triton",
                          **pairs)
  _compare(fn, ref, q, k, v, do)
