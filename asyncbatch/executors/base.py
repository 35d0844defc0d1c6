"""The executor interface shared by every device backend.

``launch`` takes a written staging buffer and returns at once with a handle; the
step runs on the device (a CUDA stream, or the device thread of the ``cpu`` and
``sim`` backends). ``wait`` blocks until the step's sampled tokens are on the
host. Steps execute in launch order, which is what makes block reuse and the
device token buffer safe: step N+1 reads the tokens step N wrote.

Contract per step:
  * the staging's fence fires once the staging's contents have been copied out;
  * decode rows take their input id from the device token buffer at their
    token row; every sampled row writes its token there;
  * the handle's result carries device start/end clock readings
    (``time.perf_counter`` seconds) for the timeline;
  * a step with a ``GrammarMask`` may run its forward before the mask is
    filled, never its sampling (``masks_ready`` is called once it is).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from asyncbatch.engine.step_contract import StepMeta
from asyncbatch.sampling.logprobs import TokenLogprobs


@dataclass(slots=True)
class StepResult:
    step_id: int
    token_ids: np.ndarray  # [R] int64, one per sampled row, in row order
    finite: np.ndarray  # [R] bool, False where the row's logits were NaN/inf
    device_start: float
    device_end: float
    h2d_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    d2h_ms: float = 0.0
    # The device sat idle inside the step, its forward done, waiting for the host's grammar mask
    # (``GrammarMask``): not busy time. ``mask_wait_start`` is on the timeline's clock.
    mask_wait_ms: float = 0.0
    mask_wait_start: float = 0.0
    logprobs: TokenLogprobs | None = None  # numpy, one entry per ``SamplerExtras.logprobs`` row
    prompt_logprobs: TokenLogprobs | None = None  # numpy, one entry per ``PromptLogprobRows`` position
    # Speculative engines: ``token_ids`` is ``[R, 1 + depth]`` and row ``i`` emitted its first ``num_emitted[i]``;
    # ``spec_counts``: rows that verified drafts, draft tokens, accepted drafts (the metrics).
    num_emitted: np.ndarray | None = None
    spec_counts: tuple[int, int, int] = (0, 0, 0)
    # Speculative engines whose drafts are made at the end of a step (n-gram): the drafts each of the step's
    # grammar rows (``GrammarMask`` order) checks in its next verify step, ``[G, k]`` of which the first
    # ``grammar_num_drafts`` ``[G]`` count; the host fills that step's masks along them.
    grammar_drafts: np.ndarray | None = None
    grammar_num_drafts: np.ndarray | None = None


class StepHandle:
    """Completion of one launched step; carries its result or the device's exception."""

    __slots__ = ("_awaited", "_done", "_error", "_result", "_waiter", "launch_time", "step_id")

    def __init__(self, step_id: int, launch_time: float) -> None:
        self.step_id = step_id
        self.launch_time = launch_time
        self._done = threading.Event()
        self._awaited = threading.Event()  # the planner blocks on this step now (``ThreadedExecutor.wait``)
        self._result: StepResult | None = None
        self._error: BaseException | None = None
        self._waiter = None  # backend-specific completion (a CUDA event and a finisher; sim: the modelled end)

    def set_result(self, result: StepResult) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def mark_awaited(self) -> None:
        """The planner is about to block on this step: until the result, it needs no interpreter time."""
        self._awaited.set()

    def wait_awaited(self, timeout: float) -> bool:
        """Wait until ``mark_awaited`` (at most ``timeout`` seconds)."""
        return self._awaited.wait(timeout)

    def is_done(self) -> bool:
        """Whether the result (or the error) is in: ``result`` would not block."""
        return self._done.is_set()

    def result(self) -> StepResult:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Executor(ABC):
    name: str = "abstract"
    simulated: bool = False

    @abstractmethod
    def launch(self, meta: StepMeta) -> StepHandle: ...

    @abstractmethod
    def wait(self, handle: StepHandle) -> StepResult: ...

    def is_done(self, handle: StepHandle) -> bool:
        """Whether ``wait(handle)`` would return without blocking (never blocks; a backend that cannot tell says
        False). The planner fills the time until then with work no step needs yet (``EngineCore``)."""
        return handle.is_done()

    def masks_ready(self, handle: StepHandle) -> None:
        """The step's ``GrammarMask`` is filled: its sampling may run. Threaded backends wait on the mask's
        own event, so only an executor that launches from the planner thread (``cuda``) needs this."""

    def close(self) -> None:
        """Release device resources and stop any device thread."""

    def describe(self) -> dict:
        return {"backend": self.name, "simulated": self.simulated}
