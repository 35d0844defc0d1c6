"""xgrammar's fill time for one row at each character position inside the 1 ms benchmark's ``name`` string
(``scripts/bench_structured.py``'s schema, with its ``maxLength`` 12, none, and 64), and after ``"age": `` (outside
any string). One matcher per position, walked there by tokens; the mean of 20 fills of that state, one thread, as
the engine compiles (``any_whitespace=False``).

    python fill_by_position.py
"""
import copy
import glob
import json
import os
import sys
import time
from pathlib import Path

import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from bench_structured import SCHEMA

# The default model's converted copy (scripts/setup_env.sh makes it).
path = next(p for p in glob.glob(os.path.expanduser("~/.cache/asyncbatch/SmolLM2-135M-Instruct*")) if os.path.isdir(p))
tok = AutoTokenizer.from_pretrained(path)
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)


def fill_us(grammar: xgr.CompiledGrammar, text: str, repeats: int = 20) -> float:
    matcher = xgr.GrammarMatcher(grammar)
    for token in tok.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token), text
    start = time.perf_counter()
    for _ in range(repeats):
        matcher.fill_next_token_bitmask(bitmask)
    return (time.perf_counter() - start) / repeats * 1e6


for max_length in (12, None, 64):
    schema = copy.deepcopy(SCHEMA)
    name = schema["items"]["properties"]["name"]
    name.pop("maxLength")
    if max_length is not None:
        name["maxLength"] = max_length
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    inside = [fill_us(grammar, '[{"name": "' + "a" * k) for k in range(12)]
    after_age = fill_us(grammar, '[{"name": "ab", "age": ')
    print(f"maxLength {max_length}: in-string fill us by chars so far {[round(x, 1) for x in inside]} "
          f"| after age: {after_age:.1f}")
