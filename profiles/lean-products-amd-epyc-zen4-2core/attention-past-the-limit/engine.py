"""The lean attention kernel in the torch ops' steps, end to end: N requests with long prompts decoding together on
the default model, the kernel (``lean_attention``, the default) against torch's decode attention (the kernel
switched off in the child: ``llama.decode_attention_kernel`` returning None), side by side. Each (side, round) is a
child process (the engine in-process), the sides alternating each round; greedy, ``ignore_eos``, the same prompts
on both sides. Prints the median decode step over the steps where every request decodes (each run's median and
their median), decode tokens a second over those steps, and whether the sides' tokens agree.

    python engine.py DTYPE BATCHES CONTEXT ROUNDS
    python engine.py bfloat16 16,32 1024 2
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOKENS = 24


def child(dtype: str, batch: int, context: int, side: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from asyncbatch import LLM, SamplingParams
    from asyncbatch.model import llama

    if side == "torch":
        llama.decode_attention_kernel = lambda *args: None
    with LLM(dtype=dtype, engine_process=False, max_num_seqs=batch, max_model_len=context + TOKENS + 16,
             max_num_batched_tokens=4096) as llm:
        words = llm.tokenizer.decode(list(range(1000, 1000 + context)))  # ~context tokens of the vocabulary
        ids = llm.tokenizer(words)["input_ids"][:context - 8]
        prompts = [{"prompt_token_ids": [100 + i] + ids} for i in range(batch)]
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
        llm.reset_stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        records = llm.timeline.window()
    steady = [r for r in records if r.num_decode == batch and not r.num_prefill]
    span = steady[-1].device_end - steady[0].device_start
    return {"tok_s": sum(r.num_decode for r in steady[1:]) / span if span > 0 else 0.0,
            "step_ms": statistics.median((r.device_end - r.device_start) * 1e3 for r in steady),
            "steps": len(steady), "tokens": [o.token_ids for o in outs]}


def main(dtype: str, batches: list[int], context: int, rounds: int) -> None:
    for batch in batches:
        res: dict[str, list[dict]] = {"torch": [], "kernel": []}
        for r in range(rounds):
            for side in ("torch", "kernel") if r % 2 == 0 else ("kernel", "torch"):
                text = subprocess.run([sys.executable, __file__, "child", dtype, str(batch), str(context), side],
                                      capture_output=True, text=True, check=True).stdout
                res[side].append(json.loads(text.strip().splitlines()[-1]))
        a, b = (statistics.median(x["step_ms"] for x in res[s]) for s in ("torch", "kernel"))
        ta, tb = (statistics.median(x["tok_s"] for x in res[s]) for s in ("torch", "kernel"))
        same = sum(x == y for x, y in zip(res["torch"][0]["tokens"], res["kernel"][0]["tokens"]))
        runs = {s: ", ".join(f"{x['step_ms']:.1f}" for x in res[s]) for s in res}
        print(f"{dtype} batch {batch:2d} context ~{context}: decode step ms (median of {rounds} runs' medians, "
              f"{res['kernel'][0]['steps']} steps a run) torch attention {a:7.1f} [{runs['torch']}], kernel {b:7.1f} "
              f"[{runs['kernel']}], ratio {b / a:.3f}; decode tok/s {ta:6.1f} -> {tb:6.1f}; requests with the same "
              f"tokens on both sides: {same} of {batch}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
    else:
        main(sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]))
