"""RetNet retention kernels (Triton-lowered Pallas): parallel, chunkwise and recurrent-step forms."""

from pallas_kernels.retention.chunkwise import (MIN_CHUNK, ChunkwiseLaunch, default_launch,
                                                fitting_chunk, retention_chunkwise_triton)
from pallas_kernels.retention.parallel import default_parallel_config, retention_parallel_triton
from pallas_kernels.retention.recurrent import retention_step_triton

__all__ = ["MIN_CHUNK", "ChunkwiseLaunch", "default_launch", "default_parallel_config", "fitting_chunk",
           "retention_chunkwise_triton", "retention_parallel_triton", "retention_step_triton"]
