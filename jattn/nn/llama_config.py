"""``LlamaConfig``: the hyper-parameters of a Llama-family decoder (Llama 2/3, Qwen2,
Mistral), read off a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling), and
the rotary-embedding frequencies they give.

Every field of the file is either used, checked to hold a value the model implements, or
known to be metadata (token ids, dtype, version); any other field is an error naming it,
so that a checkpoint is never run with a feature silently left out.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MODEL_TYPES = ("llama", "qwen2", "mistral")

# Fields of Hugging Face configs that do not change the forward pass.
METADATA_FIELDS = frozenset({
    "_name_or_path", "architectures", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "dtype", "torch_dtype", "transformers_version", "use_cache",
    "initializer_range", "max_position_embeddings", "output_attentions",
    "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "tokenizer_class", "model_type",
    "pretraining_tp", "use_return_dict", "torchscript", "tie_encoder_decoder", "prefix",
    "task_specific_params", "finetuning_task", "num_labels", "cross_attention_hidden_size",
    "add_cross_attention", "is_decoder", "sep_token_id", "decoder_start_token_id",
    "bad_words_ids", "begin_suppress_tokens", "suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty",
    "tf_legacy_loss", "pruned_heads",
})


class LlamaConfigError(ValueError):
  """A Hugging Face config that names a field or value the model does not implement."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-family decoder's hyper-parameters.

  ``sliding_windows`` holds one entry per layer: the keys a query sees (itself
  included), or None for full causal attention. ``rope_scaling`` is None or the
  ``llama3`` parameters ``(factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings)``.
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  tie_word_embeddings: bool = False
  sliding_windows: tuple = ()

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim"):
      value = getattr(self, name)
      if type(value) is not int or value < 1:
        raise LlamaConfigError(f"config field {name!r} must be a positive integer, got "
                               f"{value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise LlamaConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
    if self.model_type not in MODEL_TYPES:
      raise LlamaConfigError(f"model_type {self.model_type!r} is not one of {MODEL_TYPES}")
    windows = tuple(self.sliding_windows) or (None,) * self.num_hidden_layers
    if len(windows) != self.num_hidden_layers or not all(
        w is None or (type(w) is int and w >= 1) for w in windows):
      raise LlamaConfigError(f"sliding_windows must hold None or a positive window per layer "
                             f"({self.num_hidden_layers}), got {self.sliding_windows!r}")
    object.__setattr__(self, "sliding_windows", windows)
    if self.rope_scaling is not None:
      object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))

  @classmethod
  def from_hf(cls, config) -> "LlamaConfig":
    """The config of a Hugging Face ``config.json`` (a dict, or a transformers config
    object). Raises ``LlamaConfigError`` naming the first field it cannot honour."""
    d = dict(config if isinstance(config, dict) else config.to_dict())
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
      raise LlamaConfigError(f"config field 'model_type' is {model_type!r}; jattn's "
                             f"LlamaForCausalLM reads {', '.join(MODEL_TYPES)}")
    fields = _Fields(d)
    heads = fields.required("num_attention_heads")
    hidden = fields.required("hidden_size")
    head_dim = fields.get("head_dim")
    layers = fields.required("num_hidden_layers")
    values = dict(
        model_type=model_type, vocab_size=fields.required("vocab_size"), hidden_size=hidden,
        intermediate_size=fields.required("intermediate_size"), num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=fields.get("num_key_value_heads") or heads,
        head_dim=head_dim if head_dim is not None else hidden // heads,
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        **_rope(fields), **_biases(model_type, fields),
        sliding_windows=_windows(model_type, fields, layers))
    fields.require("hidden_act", ("silu", "swish"), "silu")
    fields.require("attention_dropout", (0, 0.0), 0.0, what="0 (no attention dropout)")
    if model_type != "llama":
      fields.require("mlp_bias", (False,), False)
      fields.require("attention_bias", (False,), False)
    fields.require("partial_rotary_factor", (1, 1.0), 1.0, what="1.0 (rotary on every dim)")
    fields.require("use_mrope", (False,), False)
    fields.finish()
    return cls(**values)

  @property
  def group(self) -> int:
    """Query heads per key/value head."""
    return self.num_attention_heads // self.num_key_value_heads


