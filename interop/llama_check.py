"""``jattn check``'s model rows: ``LlamaForCausalLM`` against transformers' own Llama,
Qwen2 and Mistral on tiny random models (float32 logits), where transformers is
installed. Imports torch and transformers: imported only when they are there."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jattn.nn.llama import LlamaForCausalLM

FAMILIES = ("llama", "qwen2", "mistral")
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf_model(kind: str, seed: int = 0):
  """A transformers model of ``kind`` with every parameter random (biases and norm
  weights too), its eager attention the reference: Llama with biases, GQA and llama3
  rope scaling; Qwen2 with tied embeddings and its second layer sliding; Mistral with a
  sliding window of 6."""
  if kind == "llama":
    config = transformers.LlamaConfig(
        **TINY, attention_bias=True, mlp_bias=True, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))
    cls = transformers.LlamaForCausalLM
  elif kind == "qwen2":
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, use_sliding_window=True,
                                      sliding_window=6, max_window_layers=1)
    cls = transformers.Qwen2ForCausalLM
  elif kind == "mistral":
    config = transformers.MistralConfig(**TINY, sliding_window=6)
    cls = transformers.MistralForCausalLM
  else:
    raise ValueError(f"kind must be one of {FAMILIES}, got {kind!r}")
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  return model


def llama_check_rows(backends, reps: int, make_row) -> list:
  """One row per (family, backend that runs it): ``make_row(case, backend, err_jax,
  err_torch, ms)``, the errors relative to the largest reference logit: against jattn's
  model on the ``xla`` backend, and against transformers. The JAX side runs its float32
  matmuls at full precision (on a GPU the default is TF32, whose 1e-3 errors are not
  the model's)."""
  with jax.default_matmul_precision("highest"):
    return _rows(backends, reps, make_row)


def _rows(backends, reps: int, make_row) -> list:
  ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 24))
  rows = []
  for kind in FAMILIES:
    hf = tiny_hf_model(kind)
    with torch.no_grad():
      ref = hf(torch.from_numpy(ids)).logits.float().numpy()
    scale = np.abs(ref).max()
    xla = np.asarray(LlamaForCausalLM.from_torch(hf, backend="xla")(jnp.asarray(ids)))
    for backend in backends:
      try:
        model = LlamaForCausalLM.from_torch(hf, backend=backend)
        forward = jax.jit(lambda m, x: m(x))
        ours = np.asarray(forward(model, jnp.asarray(ids)))
      except ValueError:  # a backend the model's attention calls cannot run on
        continue
      times = []
      for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(forward(model, jnp.asarray(ids)))
        times.append(time.perf_counter() - start)
      rows.append(make_row(kind, backend, float(np.abs(ours - xla).max() / scale),
                           float(np.abs(ours - ref).max() / scale),
                           1e3 * float(np.median(times))))
  return rows
