#!/usr/bin/env python
"""One request at a time: engine settings beside llama.cpp, side by side in one run (issue 24's one-request goals).

The one-request prompts of ``bench_speculative.py``'s workloads (``--single-prompts`` of each, one after the
other, greedy, ``--max-tokens``, EOS honoured) through one engine per ``--configs`` entry (speculation against
plain decoding at 1 and 32 requests is ``bench_speculative.py``'s subject), then llama.cpp on the same token
ids when llama-cpp-python imports. A config is ``dtype[+quantization][+compiled][+ngram[K]]``:
``float32``, ``bfloat16``, ``float32+w8a8``, ``float32+w8a8+compiled`` (``compile_decode=True``),
``bfloat16+nofp16kernel`` (its one- and two-row steps through oneDNN, not fbgemm's float16-weight kernel:
``ASYNCBATCH_BF16_FP16_KERNEL=0`` for that engine, ``model/fp16_kernel.py``), ``+nolean`` (its small decode
steps through torch's ops, not the lean CPU step: ``ASYNCBATCH_CPU_LEAN_STEP=0``, ``model/lean_step.py``),
``+noleanproducts`` (the lean step with each linear's own product, not ``lean_gemv.c``'s:
``ASYNCBATCH_CPU_LEAN_PRODUCTS=0``); ``+ngram`` adds
n-gram speculation with ``SpeculativeConfig``'s defaults, ``+ngram6`` with ``num_speculative_tokens=6`` (its
tokens are checked against the same config without it, and its mean acceptance length is reported). Every
engine is built and warmed up first and stays alive; each repeat runs the configs in turn (the order reversed
every other repeat). Figures: decode tok/s ((tokens - 1) / (finish - first token), summed over the prompts),
medians of ``--repeats``, and whether each config's greedy tokens equal the first config's.

    python scripts/bench_one_request.py --out /tmp/one_request
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from unittest.mock import patch

from bench_speculative import llamacpp_single
from harness.common import log
from harness.common import parser as script_parser
from harness.speculative_workloads import WORKLOADS, load_workload, prompt_ids, spread

from asyncbatch import LLM, SamplingParams
from asyncbatch.model.fp16_kernel import FP16_KERNEL_ENV
from asyncbatch.model.lean_kernels import LEAN_PRODUCTS_ENV, LEAN_STEP_ENV
from asyncbatch.profiling.host_info import cpu_name, git_commit


def _is_ngram(flag: str) -> bool:
    """``ngram`` or ``ngram<K>`` (K drafts a step)."""
    return flag.startswith("ngram") and (flag == "ngram" or flag[5:].isdigit())


def speculative_config(flags: list[str]) -> dict | None:
    """The ``speculative_config`` of a config's flags: None without ``ngram[K]``."""
    flag = next((f for f in flags if _is_ngram(f)), None)
    if flag is None:
        return None
    return {"method": "ngram", **({"num_speculative_tokens": int(flag[5:])} if flag != "ngram" else {})}


# Flags that switch a CPU path off for one engine, through the environment its core process starts with.
ENV_FLAGS = {"nofp16kernel": (FP16_KERNEL_ENV, "0"), "nolean": (LEAN_STEP_ENV, "0"),
             "noleanproducts": (LEAN_PRODUCTS_ENV, "0")}


def engine(config: str, threads: int) -> LLM:
    dtype, *flags = config.split("+")
    quantization = next((f for f in flags if f != "compiled" and f not in ENV_FLAGS and not _is_ngram(f)), None)
    switched = dict(ENV_FLAGS[f] for f in flags if f in ENV_FLAGS)
    with patch.dict(os.environ, switched):  # the core process takes the caller's environment as it is when it starts
        return LLM(None, device="cpu", dtype=dtype, quantization=quantization, compile_decode="compiled" in flags,
                   speculative_config=speculative_config(flags), num_threads=threads, seed=0)


def plain_twin(config: str) -> str:
    return "+".join(f for f in config.split("+") if not _is_ngram(f))


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.reset_stats()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    decode_s = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
    llm.wait_settled(30.0)
    return {"decode_tok_s": sum(len(o.token_ids) - 1 for o in outs) / decode_s,
            "tokens": [list(o.token_ids) for o in outs], "load_1min": os.getloadavg()[0],
            "acceptance_length": llm.stats().get("spec_decode_mean_acceptance_length")}


