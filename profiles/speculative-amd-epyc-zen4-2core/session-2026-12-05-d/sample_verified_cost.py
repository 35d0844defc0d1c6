"""What a one-request speculative step spends in ``TorchStep.sample_verified`` (sampling every position, accepting
drafts, proposing the next ones), on the device thread of an in-process CPU engine (float32, ngram k drafts, two
grounded prompts, 128 greedy tokens each): the median wall ms of the steps that verified drafts, and, for twenty of
them under torch.profiler, the top-level tensor operations of one step by the function that issued them.

    python profiles/speculative-amd-epyc-zen4-2core/session-2026-12-05-d/sample_verified_cost.py [K]
"""
import collections
import statistics
import sys
import time

sys.path.insert(0, "scripts")
from harness.speculative_workloads import load_workload, prompt_ids
from torch.profiler import ProfilerActivity, profile

from asyncbatch import LLM, SamplingParams
from asyncbatch.executors import torch_executor

k = int(sys.argv[1]) if len(sys.argv) > 1 else 4
original = torch_executor.TorchStep.sample_verified
calls, times, profiles = [0], [], []


def timed(self, meta, step, logits, t_sample):
    calls[0] += 1
    drafting = meta.num_decode and step.verify.width > 1
    if drafting and 40 <= calls[0] < 60:
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
            out = original(self, meta, step, logits, t_sample)
        profiles.append(p)
        return out
    started = time.perf_counter()
    out = original(self, meta, step, logits, t_sample)
    if drafting:
        times.append((time.perf_counter() - started) * 1e3)
    return out


torch_executor.TorchStep.sample_verified = timed
llm = LLM(None, device="cpu", dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": k},
          num_threads=2, seed=0, engine_process=False)
for p in [prompt_ids(llm, item["messages"]) for item in load_workload("grounded")[:2]]:
    llm.generate([p], SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
llm.close()
print(f"sample_verified, steps that verified drafts: median {statistics.median(times):.3f} ms over {len(times)}")


def is_op(event) -> bool:
    return event.name.startswith(("aten::", "mkldnn::"))


if profiles:
    events = [e for e in profiles[len(profiles) // 2].events()
              if is_op(e) and not (e.cpu_parent is not None and is_op(e.cpu_parent))]
    by_caller = collections.Counter()
    for event in events:
        parent = event.cpu_parent
        while parent is not None and ("asyncbatch/" not in parent.name or is_op(parent)):
            parent = parent.cpu_parent
        by_caller[parent.name.split("asyncbatch/")[-1] if parent is not None else "?"] += 1
    print(f"top-level tensor operations in one such step: {len(events)}")
    for caller, n in by_caller.most_common():
        print(f"  {n:4d}  {caller}")
