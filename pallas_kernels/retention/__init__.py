"""RetNet retention kernels (Triton-lowered Pallas): parallel, chunkwise and
recurrent-step forms, forward and backward."""

from jattn.kernels.retention.config import (MIN_CHUNK, ChunkwiseConfig, default_chunkwise_config,
                                            default_parallel_config, fitting_chunk)
from jattn.kernels.retention.triton_chunkwise import (retention_chunkwise_backward,
                                                      retention_chunkwise_forward)
from jattn.kernels.retention.triton_parallel import (retention_parallel_backward,
                                                     retention_parallel_forward)
from jattn.kernels.retention.triton_recurrent import (retention_step_backward,
                                                      retention_step_forward)

__all__ = ["MIN_CHUNK", "ChunkwiseConfig", "default_chunkwise_config", "default_parallel_config",
           "fitting_chunk", "retention_chunkwise_backward", "retention_chunkwise_forward",
           "retention_parallel_backward", "retention_parallel_forward",
           "retention_step_backward", "retention_step_forward"]
