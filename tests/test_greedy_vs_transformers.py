"""Greedy tokens of the engine against transformers ``generate``, one prompt at a time, float32.

The engine gets every prompt at once, with a small token budget so long prompts
are chunked and requests join and leave mid-run; the reference runs each
prompt alone.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_idle_and_clean
from golden_tokens import GoldenTokens, request_key
from reference import LazyModel, compare_greedy
from tiny_models import EOS_ID, LLAMA3_ROPE, save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch import SamplingParams

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a land far away, there lived a",
    "Translate to French: Good morning, how are you today?",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Explain in one sentence why the sky is blue.",
    "Q: What is 7 times 8?\nA:",
    "A recipe for pancakes needs flour, eggs and",
    "In the beginning",
    "import numpy as np\n",
    "Dear hiring manager, I am writing to apply for",
    " ".join(["This is a long prompt that repeats itself to be chunked over several steps."] * 12),
]


def default_workload(tokenizer) -> tuple[list[list[int]], list[int]]:
    """The prompts' token ids and each request's max_tokens (different lengths: requests leave mid-run);
    ``scripts/update_golden_tokens.py`` generates the reference for exactly these."""
    return [tokenizer.encode(p) for p in PROMPTS], [8 + (i * 5) % 25 for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def default_reference() -> dict:
    """transformers' greedy tokens for the default model, shared by the overlap and synchronous runs: the
    committed golden tokens where their key (GGUF hash, transformers version) matches, else generated here
    once and written back (``golden_tokens``); the model itself is loaded only to generate or to measure a
    near-tie's gap."""
    return {"golden": GoldenTokens.load(), "tokens": None, "model": None}


@pytest.mark.model
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_default_model_greedy_matches_transformers(make_llm, overlap, default_reference):
    llm = make_llm(device="cpu", dtype="float32", overlap=overlap, max_num_batched_tokens=96, max_num_seqs=8)
    prompt_ids, max_tokens = default_workload(llm.tokenizer)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    assert_idle_and_clean(llm)
    eos = llm.tokenizer.eos_token_id
    golden: GoldenTokens = default_reference["golden"]
    if default_reference["tokens"] is None:
        keys = [request_key(p, n, eos) for p, n in zip(prompt_ids, max_tokens)]
        default_reference["tokens"] = dict(golden.tokens) if golden.covers(keys) else {}
        default_reference["model"] = LazyModel(llm.model_path, "float32")
    cache = default_reference["tokens"]
    generated = not cache
    result = compare_greedy(default_reference["model"], prompt_ids, [o.token_ids for o in outs], max_tokens,
                            eos, cache=cache)
    if generated:
        golden.save(cache)
        print(f"golden tokens regenerated for {golden.key} into {golden.path}")
    print(f"default model ({'overlap' if overlap else 'sync'}): {result.summary()}")
    assert result.exact >= len(PROMPTS) - 2, result.summary()
    assert llm.stats()["steps"] > 0


@pytest.mark.parametrize("arch,kwargs", [
    ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    ("MistralForCausalLM", {}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen3ForCausalLM", {}),
])
def test_tiny_models_greedy_match_transformers(make_llm, tmp_path, arch, kwargs):
    path = save_tiny_model(tmp_path / arch, arch, **kwargs)
    llm = make_llm(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    prompts = [[3 + (i * 31 + j * 7) % 250 for j in range(3 + i * 5)] for i in range(8)]
    max_tokens = [6 + i * 3 for i in range(8)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens],
                        use_tqdm=False)
    assert_idle_and_clean(llm)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    result = compare_greedy(reference, prompts, [o.token_ids for o in outs], max_tokens, EOS_ID)
    print(f"{arch}: {result.summary()}")
    assert result.exact >= len(prompts) - 1, result.summary()


def test_preemption_keeps_greedy_tokens(make_llm, tmp_path):
    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    prompts = [[3 + (i * 17 + j) % 250 for j in range(10 + i)] for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    roomy = make_llm(str(path), device="cpu", dtype="float32", block_size=4)
    expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    for overlap in (True, False):
        tight = make_llm(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=22, max_num_seqs=6,
                         overlap=overlap, debug_check_integrity=True)
        got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.stats()["preemptions"] > 0, "the cache was meant to be too small"
        assert got == expected
        assert_idle_and_clean(tight)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_repetition_penalty_matches_transformers(make_llm, tmp_path, overlap):
    """Repetition penalty over prompt and output, as transformers' RepetitionPenaltyLogitsProcessor does;
    the tight cache makes requests recompute, which must rebuild the penalty state."""
    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    prompts = [[3 + (i * 17 + j) % 40 for j in range(6 + 2 * i)] for i in range(6)]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                 repetition_penalty=1.5, eos_token_id=None, pad_token_id=0,
                                 temperature=None, top_p=None, top_k=None)
        expected.append(out[0, len(prompt):].tolist())
    params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
    for kwargs in ({}, {"num_kv_blocks": 16, "block_size": 4}):
        llm = make_llm(str(path), device="cpu", dtype="float32", overlap=overlap, max_num_seqs=6, **kwargs)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, kwargs
        if kwargs:
            assert llm.stats()["preemptions"] > 0
        plain = llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].token_ids
        assert plain != expected[0], "the penalty must change something for this test to mean anything"
        llm.close()


def test_penalties_and_seeded_sampling_same_in_both_modes(make_llm, tmp_path):
    path = save_tiny_model(tmp_path / "qwen3", "Qwen3ForCausalLM")
    # Longest first: its early chunks fill whole steps in which no penalised row samples.
    prompts = [[3 + (i * 11 + j) % 60 for j in range(4 + 3 * i)] for i in reversed(range(8))]
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.3,
                             top_p=0.9 if i % 2 else 1.0, ignore_eos=True) for i in range(8)]
    runs = []
    for overlap in (True, False):
        for kwargs in ({"num_kv_blocks": 20}, {"max_num_batched_tokens": 8}):  # preemption; chunked prompts
            llm = make_llm(str(path), device="cpu", dtype="float32", overlap=overlap, block_size=4, max_num_seqs=8, **kwargs)
            runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            llm.close()
    assert all(run == runs[0] for run in runs[1:])
