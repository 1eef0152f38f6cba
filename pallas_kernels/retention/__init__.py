"""RetNet retention kernels (Triton-lowered Pallas): the parallel form so far."""

from pallas_kernels.retention.parallel import retention_parallel_triton

__all__ = ["retention_parallel_triton"]
