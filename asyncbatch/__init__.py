"""asyncbatch: continuous batching over a paged KV cache, with the planner one step ahead of the device."""

from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.errors import EngineDeadError, RequestFailedError
from asyncbatch.llm import LLM
from asyncbatch.outputs import Logprobs, RequestMetrics, RequestOutput, StreamDelta
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "EngineConfig", "EngineDeadError", "Logprobs", "RequestFailedError", "RequestMetrics",
           "RequestOutput", "SamplingParams", "SimConfig", "StreamDelta", "StructuredOutputsParams"]
__version__ = "0.1.0"
