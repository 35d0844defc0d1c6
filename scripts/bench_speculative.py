#!/usr/bin/env python
"""N-gram (prompt-lookup) speculative decoding against plain decoding, side by side in one run (issue 24).

    python scripts/bench_speculative.py                          # into profiles/speculative-<machine>
    python scripts/bench_speculative.py --repeats 1 --batch-requests 0 --out /tmp/spec   # one request only

Workloads (``scripts/harness/data/speculative/``, written for this benchmark): ``grounded`` -- rewrite,
fix, summarize or edit a given text or code, answer by quoting a passage: the output copies the prompt --
and ``open`` -- open-ended chat. Cases: one request at a time (``--single-prompts`` prompts of each
workload, one after the other; the figure people feel in a chat) and ``--batch-requests`` requests at
once (the shipped prompts in turn). Systems: the same engine settings twice, once with
``speculative_config={"method": "ngram", ...}``; both engines stay alive across the repeats and are
warmed up once (one request, and one batch when there is a batch case). Runs interleave (plain, ngram,
then ngram, plain on the next repeat, so drift on a shared machine hits both); figures are medians over
``--repeats``.

Greedy, EOS honoured, ``--max-tokens`` (``--batch-max-tokens`` for the many-request case); float32 by
default, where the engine promises speculation's tokens are identical to plain decoding's: every run
compares them request by request. Reported per workload and case: output tok/s (output tokens over the
whole time: one request's TTFT included, or the batch's wall time), for one request also decode tok/s
((tokens - 1) / (finish - first token), the figure ``bench_cpu_precision.py`` quotes for llama.cpp),
``LLM.stats()``'s acceptance rate and mean acceptance length (tokens a drafting row emits per verify
step), device ms per step, and the load average.

llama.cpp on the same one-request work (``harness/system_llamacpp.py``, the default model's GGUF, greedy,
to ``--max-tokens``) when llama-cpp-python imports; otherwise the report says so and the README quotes an
earlier run's figure, labelled as such.

Writes ``report.json`` and ``report.md`` into ``--out``.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from harness.common import cpu_seconds, log
from harness.common import parser as script_parser
from harness.speculative_report import goals, markdown
from harness.speculative_workloads import WORKLOADS, cycle, load_workload, prompt_ids, spread

from asyncbatch import LLM, SamplingParams
from asyncbatch.bench.report import write_json
from asyncbatch.config import QUANTIZATIONS
from asyncbatch.profiling.host_info import cpu_name, git_commit

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("plain", "ngram")
CASES = ("single", "batch")
STAT_KEYS = ("steps", "device_ms_per_step", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens", "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length")


def build_engines(args) -> dict[str, LLM]:
    """The two engines, alike but for ``speculative_config``."""
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
            "disable_by_batch_size": args.disable_by_batch_size}
    common = {"device": "cpu", "dtype": args.dtype, "num_threads": args.threads, "seed": args.seed,
              "quantization": args.quantization, "compile_decode": args.compile_decode}
    return {name: LLM(args.model, **common, speculative_config=spec if name == "ngram" else None)
            for name in SYSTEMS}


def engine_pids(llm: LLM) -> list[int]:
    """This process and the engine's core process: on a machine shared with other jobs, output tokens per
    CPU-second of these is steadier than per wall second (``bench_cpu_precision.py`` does the same)."""
    core = getattr(getattr(llm._client, "process", None), "pid", None)
    return [os.getpid()] + ([core] if core else [])


def run_case(llm: LLM, prompts: list[list[int]], max_tokens: int, alone: bool) -> dict:
    """One timed run: each prompt alone, one after the other (``alone``), or all at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    load = os.getloadavg()[0]
    pids = engine_pids(llm)
    llm.reset_stats()
    cpu0, start = cpu_seconds(pids), time.perf_counter()
    if alone:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu_s = time.perf_counter() - start, cpu_seconds(pids) - cpu0
    llm.wait_settled(30.0)
    stats = llm.stats()
    tokens = [list(o.token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    e2e = sum(o.metrics.finished_time - o.metrics.arrival_time for o in outs)
    decode_s = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"output_tokens": n, "wall_s": wall,
            "output_tok_s": n / (e2e if alone else wall),
            "decode_tok_s": sum(len(t) - 1 for t in tokens) / decode_s if alone and decode_s > 0 else None,
            "ttft_ms_mean": 1e3 * statistics.fmean(ttft), "load_1min": load, "cpu_s": cpu_s,
            "output_tok_per_cpu_s": n / cpu_s if cpu_s > 0 else None,
            **{k: stats.get(k) for k in STAT_KEYS}, "token_ids": tokens}


def llamacpp_single(args, prompts: list[list[int]]) -> dict:
    """llama.cpp's decode tok/s on the one-request prompts, or why it could not run."""
    try:
        from harness.system_base import BenchSettings
        from harness.system_llamacpp import LlamaCppSystem, LlamaCppUnavailable, import_llama_cpp

        import_llama_cpp()
    except Exception as exc:  # noqa: BLE001 -- any reason it cannot run is the report's entry
        return {"available": False, "reason": str(exc)}
    from asyncbatch.bench.workloads import WorkItem

    try:
        system = LlamaCppSystem(BenchSettings(model=args.model, num_threads=args.threads), threads=args.threads)
    except LlamaCppUnavailable as exc:
        return {"available": False, "reason": str(exc)}
    try:
        system.run_offline([WorkItem(prompts[0], 8)])  # warm-up
        runs = []
        for _ in range(args.repeats):
            recs = [system.run_offline([WorkItem(p, args.max_tokens)]).requests[0] for p in prompts]
            decode = sum(r.finish - r.first_token for r in recs)
            runs.append({"decode_tok_s": sum(r.output_len - 1 for r in recs) / decode,
                         "output_tok_s": sum(r.output_len for r in recs) / sum(r.finish - r.arrival for r in recs)})
        return {"available": True, "config": system.config(), "runs": runs,
                **{k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "output_tok_s")}}
    finally:
        system.close()


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests' greedy tokens agree, and where the first one that does not parts."""
    first = next(((i, next((j for j, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))))
                  for i, (s, t) in enumerate(zip(a, b)) if s != t), None)
    return {"identical": sum(s == t for s, t in zip(a, b)), "compared": len(a),
            "first_mismatch": None if first is None else {"request": first[0], "position": first[1]}}


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats (token ids dropped: the comparison keeps what matters of them)."""
    keys = [k for k, v in runs[0].items() if k != "token_ids" and (v is None or isinstance(v, (int, float)))]
    out = {}
    for k in keys:
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    return {**out, "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}


def measure(args, engines: dict[str, LLM], prompts: dict[str, dict[str, list[list[int]]]]) -> dict:
    """Every (case, workload) pair, plain and ngram back to back, ``--repeats`` times."""
    runs: dict = {c: {w: {s: [] for s in SYSTEMS} for w in prompts[c]} for c in prompts}
    match: dict = {c: {w: [] for w in prompts[c]} for c in prompts}
    for rep in range(args.repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for case, by_workload in prompts.items():
            max_tokens = args.max_tokens if case == "single" else args.batch_max_tokens
            for workload, ps in by_workload.items():
                for system in order:
                    r = run_case(engines[system], ps, max_tokens, alone=case == "single")
                    runs[case][workload][system].append(r)
                    log(f"rep {rep + 1} {case:<6} {workload:<8} {system:<5} {r['output_tok_s']:6.1f} out tok/s"
                        + (f", decode {r['decode_tok_s']:5.1f}" if r["decode_tok_s"] else "")
                        + f", accept len {r['spec_decode_mean_acceptance_length'] or 0:.2f}, load {r['load_1min']:.1f}")
                plain, ngram = (runs[case][workload][s][-1]["token_ids"] for s in SYSTEMS)
                match[case][workload].append(compare(plain, ngram))
    results: dict = {}
    for case, by_workload in runs.items():
        for workload, by_system in by_workload.items():
            m = match[case][workload]
            results.setdefault(case, {})[workload] = {
                "num_requests": len(prompts[case][workload]),
                "prompt_tokens": sum(len(p) for p in prompts[case][workload]),
                **{s: summarize(by_system[s]) for s in SYSTEMS},
                "tokens": {"identical": sum(x["identical"] for x in m), "compared": sum(x["compared"] for x in m),
                           "first_mismatch": next((x["first_mismatch"] for x in m if x["first_mismatch"]), None)}}
    return results


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weight quantization of both engines (default: none; llama.cpp always runs the GGUF's own)")
    p.add_argument("--compile-decode", action="store_true",
                   help="both engines run pure decode steps through torch.compile (compile_decode=True; with w8a8 the "
                        "fastest one-request setting measured, docs/cpu-precision.md); minutes of compiling at start")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and llama.cpp's); 1 as in the "
                   "earlier llama.cpp figure, and steadier on a shared machine")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--single-prompts", type=int, default=4, help="prompts run alone per workload (0: all)")
    p.add_argument("--batch-requests", type=int, default=32, help="requests at once (0: skip that case)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--out", default=None, help="default: profiles/speculative-<machine>")
    args = p.parse_args(argv)
    from bench_prefix_cache import machine_slug

    out_dir = Path(args.out) if args.out else ROOT / "profiles" / f"speculative-{machine_slug()}"
    started = time.time()
    doc: dict = {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                 "command": "python " + shlex.join(["scripts/bench_speculative.py", *(argv or sys.argv[1:])]),
                 "git_commit": git_commit(mark_dirty=True), "machine": f"{cpu_name()}, {os.cpu_count()} cores",
                 "python": platform.python_version(), "torch": torch.__version__, "args": vars(args),
                 "load_average": {"start": os.getloadavg()}}
    workloads = [w for w in args.workloads.split(",") if w]
    engines = build_engines(args)
    try:
        data = {w: load_workload(w) for w in workloads}
        ids = {w: [prompt_ids(engines["plain"], d["messages"]) for d in data[w]] for w in workloads}
        prompts = {"single": {w: spread(ids[w], args.single_prompts) for w in workloads}}
        if args.batch_requests > 0:
            prompts["batch"] = {w: cycle(ids[w], args.batch_requests) for w in workloads}
        doc["prompts"] = {w: [d["id"] for d in spread(data[w], args.single_prompts)] for w in workloads}
        warm = ids[workloads[0]][0]
        for llm in engines.values():
            llm.generate([warm], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            if args.batch_requests > 0:
                # The first batch through an engine builds the kernels of its prefill shapes (a third slower
                # than the next with compile_decode and w8a8): untimed, so the first timed repeat is not.
                llm.generate(prompts["batch"][workloads[0]], SamplingParams(max_tokens=8, temperature=0.0),
                             use_tqdm=False)
        doc["results"] = measure(args, engines, prompts)
    finally:
        for llm in engines.values():
            llm.close()
    doc["load_average"]["end"] = os.getloadavg()
    if args.skip_llamacpp:
        doc["llamacpp"] = {"available": False, "reason": "--skip-llamacpp"}
    else:
        doc["llamacpp"] = {w: llamacpp_single(args, ps) for w, ps in prompts["single"].items()}
        if not any(v.get("available") for v in doc["llamacpp"].values()):
            doc["llamacpp"] = {"available": False, "reason": next(iter(doc["llamacpp"].values()))["reason"]}
        log(f"llama.cpp: {doc['llamacpp'].get('reason', 'measured')}")
    doc["took_s"] = time.time() - started
    doc["goals"] = goals(doc)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(doc, out_dir / "report.json", nan_as_null=True)
    text = markdown(doc)
    (out_dir / "report.md").write_text(text + "\n")
    print(text)
    log(f"wrote {out_dir / 'report.json'} and report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
