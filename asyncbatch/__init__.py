"""asyncbatch: continuous batching over a paged KV cache, with the planner one step ahead of the device."""

from asyncbatch.config import EngineConfig
from asyncbatch.llm import LLM
from asyncbatch.outputs import RequestMetrics, RequestOutput, StreamDelta
from asyncbatch.request_handle import EngineDeadError, RequestFailedError
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.sim_config import SimConfig

__all__ = ["LLM", "EngineConfig", "EngineDeadError", "RequestFailedError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SimConfig", "StreamDelta"]
__version__ = "0.1.0"
