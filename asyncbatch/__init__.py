"""asyncbatch: continuous batching over a paged KV cache, with the planner one step ahead of the device.

``LLM`` is imported on first use (PEP 562): it brings torch and transformers (~6 s of CPU on a small machine),
which a process that only drives others does not need, e.g. ``asyncbatch serve --replicas N``'s own process,
which starts Ray and deploys the replicas (they import the engine), or a command that fails on its options.
"""

from typing import TYPE_CHECKING

from asyncbatch.config import EngineConfig, SimConfig
from asyncbatch.errors import EngineDeadError, RequestFailedError
from asyncbatch.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput, StreamDelta
from asyncbatch.sampling_params import SamplingParams
from asyncbatch.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from asyncbatch.llm import LLM

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineDeadError", "Logprobs", "RequestFailedError",
           "RequestMetrics", "RequestOutput", "SamplingParams", "SimConfig", "StreamDelta", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "LLM":
        from asyncbatch.llm import LLM

        return LLM
    raise AttributeError(f"module 'asyncbatch' has no attribute {name!r}")
