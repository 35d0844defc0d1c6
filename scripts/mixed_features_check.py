#!/usr/bin/env python
"""Every sampler feature mixed in one batch, checked against the same requests in another mode: a differential check.

Each iteration draws (from its seed) an engine configuration (rows per step, chunked prefill or not, a KV cache
tight enough to preempt or not, prefix caching on or off) and a batch of requests, each with its own mix of
what the sampler must handle beside the overlap: temperatures, top-k / top-p / min-p, penalties, seeds,
``logprobs`` (0-20), ``prompt_logprobs``, ``logit_bias``, ``min_tokens``, stop strings, ``ignore_eos``,
``allowed_token_ids``, ``n`` > 1 and structured outputs (every case of ``harness/structured_cases.py``). The
batch runs under overlap with the integrity check after every step, and again:

* ``sync`` (always): synchronous mode, same configuration: the same tokens, texts, finish reasons, and
  log-probabilities within ``--tolerance`` (a row's logits may be computed in a batch of other shape);
* ``spec`` (``--speculative``): n-gram speculation under overlap: the same tokens (verification keeps a draft
  only where the target's own sample equals it);
* ``alone`` (``--alone``): one request at a time, no prefix caching, synchronous: the same tokens (float32;
  on the tiny random model a near-tie can part them, so it says where).

Also: every output that finished by its grammar (``stop`` with no stop string or id as its reason) satisfies its
constraint, every output has at least ``min_tokens`` tokens unless it ended by its grammar, and the KV cache is
idle and clean after each run. Nothing is timed. A found difference prints the request and both outputs and the
exit status is 1.

    python scripts/mixed_features_check.py --iterations 50                       # sim, the default model's tokenizer
    python scripts/mixed_features_check.py --device cpu --model PATH --speculative --alone --iterations 20

On ``sim`` the log-probabilities are the simulator's (the sampled token at 0); on ``cpu`` they are the
model's, so the comparison means more there (float32 only: the claims are about the engine).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from harness.common import parser
from harness.structured_cases import CASES

from asyncbatch import LLM, SamplingParams, SimConfig
from asyncbatch.outputs import Logprobs, RequestOutput

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
               "disable_by_batch_size": None}


@dataclass
class Iteration:
    engine: dict
    prompts: list[str]
    params: list[SamplingParams]


def draw(seed: int, vocab_size: int) -> Iteration:
    """The iteration's engine configuration and requests, a function of ``seed`` alone."""
    rng = random.Random(seed)
    engine = {"max_num_seqs": rng.choice([4, 8, 16, 32]), "enable_prefix_caching": rng.random() < 0.6}
    if rng.random() < 0.5:
        engine["max_num_batched_tokens"] = rng.choice([32, 64, 128])  # chunked prefill
    if rng.random() < 0.5:
        engine["num_kv_blocks"] = rng.choice([24, 40, 64])  # tight: preemption
    prompts, params = [], []
    for _ in range(rng.randint(5, 40)):
        kw: dict = {"max_tokens": rng.randint(1, 40), "seed": rng.randint(0, 10**6),
                    "temperature": rng.choice([0.0, 0.7, 1.0, 1.5])}
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
        if rng.random() < 0.3:
            kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
        if rng.random() < 0.4:
            kw["logprobs"] = rng.choice([0, 1, 5, 20])
        if rng.random() < 0.25:
            kw["prompt_logprobs"] = rng.choice([0, 3])
        if rng.random() < 0.3:
            kw["logit_bias"] = {rng.randrange(vocab_size): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
        if rng.random() < 0.3:
            kw["ignore_eos"] = True
        if rng.random() < 0.2:
            kw["stop"] = ["a", "}"]
        if rng.random() < 0.15:
            kw["n"] = rng.choice([2, 3])
        if rng.random() < 0.1:
            kw["allowed_token_ids"] = list(range(40, 120))
        elif rng.random() < 0.4:
            kw["structured_outputs"] = rng.choice(CASES).params
            kw["max_tokens"] = max(kw["max_tokens"], rng.randint(20, 60))
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, min(10, kw["max_tokens"]))
        prompts.append("".join(rng.choice('abcdef {}"') for _ in range(rng.randint(1, 90))))
        params.append(SamplingParams(**kw))
    return Iteration(engine, prompts, params)


def logprobs_differ(a: Logprobs | None, b: Logprobs | None, tolerance: float) -> str | None:
    """Why two runs' log-probabilities differ, or None: the same tokens, values within ``tolerance``, and the
    same top ids (in another order only where their values are within it)."""
    if a is None or b is None:
        return None if a is None and b is None else "one run has none"
    if a.token_ids != b.token_ids:
        return "other token ids"
    if any(abs(x - y) > tolerance for x, y in zip(a.logprobs, b.logprobs)):
        return "a logprob"
    for ids_a, ids_b, values_a, values_b in zip(a.top_token_ids, b.top_token_ids, a.top_logprobs, b.top_logprobs):
        if len(values_a) != len(values_b) or any(abs(x - y) > tolerance for x, y in zip(values_a, values_b)):
            return "a top logprob"
        if sorted(ids_a) != sorted(ids_b):
            return "other top ids"
    return None


