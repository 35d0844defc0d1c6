"""Every step of a speculative engine computes 1 + k tokens per row, drafts or not (scheduler._verify_depth)."""
from asyncbatch import LLM, SamplingParams

msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}, None, {"method": "ngram", "num_speculative_tokens": 4}):
    with LLM(None, device="cpu", dtype="float32", num_threads=1, speculative_config=spec) as llm:
        llm.chat(msgs, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        llm.reset_stats()
        out = llm.chat(msgs, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)[0]
        llm.wait_settled(10.0)
        s = llm.stats()
        print(f"{'ngram' if spec else 'plain'}: {len(out.token_ids)} tokens, {s['steps']} steps, "
              f"{s['spec_decode_num_drafts']} steps with a draft, {s['device_ms_per_step']:.1f} device ms/step")
