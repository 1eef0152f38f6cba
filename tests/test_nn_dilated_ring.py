"""jattn.nn.DilatedRingAttention on 4 simulated CPU devices (see conftest): under
nnx.jit with a sequence-sharded input it equals MultiheadDilatedAttention with the same
parameters on one device, forward and input gradient; the Hilbert order is undone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jattn.nn import DilatedRingAttention, MultiheadDilatedAttention
from jattn.parallel import hilbert_flatten, hilbert_unflatten
from conftest import rel_err

PAIRS = dict(segment_lengths=(16, 64), dilation_rates=(1, 4))  # 16 stays local, 64 rings


def _modules(mesh, **kwargs):
  ring = DilatedRingAttention(32, 4, **PAIRS, mesh=mesh, backend="xla", rngs=nnx.Rngs(0),
                              **kwargs)
  plain = MultiheadDilatedAttention(32, 4, **PAIRS, backend="xla", rngs=nnx.Rngs(0),
                                    causal=kwargs.get("causal", False))
  return ring, plain


@pytest.mark.parametrize("causal", [False, True])
def test_sharded_module_under_jit_equals_one_device(mesh, causal):
  ring, plain = _modules(mesh, causal=causal)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 32))
  x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "sp", None)))
  loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
  run = nnx.jit(lambda m, x: (m(x), jax.grad(lambda x: loss(m, x))(x)))
  out, grad = run(ring, x_sharded)
  out_ref, grad_ref = run(plain, x)  # jitted: eagerly every op compiles on its own
  assert rel_err(out, out_ref) < 1e-5
  assert rel_err(grad, grad_ref) < 1e-5
  assert out.sharding.is_equivalent_to(x_sharded.sharding, out.ndim)  # still sharded


def test_hilbert_order_is_applied_and_undone(mesh):
  ring, plain = _modules(mesh, use_hilbert=True)
  image = jax.random.normal(jax.random.PRNGKey(2), (1, 8, 8, 32))  # 64 tokens
  run = nnx.jit(lambda m, x: m(x))
  out = run(ring, image)
  expected = hilbert_unflatten(run(plain, hilbert_flatten(image)), 8, 8)
  assert out.shape == image.shape and rel_err(out, expected) < 1e-5
  # A flattened image with its grid gives the same, in row-major order (on one device:
  # the order does not depend on the mesh).
  flat = DilatedRingAttention(32, 4, **PAIRS, backend="xla", use_hilbert=True, grid=(8, 8),
                              rngs=nnx.Rngs(0))
  out_flat = run(flat, image.reshape(1, 64, 32))
  np.testing.assert_allclose(out_flat.reshape(image.shape), out, atol=1e-5)


def test_full_attention_is_order_free():
  # One pair (seq, 1) is full attention, which commutes with any token order.
  full = dict(segment_lengths=(12 * 10,), dilation_rates=(1,))
  hil = DilatedRingAttention(16, 2, **full, use_hilbert=True, backend="xla", rngs=nnx.Rngs(3))
  plain = MultiheadDilatedAttention(16, 2, **full, backend="xla", rngs=nnx.Rngs(3))
  image = jax.random.normal(jax.random.PRNGKey(4), (2, 12, 10, 16))
  run = nnx.jit(lambda m, x: m(x))  # jitted: eagerly every op compiles on its own
  np.testing.assert_allclose(run(hil, image),
                             run(plain, image.reshape(2, 120, 16)).reshape(image.shape), atol=2e-5)


def test_backend_none_selects_through_select_backend(mesh):
  from jattn.gpu import select_backend

  ring = DilatedRingAttention(32, 4, **PAIRS, mesh=mesh, rngs=nnx.Rngs(0))
  assert ring.attention.backend == select_backend("dilated_attention", head_dim=8)


def test_errors(mesh):
  with pytest.raises(ValueError, match="axis_name 'tp' is not an axis of the mesh"):
    DilatedRingAttention(32, 4, **PAIRS, mesh=mesh, axis_name="tp", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="grid=.* only used with use_hilbert=True"):
    DilatedRingAttention(32, 4, **PAIRS, grid=(8, 8), rngs=nnx.Rngs(0))
  ring = DilatedRingAttention(32, 4, **PAIRS, use_hilbert=True, backend="xla", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs grid=\\(H, W\\)"):
    ring(jnp.ones((1, 64, 32)))
  sharded = DilatedRingAttention(32, 4, **PAIRS, mesh=mesh, backend="xla", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="multiple of 4 \\(4 devices on axis .sp.\\)"):
    sharded(jnp.ones((1, 66, 32)))
