"""The live-engine admission burst the probes share (``in_engine_parts.py``, ``../session-2026-12-04-night/
admit_wall.py``): the engine core in this process (``engine_process=False``, ``skip_tokenizer_init``) so that a probe
can wrap its functions, ``sim`` at 1 ms steps, the default token budget (so ~60 are admitted a step); four requests
to warm it up, then 256 prompts of 32 tokens at once, 100-token greedy outputs."""

from collections.abc import Callable

import numpy as np


def run_burst(run: int, before_burst: Callable[[], None], **llm_kwargs) -> dict:
    """One engine through the burst (prompts seeded by ``run``); ``before_burst`` runs after the warm-up, where a
    probe clears what the warm-up recorded. Returns the engine's ``stats()``."""
    from asyncbatch import LLM, SamplingParams, SimConfig

    sim = SimConfig(step_fixed_ms=1.0, per_token_us=0.0, per_context_token_ns=0.0)
    with LLM(device="sim", sim=sim, max_num_seqs=256, seed=0, engine_process=False, skip_tokenizer_init=True,
             **llm_kwargs) as llm:
        rng = np.random.default_rng(run)
        prompts = [rng.integers(256, 30000, 32).tolist() for _ in range(256)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        llm.wait_settled(5.0)
        before_burst()
        params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, seed=i) for i in range(256)]
        llm.generate(prompts, params, use_tqdm=False)
        return llm.stats()
