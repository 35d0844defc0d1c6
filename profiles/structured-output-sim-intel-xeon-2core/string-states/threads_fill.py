"""128 matchers two characters into the bench's bounded string, filled on one thread, on two Python threads
(64 rows each; xgrammar releases the GIL), and by xgrammar's BatchGrammarMatcher with 1 and 2 threads: wall
milliseconds, median of 20 fills, each variant twice.    python threads_fill.py"""
import json, time, statistics, threading
import xgrammar as xgr
from transformers import AutoTokenizer
from asyncbatch.model.loader import resolve_model_path
V = 49152
tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1, cache_enabled=False)
item = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 12}}}
cg = comp.compile_json_schema(json.dumps(item), any_whitespace=False)
prefix = tok.encode('{"name": "ab', add_special_tokens=False)
R = 128
ms = []
for i in range(R):
    m = xgr.GrammarMatcher(cg)
    for t in prefix: assert m.accept_token(t)
    ms.append(m)
bm = xgr.allocate_token_bitmask(R, V)
def fill(lo, hi):
    for i in range(lo, hi): ms[i].fill_next_token_bitmask(bm, i)
def one():
    fill(0, R)
def two():
    t = threading.Thread(target=fill, args=(0, R // 2)); t.start(); fill(R // 2, R); t.join()
bgm1, bgm2 = xgr.BatchGrammarMatcher(1), xgr.BatchGrammarMatcher(2)
def batch1(): bgm1.batch_fill_next_token_bitmask(ms, bm)
def batch2(): bgm2.batch_fill_next_token_bitmask(ms, bm)
for f in (one, two, batch1, batch2, one, two, batch1, batch2):
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    print(f.__name__, round(statistics.median(ts) * 1e3, 3), "ms for", R, "rows")
