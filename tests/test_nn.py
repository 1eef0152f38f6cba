"""jattn.nn.MultiHeadAttention: shapes, agreement with the reference backend, training."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jattn.nn import MultiHeadAttention


def test_output_shape_and_backends_agree():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 20, 32))
  layer = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rngs=nnx.Rngs(0))
  # jitted: eagerly every op of the interpret-mode kernel compiles on its own.
  run = nnx.jit(lambda layer, x: layer(x))
  y = run(layer, x)
  chex.assert_shape(y, (2, 20, 32))
  layer.backend = "xla"
  chex.assert_trees_all_close(y, run(layer, x), atol=1e-5, rtol=1e-5)


def test_cross_attention_with_segments():
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 12, 16))
  ctx = jax.random.normal(jax.random.PRNGKey(2), (1, 19, 16))
  layer = MultiHeadAttention(16, 2, head_dim=30, rngs=nnx.Rngs(1))
  q_seg = jnp.array([[0] * 6 + [1] * 6])
  kv_seg = jnp.array([[0] * 10 + [1] * 9])
  run = nnx.jit(lambda layer, ctx: layer(x, ctx, segment_ids=q_seg, context_segment_ids=kv_seg))
  y = run(layer, ctx)
  chex.assert_shape(y, (1, 12, 16))
  # Changing keys of segment 1 leaves segment-0 queries untouched.
  ctx2 = ctx.at[:, 10:].add(1.0)
  y2 = run(layer, ctx2)
  chex.assert_trees_all_close(y[:, :6], y2[:, :6], atol=1e-6)
  assert not jnp.allclose(y[:, 6:], y2[:, 6:])


def test_bad_configuration_and_input():
  with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads"):
    MultiHeadAttention(32, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads"):
    MultiHeadAttention(30, 4, rngs=nnx.Rngs(0))
  layer = MultiHeadAttention(16, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="x must be \\[batch, seq, 16\\]"):
    layer(jnp.ones((2, 5, 8)))


def test_value_width_sinks_and_dropout():
  """A value head dim of its own, learned sinks (which get gradients), dropout that draws
  a new mask per training call and none in eval mode (then equal to a rate-0 layer)."""
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 10, 16))
  layer = MultiHeadAttention(16, 2, head_dim=8, value_head_dim=12, sinks=True, causal=True,
                             dropout_rate=0.3, backend="xla", rngs=nnx.Rngs(0, dropout=1))
  chex.assert_shape(layer.v_proj.kernel[...], (16, 24))
  train = [layer(x), layer(x)]
  assert not jnp.allclose(train[0], train[1])
  layer.eval()
  plain = nnx.clone(layer)
  plain.dropout_rate = 0.0
  chex.assert_trees_all_close(layer(x), plain(x), atol=1e-6)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert jnp.all(jnp.isfinite(grads.sinks[...])) and jnp.any(grads.sinks[...] != 0)


class TinyModel(nnx.Module):
  def __init__(self, vocab, dim, rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.attn = MultiHeadAttention(dim, 2, num_kv_heads=1, causal=True, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    return self.head(h + self.attn(h))


def test_adamw_steps_reduce_loss():
  vocab, seq = 11, 24
  tokens = jax.random.randint(jax.random.PRNGKey(3), (4, seq + 1), 0, vocab)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  model = TinyModel(vocab, 32, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(3e-2)
  opt_state = tx.init(params)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(8):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert all(jnp.isfinite(jnp.array(losses)))
  assert losses[-1] < 0.7 * losses[0], losses
