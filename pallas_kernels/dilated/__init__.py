"""LongNet dilated attention (several (segment, dilation) pairs mixed by their
log-sum-exp), Triton-lowered Pallas, reading the dilated rows in place."""

from jattn.kernels.dilated.triton import dilated_triton_backward, dilated_triton_forward

__all__ = ["dilated_triton_backward", "dilated_triton_forward"]
