"""Where a live engine's admission steps spend the planner's CPU: 256 requests of 32-token prompts at once, 100-token
outputs, ``sim`` at 1 ms steps, the default token budget (so ~60 are admitted a step), the engine core in this
process so that its functions can be wrapped (``burst_workload.py``). Per admission
step: requests admitted, and per request the decision pass (``Admitter.admit`` less ``_apply``), ``_apply`` (the
array side) and ``write_prefill`` (the staging rows), in the planner thread's CPU time. Three runs.

    PYTHONPATH=<tree> python in_engine_parts.py
"""

import time

from asyncbatch.engine import admission, step_metadata

current: dict = {}
steps: list[dict] = []


def _wrap_admit(admit):
    def wrapped(self, *args, **kwargs):
        before, start = self.num_admissions, time.thread_time_ns()
        result = admit(self, *args, **kwargs)
        if self.num_admissions > before:
            current.update(n=self.num_admissions - before, admit=time.thread_time_ns() - start)
        return result
    return wrapped


def _wrap_apply(apply):
    def wrapped(self, *args, **kwargs):
        start = time.thread_time_ns()
        result = apply(self, *args, **kwargs)
        current["apply"] = current.get("apply", 0) + time.thread_time_ns() - start
        return result
    return wrapped


def _wrap_write(write):
    def wrapped(plan, *args, **kwargs):
        start = time.thread_time_ns()
        result = write(plan, *args, **kwargs)
        if plan.num_admitted and "n" in current:
            steps.append({**current, "write": time.thread_time_ns() - start})
        current.clear()
        return result
    return wrapped


admission.Admitter.admit = _wrap_admit(admission.Admitter.admit)
admission.Admitter._apply = _wrap_apply(admission.Admitter._apply)
step_metadata.write_prefill = _wrap_write(step_metadata.write_prefill)

from burst_workload import run_burst


def main() -> None:
    for run in range(3):
        run_burst(run, steps.clear)
        for s in steps:
            n = s["n"]
            print(f"run {run}: admitted {n:3}  us a request: decide {(s['admit'] - s['apply']) / 1e3 / n:5.2f}  "
                  f"apply {s['apply'] / 1e3 / n:5.2f}  write_prefill {s['write'] / 1e3 / n:5.2f}  "
                  f"all {(s['admit'] + s['write']) / 1e3 / n:5.2f}")


if __name__ == "__main__":
    main()
