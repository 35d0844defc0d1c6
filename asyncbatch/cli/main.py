"""Command line: ``python -m asyncbatch {generate,demo,profile,serve} ...`` (also installed as ``asyncbatch``).

A mistake the user can fix (an empty prompt, a sampling value out of range, a model path that does not
exist) prints one line naming the option and exits 2, as argparse does for its own errors; a traceback
is printed only for internal errors, or for every error with ``--debug``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from asyncbatch.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    positive_int,
    precision_text,
    sampling_params,
)
from asyncbatch.cli.demo import run_demo
from asyncbatch.cli.profile import add_profile_command
from asyncbatch.cli.serve import add_serve_command
from asyncbatch.engine.fork_server import start_early

USAGE_ERROR = 2


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # before loading the model: a bad value fails at once
    start_early()  # the core's fork server imports the engine beside this process (engine.fork_server)
    from asyncbatch.llm import LLM

    t0 = time.perf_counter()
    with LLM(args.model, **engine_kwargs(args, overlap=not args.no_overlap)) as llm:
        load_s = time.perf_counter() - t0
        if args.chat is not None:
            if not args.chat:
                raise ValueError("chat message must not be empty")
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.chat}], tokenize=False,
                                                       add_generation_prompt=True)
            prompt_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = args.prompt
        start = time.perf_counter()
        first = None
        n = 0
        finish = None
        for delta in llm.stream(prompt_ids, params):
            if first is None and delta.token_ids:
                first = time.perf_counter() - start
            print(delta.text, end="", flush=True)
            n += len(delta.token_ids)
            finish = delta.finish_reason or finish
        total = time.perf_counter() - start
        print()
        label = " (simulated)" if llm.simulated else f", {precision_text(llm.executor_info)}"
        print(f"--- {n} tokens, finish={finish}, load {load_s:.2f} s, TTFT {1e3 * (first or 0):.1f} ms, "
              f"total {total:.2f} s, {n / total:.1f} tok/s on {llm.device}{label}", file=sys.stderr)
        if args.trace:
            llm.export_trace(args.trace)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A short generation, then overlap vs synchronous throughput on the same requests."""
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncbatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="print a traceback for every error")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt or a chat message")
    group = gen.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt")
    group.add_argument("--chat", help="a user message; the model's chat template is applied")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    demo = sub.add_parser("demo", help="short generation + short overlap/synchronous throughput table")
    add_engine_args(demo, run_options=False)
    demo.add_argument("--num-requests", type=positive_int, default=32, help="requests in each round")
    demo.add_argument("--rounds", type=positive_int, default=3,
                      help="rounds alternating between overlap and sync; the ratio is their median")
    demo.set_defaults(func=cmd_demo)
    add_profile_command(sub, add_engine_args)
    add_serve_command(sub)
    return parser


def option_for(message: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The command-line option a user error's message names (``max_tokens`` -> ``--max-tokens``)."""
    options = {}
    for action in _actions(parser, args.command):
        for flag in action.option_strings:
            if flag.startswith("--"):
                options[action.dest] = flag
    aliases = {"sample_seed": "seed", "stop": "stop_strings", "prompt": "chat" if args.__dict__.get("chat") else "prompt"}
    # The field a "<field> must ..." clause names first (a message about a sum names its parts before it).
    for word in re.findall(r"([a-z][a-z_]+) must\b", message) + re.findall(r"[a-z][a-z_]+", message):
        for dest, flag in options.items():
            if word in (dest, aliases.get(dest)):
                return flag
    return None


def _actions(parser: argparse.ArgumentParser, command: str) -> list[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices[command]._actions)
    return []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("asyncbatch: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if args.debug or not _is_user_error(exc):
            raise
        flag = option_for(str(exc), parser, args)
        where = f"{flag}: " if flag else ""
        print(f"asyncbatch {args.command}: error: {where}{exc}", file=sys.stderr)
        return USAGE_ERROR


def _is_user_error(exc: BaseException) -> bool:
    """Errors raised while validating what the user typed (config, sampling, prompt, model path)."""
    from asyncbatch.model.default_model import DefaultModelMissingError

    if isinstance(exc, DefaultModelMissingError):
        return True
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module in _VALIDATING_MODULES:
            return True
        tb = tb.tb_next
    return False


_VALIDATING_MODULES = frozenset({
    "asyncbatch.config", "asyncbatch.sampling_params", "asyncbatch.frontend.prompt_validation",
    "asyncbatch.model.loader", "asyncbatch.cli.main", "asyncbatch.cli.profile", "asyncbatch.llm",
    "asyncbatch.cli.serve", "asyncbatch.serve.settings", "asyncbatch.serve.server", "asyncbatch.engine.builder",
})
