"""``jattn.nn.RetNet.from_torch`` against torchscale itself (``torchscale==0.3.0``, the
official RetNet code): its ``RetNetDecoder`` checkpoints load, through ``.pth`` and
``.safetensors`` files and a converted folder, and give the logits of its parallel
form in our parallel and chunkwise forms and when decoding step by step. (torchscale's
own chunkwise form scales rows differently, which the RMS norm's epsilon does not
fully cancel: see ``jattn.nn.retention``.)"""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
retnet_arch = pytest.importorskip("torchscale.architecture.retnet")
ts_config = pytest.importorskip("torchscale.architecture.config")

from jattn.interop.converted import load_converted, save_converted  # noqa: E402
from jattn.nn import RetNet  # noqa: E402
from test_cli import tool  # noqa: E402

VARIANTS = {
    # value dim != embed dim, GELU (torchscale's default), a separate output projection
    "untied-gelu": dict(decoder_embed_dim=32, decoder_value_embed_dim=48,
                        decoder_retention_heads=2, decoder_ffn_embed_dim=40),
    # tied output projection, swish FFN, an RMS norm on the embedding, 4 heads
    "tied-swish": dict(decoder_embed_dim=32, decoder_value_embed_dim=64,
                       decoder_retention_heads=4, decoder_ffn_embed_dim=24,
                       activation_fn="swish", layernorm_embedding=True,
                       share_decoder_input_output_embed=True),
}
VOCAB, LAYERS = 50, 2


def torchscale_decoder(seed, **overrides):
  torch.manual_seed(seed)
  args = ts_config.RetNetConfig(vocab_size=VOCAB, decoder_layers=LAYERS, **overrides)
  embed = torch.nn.Embedding(VOCAB, args.decoder_embed_dim)
  decoder = retnet_arch.RetNetDecoder(args, embed_tokens=embed).eval()
  with torch.no_grad():  # norms away from 1, so a dropped weight shows
    for name, p in decoder.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm_embedding.weight"):
        p.add_(0.3 * torch.randn_like(p))
  return decoder


def torchscale_logits(decoder, tokens):
  with torch.no_grad():
    return decoder(torch.from_numpy(tokens))[0].numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_loads_torchscale_checkpoints_and_gives_its_logits(variant, tmp_path):
  overrides = dict(VARIANTS[variant])
  activation = overrides.get("activation_fn", "gelu")
  decoder = torchscale_decoder(1, **overrides)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 11))
  expected = torchscale_logits(decoder, tokens)  # its parallel form

  state = decoder.state_dict()
  if variant == "tied-swish":
    from safetensors.torch import save_file

    save_file({k: v.clone().contiguous() for k, v in state.items()}, tmp_path / "m.safetensors")
    path = tmp_path / "m.safetensors"
  else:
    torch.save(state, tmp_path / "m.pth")
    path = tmp_path / "m.pth"
  model = RetNet.from_torch(path, activation=activation, backend="xla")
  c = model.config
  assert (c.num_heads, c.value_dim, c.tie_embeddings) == (
      overrides["decoder_retention_heads"], overrides["decoder_value_embed_dim"],
      variant == "tied-swish")

  x = jnp.asarray(tokens, jnp.int32)
  run = jax.jit(lambda t, mode: model(t, mode=mode, chunk_size=4), static_argnums=1)
  for mode in ("parallel", "chunkwise"):
    np.testing.assert_allclose(np.asarray(run(x, mode)), expected, atol=2e-4, rtol=1e-4)

  cache, steps = model.init_cache(2), []
  step = jax.jit(model.step)
  for i in range(tokens.shape[1]):
    logits, cache = step(x[:, i], cache)
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.stack(steps, axis=1), expected, atol=2e-4, rtol=1e-4)

  if variant == "untied-gelu":  # as a user converts it
    done = subprocess.run([tool("jattn-convert"), "retnet", str(path), str(tmp_path / "conv")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
  else:
    save_converted(model, tmp_path / "conv")
  again = load_converted(tmp_path / "conv", backend="xla")  # and back, without torch
  np.testing.assert_allclose(np.asarray(again(x)), expected, atol=2e-4, rtol=1e-4)


def test_a_checkpoint_of_another_model_is_named():
  from jattn.interop.retnet_checkpoints import load_retnet

  with pytest.raises(ValueError, match="not a RetNet checkpoint.*'conv_first.weight'"):
    load_retnet({"conv_first.weight": np.ones((4, 3, 3, 3), np.float32)})
  decoder = torchscale_decoder(2, **VARIANTS["untied-gelu"])
  state = {k: v for k, v in decoder.state_dict().items() if not k.startswith("retnet_rel_pos")}
  with pytest.raises(ValueError, match="pass num_heads"):
    load_retnet(state)
  with pytest.raises(ValueError, match="num_heads=3 but the checkpoint's decay buffer has 2"):
    load_retnet(decoder.state_dict(), num_heads=3)
  # A head count is checked against the widths before the buffer it is read off is read.
  with pytest.raises(ValueError, match=r"'retnet_rel_pos.decay' has 5 heads: embed_dim \(32\) "
                                       r"must be divisible by num_heads \(5\)"):
    load_retnet({**decoder.state_dict(), "retnet_rel_pos.decay": torch.zeros(5)})


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 10 ** 9, r"embed_dim \(32\) must be divisible by num_heads \(1000000000\)"),
    ("num_layers", 10 ** 6, "num_layers=1000000 does not match the checkpoint, whose tensors "
                            "give num_layers=1"),
    ("eps", -1.0, "eps must be a finite number > 0, got -1.0"),
])
def test_a_tampered_converted_retnet_is_refused(tmp_path, field, value, message):
  """config.json's fields are checked against the weights, and range-checked where the
  weights do not fix them (the head count: a converted folder has no decay buffer)."""
  from flax import nnx

  save_converted(RetNet(VOCAB, 32, 2, 1, rngs=nnx.Rngs(0)), tmp_path / "conv")
  meta = json.loads((tmp_path / "conv/config.json").read_text())
  meta["config"][field] = value
  (tmp_path / "conv/config.json").write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=f"does not hold a RetNet jattn can load: .*{message}"):
    load_converted(tmp_path / "conv")
