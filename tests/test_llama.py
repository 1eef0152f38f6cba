"""``jattn.nn.LlamaForCausalLM`` against transformers itself on the tiny random models
of ``jattn.interop.llama_check`` (Llama with biases, GQA and llama3 rope scaling; Qwen2
with tied embeddings and a sliding layer; Mistral with a sliding window): logits, greedy generation, prompts of different
lengths, checkpoint folders (single and sharded), the converter, config errors and
sampling."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jattn.nn.llama import LlamaForCausalLM
from jattn.nn.llama_config import LlamaConfig, LlamaConfigError, rope_frequencies
from jattn.nn.sampling import Sampling

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
from jattn.interop.llama_check import TINY, tiny_hf_model  # noqa: E402  (needs both)

VOCAB, PROMPT, NEW = TINY["vocab_size"], 11, 24
FAMILIES = {"llama": 0, "qwen2": 1, "mistral": 2}  # and their seeds


def hf_model(kind: str):
  return tiny_hf_model(kind, seed=FAMILIES[kind])


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def pair(request):
  hf = hf_model(request.param)
  return request.param, hf, LlamaForCausalLM.from_torch(hf)


def prompts(seed: int, batch: int = 3):
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, PROMPT))


def test_config_reads_each_family(pair):
  kind, hf, ours = pair
  c = ours.config
  assert c.model_type == kind and c.group == 2
  expected = {"llama": (None, None), "qwen2": (None, 6), "mistral": (6, 6)}[kind]
  assert c.sliding_windows == expected
  assert (c.rope_scaling is not None) == (kind == "llama")
  assert c.tie_word_embeddings == (kind == "qwen2") and (ours.lm_head is None) == (kind == "qwen2")


def test_logits_match_transformers(pair):
  _, hf, ours = pair
  ids = prompts(0)
  with torch.no_grad():
    ref = hf(torch.from_numpy(ids)).logits.numpy()
  got = np.asarray(jax.jit(lambda m, x: m(x))(ours, jnp.asarray(ids)))
  assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_greedy_generation_and_prompts_of_different_lengths_match_transformers(pair):
  """24 new tokens, one batch of prompts of lengths 11, 4 and 1: transformers left-pads
  (its positions from the mask), jattn right-pads with ``lengths``."""
  _, hf, ours = pair
  ids, lengths = prompts(1), np.array([PROMPT, 4, 1])
  left = np.zeros_like(ids)
  mask = np.zeros_like(ids)
  for row, n in enumerate(lengths):
    left[row, PROMPT - n:], mask[row, PROMPT - n:] = ids[row, :n], 1
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(left), attention_mask=torch.from_numpy(mask),
                      max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, PROMPT:].numpy()
  got = np.asarray(ours.generate(jnp.asarray(ids), NEW, lengths=jnp.asarray(lengths)))
  np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("shards", [False, True])
def test_from_pretrained_reads_hugging_face_folders(tmp_path, shards):
  hf = hf_model("qwen2" if shards else "llama")
  hf.save_pretrained(tmp_path, safe_serialization=True,
                     max_shard_size="20KB" if shards else "5GB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json") == shards
  ours = LlamaForCausalLM.from_pretrained(str(tmp_path))
  ids = prompts(2, batch=2)
  with torch.no_grad():
    ref = hf(torch.from_numpy(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), ref, rtol=0,
                             atol=1e-4 * np.abs(ref).max())


def test_checkpoint_dtype_is_kept_and_mismatches_name_the_key(tmp_path):
  hf = hf_model("mistral").to(torch.bfloat16)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  ours = LlamaForCausalLM.from_pretrained(str(tmp_path))
  assert ours.model.layers[0].mlp.up_proj.kernel.dtype == jnp.bfloat16
  state = hf.state_dict()
  state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:, :3]
  with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape"):
    LlamaForCausalLM.from_torch(state, hf.config)
  del state["model.norm.weight"]
  with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\]"):
    LlamaForCausalLM.from_torch(state, hf.config)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(ValueError) as error:  # the folder named once, at the start
    LlamaForCausalLM.from_pretrained(str(tmp_path))
  assert str(error.value) == (f"{str(tmp_path)!r} holds neither model.safetensors nor "
                              "model.safetensors.index.json (only safetensors weights are read)")


def test_converter_writes_a_folder_from_pretrained_reads(tmp_path):
  from tests.test_cli import run

  hf = hf_model("mistral")
  hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
  # converted by an install without torch or the safetensors package: numpy reads it
  done = run("jattn-convert", "llama", str(tmp_path / "hf"), str(tmp_path / "out"),
             without=("torch", "safetensors", "transformers"))
  assert done.returncode == 0, done.stderr
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "params.safetensors"]
  ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
  ids = prompts(3, batch=1)
  with torch.no_grad():
    ref = hf(torch.from_numpy(ids)).logits.numpy()
  assert np.abs(np.asarray(ours(jnp.asarray(ids))) - ref).max() <= 1e-4 * np.abs(ref).max()
  for argv, says in [(("llama", str(tmp_path / "none"), str(tmp_path / "o2")),
                      "a llama conversion reads a model folder"),
                     (("llama", str(tmp_path / "out"), str(tmp_path / "o3")),
                      "holds neither model.safetensors")]:
    done = run("jattn-convert", *argv)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.splitlines()) == 1
    assert not os.path.exists(argv[-1])


def hf_dict(**changes) -> dict:
  d = tf.LlamaConfig(**TINY).to_dict()
  d.update(changes)
  return json.loads(json.dumps(d))  # as read from config.json


@pytest.mark.parametrize("changes, says", [
    (dict(model_type="gpt2"), "'model_type' is 'gpt2'"),
    (dict(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)),
     "rope_type 'yarn'"),
    (dict(quantization_config={"bits": 4}), "'quantization_config' is not one"),
    (dict(attention_dropout=0.1), "'attention_dropout' is 0.1"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(partial_rotary_factor=0.5), "'partial_rotary_factor' is 0.5"),
])
def test_config_fields_it_cannot_honour_are_named(changes, says):
  with pytest.raises(LlamaConfigError, match=says.replace("(", r"\(")):
    LlamaConfig.from_hf(hf_dict(**changes))


def test_a_published_qwen2_config_reads():
  """A config.json with the fields published Qwen2.5 checkpoints carry (0.5B's sizes),
  plus use_mrope at false (a field of Qwen2-VL's configs)."""
  c = LlamaConfig.from_hf(dict(
      architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643,
      eos_token_id=151645, hidden_act="silu", hidden_size=896, initializer_range=0.02,
      intermediate_size=4864, max_position_embeddings=32768, max_window_layers=21,
      model_type="qwen2", num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2,
      rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768,
      tie_word_embeddings=True, torch_dtype="bfloat16", transformers_version="4.43.1",
      use_cache=True, use_sliding_window=False, use_mrope=False, vocab_size=151936))
  assert (c.head_dim, c.group, c.sliding_windows) == (64, 7, (None,) * 24)
  assert c.qkv_bias and not c.o_bias and c.tie_word_embeddings and c.rope_theta == 1e6


def test_rope_spellings_agree_and_llama3_bands():
  """transformers 4's rope_theta + rope_scaling and 5's rope_parameters read alike;
  llama3 divides long wavelengths by factor and keeps short ones."""
  scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=64)
  old = hf_dict(rope_theta=5e5, rope_scaling=scaling)
  old.pop("rope_parameters", None)
  new = hf_dict(rope_parameters=dict(scaling, rope_theta=5e5))
  new.pop("rope_scaling", None), new.pop("rope_theta", None)
  a, b = LlamaConfig.from_hf(old), LlamaConfig.from_hf(new)
  assert a == b and a.rope_theta == 5e5
  plain = rope_frequencies(LlamaConfig.from_hf(hf_dict(rope_parameters=dict(
      rope_type="default", rope_theta=5e5))))
  scaled = rope_frequencies(a)
  wavelength = 2 * np.pi / plain
  np.testing.assert_allclose(scaled[wavelength > 64], plain[wavelength > 64] / 8, rtol=1e-6)
  np.testing.assert_array_equal(scaled[wavelength < 16], plain[wavelength < 16])


def tiny(seed=0, **changes):
  config = LlamaConfig(**{**dict(model_type="llama", vocab_size=VOCAB, hidden_size=16,
                                 intermediate_size=24, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8),
                          **changes})
  return LlamaForCausalLM(config, rngs=nnx.Rngs(seed))


def test_sampling_filters_and_eos():
  model = tiny()
  ids = jnp.asarray(prompts(4, batch=2))
  greedy = model.generate(ids, 6)
  key = jax.random.key(5)
  # top_k=1 and a tiny top_p leave one candidate: the greedy token, whatever the draw
  np.testing.assert_array_equal(model.generate(ids, 6, temperature=1.5, top_k=1, key=key),
                                greedy)
  np.testing.assert_array_equal(model.generate(ids, 6, temperature=0.7, top_p=1e-6, key=key),
                                greedy)
  drawn = model.generate(ids, 6, temperature=1.0, key=key)
  np.testing.assert_array_equal(drawn, model.generate(ids, 6, temperature=1.0, key=key))
  eos = int(greedy[0, 2])
  stopped = np.asarray(model.generate(ids, 6, eos_token_id=[eos, VOCAB + 5]))
  for row in range(2):
    hits = np.flatnonzero(np.asarray(greedy[row]) == eos)
    end = hits[0] + 1 if hits.size else 6
    np.testing.assert_array_equal(stopped[row, :end], greedy[row, :end])
    assert (stopped[row, end:] == eos).all()
  with pytest.raises(ValueError, match="needs key"):
    model.generate(ids, 2, temperature=1.0)
  with pytest.raises(ValueError, match="top_p must be"):
    Sampling(1.0, top_p=1.5)
  with pytest.raises(ValueError, match=r"lengths must be in \[1, prompt_len = 11\]"):
    model.generate(ids, 2, lengths=jnp.array([0, 4]))


def test_top_p_keeps_the_token_that_crosses_the_mass():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.vmap(lambda k: Sampling(1.0, top_p=0.7)(logits, k))(keys)
  assert set(np.unique(draw).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8


def test_x64_mode_gives_the_same_logits():
  model = tiny(seed=2)
  ids = prompts(7, batch=2)
  expected = np.asarray(model(jnp.asarray(ids)))
  with jax.enable_x64(True):
    got = model(jnp.asarray(ids, jnp.int64))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_a_training_step_under_jit_gives_finite_gradients():
  model = tiny(seed=1, qkv_bias=True)
  ids = jnp.asarray(prompts(6, batch=2))

  @nnx.jit
  def step(model, ids):
    def loss(model):
      logits = model(ids[:, :-1])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))
    value, grads = nnx.value_and_grad(loss)(model)
    return value, grads

  value, grads = step(model, ids)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)
