"""OutputProcessor.process on N streamed rows with the default tokenizer (its tokenizer.json from the model cache): us
per row, and where it goes. Run from the repository root: python <this file> 256 stops|nostops [profile]."""
import gc, sys, time, statistics, queue, cProfile, pstats
import numpy as np
from tokenizers import Tokenizer
from asyncbatch.frontend.output_processor import OutputProcessor
from asyncbatch.frontend.request_handle import RequestHandle
from asyncbatch.frontend.detokenizer import IncrementalDetokenizer
from asyncbatch.frontend.stop_strings import StopStringMatcher
from asyncbatch.outputs import RequestMetrics
from asyncbatch.engine.messages import StepOutputs
from asyncbatch.profiling.timeline import Timeline
import glob, os
tk = Tokenizer.from_file(glob.glob(os.path.expanduser("~/.cache/asyncbatch/SmolLM2*/tokenizer.json"))[0])
N = int(sys.argv[1]); stops = sys.argv[2] == "stops"
handles = {}
for seq in range(N):
    handles[seq] = RequestHandle(seq, f"r{seq}", None, [1, 2, 3], IncrementalDetokenizer(tk, [1, 2, 3]),
                                 StopStringMatcher(["The end"] if stops else [], False), RequestMetrics(0.0),
                                 streaming=True, deltas=queue.SimpleQueue())
op = OutputProcessor(handles, Timeline(), frozenset({2}), lambda m: None, False)
seqs = np.arange(N, dtype=np.int64); rng = np.random.default_rng(0)
empty = np.zeros(0, dtype=np.int64); times = []
pr = cProfile.Profile()
gc.freeze()
for step in range(100):
    toks = rng.integers(100, 20000, N)
    out = StepOutputs(step, seqs, toks, np.zeros(N, dtype=np.int8), empty, empty.astype(np.int8), empty, None)
    if step == 50 and len(sys.argv) > 3: pr.enable()
    t = time.thread_time_ns(); op.process(out); times.append(time.thread_time_ns() - t)
    if step == 60: pr.disable()
    for h in handles.values():
        while not h.deltas.empty(): h.deltas.get_nowait()
print(sys.argv[1:3], f"us per row: median {statistics.median(times)/1e3/N:.2f}")
if len(sys.argv) > 3: pstats.Stats(pr).sort_stats("tottime").print_stats(12)
