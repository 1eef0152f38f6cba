"""Window attention with a learned relative-position bias and shift masks (the
attention inside Swin-style and DAT blocks), Triton-lowered Pallas."""

from jattn.kernels.window.config import default_window_config
from jattn.kernels.window.triton import window_triton_backward, window_triton_forward

__all__ = ["default_window_config", "window_triton_backward", "window_triton_forward"]
