"""Window attention with a learned relative-position bias and shift masks
(the attention inside Swin-style and DAT blocks), Triton-lowered Pallas."""

from pallas_kernels.window.attention import default_window_config, window_attention_triton

__all__ = ["default_window_config", "window_attention_triton"]
