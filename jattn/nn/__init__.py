"""Flax NNX modules built on the jattn ops."""

from jattn.nn.attention import MultiHeadAttention
from jattn.nn.retention import MultiScaleRetention, RetNet, RetNetLayer

__all__ = ["MultiHeadAttention", "MultiScaleRetention", "RetNet", "RetNetLayer"]
