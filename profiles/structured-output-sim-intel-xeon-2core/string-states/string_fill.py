"""xgrammar's mask time for one row at each position inside a bounded JSON string, against other states.

The benchmark's costly steps (bench_structured's ten idlest) are those where its 128 grammar rows are inside
the ``name`` string (``maxLength: 12``). This fills one matcher's bitmask (``fill_next_token_bitmask``, one
thread, as the engine's batch fill does per row) at k = 0, 2, .., 12 characters into that string, in three
grammars: the bench's schema as xgrammar compiles it (``{0, 12}`` repetition), the same with the repetition
written as nested optionals, and an unbounded string (``*``); and, for scale, after the string (the next key).
Tokenizer: the default model's (SmolLM2-135M-Instruct, vocabulary 49,152). Median of 30 fills, microseconds,
and how many tokens the mask allows.

    python string_fill.py
"""

import json
import statistics
import time

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

from asyncbatch.model.loader import resolve_model_path

V = 49152
N = 12
tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1, cache_enabled=False)
item = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": N}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
base = str(xgr.Grammar.from_json_schema(json.dumps(item), any_whitespace=False))
rep = next(line.split("::=")[1].strip() for line in base.splitlines() if f"{{0, {N}}}" in line)
chars = rep.split()[1].split("{")[0]  # the repetition's character rule
nested = "\n".join([f'r{k} ::= "" | ({chars} r{k - 1})' for k in range(N, 0, -1)] + ['r0 ::= ""'])
grammars = {
    "schema ({0, 12})": comp.compile_json_schema(json.dumps(item), any_whitespace=False),
    "nested optionals": comp.compile_grammar(base.replace(f"{chars}{{0, {N}}}", f"r{N}") + "\n" + nested),
    "unbounded (*)": comp.compile_grammar(base.replace(f"{chars}{{0, {N}}}", f"{chars}*")),
}
prefix = tok.encode('{"name": "', add_special_tokens=False)
a = tok.encode("a", add_special_tokens=False)[0]
bitmask = xgr.allocate_token_bitmask(1, V)


def fill_us(matcher) -> tuple[float, int]:
    times = []
    for _ in range(30):
        t0 = time.perf_counter_ns()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter_ns() - t0)
    allowed = int(np.unpackbits(bitmask.numpy().view(np.uint8)).sum())
    return statistics.median(times) / 1e3, allowed


for name, compiled in grammars.items():
    cells = []
    for k in range(0, N + 1, 2):
        m = xgr.GrammarMatcher(compiled)
        for t in prefix + [a] * k:
            assert m.accept_token(t), (name, k)
        us, allowed = fill_us(m)
        cells.append(f"k={k}: {us:.1f} us ({allowed})")
    print(f"{name:18s} " + ", ".join(cells))
m = xgr.GrammarMatcher(grammars["schema ({0, 12})"])
for t in tok.encode('{"name": "ab", "age": ', add_special_tokens=False):
    assert m.accept_token(t)
us, allowed = fill_us(m)
print(f"after the string, before the age's digits: {us:.1f} us ({allowed})")
