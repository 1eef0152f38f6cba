"""LongNet: the torch reference (interop/longnet_torch.py) against its definition and
against jattn.dilated_attention (forward and gradients, both backends), and the Flax
layers against their torch counterparts with converted weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

import jattn.interop as interop  # noqa: E402
import jattn  # noqa: E402
from jattn.interop.convert import load_torch_state_dict, to_torch_state_dict  # noqa: E402
from jattn.interop.longnet_torch import (  # noqa: E402
    TorchDilatedAttention, TorchMultiheadDilatedAttention, dilated_attention_torch)
from jattn.nn import DilatedAttention, MultiheadDilatedAttention  # noqa: E402

HEADS, HEAD_DIM = 4, 8
PAIR_SETS = {
    "three pairs": dict(seq=48, kv_heads=4, segment_lengths=(8, 16, 48),
                        dilation_rates=(1, 2, 4), causal=False),
    # 37: partial last segments; 64 > seq: one segment.
    "causal gqa seq 37 w > seq": dict(seq=37, kv_heads=2, segment_lengths=(4, 8, 64),
                                      dilation_rates=(1, 2, 4), causal=True),
    "no rate 1 mqa w > seq": dict(seq=30, kv_heads=1, segment_lengths=(8, 48),
                                  dilation_rates=(2, 3), causal=False),
}


def _draw(seq, kv_heads, seed=0, heads=HEADS, head_dim=HEAD_DIM):
  """Random float32 ``q, k, v`` and output cotangent ``do`` (numpy)."""
  rng = np.random.default_rng(seed)
  normal = lambda h: rng.standard_normal((2, seq, h, head_dim), dtype=np.float32)
  return normal(heads), normal(kv_heads), normal(kv_heads), normal(heads)


def _split(case):
  """``(seq, kv_heads, op kwargs)`` of a ``PAIR_SETS`` entry."""
  case = dict(case)
  return case.pop("seq"), case.pop("kv_heads"), case


def _jax_run(q, k, v, do, backend, **kwargs):
  """``[out, dq, dk, dv]`` of ``jattn.dilated_attention`` as numpy arrays."""
  @jax.jit
  def run(q, k, v, do):
    out, pull = jax.vjp(lambda *a: jattn.dilated_attention(*a, backend=backend, **kwargs),
                        q, k, v)
    return (out, *pull(do))

  return [np.asarray(x) for x in run(q, k, v, do)]


def _torch_run(q, k, v, do, dtype=torch.float64, **kwargs):
  """``[out, dq, dk, dv]`` of ``dilated_attention_torch`` as numpy arrays."""
  args = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in (q, k, v)]
  out = dilated_attention_torch(*args, **kwargs)
  out.backward(torch.tensor(do, dtype=dtype))
  return [x.detach().numpy() for x in (out, *(a.grad for a in args))]


def _assert_close(ours, ref, tol, names=("out", "dq", "dk", "dv")):
  """Max abs error relative to the reference's largest magnitude, per array."""
  for name, a, b in zip(names, ours, ref):
    err = np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b))
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def test_torch_pair_is_segmented_full_attention():
  """One pair, head by head: the positions ≡ h (mod r) of each segment are one
  segment id of ``flash_attention_torch`` (SDPA), and the other positions are zeros."""
  seq, kv_heads = 29, 2
  q, k, v, _ = (torch.from_numpy(x).double() for x in _draw(seq, kv_heads, seed=1))
  pos = torch.arange(seq)
  for (w, r), causal in [((8, 2), True), ((12, 4), False), ((64, 8), True), ((10, 1), False)]:
    out = dilated_attention_torch(q, k, v, [w], [r], causal=causal)
    for h in range(HEADS):
      ids = ((pos // w) * r + pos % r)[None]
      kv_head = h // (HEADS // kv_heads)
      kv = slice(kv_head, kv_head + 1)
      want = interop.flash_attention_torch(q[:, :, h:h + 1], k[:, :, kv], v[:, :, kv],
                                           causal=causal, q_segment_ids=ids, kv_segment_ids=ids)
      mine = (pos - h) % r == 0
      torch.testing.assert_close(out[:, mine, h], want[:, mine, 0], rtol=1e-12, atol=1e-12)
      assert torch.all(out[:, ~mine, h] == 0)


@pytest.mark.parametrize("case", PAIR_SETS.values(), ids=PAIR_SETS.keys())
def test_op_matches_torch_reference(case, backend="xla"):
  # The semantics against torch; the kernels meet the jnp reference in test_dilated.py.
  seq, kv_heads, kwargs = _split(case)
  q, k, v, do = _draw(seq, kv_heads)
  ours = _jax_run(q, k, v, do, backend, **kwargs)
  _assert_close(ours, _torch_run(q, k, v, do, **kwargs), 1e-5)
  if 1 not in kwargs["dilation_rates"]:
    # Position p is covered for head h iff p ≡ h (mod some r_i); the rest are zeros.
    p, h = np.arange(seq)[:, None], np.arange(HEADS)[None, :]
    uncovered = np.all([(p - h) % r != 0 for r in kwargs["dilation_rates"]], axis=0)
    assert uncovered.any() and not uncovered.all()
    assert np.all(ours[0][:, uncovered] == 0)
    assert np.all(np.abs(ours[0][:, ~uncovered]).max(-1) > 0)


def test_torch_reference_float32_matches_float64():
  for case in PAIR_SETS.values():
    seq, kv_heads, kwargs = _split(case)
    q, k, v, do = _draw(seq, kv_heads, seed=2)
    _assert_close(_torch_run(q, k, v, do, torch.float32, **kwargs),
                  _torch_run(q, k, v, do, **kwargs), 1e-5)


def test_detached_weights_change_only_the_gradients():
  seq, kv_heads, kwargs = _split(PAIR_SETS["causal gqa seq 37 w > seq"])
  q, k, v, do = _draw(seq, kv_heads, seed=3)
  ours = _torch_run(q, k, v, do, **kwargs)
  detached = _torch_run(q, k, v, do, detach_weights=True, **kwargs)
  np.testing.assert_array_equal(detached[0], ours[0])
  for name, a, b in zip(("dq", "dk"), detached[1:3], ours[1:3]):
    assert np.max(np.abs(a - b)) > 1e-2 * np.max(np.abs(b)), name
  # The weights depend on q and k only, so v's gradient is the same either way.
  np.testing.assert_allclose(detached[3], ours[3], rtol=1e-12, atol=1e-12)
  # With one pair the weights are all 1: nothing to detach.
  one = dict(segment_lengths=(16,), dilation_rates=(2,), causal=True)
  _assert_close(_torch_run(q, k, v, do, detach_weights=True, **one),
                _torch_run(q, k, v, do, **one), 1e-12)


def test_crosscheck_harness_has_dilated_attention():
  report = interop.crosscheck("dilated_attention", dtype="bfloat16", backend="xla",
                              torch_device="cpu", seq=40, causal=True)
  assert set(report.errors) == {"out", "dq", "dk", "dv"}
  assert report.ok, str(report)


def test_dilated_attention_layer():
  seq, kv_heads, kwargs = _split(PAIR_SETS["causal gqa seq 37 w > seq"])
  q, k, v, _ = _draw(seq, kv_heads, seed=4)
  pairs = dict(segment_lengths=kwargs["segment_lengths"], dilation_rates=kwargs["dilation_rates"])
  layer = DilatedAttention(**pairs, scale=0.3, backend="xla")
  torch_layer = TorchDilatedAttention(**pairs, scale=0.3)
  call = nnx.jit(lambda layer, q, k, v: (layer(q, k, v), layer(q, k, v, causal=True)))
  outs = call(layer, q, k, v)
  for out, causal in zip(outs, (False, True)):
    want = torch_layer(*(torch.from_numpy(x).double() for x in (q, k, v)), causal=causal)
    _assert_close([out], [want.numpy()], 1e-5, names=[f"causal={causal}"])
  assert not np.allclose(*outs)


def _module_pair(seed, **config):
  """A ``TorchMultiheadDilatedAttention`` (float64, every parameter perturbed so biases
  and the norm are not at their init) and the Flax layer with its weights."""
  torch.manual_seed(seed)
  reference = TorchMultiheadDilatedAttention(32, HEADS, (8, 16, 32), (1, 2, 4),
                                             dtype=torch.float64, **config)
  with torch.no_grad():
    for p in reference.parameters():
      p.add_(0.2 * torch.randn_like(p))
  flax_config = {("use_bias" if k == "bias" else k): v for k, v in config.items()}
  layer = MultiheadDilatedAttention(32, HEADS, (8, 16, 32), (1, 2, 4), backend="xla",
                                    rngs=nnx.Rngs(seed), **flax_config)
  load_torch_state_dict(layer, reference.state_dict())
  return reference, layer


@pytest.mark.parametrize("config", [
    dict(),
    dict(layer_norm=False, causal=True, num_kv_heads=2),
    dict(causal=True, num_kv_heads=1, bias=False),
], ids=["norm", "no-norm causal gqa", "norm causal mqa no-bias"])
def test_multihead_layer_matches_torch_module(config):
  reference, layer = _module_pair(5, **config)
  flip = not reference.attention.causal
  rng = np.random.default_rng(5)
  x, cotangent, key, value = (rng.standard_normal((2, 40, 32), dtype=np.float32)
                              for _ in range(4))

  @nnx.jit
  def run(layer, x, cotangent, key, value):
    out, pull = jax.vjp(layer, x)
    # Distinct key and value, and the causal override.
    return out, pull(cotangent)[0], layer(x, key, value, causal=flip)

  out, dx, cross = run(layer, x, cotangent, key, value)
  x_t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
  want = reference(x_t)
  want.backward(torch.from_numpy(cotangent).double())
  with torch.no_grad():
    want_cross = reference(*(torch.from_numpy(a).double() for a in (x, key, value)), causal=flip)
  _assert_close([out, dx, cross], [want.detach().numpy(), x_t.grad.numpy(), want_cross.numpy()],
                2e-5, names=["out", "dx", "cross-attention out"])


def test_multihead_layer_under_jit_and_back_to_torch():
  reference, layer = _module_pair(6, num_kv_heads=2)
  x = np.random.default_rng(6).standard_normal((2, 33, 32), dtype=np.float32)
  jitted = nnx.jit(lambda m, x: m(x, causal=True))(layer, x)
  fresh = TorchMultiheadDilatedAttention(32, HEADS, (8, 16, 32), (1, 2, 4), num_kv_heads=2)
  fresh.load_state_dict({k: torch.tensor(v) for k, v in to_torch_state_dict(layer).items()},
                        strict=True)
  with torch.no_grad():
    want = fresh(torch.from_numpy(x), causal=True).numpy()
  _assert_close([jitted], [want], 2e-5)


def test_magneto_init_matches_torch():
  torch.manual_seed(7)
  reference = TorchMultiheadDilatedAttention(128, 4, (8,), (1,), gamma_init=0.5)
  layer = MultiheadDilatedAttention(128, 4, (8,), (1,), gamma_init=0.5, rngs=nnx.Rngs(7))
  for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
    kernel = np.asarray(getattr(layer, name).kernel[...])
    std = getattr(reference, name).weight.std().item()  # gain * sqrt(2 / (in + out))
    assert abs(kernel.std() / std - 1) < 0.05, name
    assert np.abs(kernel).max() > 3 * std, f"{name}: looks truncated"  # torch's is not
    assert np.all(np.asarray(getattr(layer, name).bias[...]) == 0)
  np.testing.assert_allclose(layer.v_proj.kernel[...].std() / layer.q_proj.kernel[...].std(), 0.5,
                             rtol=0.05)


def test_checkpoint_with_norm_does_not_load_without_it():
  reference = TorchMultiheadDilatedAttention(32, HEADS, (8,), (1,))
  layer = MultiheadDilatedAttention(32, HEADS, (8,), (1,), layer_norm=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"unexpected keys \['norm.bias', 'norm.weight'\]"):
    load_torch_state_dict(layer, reference.state_dict())


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match=r"embed_dim \(30\) must be divisible by num_heads \(4\)"):
    MultiheadDilatedAttention(30, 4, (8,), (1,), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
    MultiheadDilatedAttention(32, 4, (8,), (1,), num_kv_heads=3, rngs=nnx.Rngs(0))
  layer = MultiheadDilatedAttention(32, 4, (8,), (1,), backend="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32))
  with pytest.raises(ValueError, match=r"query must be \[batch, seq, 32\], got shape \(2, 16, 8\)"):
    layer(x[..., :8])
  with pytest.raises(ValueError, match=r"key must have query's shape \(2, 16, 32\)"):
    layer(x, x[:, :12])
  with pytest.raises(ValueError, match=r"value must have query's shape"):
    layer(x, x, x[:1])
  bad = MultiheadDilatedAttention(32, 4, (8, 12), (1, 5), backend="xla", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"segment length a multiple of the dilation rate, "
                     r"got \(w=12, r=5\)"):
    bad(x)
  with pytest.raises(ValueError, match="must be non-empty and of the same length"):
    DilatedAttention((8, 16), (1,))(*(jnp.ones((1, 16, 2, 8)),) * 3)
  q = torch.randn(1, 16, 4, 8)
  with pytest.raises(ValueError, match=r"q's 4 heads must be a multiple of k/v's 3 heads"):
    dilated_attention_torch(q, q[:, :, :3], q[:, :, :3], [8], [1])
  with pytest.raises(ValueError, match=r"got \(w=8, r=3\)"):
    TorchDilatedAttention([8], [3])
  with pytest.raises(ValueError, match="must be non-empty and of the same length"):
    TorchMultiheadDilatedAttention(32, 4, (8, 16), (1,))
