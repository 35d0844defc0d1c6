"""OutputProcessor.process on 1,024 live token_only rows (text ids kept, EOS hidden), steady steps: us per row.
Run from the repository root: python <this file> text|ids. The detokenizer is an unconstructed IncrementalDetokenizer:
only its type matters on this path (no request finishes here, so nothing is decoded)."""
import gc, sys, time, statistics
import numpy as np
from transformers import AutoTokenizer
from asyncbatch.frontend.output_processor import OutputProcessor
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer, NullDetokenizer
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.outputs import RequestMetrics
from asyncbatch.engine.messages import StepOutputs
from asyncbatch.profiling.timeline import Timeline
text = sys.argv[1] == "text"
N = 1024
class Tok:  # minimal stand-in: IncrementalDetokenizer is only constructed, its decode never runs on the fast path
    pass
def det():
    if not text:
        return NullDetokenizer()
    d = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
    return d
handles = {}
for seq in range(N):
    handles[seq] = RequestHandle(seq, f"r{seq}", None, [1, 2, 3], det(), StopStringMatcher([], False), RequestMetrics(0.0))
tl = Timeline()
op = OutputProcessor(handles, tl, frozenset({2}), lambda m: None, False)
seqs = np.arange(N, dtype=np.int64)
rng = np.random.default_rng(0)
empty = np.zeros(0, dtype=np.int64)
times = []
gc.freeze()
for step in range(200):
    toks = rng.integers(3, 30000, N)
    out = StepOutputs(step, seqs, toks, np.zeros(N, dtype=np.int8), empty, empty.astype(np.int8), empty, None)
    t = time.thread_time_ns(); op.process(out); times.append(time.thread_time_ns() - t)
print(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", f"us per row: median {statistics.median(times)/1e3/N:.3f}, best {min(times)/1e3/N:.3f}")
