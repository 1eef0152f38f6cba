"""LongNet dilated attention (several (segment, dilation) pairs mixed by their
log-sum-exp), Triton-lowered Pallas, reading the dilated rows in place."""

from pallas_kernels.dilated.attention import (dilated_attention_triton, dilated_pairs_backward,
                                              dilated_pairs_forward)

__all__ = ["dilated_attention_triton", "dilated_pairs_backward", "dilated_pairs_forward"]
