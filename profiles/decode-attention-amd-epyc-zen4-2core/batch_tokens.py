"""float32 greedy tokens of prompts alone vs in one batch, num_threads 2 (the default model)."""
import sys
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
threads = int(sys.argv[1])
prompts = [f"Write a short note about {t}." for t in ("rivers", "mountains", "bread", "clocks", "the moon", "bees",
           "copper", "trains", "chess", "tea", "glass", "owls")]
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
with LLM("smollm2-135m", device="cpu", dtype="float32", num_threads=threads, seed=0) as llm:
    together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
same = sum(a == b for a, b in zip(alone, together))
print(f"threads {threads}: {same}/{len(prompts)} identical; first divergences:",
      [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(alone, together) if a != b])