class _Fields:
  """A config dict's fields, each marked as read when asked for."""

  def __init__(self, d: dict):
    self.d, self.read = d, set()

  def get(self, name, default=None):
    self.read.add(name)
    value = self.d.get(name, default)
    return default if value is None else value

  def required(self, name):
    """Reads ``name``, which the config must give (``LlamaConfig`` checks its value)."""
    if name not in self.d:
      raise LlamaConfigError(f"config has no field {name!r}")
    return self.get(name)

  def require(self, name, allowed, default, *, what=None):
    """Reads ``name`` (``default`` where absent), which must be one of ``allowed``."""
    value = self.get(name, default)
    if value not in allowed:
      raise LlamaConfigError(f"config field {name!r} is {value!r}; jattn's LlamaForCausalLM "
                             f"implements {what or ' or '.join(map(repr, allowed))}")

  def finish(self):
    unknown = sorted(set(self.d) - self.read - METADATA_FIELDS)
    if unknown:
      raise LlamaConfigError(f"config field {unknown[0]!r} is not one jattn's "
                             f"LlamaForCausalLM implements (value {self.d[unknown[0]]!r})"
                             + (f"; also {unknown[1:4]}" if len(unknown) > 1 else ""))


def _rope(fields: _Fields) -> dict:
  """``rope_theta`` and ``rope_scaling`` from either spelling: transformers 5's
  ``rope_parameters`` dict, or 4.x's ``rope_theta`` and ``rope_scaling``."""
  params = fields.get("rope_parameters")
  scaling = fields.get("rope_scaling")
  theta = fields.get("rope_theta")
  if params is not None and scaling is None:
    scaling = params
    theta = params.get("rope_theta", theta)
  theta = 10000.0 if theta is None else float(theta)
  if scaling is None:
    return dict(rope_theta=theta, rope_scaling=None)
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  known = {"rope_type", "type", "rope_theta"}
  if kind == "default":
    extra = sorted(set(scaling) - known)
    if extra:
      raise LlamaConfigError(f"config field 'rope_scaling' of type 'default' has fields "
                             f"{extra} jattn does not implement")
    return dict(rope_theta=theta, rope_scaling=None)
  if kind != "llama3":
    raise LlamaConfigError(f"config field 'rope_scaling' has rope_type {kind!r}; jattn's "
                           "LlamaForCausalLM implements 'default' and 'llama3'")
  names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [n for n in names if n not in scaling]
  extra = sorted(set(scaling) - known - set(names))
  if missing or extra:
    raise LlamaConfigError(f"config field 'rope_scaling' (llama3) needs {list(names)}"
                           + (f"; missing {missing}" if missing else "")
                           + (f"; has {extra} jattn does not implement" if extra else ""))
  return dict(rope_theta=theta, rope_scaling=tuple(float(scaling[n]) for n in names))


def _biases(model_type: str, fields: _Fields) -> dict:
  """Which projections carry a bias: Llama's ``attention_bias`` (q, k, v and o) and
  ``mlp_bias``; Qwen2's q, k, v always (not o); Mistral none."""
  if model_type == "llama":
    attention = bool(fields.get("attention_bias", False))
    return dict(qkv_bias=attention, o_bias=attention, mlp_bias=bool(fields.get("mlp_bias", False)))
  if model_type == "qwen2":
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False)
  return dict(qkv_bias=False, o_bias=False, mlp_bias=False)


def _windows(model_type: str, fields: _Fields, layers: int) -> tuple:
  """Each layer's sliding window (keys seen, itself included) or None. Mistral: every
  layer when ``sliding_window`` is set. Qwen2: ``layer_types`` where given, otherwise
  (with ``use_sliding_window``) the layers from ``max_window_layers`` on. Llama: none."""
  if model_type == "llama":
    return (None,) * layers
  window = fields.get("sliding_window")
  if model_type == "mistral":
    return (window,) * layers
  use = bool(fields.get("use_sliding_window", False))
  first = fields.get("max_window_layers", layers)
  types = fields.get("layer_types")
  if not use or window is None:
    if types is not None and any(t != "full_attention" for t in types):
      raise LlamaConfigError("config field 'layer_types' names sliding layers but "
                             "use_sliding_window is false or sliding_window is null")
    return (None,) * layers
  if types is None:
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
  if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
    raise LlamaConfigError(f"config field 'layer_types' must give 'full_attention' or "
                           f"'sliding_attention' for each of the {layers} layers")
  return tuple(window if t == "sliding_attention" else None for t in types)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
  """``[head_dim // 2]`` float32 inverse frequencies of the rotary embedding
  (``theta ** (-2i / head_dim)``), rescaled band by band for ``llama3`` scaling: long
  wavelengths divided by ``factor``, short ones kept, the band between blended."""
  d = config.head_dim
  inv = (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32)
                                      / d))).astype(np.float32)
  if config.rope_scaling is None:
    return inv
  factor, low, high, original = (np.float32(v) for v in config.rope_scaling)
  wavelength = np.float32(2 * math.pi) / inv
  low_wavelength, high_wavelength = original / low, original / high
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * inv / factor + smooth * inv
  out = np.where(wavelength > low_wavelength, inv / factor, inv)
  medium = (wavelength <= low_wavelength) & (wavelength >= high_wavelength)
  return np.where(medium, blended, out).astype(np.float32)
