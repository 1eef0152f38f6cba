"""LongNet dilated attention (several (segment, dilation) pairs mixed by their
log-sum-exp), Triton-lowered Pallas, reading the dilated rows in place."""

from pallas_kernels.dilated.attention import (DilatedConfig, default_dilated_config,
                                              dilated_attention_triton)

__all__ = ["DilatedConfig", "default_dilated_config", "dilated_attention_triton"]
