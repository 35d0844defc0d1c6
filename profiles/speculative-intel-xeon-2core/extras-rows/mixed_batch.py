"""One batch of grounded requests under speculation, one of which asks for a sampler extra (or nothing).

    PYTHONPATH=<tree> python mixed_batch.py OUT.json [--extra logprobs|bias|json|json-schema|none] [--on first|all]
        [--requests 4] [--max-tokens 96] [--spec ngram|draft-self]

Default model, float32, 2 threads, overlap, ``speculative_config={"method": "ngram"}`` (k = 4; ``--spec
draft-self``: the default model drafting for itself, ``method="draft_model"``, k = 4), greedy, EOS
honoured; the engine is built and warmed up once, then the batch runs ``--repeats`` times. Request 0 asks for
the ``--extra`` (``--on all``: every request does): logprobs, a logit_bias and ``min_tokens``, a JSON object, a JSON
schema with two free-text fields (``JSON_SCHEMA``, the prompt asking for it: the answer in JSON, which echoes the
given text as the plain answer does), or nothing. Writes the batch's
wall seconds per repeat, output tokens, acceptance counters and every request's token ids (so that two trees'
runs can be compared token for token). Run from outside the tree (``cd /tmp``) so that ``PYTHONPATH`` decides
which tree's code runs, in the frontend and in the engine-core process alike.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
from harness.speculative_workloads import load_workload, prompt_ids, spread

from asyncbatch import LLM, SamplingParams, StructuredOutputsParams

JSON_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}},
               "required": ["title", "text"]}
JSON_ASK = '\n\nAnswer in JSON: {"title": a short title, "text": your answer}.'


def main() -> None:
    out = Path(sys.argv[1])
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    extra, n = args.get("--extra", "logprobs"), int(args.get("--requests", "4"))
    max_tokens, repeats = int(args.get("--max-tokens", "96")), int(args.get("--repeats", "3"))
    spec = {"ngram": {"method": "ngram"},
            "draft-self": {"method": "draft_model", "model": "smollm2-135m"}}[args.get("--spec", "ngram")]
    llm = LLM(dtype="float32", num_threads=2, speculative_config=spec)
    cases = spread(load_workload("grounded"), n)
    on_all = args.get("--on", "first") == "all"
    if extra == "json-schema":  # the requests that answer in JSON are told how
        for i, case in enumerate(cases):
            if on_all or i == 0:
                last = case["messages"][-1]
                case["messages"] = [*case["messages"][:-1], {**last, "content": last["content"] + JSON_ASK}]
    prompts = [prompt_ids(llm, c["messages"]) for c in cases]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0) for _ in prompts]
    # The first request asks for the extra; its answer is as long as the others' (max_tokens), so it is live
    # for most of the batch.
    if extra == "logprobs":
        params[0] = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    elif extra == "bias":  # a ban that changes nothing here (token 0), and EOS banned for the first 32 tokens
        params[0] = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias={0: -100.0}, min_tokens=32)
    elif extra == "json":
        params[0] = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                   structured_outputs=StructuredOutputsParams(json_object=True))
    elif extra == "json-schema":
        params[0] = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                   structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA))
    if on_all:
        params = [params[0]] * n
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
    before = llm.stats()
    walls, runs, latencies = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        runs.append([o.token_ids for o in outs])
        latencies.append([o.metrics.latency for o in outs])  # request 0 asked for the extra
    logprobs = outs[0].logprobs.logprobs if outs[0].logprobs is not None else None  # the chosen tokens'
    stats = llm.stats()
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "steps")
    result = {"extra": extra, "on": args.get("--on", "first"), "spec": args.get("--spec", "ngram"), "requests": n,
              "max_tokens": max_tokens,
              "walls_s": walls, "latencies_s": latencies, "texts": [o.text for o in outs],
              "output_tokens": sum(len(t) for t in runs[0]), "tokens": runs[0], "logprobs_0": logprobs,
              "same_tokens_every_repeat": all(r == runs[0] for r in runs),
              **{k: stats[k] - before.get(k, 0) for k in keys},
              "mean_acceptance_length": stats["spec_decode_mean_acceptance_length"]}
    llm.close()
    out.write_text(json.dumps(result))
    med = sorted(walls)[len(walls) // 2]
    others = sorted(sum(lat[1:]) / (n - 1) for lat in latencies)[len(latencies) // 2]
    first = sorted(lat[0] for lat in latencies)[len(latencies) // 2]
    print(f"{extra}: {result['output_tokens']} tokens, batch median {med:.2f} s ({result['output_tokens'] / med:.1f} "
          f"tok/s); latency: request 0 {first:.2f} s, the others' mean {others:.2f} s; draft tokens "
          f"{result['spec_decode_num_draft_tokens']}, accepted {result['spec_decode_num_accepted_tokens']}")


if __name__ == "__main__":
    main()
