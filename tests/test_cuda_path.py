"""The ``cuda`` backend on a real GPU: graphs against eager, overlap against sync, no host syncs.

Skipped without CUDA; ``scripts/gpu_check.sh`` runs it on a lent GPU machine.
Two levels:

* the executor alone, driven with hand-written decode steps (as in
  ``test_decode_graph``): graph replay against the eager path, token for token,
  and ``torch.cuda.set_sync_debug_mode("error")`` around every ``launch`` of a
  steady-state loop;
* the whole engine (``LLM(device="cuda")``) on a tiny model with greedy,
  seeded, filtered and penalised requests, chunked prefill and joins/leaves:
  graphs on == graphs off, overlap == sync, and the steady-state run raises
  nothing under the sync-debug mode.

Float32 throughout, so graph and eager steps (whose matrix products have
different row counts) agree to rounding and the tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh)")]

from test_decode_graph import MAX_BLOCKS, MAX_SEQS, prefilled_state, write_decode_rows
from tiny_models import save_tiny_model

from asyncbatch import SamplingParams
from asyncbatch.engine.host_staging import StagingBuffer
from asyncbatch.model.loader import load_model

CUDA = torch.device("cuda")
GRAPH_SIZES = (1, 2, 4)  # a 5-row step has no graph: graph and eager steps interleave


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cuda") / "llama", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def tiny_cuda_model(tiny_path):
    return load_model(tiny_path, torch.float32, CUDA, max_positions=4 * MAX_BLOCKS)


def run_decode_steps(model, graphs: bool, temps, top_k, sync_debug: bool = False) -> list[list[int]]:
    from asyncbatch.executors.cuda_executor import CudaExecutor, SamplingVariant

    caches, token_buffer, tables = prefilled_state(model)
    executor = CudaExecutor(model, caches, MAX_SEQS, CUDA, max_blocks_per_seq=MAX_BLOCKS, enable_cuda_graphs=graphs,
                            cuda_graph_batch_sizes=GRAPH_SIZES, capture_variants=tuple(SamplingVariant))
    executor.token_buffer.copy_(token_buffer)
    torch.cuda.synchronize()  # that copy ran on the default stream; the executor's streams do not wait for it
    buffers = [StagingBuffer.allocate(i, 16, MAX_SEQS, MAX_BLOCKS, pinned=True) for i in range(2)]
    sizes = [5, 4, 4, 3, 5, 2, 1, 1, 4]
    tokens, pending = [], []
    try:
        for step, n in enumerate(sizes):
            staging = buffers[step % 2]
            staging.fence.wait()
            staging.fence.arm()
            meta = write_decode_rows(staging, tables, n, step, temps, top_k)
            if sync_debug:
                torch.cuda.set_sync_debug_mode("error")
            try:
                pending.append(executor.launch(meta))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            if len(pending) == 2:  # one step ahead, as the engine runs
                tokens.append(executor.wait(pending.pop(0)).token_ids.tolist())
        tokens += [executor.wait(h).token_ids.tolist() for h in pending]
    finally:
        executor.close()
    return tokens


@pytest.mark.parametrize("temps,top_k", [([0.0] * 5, 0), ([0.0, 0.9, 1.3, 0.0, 0.7], 0),
                                         ([0.8, 0.9, 1.3, 0.0, 0.7], 20)], ids=["greedy", "sample", "filtered"])
def test_graph_replay_equals_eager(tiny_cuda_model, temps, top_k):
    eager = run_decode_steps(tiny_cuda_model, False, temps, top_k)
    graphs = run_decode_steps(tiny_cuda_model, True, temps, top_k)
    assert graphs == eager
    assert [len(t) for t in eager] == [5, 4, 4, 3, 5, 2, 1, 1, 4]


def test_no_host_sync_on_the_launch_path(tiny_cuda_model):
    temps = [0.0, 0.9, 1.3, 0.0, 0.7]
    reference = run_decode_steps(tiny_cuda_model, True, temps, 20)  # warm-up: compiles, captures
    assert run_decode_steps(tiny_cuda_model, True, temps, 20, sync_debug=True) == reference


def test_graph_capture_bookkeeping(tiny_cuda_model):
    from asyncbatch.executors.cuda_executor import STAGING_BUFFERS, CudaExecutor, SamplingVariant

    caches, _, _ = prefilled_state(tiny_cuda_model)
    executor = CudaExecutor(tiny_cuda_model, caches, MAX_SEQS, CUDA, max_blocks_per_seq=MAX_BLOCKS)
    try:
        info = executor.describe()
        stats = info["cuda_graph_stats"]
        assert info["attention"] == "triton" and info["cuda_graph_batch_sizes"] == [1, 2, 4, MAX_SEQS]
        assert stats["num_graphs"] == STAGING_BUFFERS * 4 * 2 and stats["lazy_captures"] == 0
        assert stats["capture_s"] > 0 and stats["pool_bytes"] > 0
        assert executor.graphs.has(1, MAX_SEQS, SamplingVariant.SAMPLE)
    finally:
        executor.close()


def engine_workload():
    prompts = [[3 + (i * 37 + j * 11) % 250 for j in range(4 + 9 * i)] for i in range(10)]
    params = []
    for i in range(10):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=12 + i, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=15, temperature=0.8, top_k=20, top_p=0.9, seed=i))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=18, temperature=0.7, repetition_penalty=1.3, seed=i))
        else:
            params.append(SamplingParams(max_tokens=25, temperature=0.0))
    return prompts, params


def shared_prefix_workload():
    """Prompts sharing a 40-token prefix, cut on and off block boundaries, and two that are entirely a prefix."""
    system = [3 + (j * 29) % 250 for j in range(40)]
    cuts = [40, 40, 36, 17, 40, 8, 40, 33]
    prompts = [system[:cut] + [5 + i, 7 + 2 * i] for i, cut in enumerate(cuts)] + [system, system[:36]]
    _, mixed = engine_workload()
    return prompts, mixed[:len(prompts)]


def run_engine(make_llm, path, workload=engine_workload, **kwargs) -> tuple[list[list[int]], dict]:
    llm = make_llm(str(path), device="cuda", dtype="float32", max_num_seqs=6, max_num_batched_tokens=32,
                   block_size=4, debug_check_integrity=True, **kwargs)
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_integrity()
    assert llm.num_free_blocks == llm.num_usable_blocks
    return [o.token_ids for o in outs], llm.executor_info


def test_engine_graphs_and_overlap_agree(make_llm, tiny_path):
    runs = {}
    for graphs in (True, False):
        for overlap in (True, False):
            runs[graphs, overlap], info = run_engine(make_llm, tiny_path, enable_cuda_graphs=graphs, overlap=overlap)
            assert info["cuda_graphs"] is graphs, "engine_builder must pass enable_cuda_graphs to CudaExecutor"
    reference = runs[False, False]
    assert all(tokens == reference for tokens in runs.values())
    assert sum(map(len, reference)) > 100


def test_engine_prefix_caching_on_and_off_agree(make_llm, tiny_path):
    """Cached prefixes read by the Triton prefill kernel and by graph-replayed decode steps; penalised and
    seeded rows after a hit; overlap and sync."""
    runs = {}
    for caching in (True, False):
        for overlap in (True, False):
            runs[caching, overlap], _ = run_engine(make_llm, tiny_path, shared_prefix_workload,
                                                   enable_prefix_caching=caching, overlap=overlap)
    reference = runs[False, False]
    assert all(tokens == reference for tokens in runs.values())


def test_engine_steady_state_has_no_host_sync(make_llm, tiny_path):
    llm = make_llm(str(tiny_path), device="cuda", dtype="float32", max_num_seqs=6, max_num_batched_tokens=32,
                   block_size=4)
    prompts, params = engine_workload()
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # warm-up: compile and capture
    torch.cuda.set_sync_debug_mode("error")  # process-wide: the planner thread's launches included
    try:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got == want


def test_engine_fused_elementwise_kernels_agree(make_llm, tiny_path, monkeypatch):
    """``fused_elementwise``'s kernels (``ASYNCBATCH_FUSED_ELEMENTWISE=1``) in captured graphs and eager steps,
    overlap and sync: the torch ops' tokens (float32: the logits differ only by the norm's order of summation)."""
    from asyncbatch.executors.cuda_executor import FUSED_ELEMENTWISE_ENV

    want, info = run_engine(make_llm, tiny_path)
    assert info["fused_elementwise"] is False
    monkeypatch.setenv(FUSED_ELEMENTWISE_ENV, "1")
    for graphs in (True, False):
        for overlap in (True, False):
            got, info = run_engine(make_llm, tiny_path, enable_cuda_graphs=graphs, overlap=overlap)
            assert info["fused_elementwise"] is True
            assert got == want, (graphs, overlap)


def test_engine_split_decode_kernel_agrees(make_llm, tiny_path, monkeypatch):
    """The split decode kernel (``split_decode``, the default: a few rows, so several runs per row and the
    merge kernel) in captured graphs and eager steps, overlap and sync: the grouped kernel's tokens. Each
    engine reports the kernel it launched: a variable set after the fork server started reaches its core."""
    from asyncbatch.model import triton_attention

    previous = triton_attention.decode_kernel()
    try:
        runs = {}
        for kernel in triton_attention.DECODE_KERNELS:
            monkeypatch.setenv("ASYNCBATCH_DECODE_KERNEL", kernel)  # an engine-core process reads it at import
            triton_attention.set_decode_kernel(kernel)  # an in-process engine
            for graphs in (True, False):
                for overlap in (True, False):
                    runs[kernel, graphs, overlap], info = run_engine(make_llm, tiny_path, enable_cuda_graphs=graphs,
                                                                     overlap=overlap)
                    assert info["decode_kernel"] == kernel
    finally:
        triton_attention.set_decode_kernel(previous)
    want = runs["grouped", False, False]
    assert all(tokens == want for tokens in runs.values())
