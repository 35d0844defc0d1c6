"""float32: the chosen tokens' logprobs of prompts alone vs in one batch (the default model)."""
import sys
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
threads = int(sys.argv[1])
prompts = [f"Write a short note about {t}." for t in ("rivers", "mountains", "bread", "clocks", "the moon", "bees", "copper", "trains")]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
def lps(o):
    return [e.logprob for e in o.logprobs] if hasattr(o.logprobs, "__iter__") else o.logprobs
with LLM("smollm2-135m", device="cpu", dtype="float32", num_threads=threads, seed=0) as llm:
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
diffs = [max(abs(a - b) for a, b in zip(x.logprobs.logprobs, y.logprobs.logprobs)) for x, y in zip(alone, together)]
same = sum(x.token_ids == y.token_ids for x, y in zip(alone, together))
print(f"threads {threads}: tokens identical {same}/{len(prompts)}; chosen-token logprob max |diff| per prompt: {[f'{d:.1e}' for d in diffs]}")
