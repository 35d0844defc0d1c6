"""The goals of issue 24's benchmark and the markdown table of ``scripts/bench_speculative.py``'s report.

Kept apart from the measuring script so the verdicts can be read (and re-derived from a ``report.json``)
without the engine.
"""

from __future__ import annotations

# llama.cpp is not always installed where the benchmark runs; then the goals are judged against this
# figure from another run on the same machine, and the report says so wherever it is used.
LLAMACPP_REFERENCE = {
    "decode_tok_s": 74.3,
    "source": ("profiles/cpu-decode-amd-epyc-2core/README.md section 4 (throughput-1thread/precision.json, commit "
               "53b48a8): llama.cpp, the default model's Q4_1 GGUF, 1 thread, one request alone, 48 output tokens "
               "of the README's chat prompt -- another run, not this one"),
}


def llamacpp_figure(doc: dict, workload: str) -> tuple[float | None, str]:
    """llama.cpp's one-request decode tok/s for ``workload``: this run's, else the earlier run's (labelled)."""
    entry = doc.get("llamacpp", {})
    if entry.get("available") is False:
        return LLAMACPP_REFERENCE["decode_tok_s"], "earlier run (llama.cpp not installed here)"
    this = entry.get(workload, {})
    if this.get("available"):
        return this["decode_tok_s"], "this run"
    return LLAMACPP_REFERENCE["decode_tok_s"], "earlier run"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def goals(doc: dict) -> list[dict]:
    """Issue 24's goals, each with the measured ratio, its target and whether it was met."""
    res, out = doc.get("results", {}), []

    def add(goal: str, value: float | None, target: float, basis: str) -> None:
        out.append({"goal": goal, "value": value, "target": target, "basis": basis,
                    "met": None if value is None else value >= target})

    single = res.get("single", {})
    if "grounded" in single:
        g = single["grounded"]
        llama, where = llamacpp_figure(doc, "grounded")
        add("grounded, one request: ngram >= 2x plain (decode tok/s)",
            _ratio(g["ngram"]["decode_tok_s"], g["plain"]["decode_tok_s"]), 2.0, "this run")
        add("grounded, one request: ngram >= 1.0x llama.cpp (decode tok/s)",
            _ratio(g["ngram"]["decode_tok_s"], llama), 1.0, f"llama.cpp: {where}")
    if "open" in single:
        o = single["open"]
        llama, where = llamacpp_figure(doc, "open")
        add("open chat, one request: plain (the lean step alone) >= 0.5x llama.cpp (decode tok/s)",
            _ratio(o["plain"]["decode_tok_s"], llama), 0.5, f"llama.cpp: {where}")
    for workload, b in res.get("batch", {}).items():
        # With drafting off at this batch size (``disable_by_batch_size``) both engines run the same steps, and
        # the ratio is the machine's run-to-run spread: the basis says so.
        idle = not any(r.get("spec_decode_num_drafts") for r in b["ngram"]["runs"])
        add(f"{workload}, {b['num_requests']} requests: ngram no slower than plain (output tok/s)",
            _ratio(b["ngram"]["output_tok_s"], b["plain"]["output_tok_s"]), 1.0,
            "this run; no drafts verified (both engines ran the same steps)" if idle else "this run")
    return out


