"""Tuned configs: the on-disk cache and shipped table (``cache``), the generic search
over any implementation's tuning stages (``search``), and the ``BlockConfig`` search
space and cost model the Triton-lowered kernels share (``spaces``). The command line
is ``python -m jattn.autotune``."""
