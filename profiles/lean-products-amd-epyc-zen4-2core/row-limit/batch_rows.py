"""The lean step's row limit end to end: N requests decoding together on the default model, with the limit this
CPU gets (``lean_step.lean_max_rows``) against the default five rows (``LEAN_MAX_ROWS``), side by side. Each
(limit, round) is a child process (the engine in-process, ``engine_process=False``, so that the limit set before
the model loads is the one it runs with), the two sides alternating each round; greedy, ``ignore_eos``, the same
prompts on both sides. Prints the median decode step time over the steps where every request decodes (each
run's median, and their median), whether each side repeats its tokens, and how many requests' tokens agree
between the sides (bfloat16 parts at near-ties between the lean step's kernels and the torch ops').

    python batch_rows.py DTYPE BATCHES ROUNDS
    python batch_rows.py bfloat16 6,8,10 3
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOKENS = 48


def child(dtype: str, batch: int, limit: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from asyncbatch import LLM, SamplingParams
    from asyncbatch.model import lean_step

    if limit == "default":
        lean_step.MEASURED_MAX_ROWS = {torch.float32: lean_step.LEAN_MAX_ROWS, torch.bfloat16: lean_step.LEAN_MAX_ROWS}
    prompts = [f"Write a short story about the number {i}, in plain words." for i in range(batch)]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(dtype=dtype, engine_process=False, max_num_seqs=batch) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        llm.reset_stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        records = llm.timeline.window()
        rows = llm.executor_info["lean_max_rows"]
    steady = [r for r in records if r.num_decode == batch and not r.num_prefill]
    span = steady[-1].device_end - steady[0].device_start
    return {"tok_s": sum(r.num_decode for r in steady[1:]) / span if span > 0 else 0.0,
            "step_ms": statistics.median((r.device_end - r.device_start) * 1e3 for r in steady),
            "tokens": [o.token_ids for o in outs], "lean_max_rows": rows}


def main(dtype: str, batches: list[int], rounds: int) -> None:
    for batch in batches:
        res: dict[str, list[dict]] = {"default": [], "measured": []}
        for r in range(rounds):
            for side in ("default", "measured") if r % 2 == 0 else ("measured", "default"):
                text = subprocess.run([sys.executable, __file__, "child", dtype, str(batch), side],
                                      capture_output=True, text=True, check=True).stdout
                res[side].append(json.loads(text.strip().splitlines()[-1]))
        a = statistics.median(x["step_ms"] for x in res["default"])
        b = statistics.median(x["step_ms"] for x in res["measured"])
        steady = all(x["tokens"] == res[side][0]["tokens"] for side in res for x in res[side])
        across = sum(a == b for a, b in zip(res["default"][0]["tokens"], res["measured"][0]["tokens"]))
        runs = {side: ", ".join(f"{x['step_ms']:.2f}" for x in res[side]) for side in res}
        print(f"{dtype} batch {batch:2d}: step ms, median of {rounds} runs' medians: limit 5 {a:6.2f} "
              f"[{runs['default']}], limit {res['measured'][0]['lean_max_rows']} {b:6.2f} [{runs['measured']}], "
              f"ratio {b / a:.3f}; each side's runs the same tokens: {steady}; requests with the same tokens on both "
              f"sides: {across} of {batch}", flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
    else:
        main(sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]))
