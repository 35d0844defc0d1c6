"""Command line: ``python -m asyncbatch {generate,demo} ...`` (also installed as ``asyncbatch``)."""

from __future__ import annotations

import argparse
import sys
import time

from asyncbatch.sampling_params import SamplingParams


def _engine_args(parser: argparse.ArgumentParser, run_options: bool = True) -> None:
    """The engine's options; ``run_options`` adds --no-overlap and --trace (the demo runs both modes itself)."""
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, or alias (default: smollm2-135m)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "sim"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    if run_options:
        parser.add_argument("--no-overlap", action="store_true", help="synchronous mode (the ablation)")
        parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the run to this path")


def engine_kwargs(args: argparse.Namespace, overlap: bool) -> dict:
    """``LLM`` keyword arguments from ``_engine_args``' options."""
    return {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed, "overlap": overlap}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sample-seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from asyncbatch.llm import LLM

    t0 = time.perf_counter()
    with LLM(args.model, **engine_kwargs(args, overlap=not args.no_overlap)) as llm:
        load_s = time.perf_counter() - t0
        params = _params(args)
        if args.chat is not None:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.chat}], tokenize=False,
                                                       add_generation_prompt=True)
            prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = args.prompt
        start = time.perf_counter()
        first = None
        text, n = "", 0
        finish = None
        for delta in llm.stream(prompt_ids, params):
            if first is None and delta.token_ids:
                first = time.perf_counter() - start
            print(delta.text, end="", flush=True)
            text += delta.text
            n += len(delta.token_ids)
            finish = delta.finish_reason or finish
        total = time.perf_counter() - start
        print()
        label = " (simulated)" if llm.simulated else ""
        print(f"--- {n} tokens, finish={finish}, load {load_s:.2f} s, TTFT {1e3 * (first or 0):.1f} ms, "
              f"total {total:.2f} s, {n / total:.1f} tok/s on {llm.device}{label}", file=sys.stderr)
        if args.trace:
            llm.export_trace(args.trace)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A short generation, then overlap vs synchronous throughput on the same requests."""
    from asyncbatch.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt or a chat message")
    group = gen.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--chat", help="a user message; the model's chat template is applied")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="short generation + short overlap/synchronous throughput table")
    _engine_args(demo, run_options=False)
    demo.add_argument("--num-requests", type=int, default=32)
    demo.set_defaults(func=cmd_demo)
    from asyncbatch.profile_cli import add_profile_command  # imported here: it imports this module

    add_profile_command(sub, _engine_args)
    args = parser.parse_args(argv)
    return args.func(args)
