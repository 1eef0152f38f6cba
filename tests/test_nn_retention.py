"""jattn.nn.MultiScaleRetention and RetNet: modes agree, decoding matches, it trains."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jattn.nn import MultiScaleRetention, RetNet
from jattn.nn.retention import theta_shift


def test_theta_shift_rotates_pairs_and_keeps_norms():
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 8))
  y = theta_shift(x, jnp.arange(5))
  chex.assert_trees_all_close(y[:, 0], x[:, 0])  # position 0: no rotation
  pair_norm = lambda a: jnp.linalg.norm(a.reshape(*a.shape[:-1], -1, 2), axis=-1)
  chex.assert_trees_all_close(pair_norm(y), pair_norm(x), atol=1e-5)
  # Relative positions: <R_m q, R_n k> depends on n - m only.
  q, k = x[:, :1], x[:, 1:2]
  dot_at = lambda m, n: jnp.sum(theta_shift(q, jnp.array([m])) * theta_shift(k, jnp.array([n])))
  chex.assert_trees_all_close(dot_at(0, 3), dot_at(5, 8), atol=1e-4)


def test_layer_modes_and_decoding_agree():
  layer = MultiScaleRetention(32, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 21, 32))
  # jitted: eagerly every op (of the interpret-mode kernels too) compiles on its own.
  par, chunked, rec = nnx.jit(lambda layer, x: (
      layer(x, mode="parallel"), layer(x, mode="chunkwise", chunk_size=16),
      layer(x, mode="recurrent")))(layer, x)
  chex.assert_shape(par, (2, 21, 32))
  chex.assert_trees_all_close(chunked, par, atol=1e-4)
  chex.assert_trees_all_close(rec, par, atol=1e-4)
  cache = layer.init_cache(2)
  steps = []
  step = nnx.jit(lambda layer, x, cache: layer.step(x, cache))
  for t in range(21):
    y, cache = step(layer, x[:, t], cache)
    steps.append(y)
  chex.assert_trees_all_close(jnp.stack(steps, 1), par, atol=1e-4)
  names = {"q_proj", "k_proj", "v_proj", "g_proj", "out_proj"}
  assert names <= set(vars(layer)) and layer.v_proj.kernel[...].shape == (32, 64)


def test_a_nonfinite_input_reaches_only_later_positions_in_every_mode():
  # Beside retention, the layer's own row factors (decayed key sums, by a scan) mix
  # positions: they too keep an inf to the positions at and after it.
  layer = MultiScaleRetention(32, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 21, 32))
  run = nnx.jit(lambda layer, x: [layer(x, mode=mode, chunk_size=16)
                                  for mode in ("parallel", "chunkwise", "recurrent")])
  for y, y_clean in zip(run(layer, x.at[0, 11, 5].set(jnp.inf)), run(layer, x)):
    np.testing.assert_array_equal(~jnp.isfinite(y).all(-1), np.arange(21) >= [[11], [21]])
    chex.assert_trees_all_close((y[0, :11], y[1]), (y_clean[0, :11], y_clean[1]), atol=1e-6)


def test_layer_rejects_bad_widths():
  with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads \\(4\\)"):
    MultiScaleRetention(30, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="must be even"):
    MultiScaleRetention(12, 4, rngs=nnx.Rngs(0))
  layer = MultiScaleRetention(16, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"x must be \[batch, seq, 16\]"):
    layer(jnp.ones((2, 5, 8)))


def test_retnet_learns_a_periodic_sequence_and_decodes_like_the_parallel_form():
  vocab, period, seq = 11, 5, 24
  model = RetNet(vocab, 32, 4, 2, backend="xla", rngs=nnx.Rngs(0))
  base = jnp.arange(period) * 2 % vocab
  starts = jax.random.randint(jax.random.PRNGKey(2), (16,), 0, period)
  tokens = jnp.stack([jnp.roll(jnp.tile(base, seq // period + 2), -s)[:seq + 1] for s in starts])
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

  def loss_fn(model):
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  first = float(nnx.jit(loss_fn)(model))
  for _ in range(80):
    last = float(train_step(model, optimizer))
  assert last < 0.25 * first, (first, last)
  logits, chunked = nnx.jit(lambda model, x: (model(x), model(x, mode="chunkwise",
                                                                chunk_size=16)))(model, inputs[:2])
  chex.assert_trees_all_close(chunked, logits, atol=2e-3)
  cache = model.init_cache(2)
  step = nnx.jit(lambda model, token, cache: model.step(token, cache))
  for t in range(6):
    step_logits, cache = step(model, inputs[:2, t], cache)
    chex.assert_trees_all_close(step_logits, logits[:, t], atol=2e-3)
