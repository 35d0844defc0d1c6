# PYTHONPATH=<this folder> TOUCH=1: before the first admission of a burst into an idle engine, read every planner
# array the admission writes (row state, block table, reference counts, free stack), outside the admission's timing.
import os

if os.environ.get("TOUCH"):
    from asyncbatch.engine import admission
    orig = admission.Admitter.admit
    def admit(self, prefill, budget, drained):
        if self.waiting and not self.running:
            r, b = self.rows, self.blocks
            for a in (r.counters, r.int_constants, r.float_constants, r._flags, r.decoding, b.block_table, b.ref,
                      b.num_row_blocks, b._free, b.decode_slot_base):
                a.sum()
        return orig(self, prefill, budget, drained)
    admission.Admitter.admit = admit
