"""asyncbatch: continuous batching over a paged KV cache, with the planner one step ahead of the device."""

from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.errors import EngineDeadError, RequestFailedError
from asyncbatch.llm import LLM
from asyncbatch.outputs import RequestMetrics, RequestOutput, StreamDelta
from asyncbatch.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "EngineDeadError", "RequestFailedError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SimConfig", "StreamDelta"]
__version__ = "0.1.0"
