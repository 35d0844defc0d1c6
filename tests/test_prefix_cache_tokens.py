"""Prefix caching on the default model (real torch execution on CPU): the same tokens with caching on and off.

A batch of prompts sharing a system prompt: cut at a block boundary and off
it, with questions after it, repeated, and prompts that are entirely a
prefix of others (so entirely cached once those ran). Chunked prefill spreads
admissions over steps so later requests find earlier ones' blocks; a KV
cache of 14 blocks forces preemption (recompute reuses what is still cached)
and eviction (20 did until requests sharing a prefix with a chunk of the same
plan waited a step for its blocks: the cache then went further). Overlap and
synchronous mode. Penalties and seeded sampling must see a reused prefix
exactly as a computed one.

In float32 the tokens are identical; in bfloat16 a cached prefix's KV was
computed in another batch, so its rounding differs and the runs may part at
near-ties only (the bfloat16 variants; docs/reproducibility.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from engine_checks import assert_idle_and_clean
from reference import assert_bfloat16_runs_agree

from asyncbatch import SamplingParams

pytestmark = pytest.mark.model

SYSTEM = ("You are the assistant of a small bakery in a quiet town. You answer questions about opening hours, "
          "bread, cakes, allergens and prices in one or two short sentences. You are friendly and precise, you "
          "never invent facts, and you say so when you do not know. The bakery opens at seven in the morning and "
          "closes at six in the evening, except on Sundays, when it closes at noon. Question:")
QUESTIONS = [" When do you open on Saturday?", " Do you sell rye bread?", " Is there gluten in the croissants?",
             " How much is a birthday cake?"]
BLOCK = 16  # EngineConfig's default block size
# Penalties over prompt and output, and seeded sampling: what must see a reused prefix as a computed one.
PENALISED_SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=11, repetition_penalty=1.5,
                                  presence_penalty=0.4, frequency_penalty=0.3, ignore_eos=True)


def prompts_of(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """(the batch, prompts that are entirely a prefix of the batch's prompts)."""
    system = tokenizer.encode(SYSTEM)
    assert len(system) > 4 * BLOCK + 10
    aligned, unaligned = system[:4 * BLOCK], system[:4 * BLOCK - 7]
    questions = [tokenizer.encode(q) for q in QUESTIONS]
    batch = [system + q for q in questions]
    batch += [aligned + questions[0], unaligned + questions[1], aligned, system, system + questions[2],
              unaligned + questions[3]]
    return batch, [aligned, system]


@dataclass
class Run:
    batch: list[list[int]]  # output tokens of the batch
    again: list[list[int]]  # output tokens of the prefixes submitted alone afterwards
    stats: dict  # LLM.stats()
    cache: dict  # prefix_cache_stats at the end
    again_cache: dict  # prompt and cached tokens of the second round alone
    prefix_lens: list[int]
    prompts: list[list[int]]  # the batch's prompts, then the prefixes'
    model_path: str


def run(make_llm, caching: bool, params: SamplingParams | list[SamplingParams], dtype: str = "float32",
        **kwargs) -> Run:
    """``params``: one for every request, or a list for the batch's requests and then the prefixes'."""
    llm = make_llm(device="cpu", dtype=dtype, enable_prefix_caching=caching, debug_check_integrity=True,
                   max_num_seqs=8, **kwargs)
    batch, prefixes = prompts_of(llm.tokenizer)
    batch_params, again_params = ((params[:len(batch)], params[len(batch):]) if isinstance(params, list)
                                  else (params, params))
    first = [o.token_ids for o in llm.generate(batch, batch_params, use_tqdm=False)]
    before = llm.prefix_cache_stats()
    again = [o.token_ids for o in llm.generate(prefixes, again_params, use_tqdm=False)]
    after = llm.prefix_cache_stats()
    stats = llm.stats()
    assert_idle_and_clean(llm)
    assert stats["prefix_cache_hit_rate"] == after["hit_rate"]
    assert stats["prefix_cached_blocks"] == after["cached_blocks"]
    return Run(first, again, stats, after, {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens")},
               [len(p) for p in prefixes], batch + prefixes, str(llm.model_path))


@pytest.fixture(scope="module")
def caching_off_runs() -> dict:
    """The caching-off reference of each engine configuration, made once in whichever mode runs first and
    compared with caching on in both modes: in float32 overlap and synchronous mode give the same tokens
    (tests/test_overlap_cpu.py), so one reference serves both and saves a run of the model per mode."""
    return {}


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["overlap", "sync"])
@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 48},  # chunked prefill; admissions spread over steps
    {"max_num_batched_tokens": 64, "num_kv_blocks": 14},  # preemption and eviction
], ids=["chunked", "tight"])
def test_tokens_identical_with_caching_on_and_off(make_llm, overlap, engine_kwargs, caching_off_runs):
    """Greedy rows beside rows with penalties and seeded sampling (which must see a reused prefix exactly as a
    computed one), in float32: the same tokens."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [greedy if i % 2 else PENALISED_SEEDED for i in range(12)]  # 10 batch prompts, then the 2 prefixes
    on = run(make_llm, True, params, overlap=overlap, **engine_kwargs)
    key = tuple(sorted(engine_kwargs.items()))
    if key not in caching_off_runs:
        caching_off_runs[key] = run(make_llm, False, params, overlap=overlap, **engine_kwargs)
    off = caching_off_runs[key]
    assert len(on.prompts) == len(params)
    assert on.batch == off.batch
    assert on.again == off.again
    assert on.stats["prefix_cache_hit_rate"] > 0.3, on.cache
    assert off.stats["prefix_cache_hit_rate"] == 0.0 and off.stats["prefix_cached_blocks"] == 0
    if "num_kv_blocks" in engine_kwargs:
        assert on.stats["preemptions"] > 0 and off.stats["preemptions"] > 0
        assert on.cache["evictions"] > 0
    else:
        assert on.stats["preemptions"] == 0
        # Prompts that are entirely cached: every full block but the one holding the last token is reused.
        assert on.again_cache == {"prompt_tokens": sum(on.prefix_lens),
                                  "cached_tokens": sum((n - 1) // BLOCK * BLOCK for n in on.prefix_lens)}


@pytest.mark.slow
def test_tokens_with_caching_on_and_off_bfloat16(make_llm):
    """bfloat16, forced so every CPU runs it, in the tight cache (chunked prefill, cache hits, preemption and
    eviction at once), greedy rows beside rows with penalties and seeded sampling: the runs part only at
    near-ties, and the cache is used as in float32."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [greedy if i % 2 else PENALISED_SEEDED for i in range(12)]  # 10 batch prompts, then the 2 prefixes
    engine_kwargs = {"max_num_batched_tokens": 64, "num_kv_blocks": 14}
    on = run(make_llm, True, params, dtype="bfloat16", overlap=True, **engine_kwargs)
    off = run(make_llm, False, params, dtype="bfloat16", overlap=True, **engine_kwargs)
    assert len(on.prompts) == len(params)
    assert on.stats["prefix_cache_hit_rate"] > 0.3, on.cache
    assert on.stats["preemptions"] > 0 and on.cache["evictions"] > 0
    assert_bfloat16_runs_agree(on.model_path, "caching on vs off", on.prompts, on.batch + on.again,
                               off.batch + off.again, params)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_cache_salt_shares_blocks_only_within_its_salt(make_llm, overlap):
    """vLLM's ``cache_salt``: the same prompt under another salt, or none, computes everything again; under the
    same salt it hits; tokens are the same either way (``sim``, block accounting checked after every step)."""
    llm = make_llm("smollm2-135m", device="sim", overlap=overlap, block_size=16, debug_check_integrity=True,
                   skip_tokenizer_init=True, engine_process=False)
    prompt = list(range(100, 164))  # four full blocks
    tokens = {}

    def run(salt: str | None) -> int:
        before = llm.prefix_cache_stats()["cached_tokens"]
        out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, seed=1, cache_salt=salt),
                           use_tqdm=False)[0]
        tokens.setdefault("first", out.token_ids)
        assert out.token_ids == tokens["first"]
        return llm.prefix_cache_stats()["cached_tokens"] - before

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0 and run(None) == 0  # other salts, and none, do not see tenant-a's blocks
    assert run("tenant-a") == 48 and run(None) == 48 and run("tenant-b") == 48  # each hits its own (3 of 4 blocks)
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