def outputs_differ(a: RequestOutput, b: RequestOutput, tolerance: float | None) -> str | None:
    """Why two runs of one request differ, or None. ``tolerance`` None: tokens, texts and finish reasons only."""
    completions_a, completions_b = [a, *a.more_outputs], [b, *b.more_outputs]
    if len(completions_a) != len(completions_b):
        return "another number of completions"
    for k, (x, y) in enumerate(zip(completions_a, completions_b)):
        if (x.token_ids, x.text, x.finish_reason) != (y.token_ids, y.text, y.finish_reason):
            return f"completion {k}: tokens, text or finish reason"
        why = None if tolerance is None else logprobs_differ(x.logprobs, y.logprobs, tolerance)
        if why:
            return f"completion {k}: {why}"
    why = None if tolerance is None else logprobs_differ(a.prompt_logprobs, b.prompt_logprobs, tolerance)
    return f"prompt logprobs: {why}" if why else None


def constraint_violations(params: SamplingParams, output: RequestOutput) -> list[str]:
    """What an output owes its request beyond the comparison: a grammar's stop satisfies it, and ``min_tokens``."""
    found = []
    for completion in [output, *output.more_outputs]:
        # A stop string or id ends a completion with it as its stop_reason; the grammar's end (EOS) with None.
        by_grammar = (params.structured_outputs is not None and completion.finish_reason == "stop"
                      and completion.stop_reason is None)
        if by_grammar:
            case = next(c for c in CASES if c.params is params.structured_outputs)
            try:
                case.check(completion.text)
            except AssertionError as exc:
                found.append(f"{case.name}: {exc}")
        elif completion.finish_reason in ("stop", "length") and len(completion.token_ids) < params.min_tokens:
            found.append(f"{len(completion.token_ids)} tokens under min_tokens={params.min_tokens}")
    return found


def run(engine: dict, it: Iteration) -> list[RequestOutput]:
    with LLM(**engine, debug_check_integrity=True) as llm:
        outputs = llm.generate(it.prompts, it.params, use_tqdm=False)
        llm.check_integrity()
        if llm.num_free_blocks != llm.num_usable_blocks:
            raise AssertionError(f"{llm.num_usable_blocks - llm.num_free_blocks} KV blocks held after the run")
    return outputs


def check(it: Iteration, base: dict, tolerance: float, speculative: bool, alone: bool) -> list[str]:
    """One iteration; the problems found (empty: none)."""
    engine = {**base, **it.engine}
    problems = []
    subject = run({**engine, "overlap": True}, it)
    references = {"sync": (run({**engine, "overlap": False}, it), tolerance)}
    if speculative:
        references["spec"] = (run({**engine, "overlap": True, "speculative_config": SPECULATIVE}, it), None)
    if alone:
        references["alone"] = (run({**base, "overlap": False, "max_num_seqs": 1, "enable_prefix_caching": False}, it),
                               None)
    for i, (params, output) in enumerate(zip(it.params, subject)):
        for name, (outputs, tol) in references.items():
            why = outputs_differ(output, outputs[i], tol)
            if why:
                problems.append(f"request {i} overlap vs {name}: {why}\n  params: {params}\n"
                                f"  overlap: {output.token_ids} {output.finish_reason}\n"
                                f"  {name}: {outputs[i].token_ids} {outputs[i].finish_reason}")
        problems += [f"request {i}: {v}\n  params: {params}" for v in constraint_violations(params, output)]
    return problems


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--device", choices=["sim", "cpu"], default="sim")
    p.add_argument("--model", default=None, help="the model (cpu: required to be float32-able; default: the "
                                                  "default model)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="the first iteration's seed (iteration k: seed + k)")
    p.add_argument("--tolerance", type=float, default=2e-4, help="log-probabilities' largest difference")
    p.add_argument("--speculative", action="store_true", help="also compare n-gram speculation's tokens")
    p.add_argument("--alone", action="store_true", help="also compare one request at a time (synchronous)")
    args = p.parse_args(argv)
    base: dict = {"device": args.device, "engine_process": False}
    if args.model:
        base["model"] = args.model
    if args.device == "cpu":
        base["dtype"] = "float32"
    else:
        base["sim"] = SimConfig(step_fixed_ms=0.1, per_token_us=0.1, output_len_min=4, output_len_max=64)
    with LLM(**base) as probe:
        vocab_size = probe.processor.vocab_size
    failed = 0
    for seed in range(args.seed, args.seed + args.iterations):
        start = time.perf_counter()
        it = draw(seed, vocab_size)
        problems = check(it, base, args.tolerance, args.speculative, args.alone)
        failed += bool(problems)
        print(f"seed {seed}: {it.engine} {'ok' if not problems else f'{len(problems)} problems'}"
              f" ({time.perf_counter() - start:.1f} s)", flush=True)
        for problem in problems[:5]:
            print("  " + problem.replace("\n", "\n  "), flush=True)
    print(f"{args.iterations - failed} of {args.iterations} iterations without a difference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
