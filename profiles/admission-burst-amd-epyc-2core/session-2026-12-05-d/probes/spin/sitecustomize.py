# PYTHONPATH=<this folder> TOUCH=<ms>: spin that long before the first admission of a burst into an idle engine.
import os
import time

if os.environ.get("TOUCH"):
    from asyncbatch.engine import admission
    orig = admission.Admitter.admit
    def admit(self, prefill, budget, drained):
        if self.waiting and not self.running:
            end = time.perf_counter() + float(os.environ["TOUCH"]) * 1e-3
            while time.perf_counter() < end:
                pass
        return orig(self, prefill, budget, drained)
    admission.Admitter.admit = admit
