"""The grammar-mask path through every backend, with a scripted grammar instead of a grammar library.

``ScriptedCompiler`` stands in for ``asyncbatch.sampling.grammar.GrammarCompiler``: a request's "grammar"
allows the tokens of its choice string one at a time (``allowed[i]`` at output ``i``), then only EOS.
Every constrained output is therefore known in advance, whatever the random weights prefer, so the test
checks the plumbing exactly: masks filled for the right step (token N seen before N+1 is sampled), the
device waiting only for them (``cpu``: the device thread; ``cuda``: sampling enqueued by ``masks_ready``),
late rows after a finish, plain rows untouched. It needs no grammar library, so it runs everywhere; on a
GPU machine ``scripts/gpu_check.sh`` runs it with ``device="cuda"``.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from test_decode_graph import cuda_host_shim  # noqa: F401 - the fixture is used by name
from tiny_models import EOS_ID, save_tiny_model

from asyncbatch import LLM, SamplingParams, StructuredOutputsParams
from asyncbatch.sampling.token_bitmask import bitmask_words

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh)")])]


class ScriptedMatcher:
    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script, self.pos, self.vocab_size, self.done = script, 0, vocab_size, False

    def accept(self, token_id: int) -> bool:
        if self.pos < len(self.script):
            if token_id != self.script[self.pos]:
                return False
            self.pos += 1
            return True
        if token_id == EOS_ID:
            self.done = True
            return True
        return False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        allowed = self.script[self.pos] if self.pos < len(self.script) else EOS_ID
        bitmask[row] = 0
        bitmask[row, allowed // 32] = np.int32(np.uint32(1 << (allowed % 32)).view(np.int32))

    def is_terminated(self) -> bool:
        return self.done


class ScriptedCompiler:
    """The choice's text as the tiny byte-level tokenizer encodes it, token by token, then EOS."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, backend: str = "auto") -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        assert bitmask_words(vocab_size) > EOS_ID // 32

    def validate(self, params: StructuredOutputsParams) -> None:
        if params.choice is None or len(params.choice) != 1:
            raise ValueError("structured_outputs.choice: the scripted grammar takes one choice")

    def fill_bitmasks(self, matchers: list[ScriptedMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def accept_tokens(self, matchers: list[ScriptedMatcher], tokens: list[int]) -> list[bool]:
        return [matcher.accept(token) for matcher, token in zip(matchers, tokens)]

    def matcher(self, params: StructuredOutputsParams) -> ScriptedMatcher:
        return ScriptedMatcher(self.tokenizer.encode(params.choice[0], add_special_tokens=False), self.vocab_size)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("scripted") / "llama", "LlamaForCausalLM")


@pytest.fixture
def scripted(monkeypatch):
    from asyncbatch.sampling import grammar

    monkeypatch.setattr(grammar, "GrammarCompiler", ScriptedCompiler)


def _requests() -> tuple[list[str], list[SamplingParams], list[str]]:
    words = ["a", "json", "overlap", "the mask of step N+1 sees token N", "xy" * 20]
    prompts, params, expected = [], [], []
    for i in range(20):
        word = words[i % len(words)]
        prompts.append(f"prompt {i % 4}")
        if i % 3 == 2:  # a plain row between the constrained ones
            params.append(SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
            expected.append("")
        else:
            params.append(SamplingParams(max_tokens=64, temperature=1.0 if i % 2 else 0.0, seed=i, logprobs=2,
                                         structured_outputs=StructuredOutputsParams(choice=[word])))
            expected.append(word)
    return prompts, params, expected


@pytest.mark.parametrize("device", DEVICES)
def test_scripted_grammar_is_followed_exactly_in_every_mode(tiny_model, scripted, device):
    prompts, params, expected = _requests()
    tokens = {}
    for overlap in (True, False):
        for mask_overlap in ((True, False) if overlap else (True,)):
            with LLM(str(tiny_model), device=device, dtype="float32", max_num_seqs=8, engine_process=False,
                     overlap=overlap, grammar_mask_overlap=mask_overlap, num_kv_blocks=24,
                     debug_check_integrity=True) as llm:
                outputs = llm.generate(prompts, params, use_tqdm=False)
                stats = llm.stats()
            for out, word in zip(outputs, expected):
                if word:
                    assert out.text == word, (device, overlap, out.text)
                    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID
                    assert len(out.logprobs) == len(out.token_ids)
                else:
                    assert len(out.token_ids) == 12
            assert stats["mask_fill_us_per_row"] > 0
            tokens[overlap, mask_overlap] = [o.token_ids for o in outputs]
    assert tokens[True, True] == tokens[False, True] == tokens[True, False]


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _choice(word: str) -> SamplingParams:
    return SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(choice=[word]))


@pytest.mark.parametrize("warm", [True, False])
def test_the_warm_up_builds_both_compilers_before_the_first_grammar(tiny_model, monkeypatch, make_llm, warm):
    """``structured_outputs_warmup``: the frontend's compiler (the submission's check) and the core's (the
    matchers) are built on their background threads at start, once each; the first grammar finds them.
    Without it they are built when that grammar arrives, on the caller's thread and the core's worker."""
    from asyncbatch.sampling import grammar

    built: list[str] = []

    class Counting(ScriptedCompiler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(threading.current_thread().name)

    monkeypatch.setattr(grammar, "GrammarCompiler", Counting)
    llm = make_llm(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=4, engine_process=False,
                   num_kv_blocks=24, structured_outputs_warmup=warm)
    if warm:
        _wait_for(lambda: len(built) == 2)
        assert sorted(built) == ["asyncbatch-grammar-warmup", "asyncbatch-grammar_0"]
    else:
        time.sleep(0.2)
        assert built == []
    outputs = llm.generate(["p", "q"], [_choice("json"), _choice("overlap")], use_tqdm=False)
    assert [o.text for o in outputs] == ["json", "overlap"]
    assert all(o.finish_reason == "stop" for o in outputs)
    assert sorted(built) == (["asyncbatch-grammar-warmup", "asyncbatch-grammar_0"] if warm
                             else ["MainThread", "asyncbatch-grammar_0"])


def test_a_warm_up_that_cannot_build_is_logged_and_the_engine_serves_on(tiny_model, monkeypatch, make_llm,
                                                                        caplog):
    """No grammar library: the warm-up says so in the log; plain requests run; a structured one gets the
    reason at submission, as it would without the warm-up."""
    from asyncbatch.sampling import grammar

    class Missing:
        def __init__(self, *args, **kwargs) -> None:
            raise ImportError("no grammar library in this test")

    monkeypatch.setattr(grammar, "GrammarCompiler", Missing)
    with caplog.at_level(logging.INFO):
        llm = make_llm(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=4, engine_process=False,
                       num_kv_blocks=24, structured_outputs_warmup=True)
        _wait_for(lambda: sum("was not built ahead" in r.getMessage() for r in caplog.records) == 2)
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    assert len(llm.generate(["p"], plain, use_tqdm=False)[0].token_ids) == 6
    with pytest.raises(ImportError, match="no grammar library in this test"):
        llm.generate(["p"], _choice("json"), use_tqdm=False)
    assert len(llm.generate(["q"], plain, use_tqdm=False)[0].token_ids) == 6


def _extras_requests() -> tuple[list[str], list[SamplingParams]]:
    """``_requests``' grammar rows (with logprobs) and plain rows, and rows with each other sampler extra."""
    prompts, params, _ = _requests()
    extras = [SamplingParams(max_tokens=16, temperature=0.0, logit_bias={5: 5.0, 9: -100.0}, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=11, min_tokens=10),
              SamplingParams(max_tokens=16, temperature=0.7, seed=12, repetition_penalty=1.4, logprobs=3,
                             ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.0, ignore_eos=True)]
    return prompts + [f"extra {i}" for i in range(len(extras))], params + extras


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_decode_steps_with_sampler_extras_replay_their_forward(tiny_model, scripted, cuda_host_shim, overlap):  # noqa: F811
    """On the CUDA executor's host logic (run on the CPU by ``cuda_host_shim``), decode steps with grammar rows,
    logit_bias, min_tokens, penalties or logprobs replay the graph of their forward alone and sample eagerly
    (they used to run the whole step eagerly): tokens and logprobs equal the CPU executor's."""
    prompts, params = _extras_requests()
    runs = {}
    for name, settings in (("cpu", {}), ("graphs", {"enable_cuda_graphs": True, "cuda_graph_batch_sizes": (2, 4, 8)})):
        cuda_host_shim.clear()
        cuda_host_shim.update(settings)
        with LLM(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=8, engine_process=False,
                 overlap=overlap, num_kv_blocks=48, debug_check_integrity=True) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            info = llm._core.executor.describe()
        runs[name] = ([o.token_ids for o in outputs], [o.logprobs for o in outputs])
        if name == "graphs":
            assert info["cuda_graph_forward_only_steps"] > 10, info
    assert runs["graphs"][0] == runs["cpu"][0]
    for got, want in zip(runs["graphs"][1], runs["cpu"][1]):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.token_ids == want.token_ids and got.ranks == want.ranks
            assert got.top_token_ids == want.top_token_ids
            assert np.allclose(got.logprobs, want.logprobs, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh)")
def test_sampler_extras_on_a_gpu_replay_their_forward_and_match_eager_steps(tiny_model, scripted):
    """The same on a real GPU: float32, graphs on (extras steps replay their forward's graph) against graphs off
    (every step eager); tokens equal, logprobs within 1e-4."""
    prompts, params = _extras_requests()
    runs = {}
    for graphs in (True, False):
        with LLM(str(tiny_model), device="cuda", dtype="float32", max_num_seqs=8, engine_process=False,
                 enable_cuda_graphs=graphs, num_kv_blocks=48, debug_check_integrity=True) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            info = llm._core.executor.describe()
        runs[graphs] = outputs
        if graphs:
            assert info["cuda_graph_forward_only_steps"] > 10, info
    for with_graphs, eager in zip(runs[True], runs[False]):
        assert with_graphs.token_ids == eager.token_ids
        if eager.logprobs is not None:
            assert np.allclose(with_graphs.logprobs.logprobs, eager.logprobs.logprobs, atol=1e-4)
