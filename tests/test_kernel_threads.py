"""A cpu engine runs its kernels on one OpenMP pool, its device thread's (``executors/kernel_threads.py``).

A second thread with a pool of its own (the thread that built the engine used to be one) makes GNU OpenMP
park its workers between parallel regions whenever the pools hold more threads than the machine has cores,
and every decode step pays for it (1.6x on a 2-core Xeon). Each test runs in a fresh interpreter, the only
way to see which pools a process made, and counts the threads that are not Python's: OpenMP's workers,
OpenBLAS's (counted before the engine starts) and none other, with the tokenizer off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")

_THREAD_SETTINGS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from asyncbatch import LLM, SamplingParams

    def native_threads():
        return len(os.listdir("/proc/self/task")) - threading.active_count()

    threads = int(sys.argv[1])
    torch.set_num_threads(3)  # the caller's own setting, which the engine must leave as it was
    before = native_threads()
    llm = LLM(None, device="cpu", dtype="float32", num_threads=threads, engine_process=False, overlap=True,
              skip_tokenizer_init=True)
    prompts = [[100 + (i * 37 + j) % 5000 for i in range(48)] for j in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0), use_tqdm=False)
    device_threads = llm.executor_info["torch_threads"]
    workers = native_threads() - before
    caller = torch.get_num_threads()
    llm.close()
    print(json.dumps({"workers": workers, "caller": caller, "device_threads": device_threads}))
""")


def _run(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_SETTINGS}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(threads)], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("threads", [2, 3])
def test_one_openmp_pool_the_device_threads(threads: int) -> None:
    result = _run(threads)
    # A pool of n threads adds n - 1 workers to the thread that opens it; a second pool would add more.
    assert result["workers"] == threads - 1, result
    assert result["device_threads"] == threads, result
    assert result["caller"] == 3, result  # the building thread got its own count back


def test_device_thread_runs_on_start_first_and_calls_in_queue_order() -> None:
    import threading

    from asyncbatch.executors.device_thread import DeviceThread

    seen: list[str] = []
    thread = DeviceThread("asyncbatch-test-device", run_step=None,  # type: ignore[arg-type]: no step is submitted
                          on_start=lambda: seen.append(threading.current_thread().name))
    try:
        assert thread.call(lambda: threading.current_thread().name) == "asyncbatch-test-device"
        assert seen == ["asyncbatch-test-device"]
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
        assert thread.call(lambda: 7) == 7  # an error in a call does not end the thread
    finally:
        thread.stop()
    assert not thread.alive
