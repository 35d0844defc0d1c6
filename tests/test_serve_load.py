"""Load: 1,000 streaming requests over 200 concurrent connections against ``asyncbatch serve --device sim``.

Every stream must complete with no error, and its token ids must equal the same
request's ids run without the server: all 1,000 through ``LLM.generate`` in one
batch, and a sample of them one at a time (on ``sim`` a request's tokens are a
function of its seed, prompt and position, so batching must not change them).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[serve]')")

from asyncbatch import LLM, SamplingParams
from asyncbatch.profiling.stack_dump import DUMP_HEADER
from tests.serve_harness import ServeProcess

NUM_REQUESTS = 1000
CONCURRENCY = 200
TIME_LIMIT_S = 300


def workload() -> list[dict]:
    rng = random.Random(13)
    return [{"prompt": [rng.randrange(1, 40000) for _ in range(rng.randint(4, 48))],
             "max_tokens": rng.randint(8, 48), "seed": i} for i in range(NUM_REQUESTS)]


async def run_load(url: str, requests: list[dict]) -> tuple[dict[int, list[int]], list[str], list[str]]:
    ids: dict[int, list[int]] = {}
    errors: list[str] = []
    resent: list[str] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def one(i: int, request: dict) -> None:
            body = {**request, "temperature": 1.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
            async with gate:
                for _attempt in range(3):
                    got, finishes, done, answered = [], [], False, False
                    try:
                        async with http.stream("POST", "/v1/completions", json=body) as response:
                            answered = True
                            if response.status_code != 200:
                                errors.append(f"{i}: HTTP {response.status_code} {await response.aread()!r}")
                                return
                            async for line in response.aiter_lines():
                                if line == "data: [DONE]":
                                    done = True
                                elif line.startswith("data: "):
                                    event = json.loads(line[6:])
                                    if "error" in event:
                                        errors.append(f"{i}: {event['error']}")
                                    for choice in event.get("choices", []):
                                        got += choice["token_ids"]
                                        if choice["finish_reason"]:
                                            finishes.append(choice["finish_reason"])
                        break
                    except httpx.HTTPError as exc:
                        if answered:  # the server had the request: a broken stream is an error
                            errors.append(f"{i}: {exc!r}")
                            return
                        # No response yet: the request may never have reached the server (a pooled keep-alive
                        # connection closed under it), so it is sent again, as HTTP clients do; counted.
                        resent.append(f"{i}: {exc!r}")
            if not done or finishes != ["length"]:
                errors.append(f"{i}: stream ended without [DONE] or with {finishes}")
            ids[i] = got

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return ids, errors, resent


@pytest.mark.slow
def test_thousand_streams_no_error_no_lost_or_duplicated_token() -> None:
    requests = workload()
    server = ServeProcess("--max-num-seqs", "256", "--sim-step-ms", "2")
    try:
        start = time.monotonic()
        ids, errors, resent = asyncio.run(asyncio.wait_for(run_load(server.url, requests), TIME_LIMIT_S))
        elapsed = time.monotonic() - start
        if errors:  # e.g. streams that stopped: every thread's stack, server and engine core, into the log
            server.dump_stacks()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        log = server.kill()
    print(f"{len(ids)} of {NUM_REQUESTS} streams complete over {CONCURRENCY} connections in {elapsed:.1f} s; "
          f"{sum(len(v) for v in ids.values())} tokens; {len(errors)} errors; {len(resent)} sent again {resent[:3]}")
    problems = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line or "Error" in line]
    if errors:  # in full, in the report's captured output (an assertion message is shortened there)
        print("server log from the first thread stack on:\n" + log[log.find(DUMP_HEADER):], flush=True)
    assert not errors, (errors[:5], problems[:20])
    assert len(ids) == NUM_REQUESTS
    assert len(resent) <= NUM_REQUESTS // 100, resent[:5]  # a rare connection race, not a pattern
    assert 'asyncbatch:request_success_total{finished_reason="length"' in metrics

    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=1.0, ignore_eos=True, seed=r["seed"])
              for r in requests]
    with LLM(device="sim", max_model_len=8192, max_num_seqs=256) as llm:
        batch = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
        alone = {i: llm.generate([requests[i]["prompt"]], params[i], use_tqdm=False)[0] for i in range(0, 1000, 100)}
    mismatched = [i for i, out in enumerate(batch) if out.token_ids != ids[i]]
    assert not mismatched, f"{len(mismatched)} streams differ from the batch reference, e.g. {mismatched[:5]}"
    assert all(out.token_ids == ids[i] for i, out in alone.items())
