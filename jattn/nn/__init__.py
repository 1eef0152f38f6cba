"""Flax NNX modules built on the jattn ops."""

from jattn.nn.attention import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
