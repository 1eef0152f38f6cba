"""RetNet retention kernels (Triton-lowered Pallas): parallel, chunkwise and recurrent-step forms."""

from pallas_kernels.retention.chunkwise import ChunkwiseLaunch, retention_chunkwise_triton
from pallas_kernels.retention.parallel import retention_parallel_triton
from pallas_kernels.retention.recurrent import retention_step_triton

__all__ = ["ChunkwiseLaunch", "retention_chunkwise_triton", "retention_parallel_triton",
           "retention_step_triton"]
