"""Plain vs ngram vs draft_model, one request at a time, side by side in one run (issue 24 part 1).

    PYTHONPATH=$PWD python profiles/speculative-amd-epyc-2core/draft_model_side_by_side.py [--repeats 3]

The default model (SmolLM2-135M-Instruct), float32, 1 torch thread, overlap, greedy, EOS honoured, 96 tokens
at most; two chat prompts of ``scripts/harness/data/speculative/``: ``prose-one-change`` (grounded: the output
copies the prompt) and ``story-lighthouse`` (open). The draft model is the target itself: the only model at
hand that shares its vocabulary (a cut of its first 8 or 16 layers drafted nothing the target accepted), so
the acceptance is the most a draft can have and the cost the most a draft can cost: the figure is the
mechanism's overhead, not a draft model's gain. Engines stay alive, warmed up once; each repeat runs the
three in a rotated order; the table gives medians. Prints a markdown table and the per-run lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from asyncbatch import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = {"grounded": ("grounded", "prose-one-change"), "open": ("open", "story-lighthouse")}
SPECS = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
         "draft_model": {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 4}}


def messages(workload: str, prompt_id: str) -> list[dict]:
    items = json.loads((ROOT / "scripts/harness/data/speculative" / f"{workload}.json").read_text())
    return next(item["messages"] for item in items if item["id"] == prompt_id)


def one_run(llm: LLM, msgs: list[dict], max_tokens: int) -> dict:
    load = os.getloadavg()[0]
    llm.reset_stats()
    out = llm.chat(msgs, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    llm.wait_settled(10.0)
    s = llm.stats()
    m = out.metrics
    n = len(out.token_ids)
    return {"tokens": list(out.token_ids), "decode_tok_s": (n - 1) / (m.finished_time - m.first_token_time),
            "output_tok_s": n / (m.finished_time - m.arrival_time), "steps": s["steps"],
            "device_ms_per_step": s["device_ms_per_step"], "load": load,
            "accept_len": s["spec_decode_mean_acceptance_length"], "accept_rate": s["spec_decode_acceptance_rate"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    engines = {name: LLM(None, device="cpu", dtype="float32", num_threads=1, speculative_config=spec)
               for name, spec in SPECS.items()}
    runs: dict = {(w, s): [] for w in PROMPTS for s in SPECS}
    try:
        for llm in engines.values():  # warm-up
            llm.chat(messages(*PROMPTS["open"]), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        started = time.time()
        names = list(SPECS)
        for rep in range(args.repeats):
            order = names[rep % 3:] + names[:rep % 3]
            for workload, prompt in PROMPTS.items():
                for name in order:
                    r = one_run(engines[name], messages(*prompt), args.max_tokens)
                    runs[(workload, name)].append(r)
                    print(f"rep {rep + 1} {workload:<8} {name:<11} decode {r['decode_tok_s']:5.1f} tok/s, "
                          f"{len(r['tokens'])} tokens, {r['steps']} steps x {r['device_ms_per_step']:.0f} ms, "
                          f"accept len {r['accept_len']:.2f}, load {r['load']:.2f}", flush=True)
        print(f"\n{time.time() - started:.0f} s\n")
    finally:
        for llm in engines.values():
            llm.close()
    print("| prompt | system | decode tok/s | vs plain | output tok/s | steps | device ms/step | acceptance rate "
          "| mean acceptance length | tokens = plain | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload in PROMPTS:
        plain = statistics.median(r["decode_tok_s"] for r in runs[(workload, "plain")])
        for name in SPECS:
            rs = runs[(workload, name)]

            def med(key: str, rs: list[dict] = rs) -> float:
                return statistics.median(r[key] for r in rs)

            same = sum(r["tokens"] == q["tokens"] for r, q in zip(rs, runs[(workload, "plain")]))
            loads = [r["load"] for r in rs]
            print(f"| {workload} | {name} | {med('decode_tok_s'):.1f} | {med('decode_tok_s') / plain:.2f}x "
                  f"| {med('output_tok_s'):.1f} | {med('steps'):.0f} | {med('device_ms_per_step'):.0f} "
                  f"| {med('accept_rate'):.2f} | {med('accept_len'):.2f} | {same} / {len(rs)} "
                  f"| {min(loads):.1f}-{max(loads):.1f} |")


if __name__ == "__main__":
    main()
