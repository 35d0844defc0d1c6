"""Batch fills at fresh matcher states: xgrammar's ``BatchGrammarMatcher`` with one thread against ``T`` threads.

Two sets of ``R`` matchers of the benchmark's schema walk the same random path (tokens drawn uniformly from the
first set's mask, as the sim's random logits do); each step both sets are filled once, at the state the step's
token left them in (a fresh state, as in the engine: every step fills each matcher once), one with each batch
matcher, in alternating order; their masks must be equal. Prints each side's median fill and the ratio of sums.

    python profiles/structured-output-sim-amd-epyc-zen4-2core/rounds-and-fresh-state-threads/fill_threads.py R T [STEPS]
"""
import sys, time, statistics
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
R = int(sys.argv[1]); T = int(sys.argv[2]); STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 60
from asyncbatch.model.loader import load_config, load_tokenizer, resolve_model_path  # noqa: E402
path = resolve_model_path(None)
tok = load_tokenizer(path)
V = int(load_config(path)[0].vocab_size)
lib = XGrammarLib(tok, V, tok.eos_token_id)
comp = lib.compile(StructuredOutputsParams(json=SCHEMA))
A = [lib.matcher(comp) for _ in range(R)]; B = [lib.matcher(comp) for _ in range(R)]
rng = np.random.default_rng(0)
W = bitmask_words(V)
bmA = np.zeros((R, W), dtype=np.int32); bmB = np.zeros((R, W), dtype=np.int32)
one = xgr.BatchGrammarMatcher(max_threads=1)._handle.batch_fill_next_token_bitmask
many = xgr.BatchGrammarMatcher(max_threads=T)._handle.batch_fill_next_token_bitmask
rows = list(range(R))
ta, tb = [], []
lib.fill_batch(A, bmA, rows); lib.fill_batch(B, bmB, rows)
for step in range(STEPS):
    toks = [int(rng.choice(np.flatnonzero(np.unpackbits(bmA[r].view(np.uint8), bitorder="little")[:V]))) for r in range(R)]
    lib.accept_batch(A, toks); lib.accept_batch(B, toks)
    hA = [m._h for m in A]; hB = [m._h for m in B]
    for first in ((0, 1) if step % 2 else (1, 0)):
        t = time.perf_counter()
        (one(hA, bmA, rows, False) if first == 0 else many(hB, bmB, rows, False))
        (ta if first == 0 else tb).append(time.perf_counter() - t)
    assert np.array_equal(bmA, bmB)
ta = np.array(ta) * 1e3; tb = np.array(tb) * 1e3
print(f"rows {R}: 1 thread median {np.median(ta):.3f} ms (sum {ta.sum():.1f}); {T} threads median {np.median(tb):.3f} ms (sum {tb.sum():.1f}); ratio of sums {tb.sum()/ta.sum():.2f}")
