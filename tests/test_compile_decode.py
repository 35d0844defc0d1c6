"""``compile_decode=True``: pure decode steps through ``torch.compile`` give the eager path's greedy tokens.

Compiling takes ~40-55 s per model on the tiny model with a cold cache (2 shared cores), so the engine test is
marked slow and runs in-process engines. Inductor's on-disk cache serves a graph equal to one compiled before:
the tests below are built so that it can. A ``w8a8`` graph names each packed weight by the smallest free
handle (``model.quantization``), so an engine is freed before the next is built (handles then restart at 0,
layer for layer), and the rows test uses the engine test's block size, cache size and positions (the cache
tensors' shapes are part of the graph): after the engine test, its graphs are cache hits, not a third compile.
"""

from __future__ import annotations

import gc

import pytest
import torch
from engine_checks import assert_idle_and_clean
from tiny_models import save_tiny_model
from torch._dynamo.utils import counters

from asyncbatch import LLM, SamplingParams
from asyncbatch.config import EngineConfig
from asyncbatch.model.compiled_decode import CompiledDecode, check_compile_decode, cxx_compiler

# The engine test's KV cache and model shapes, which the rows test shares (the module docstring says why):
# 64 blocks of 4 tokens hold the engine test's 6 requests (48 blocks at most) without preemption, and 5 rows of
# 40 tokens (50 blocks) in the rows test; 128 positions is the tiny model's max_position_embeddings.
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 64
MAX_POSITIONS = 128

needs_cxx = pytest.mark.skipif(cxx_compiler() is None,
                               reason="torch.compile's CPU backend needs a C++ compiler (g++); none on PATH")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("compile") / "llama", "LlamaForCausalLM",
                               tie_word_embeddings=True))


