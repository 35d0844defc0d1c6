"""``SimExecutor.is_done`` answers as a device's completion event would: the step is done once its modelled end
has passed, whether or not the thread that delivers its result has had the interpreter yet (the release slice
of ``EngineCore`` asks it before every piece of work it does while the step runs)."""

from __future__ import annotations

import time

from sim_steps import one_row_step

from asyncbatch.config import SimConfig
from asyncbatch.engine.host_staging import StagingPair
from asyncbatch.executors.sim_executor import SimExecutor


def test_a_step_is_done_at_its_modelled_end_before_its_result_is_delivered() -> None:
    sim = SimConfig(step_fixed_ms=150.0, per_token_us=0.0, per_context_token_ns=0.0)
    executor = SimExecutor(sim, vocab_size=1000, eos_token_id=2, max_num_seqs=4)
    delivering = executor._thread._complete
    # The thread that delivers results is held back for 0.3 s past the step's end (as when it waits for the GIL).
    executor._thread._complete = lambda step, handle: (time.sleep(0.3), delivering(step, handle))
    try:
        staging = StagingPair(64, 4, 8, pinned=False).next_buffer()
        handle = executor.launch(one_row_step(staging))
        launched = time.perf_counter()
        assert not executor.is_done(handle)  # 150 ms to go
        while not executor.is_done(handle):
            time.sleep(0.002)
        done_at = time.perf_counter()
        assert done_at - launched >= 0.15 - 0.005  # not before the modelled end
        assert not handle.is_done()  # the result is not delivered yet
        result = executor.wait(handle)
        assert result.step_id == 1 and abs((result.device_end - result.device_start) - 0.15) < 1e-6
        assert result.device_end <= done_at
    finally:
        executor.close()
