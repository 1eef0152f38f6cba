"""Flax NNX modules built on the jattn ops."""

from jattn.nn.attention import MultiHeadAttention
from jattn.nn.dat import DAT, PRESETS as DAT_PRESETS, DATConfig
from jattn.nn.decoder import DecoderBlock, DecoderLM
from jattn.nn.generate import decode_steps, generate, greedy_generate, prefill
from jattn.nn.dilated import DilatedAttention, MultiheadDilatedAttention
from jattn.nn.dilated_ring import DilatedRingAttention
from jattn.nn.kv_cache import AttentionCache, KVCache, PagedKVCache
from jattn.nn.llama import LlamaForCausalLM
from jattn.nn.llama_config import LlamaConfig, LlamaConfigError
from jattn.nn.norms import RMSNorm
from jattn.nn.retention import GLU, MultiScaleRetention, RetNet, RetNetConfig, RetNetLayer
from jattn.nn.sampling import Sampling

__all__ = ["AttentionCache", "DAT", "DATConfig", "DAT_PRESETS", "DecoderBlock", "DecoderLM",
           "DilatedAttention", "DilatedRingAttention", "GLU", "KVCache", "LlamaConfig",
           "LlamaConfigError", "LlamaForCausalLM", "MultiHeadAttention",
           "MultiScaleRetention", "MultiheadDilatedAttention", "PagedKVCache", "RMSNorm",
           "RetNet", "RetNetConfig", "RetNetLayer", "Sampling", "decode_steps", "generate",
           "greedy_generate", "prefill"]
