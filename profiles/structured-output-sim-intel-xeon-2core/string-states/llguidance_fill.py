"""llguidance's mask inside the bench's bounded string (the other grammar backend), for comparison with
string_fill.py: a matcher's repeated mask in one state (its own cache), then the first mask in each state of
fresh copies of a compiled matcher, as the engine's rows are. Microseconds.    python llguidance_fill.py"""
import json, time, statistics
import numpy as np
import llguidance, llguidance.hf
from transformers import AutoTokenizer
from asyncbatch.model.loader import resolve_model_path
V = 49152
tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
lt = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=tok.eos_token_id)
item = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(item), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
base = llguidance.LLMatcher(lt, g, log_level=0)
buf = np.zeros((V // 32,), dtype=np.int32)
base.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
prefix = tok.encode('{"name": "', add_special_tokens=False); a = tok.encode("a", add_special_tokens=False)[0]
for k in (0, 2, 4, 6, 8, 10, 12):
    m = base.deep_copy()
    for t in prefix + [a] * k: assert m.consume_token(t), k
    ts = []
    for _ in range(30):
        t0 = time.perf_counter_ns(); m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes); ts.append(time.perf_counter_ns() - t0)
    print(k, round(statistics.median(ts) / 1e3, 1), "us", int(np.unpackbits(buf.view(np.uint8)).sum()), "allowed")
m = base.deep_copy()
for t in tok.encode('{"name": "ab", "age": ', add_special_tokens=False): assert m.consume_token(t)
ts = []
for _ in range(30):
    t0 = time.perf_counter_ns(); m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes); ts.append(time.perf_counter_ns() - t0)
print("after string", round(statistics.median(ts) / 1e3, 1), "us")
print("first compute per state, fresh copies of a base that computed only the start mask")
base2 = llguidance.LLMatcher(lt, g, log_level=0)
base2.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
for k in (0, 2, 4, 6, 8, 10):
    firsts = []
    for rep in range(3):
        m = base2.deep_copy()
        for t in prefix + [a] * k: assert m.consume_token(t), k
        t0 = time.perf_counter_ns(); m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes); firsts.append((time.perf_counter_ns() - t0) / 1e3)
    print(k, [round(x, 1) for x in firsts])
