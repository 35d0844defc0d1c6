"""Batch fills at fresh matcher states: one call on this thread against two halves at once, one on a helper thread.

The same walk as ``fill_threads.py`` (two sets of 128 matchers, the same random tokens); each step one set is
filled in one call (xgrammar, one thread), the other in two calls of 64 rows at once, the second on a helper
thread of ours with its own one-thread ``BatchGrammarMatcher`` (the call releases the GIL), in alternating order;
their masks must be equal. What the engine's fill would gain from splitting a step's batch over two threads.

    python profiles/structured-output-sim-amd-epyc-zen4-2core/rounds-and-fresh-state-threads/fill_halves.py
"""
import sys, time, threading, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import numpy as np
import xgrammar as xgr
from asyncbatch.sampling.grammar_xgrammar import XGrammarLib
from asyncbatch.sampling.token_bitmask import bitmask_words
from asyncbatch.structured_outputs import StructuredOutputsParams
sys.path.insert(0, str(ROOT / "scripts"))
from bench_structured import SCHEMA
from asyncbatch.model.loader import load_config, load_tokenizer, resolve_model_path  # noqa: E402
path = resolve_model_path(None)
tok = load_tokenizer(path)
V = int(load_config(path)[0].vocab_size)
lib = XGrammarLib(tok, V, tok.eos_token_id)
comp = lib.compile(StructuredOutputsParams(json=SCHEMA))
R = 128
A = [lib.matcher(comp) for _ in range(R)]; B = [lib.matcher(comp) for _ in range(R)]
rng = np.random.default_rng(0)
W = bitmask_words(V)
bmA = np.zeros((R, W), dtype=np.int32); bmB = np.zeros((R, W), dtype=np.int32)
f1 = lib._fill_ffi
f2 = xgr.BatchGrammarMatcher(max_threads=1)._handle.batch_fill_next_token_bitmask
go = threading.Event(); done = threading.Event(); job = [None]
def helper():
    while True:
        go.wait(); go.clear()
        if job[0] is None: return
        h, r = job[0]; f2(h, bmB, r, False); done.set()
th = threading.Thread(target=helper, daemon=True); th.start()
seqs, pars = [], []
lib.fill_batch(A, bmA, list(range(R))); lib.fill_batch(B, bmB, list(range(R)))
for step in range(100):
    toks = [int(rng.choice(np.flatnonzero(np.unpackbits(bmA[r].view(np.uint8), bitorder="little")[:V]))) for r in range(R)]
    lib.accept_batch(A, toks); lib.accept_batch(B, toks)
    hA = [m._h for m in A]; hB = [m._h for m in B]; rows = list(range(R))
    order = step % 2
    def run_seq():
        t = time.perf_counter(); f1(hA, bmA, rows, False); return time.perf_counter() - t
    def run_par():
        t = time.perf_counter(); job[0] = (hB[64:], rows[64:]); go.set(); f1(hB[:64], bmB, rows[:64], False); done.wait(); done.clear(); return time.perf_counter() - t
    if order: s = run_seq(); p = run_par()
    else: p = run_par(); s = run_seq()
    seqs.append(s); pars.append(p)
    assert np.array_equal(bmA, bmB)
seqs = np.array(seqs) * 1e3; pars = np.array(pars) * 1e3
print(f"fresh states: one call median {np.median(seqs):.3f} sum {seqs.sum():.1f}; parallel halves median {np.median(pars):.3f} sum {pars.sum():.1f}")
top = np.argsort(-seqs)[:6]
print("costliest:", [(int(i), round(seqs[i], 3), round(pars[i], 3)) for i in top])
