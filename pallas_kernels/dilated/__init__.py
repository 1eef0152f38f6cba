"""LongNet dilated attention (several (segment, dilation) pairs mixed by their
log-sum-exp), reading the dilated rows in place: Triton-lowered Pallas (forward and
backward), and a forward on the Hopper kernels (``mosaic``)."""

from jattn.kernels.dilated.mosaic import dilated_mosaic_forward, unsupported_pair
from jattn.kernels.dilated.triton import dilated_triton_backward, dilated_triton_forward

__all__ = ["dilated_mosaic_forward", "dilated_triton_backward", "dilated_triton_forward",
           "unsupported_pair"]