def _f(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(doc: dict) -> str:
    """The report: set-up, one table row per (case, workload), llama.cpp, the goals."""
    a = doc["args"]
    loads = [r["load_1min"] for case in doc["results"].values() for w in case.values()
             for s in ("plain", "ngram") for r in w[s]["runs"]]
    lines = [f"# N-gram speculative decoding vs plain ({doc['machine']})", "",
             f"Commit {doc['git_commit']}; Python {doc['python']}, torch {doc['torch']}; took {doc['took_s']:.0f} s.",
             "", f"Command: `{doc['command']}`", "",
             (f"Model: {a['model'] or 'SmolLM2-135M-Instruct (default)'}, dtype **{a['dtype']}**"
              f"{', quantization **' + a['quantization'] + '**' if a.get('quantization') else ''}"
              f"{', **compile_decode**' if a.get('compile_decode') else ''}, {a['threads']} torch "
              f"thread(s), overlap mode, greedy, EOS honoured; max_tokens {a['max_tokens']} (one request) / "
              f"{a['batch_max_tokens']} (many). ngram: num_speculative_tokens {a['num_speculative_tokens']}, "
              f"prompt_lookup {a['prompt_lookup_min']}-{a['prompt_lookup_max']}, disable_by_batch_size "
              f"{a['disable_by_batch_size']}; otherwise the same engine settings. Medians over {a['repeats']} "
              "repeat(s), plain and ngram interleaved."),
             "", (f"Load average (1 min) during the runs: min {min(loads):.1f}, median {sorted(loads)[len(loads) // 2]:.1f}, "
                  f"max {max(loads):.1f}; start {' / '.join(f'{x:.1f}' for x in doc['load_average']['start'])}, "
                  f"end {' / '.join(f'{x:.1f}' for x in doc['load_average']['end'])} (1/5/15 min)."), "",
             ("One request: the prompts listed below, each alone, one after the other; output tok/s = their tokens / "
             "their end-to-end times (TTFT included), decode tok/s = (tokens - 1) / (finish - first token). Tok per "
             "CPU-s: output tokens per CPU-second of this process and the engine's core process (steadier than wall "
             "time on a shared machine)."), "",
             ("| workload | requests | plain tok/s | ngram tok/s | ngram / plain | tok per CPU-s plain / ngram (ratio) "
             "| plain decode tok/s | ngram decode tok/s | decode ngram / plain | acceptance rate | mean acceptance "
             "length | device ms/step plain / ngram | greedy tokens identical |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case, by_workload in doc["results"].items():
        for workload, r in by_workload.items():
            p, n, t = r["plain"], r["ngram"], r["tokens"]
            lines.append(
                f"| {workload} | {1 if case == 'single' else r['num_requests']} | {_f(p['output_tok_s'])} | "
                f"{_f(n['output_tok_s'])} | {_x(_ratio(n['output_tok_s'], p['output_tok_s']))} | "
                f"{_f(p['output_tok_per_cpu_s'])} / {_f(n['output_tok_per_cpu_s'])} "
                f"({_x(_ratio(n['output_tok_per_cpu_s'], p['output_tok_per_cpu_s']))}) | "
                f"{_f(p['decode_tok_s'])} | {_f(n['decode_tok_s'])} | {_x(_ratio(n['decode_tok_s'], p['decode_tok_s']))} "
                f"| {_f(n['spec_decode_acceptance_rate'], 2)} | {_f(n['spec_decode_mean_acceptance_length'], 2)} | "
                f"{_f(p['device_ms_per_step'], 0)} / {_f(n['device_ms_per_step'], 0)} | "
                f"{t['identical']} / {t['compared']} |")
    lines += ["", "One-request prompts: " + "; ".join(f"{w}: {', '.join(ids)}" for w, ids in doc["prompts"].items()),
              ""]
    llama = doc["llamacpp"]
    if llama.get("available") is False:
        lines += [(f"llama.cpp: **not measured in this run** ({llama['reason']}). The goals below use "
                  f"{LLAMACPP_REFERENCE['decode_tok_s']} decode tok/s from {LLAMACPP_REFERENCE['source']}."), ""]
    else:
        lines += ["llama.cpp on the same one-request prompts (decode tok/s, median): " + "; ".join(
            f"{w}: {_f(v.get('decode_tok_s'))}" for w, v in llama.items()), ""]
    lines += ["| goal | measured | target | met | basis |", "|---|---|---|---|---|"]
    for g in doc["goals"]:
        met = "—" if g["met"] is None else ("**met**" if g["met"] else "**NOT met**")
        lines.append(f"| {g['goal']} | {_x(g['value'])} | {g['target']:.1f}x | {met} | {g['basis']} |")
    return "\n".join(lines)