def main() -> None:
    p = script_parser(__doc__)
    p.add_argument("--configs", default="float32,bfloat16,float32+w8a8,float32+w8a8+compiled")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--single-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # llamacpp_single reads it
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    configs = args.configs.split(",")
    started = time.time()
    engines, start_s = {}, {}
    for c in configs:
        t0 = time.perf_counter()
        engines[c] = engine(c, args.threads)
        start_s[c] = time.perf_counter() - t0
        log(f"{c}: ready in {start_s[c]:.1f} s")
    first = engines[configs[0]]
    prompts = {w: spread([prompt_ids(first, d["messages"]) for d in load_workload(w)], args.single_prompts)
               for w in args.workloads.split(",")}
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    for llm in engines.values():
        llm.generate([prompts[next(iter(prompts))][0]], warm, use_tqdm=False)
    runs: dict = {w: {c: [] for c in configs} for w in prompts}
    try:
        for rep in range(args.repeats):
            for w, ps in prompts.items():
                for c in (configs if rep % 2 == 0 else configs[::-1]):
                    r = run(engines[c], ps, args.max_tokens)
                    runs[w][c].append(r)
                    log(f"rep {rep + 1} {w:<8} {c:<24} decode {r['decode_tok_s']:6.1f} tok/s, load {r['load_1min']:.1f}")
    finally:
        for llm in engines.values():
            llm.close()
    results = {w: {c: {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                       "runs": [r["decode_tok_s"] for r in rs],
                       "acceptance_length": rs[-1]["acceptance_length"],
                       "tokens_equal_first_config": all(r["tokens"] == b["tokens"]
                                                        for r, b in zip(rs, by_config[configs[0]])),
                       "tokens_equal_plain_twin": all(r["tokens"] == b["tokens"]
                                                      for r, b in zip(rs, by_config[plain_twin(c)]))
                       if plain_twin(c) in by_config else None}
                   for c, rs in by_config.items()} for w, by_config in runs.items()}
    llama = {} if args.skip_llamacpp else {w: llamacpp_single(args, ps) for w, ps in prompts.items()}
    doc = {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "git_commit": git_commit(mark_dirty=True),
           "machine": f"{cpu_name()}, {os.cpu_count()} cores", "args": vars(args), "engine_start_s": start_s,
           "results": results, "llamacpp": {w: {k: v for k, v in d.items() if k != "runs"} for w, d in llama.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "one_request.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# One request at a time: engine settings beside llama.cpp ({doc['machine']})", "",
             f"Commit {doc['git_commit']}; {args.threads} threads; medians of {args.repeats} repeats; decode tok/s.", "",
             "| workload | " + " | ".join(configs) + " | llama.cpp |", "|---" * (len(configs) + 2) + "|"]
    for w in prompts:
        lc = llama.get(w, {}).get("decode_tok_s")
        cells = [f"{results[w][c]['decode_tok_s']:.1f}" + (f" ({results[w][c]['decode_tok_s'] / lc:.2f}x)" if lc else "")
                 for c in configs]
        lines.append(f"| {w} | " + " | ".join(cells) + (f" | {lc:.1f} |" if lc else " | -- |"))
    lines += ["", "Tokens equal to the first config's (per workload): " + "; ".join(
        f"{w}: " + ", ".join(f"{c} {results[w][c]['tokens_equal_first_config']}" for c in configs) for w in prompts),
        "", "Speculative configs, against the same config without ``+ngram[K]``: " + ("; ".join(
            f"{w} {c}: tokens equal {results[w][c]['tokens_equal_plain_twin']}, mean acceptance length "
            f"{results[w][c]['acceptance_length']:.2f}" for w in prompts for c in configs
            if results[w][c]['tokens_equal_plain_twin'] is not None and results[w][c]['acceptance_length'])
            or "none run"),
        "", "Engine start (s): " + ", ".join(f"{c} {s:.1f}" for c, s in start_s.items())]
    (out / "one_request.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
