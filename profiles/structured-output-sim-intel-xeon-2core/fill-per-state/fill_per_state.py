"""Mask fill time per row at each position of ``[{"name": "abcdefghij`` under bench_structured's schema (64
matchers at once, the default model's tokenizer), for xgrammar and llguidance, with the name's ``maxLength``
and without it: which grammar states cost the 1 ms lockstep run its idle (issue 23).

    python profiles/structured-output-sim-intel-xeon-2core/fill-per-state/fill_per_state.py   # repository root
"""
import time, json, statistics, copy
from asyncbatch.model.loader import load_tokenizer, resolve_model_path
from asyncbatch.sampling.grammar import GrammarCompiler, allocate_bitmask
from asyncbatch.structured_outputs import StructuredOutputsParams
import sys
sys.path.insert(0, "scripts")
from bench_structured import SCHEMA
tok = load_tokenizer(resolve_model_path(None))
V = 49152
unb = copy.deepcopy(SCHEMA); del unb["items"]["properties"]["name"]["maxLength"]
text = '[{"name": "abcdefghij'
ids = tok.encode(text, add_special_tokens=False)
print(len(ids), [tok.decode([i]) for i in ids])
for backend in ("xgrammar", "llguidance"):
    comp = GrammarCompiler(tok, V, tok.eos_token_id, backend=backend)
    for label, schema in (("maxLength12", SCHEMA), ("unbounded", unb)):
        params = StructuredOutputsParams(json=schema)
        ms = [comp.matcher(params) for _ in range(64)]
        bm = allocate_bitmask(64, V)
        rows = list(range(64))
        out = []
        for k, t in enumerate(ids):
            comp.fill_bitmasks(ms, bm, rows)
            t0 = time.perf_counter(); 
            for _ in range(3): comp.fill_bitmasks(ms, bm, rows)
            out.append((time.perf_counter() - t0) / 3 / 64 * 1e6)
            assert all(comp.accept_tokens(ms, [t] * 64))
        print(backend, label, "us/row per position:", [round(x, 1) for x in out])
