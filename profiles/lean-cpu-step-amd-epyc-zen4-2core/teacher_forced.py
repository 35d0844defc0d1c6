"""How far each engine's next-token distribution is from the float32 torch ops', teacher-forced: the eight
one-request prompts of ``bench_one_request.py`` (four grounded, four open chat), each prefilled and then decoded
one row at a time along the float32 torch model's own greedy continuation (128 tokens), so every engine sees the
same tokens and a near-tie cannot send one down another path. Per engine (float32 / bfloat16, torch ops / lean
step, ``ASYNCBATCH_CPU_LEAN_STEP`` read at load): how often its argmax is the reference's, and the mean and largest
|logprob difference| of the reference's chosen token.

    PYTHONPATH=$PWD:$PWD/scripts python profiles/lean-cpu-step-amd-epyc-zen4-2core/teacher_forced.py
"""
import os

import torch
from harness.speculative_workloads import WORKLOADS, load_workload, prompt_ids, spread

from asyncbatch import LLM
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.lean_kernels import LEAN_STEP_ENV
from asyncbatch.model.loader import load_model, resolve_model_path

BLOCK, STEPS = 16, 128
torch.set_num_threads(2)
llm = LLM(None, device="cpu", dtype="float32", num_threads=2, seed=0)
prompts = [p for w in WORKLOADS for p in spread([prompt_ids(llm, d["messages"]) for d in load_workload(w)], 4)]
llm.close()
path = resolve_model_path(None)


def model(dtype: torch.dtype, lean: str):
    os.environ[LEAN_STEP_ENV] = lean
    try:
        return load_model(path, dtype, torch.device("cpu"), max_positions=2048)
    finally:
        os.environ.pop(LEAN_STEP_ENV, None)


def logprobs(m, prompt: list[int], forced: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    """[STEPS, vocab] float32 log-probabilities after the prompt and after each forced token (greedy when None)."""
    n = len(prompt)
    table = torch.arange(1, 2 + (n + STEPS) // BLOCK)
    kv = m.new_kv_caches(len(table) + 1, BLOCK)
    out, tokens = [], []
    with torch.inference_mode():
        pos = torch.arange(n)
        logits = m(ForwardBatch(torch.tensor(prompt), pos, table[pos // BLOCK] * BLOCK + pos % BLOCK, 0,
                                torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                [PrefillRow(0, n, n, table)], torch.tensor([n - 1])), kv)
        for i in range(STEPS):
            out.append(torch.log_softmax(logits[0].float(), -1))
            tok = int(out[-1].argmax()) if forced is None else forced[i]
            tokens.append(tok)
            p = n + i
            logits = m(ForwardBatch(torch.tensor([tok]), torch.tensor([p]), table[p // BLOCK:p // BLOCK + 1] * BLOCK
                                    + p % BLOCK, 1, table[None, :], torch.tensor([p + 1]), [], torch.arange(1)), kv)
    return torch.stack(out), tokens


reference = model(torch.float32, "0")
refs = [logprobs(reference, p, None) for p in prompts]
print(f"teacher-forced along the float32 torch ops' greedy tokens: {len(prompts)} prompts x {STEPS} positions")
for name, dtype, lean in (("float32 lean", torch.float32, "1"), ("bfloat16 torch", torch.bfloat16, "0"),
                          ("bfloat16 lean", torch.bfloat16, "1")):
    m = model(dtype, lean)
    agree, diffs = 0, []
    for p, (ref_lp, ref_tokens) in zip(prompts, refs):
        lp, _ = logprobs(m, p, ref_tokens)
        agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        chosen = torch.tensor(ref_tokens)[:, None]
        diffs.append((lp.gather(1, chosen) - ref_lp.gather(1, chosen)).abs().flatten())
    d = torch.cat(diffs)
    print(f"{name:15s} lean kernels {m.lean_kernels is not None!s:5s}  top-1 agreement {agree / d.numel():.4f}  "
          f"|dlogprob| mean {d.mean():.2e}  max {d.max():.2e}")