def test_unsupported_combinations_raise_value_errors_naming_compile_decode(monkeypatch):
    for device in ("cuda", "sim"):
        with pytest.raises(ValueError, match="compile_decode"):
            EngineConfig(device=device, compile_decode=True)
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match="compile_decode"):
            EngineConfig(device="cpu", quantization=scheme, compile_decode=True)
        with pytest.raises(ValueError, match="compile_decode"):
            check_compile_decode(True, "cpu", scheme)
    with pytest.raises(ValueError, match="compile_decode"):
        check_compile_decode(True, "cuda", None)
    with pytest.raises(TypeError, match="compile_decode"):
        EngineConfig(compile_decode="yes")
    check_compile_decode(False, "cuda", "int8")  # off: nothing to check
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="compile_decode=True needs a C.. compiler"):
        check_compile_decode(True, "cpu", None)
    assert EngineConfig(dtype="float32").compile_decode is False


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("scheme", [None, "w8a8"])
@pytest.mark.usefixtures("make_llm")  # its teardown: no engine thread or core process left
def test_compiled_decode_gives_the_eager_greedy_tokens_in_overlap_and_sync(tiny_llama, scheme):
    """Plain decoding and n-gram speculation: a verify step is a pure decode batch of ``1 + k`` one-token rows a
    request (each with its own block table and length), so it runs the compiled graph too. Half the prompts
    repeat a pattern, so the n-gram proposer drafts from the prompt."""
    prompts = [[3 + (i * 31 + j * 7) % 250 for j in range(3 + i * 5)] for i in range(3)]
    prompts += [[5 + i, 9, 17 + i, 33] * (2 + i) for i in range(3)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    runs = {}
    for compiled, overlap, spec in ((False, True, False), (True, True, False), (True, False, False),
                                    (True, True, True), (True, False, True)):
        runs[compiled, overlap, spec] = _greedy_tokens(tiny_llama, scheme, compiled, overlap, prompts, params,
                                                       speculative=spec)
        gc.collect()  # the engine is freed, and with it its w8a8 handles (the module docstring says why)
    eager = runs[False, True, False]
    for key, tokens in runs.items():
        assert tokens == eager, f"compiled, overlap, speculative = {key}"
    assert [len(t) for t in eager] == [8 + 3 * i for i in range(6)]


def _greedy_tokens(model: str, scheme: str | None, compiled: bool, overlap: bool, prompts: list[list[int]],
                   params: list[SamplingParams], speculative: bool = False) -> list[list[int]]:
    """One engine's tokens for ``prompts``, after the checks every engine of the test passes; the engine is
    closed, and nothing outside this call refers to it."""
    spec = {"method": "ngram", "num_speculative_tokens": BLOCK_SIZE - 1, "prompt_lookup_min": 1,
            "min_acceptance": 0.0} if speculative else None
    with LLM(model, device="cpu", dtype="float32", quantization=scheme, compile_decode=compiled, overlap=overlap,
             engine_process=False, max_num_batched_tokens=24, max_num_seqs=6, block_size=BLOCK_SIZE,
             num_kv_blocks=NUM_KV_BLOCKS, num_threads=1, debug_check_integrity=True, speculative_config=spec) as llm:
        graphs = counters["stats"]["unique_graphs"]
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # Warm-up compiled every graph: no step (rows 1-6, or up to 6 x 4 verified tokens, block tables
        # growing) compiles another.
        assert counters["stats"]["unique_graphs"] == graphs
        info = llm.executor_info
        assert info["compile_decode"] is compiled and info["quantization"] == scheme
        if compiled:
            assert info["compiled_steps"] > 0 and info["compile_seconds"] > 0
        else:
            assert info["compiled_steps"] == 0
        if speculative:  # drafts were verified, and some accepted: several tokens a step went through the graph
            stats = llm.stats()
            assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
        assert_idle_and_clean(llm)
    return tokens


def test_compile_decode_is_off_by_default(make_llm, tiny_llama):
    llm = make_llm(tiny_llama, device="cpu", dtype="float32", engine_process=False, num_threads=1)
    info = llm.executor_info
    assert info["compile_decode"] is False and info["compile_seconds"] is None
    assert torch.compiler.is_compiling() is False


@needs_cxx
@pytest.mark.slow
def test_compiled_w8a8_rows_are_independent_of_the_batch_and_close_to_eager(tiny_llama):
    """One row alone (its own graph) against the same row in a batch of five, and against eager. w8a8 only:
    it is batch-independent by design (per-row activation grids); float32's matmul kernels differ with the
    row count in the eager path too, and the engine test covers its tokens."""
    scheme = "w8a8"
    from harness.decode_step import decode_batch

    from asyncbatch.model.compiled_decode import CompiledDecode
    from asyncbatch.model.loader import load_model

    gc.collect()  # no w8a8 model of an earlier test holds handles: ours are the engine test's
    model = load_model(tiny_llama, torch.float32, torch.device("cpu"), max_positions=MAX_POSITIONS,
                       quantization=scheme)
    kv_caches = model.new_kv_caches(NUM_KV_BLOCKS, BLOCK_SIZE)
    compiled = CompiledDecode(model, kv_caches)
    vocab = int(model.config.vocab_size)
    with torch.inference_mode():
        eager = model(decode_batch(5, 40, BLOCK_SIZE, vocab=vocab), kv_caches)
        five = compiled(decode_batch(5, 40, BLOCK_SIZE, vocab=vocab))
        one = compiled(decode_batch(1, 40, BLOCK_SIZE, vocab=vocab))  # the same first row, alone (the one-row graph)
    assert one.shape == (1, vocab) and five.shape == (5, vocab)
    assert torch.equal(one[0], five[0])
    torch.testing.assert_close(five, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(five.argmax(-1), eager.argmax(-1))


def test_a_traced_step_writes_the_kv_cache_through_the_in_place_op(tiny_llama):
    """While compiling, K/V reach the caches through ``asyncbatch::write_kv`` (``kv_write_op``), an op that declares
    the caches mutated, not through ``index_copy_``: traced as ``index_copy_`` on the caches the function closes
    over, the graph rewrote every cache it wrote in full, each step (one row of the default model: 28 ms with a
    small cache, 257 ms with 2,049 blocks). Dynamo's graph is read through a backend that records it (no C++
    compiler needed); the eager path keeps ``index_copy_``."""
    from harness.decode_step import decode_batch

    from asyncbatch.model.loader import load_model

    model = load_model(tiny_llama, torch.float32, torch.device("cpu"), max_positions=MAX_POSITIONS)
    kv_caches = model.new_kv_caches(NUM_KV_BLOCKS, BLOCK_SIZE)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    batch = decode_batch(2, 40, BLOCK_SIZE, vocab=int(model.config.vocab_size))
    step = torch.compile(lambda b: model(b, kv_caches), backend=record, fullgraph=True)
    with torch.inference_mode():
        expected = model(batch, kv_caches)
        logits = step(batch)
    torch._dynamo.reset()
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
    assert targets.count("asyncbatch.write_kv") == model.config.num_hidden_layers, targets
    assert not any("index_copy" in t for t in targets), targets
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_failed_compile_leaves_no_device_thread(tiny_llama, monkeypatch):
    """The warm-up compiles on the device thread (``kernel_threads``); when it fails, the executor stops the thread
    before the error reaches the engine's builder."""
    import threading

    from asyncbatch.executors.torch_executor import TorchExecutor
    from asyncbatch.model.loader import load_model

    def fail(self):
        raise RuntimeError("compiler missing")

    monkeypatch.setattr(CompiledDecode, "warm_up", fail)
    model = load_model(tiny_llama, torch.float32, torch.device("cpu"), max_positions=MAX_POSITIONS)
    with pytest.raises(RuntimeError, match="compiler missing"):
        TorchExecutor(model, model.new_kv_caches(NUM_KV_BLOCKS, BLOCK_SIZE), 4, torch.device("cpu"),
                      compile_decode=True, num_threads=1)
    assert not [t.name for t in threading.enumerate() if t.name == "asyncbatch-device"]


def test_cli_flag_reaches_the_engine_kwargs():
    import argparse

    from asyncbatch.cli.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]), overlap=True)["compile_decode"] is False
    assert engine_kwargs(parser.parse_args(["--compile-decode"]), overlap=True)["compile_decode"] is True
