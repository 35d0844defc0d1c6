"""Options every command shares, and how they become ``LLM`` keywords and ``SamplingParams``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from asyncbatch.config import DEVICES, DTYPES, GRAMMAR_BACKENDS, QUANTIZATIONS, SCHEDULING_POLICIES
from asyncbatch.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser, run_options: bool = True) -> None:
    """The engine's options; ``run_options`` adds --no-overlap and --trace (the demo runs both modes itself)."""
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, or alias (default: smollm2-135m)")
    parser.add_argument("--device", default="auto", choices=list(DEVICES))
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES))
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                        help="cpu only: int8 / int4 weight-only, or w8a8 (int8 weights and activations)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="cpu only: run decode steps through torch.compile (compiled at start, minutes)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length (prompt + output) per request (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, when the model's has none")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of shared prompt prefixes (default: on)")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                        help="fcfs: arrival order; priority: by each request's priority, lower first (vLLM's)")
    parser.add_argument("--structured-outputs-backend", default="auto", choices=["auto", *GRAMMAR_BACKENDS],
                        help="grammar library for structured outputs (pip install .[structured]); auto: xgrammar")
    parser.add_argument("--speculative-config", type=_json_object, default=None,
                        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             'or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' '
                             "(cpu and sim; docs/speculative.md)")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults for what a request leaves unset: auto (the model's "
                             "generation_config.json, as vLLM), vllm (neutral), or a folder holding one")
    parser.add_argument("--override-generation-config", type=_json_object, default=None,
                        help='JSON laid over the generation config, e.g. \'{"temperature": 0.5}\'')
    if run_options:
        parser.add_argument("--no-overlap", action="store_true", help="synchronous mode (the ablation)")
        parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the run to this path")


def engine_kwargs(args: argparse.Namespace, overlap: bool) -> dict:
    """``LLM`` keyword arguments from ``add_engine_args``' options."""
    return {"device": args.device, "dtype": args.dtype, "quantization": args.quantization,
            "compile_decode": args.compile_decode, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
            "seed": args.seed, "overlap": overlap,
            "tokenizer": args.tokenizer, "chat_template": args.chat_template,
            "enable_prefix_caching": args.enable_prefix_caching, "scheduling_policy": args.scheduling_policy,
            "structured_outputs_backend": args.structured_outputs_backend,
            "speculative_config": args.speculative_config, "generation_config": args.generation_config,
            "override_generation_config": args.override_generation_config}


def _json_object(text: str) -> dict:
    """A JSON object option (argparse turns the error into a usage error naming the option)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An option that counts something there must be at least one of (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative(kind: type[int | float]) -> Callable[[str], int | float]:
    """An option of ``kind`` that may be 0 but not negative."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not value >= 0:  # NaN fails too
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= 0, got {text!r}")
        return value
    return parse


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sample-seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def precision_text(info: dict) -> str:
    """The weights' precision from ``LLM.executor_info``, e.g. ``"float32 (auto -> float32: no native ...)"``
    or ``"float32 activations, w8a8 weights"``; empty on the simulated device."""
    dtype = info.get("dtype")
    if dtype is None:
        return ""
    quant = info.get("quantization")
    text = f"{dtype} activations, {quant} weights" if quant else dtype
    choice = info.get("dtype_choice")
    return f"{text} ({choice})" if choice else text
