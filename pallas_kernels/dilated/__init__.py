"""LongNet dilated attention (several (segment, dilation) pairs mixed by their
log-sum-exp), reading the dilated rows in place: Triton-lowered Pallas and the Hopper
kernels (``mosaic``), forward and backward."""

from jattn.kernels.dilated.mosaic import (dilated_mosaic_backward, dilated_mosaic_forward,
                                          unsupported_pair)
from jattn.kernels.dilated.triton import dilated_triton_backward, dilated_triton_forward

__all__ = ["dilated_mosaic_backward", "dilated_mosaic_forward", "dilated_triton_backward",
           "dilated_triton_forward", "unsupported_pair"]
