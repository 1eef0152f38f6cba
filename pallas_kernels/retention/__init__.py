"""RetNet retention kernels (Triton-lowered Pallas): parallel and chunkwise forms."""

from pallas_kernels.retention.chunkwise import retention_chunkwise_triton
from pallas_kernels.retention.parallel import retention_parallel_triton

__all__ = ["retention_chunkwise_triton", "retention_parallel_triton"]
