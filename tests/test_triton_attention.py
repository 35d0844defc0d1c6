"""The Triton paged-attention kernels against the torch reference, on random inputs.

On a CUDA machine the kernels are compiled and run on the GPU; elsewhere they
run in Triton's CPU interpreter, which ``TRITON_INTERPRET=1`` selects when
Triton is *first imported*. This module sets it if it gets there first; in a
full test session some earlier module has usually imported Triton already
(transformers' model classes import it through ``torch._dynamo``), and then
one test reruns this file in a fresh interpreter process instead.

The reference is ``paged_attention``'s torch code in float64 on the CPU.
Relative error ``|out - ref| / |ref|`` must stay below 1e-5 for float32
inputs and 1e-2 for bfloat16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
_IN_FRESH_PROCESS = not _CUDA and os.environ.get("TRITON_INTERPRET") != "1"
kernel_test = pytest.mark.skipif(_IN_FRESH_PROCESS, reason="Triton was imported without its interpreter: "
                                 "test_kernels_in_a_fresh_interpreter_process runs this test")

from asyncbatch.model import paged_attention as reference
from asyncbatch.model import split_decode
from asyncbatch.model import triton_attention as kernels
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow

DEVICE = torch.device("cuda" if _CUDA else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
POISON = float("nan")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Random K/V caches; the last block is all NaN and no row's context ever covers it."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k[-1], v[-1] = POISON, POISON
    return k.to(dtype), v.to(dtype)


def random_tables(rows: int, width: int, needed: list[int], num_blocks: int, seed: int) -> torch.Tensor:
    """Distinct real blocks (1 .. num_blocks - 2) for each row's context; the poisoned block after it."""
    g = torch.Generator().manual_seed(seed)
    table = torch.full((rows, width), num_blocks - 1, dtype=torch.int64)
    for i, n in enumerate(needed):
        table[i, :n] = torch.randperm(num_blocks - 2, generator=g)[:n] + 1
    return table


def clean(table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The table for the reference, which gathers every entry (masked ones too): poison → block 1."""
    return torch.where(table == num_blocks - 1, 1, table)


DECODE_SHAPES = {
    "4-4-16-4": (4, 4, 16, 4),  # no GQA
    "9-3-64-16": (9, 3, 64, 16),  # SmolLM2-135M's shape
    "8-2-32-8": (8, 2, 32, 8),  # group of 4
    "6-2-24-4": (6, 2, 24, 4),  # head_dim padded to 32
}
DECODE_LAUNCHES = {"grouped": (None, None), "split-1": (1, None), "split-2": (2, None), "split-16": (16, None),
                   "split-2-n64": (2, 64)}


def decode_cases() -> list:
    """Every launch x shape x dtype, but in the interpreter split-16 in float32 only: its empty runs do not
    depend on the dtype, bfloat16's split path is covered by the other split launches, and the interpreter
    takes 4-9 s a split-16 case (the GPU check runs them all)."""
    cases = []
    for launch, (splits, block_n) in DECODE_LAUNCHES.items():
        for shape, dims in DECODE_SHAPES.items():
            for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                if splits == 16 and dtype == torch.bfloat16 and not _CUDA:
                    continue
                cases.append(pytest.param(dtype, *dims, splits, block_n, id=f"{launch}-{shape}-{name}"))
    return cases


@kernel_test
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,block_size,splits,block_n", decode_cases())
def test_decode_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size, splits, block_n):
    """``splits``: None runs the grouped kernel, a number the split kernel with that many runs per row
    (16: more runs than tiles, most of them empty); ``block_n``: its keys per tile, where not its choice
    (64, the tensor-core choice, also in the interpreter)."""
    lens = [1, 7, block_size, 3 * block_size + 5, 70, 0]  # 0: a row with nothing to attend writes zeros
    needed = [-(-n // block_size) for n in lens]
    width = max(needed) + 3  # wider than any row needs, as in a captured graph
    num_blocks = sum(needed) + 4
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=heads)
    tables = random_tables(len(lens), width, needed, num_blocks, seed=1)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int64)
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), context_lens.to(DEVICE),
            head_dim**-0.5)
    if splits is None:
        out = kernels.decode_attention(*args)
    else:
        launch = split_decode.split_decode_launch(heads // kv_heads, head_dim, block_size, splits,
                                                  fp32_dot=dtype == torch.float32 or not _CUDA, block_n=block_n)
        out = split_decode.split_decode_attention(*args, launch=launch)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.all(out[-1] == 0)
    real = slice(0, len(lens) - 1)
    ref = reference.decode_attention(q[real].double(), k_cache.double(), v_cache.double(),
                                     clean(tables[real], num_blocks), context_lens[real], head_dim**-0.5)
    assert relative_error(out[real], ref) < TOLERANCE[dtype]


def test_decode_splits_fill_the_device_from_the_shape_alone():
    """Powers of two within [1, 16] and the context's tiles; fewer rows get more; the interpreter gets one."""
    h200 = 132
    assert split_decode.decode_splits(256, 3, max_tiles=32, multiprocessors=h200) <= 2
    assert split_decode.decode_splits(1, 3, max_tiles=32, multiprocessors=h200) == 16
    assert split_decode.decode_splits(1, 3, max_tiles=5, multiprocessors=h200) == 4
    assert split_decode.decode_splits(1, 3, max_tiles=1, multiprocessors=h200) == 1
    chosen = [split_decode.decode_splits(rows, 3, 64, h200) for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    assert chosen == sorted(chosen, reverse=True) and all(s & (s - 1) == 0 for s in chosen)
    q, k_cache = torch.zeros(1, 9, 64), torch.zeros(4, 16, 3, 64)
    assert split_decode.engine_launch(q, k_cache, table_width=64).constexprs["SPLITS"] == 1


def test_the_decode_kernel_is_chosen_by_name():
    with pytest.raises(ValueError, match=r"decode kernel must be one of \('grouped', 'split'\), got 'fast'"):
        kernels.set_decode_kernel("fast")
    env = {**os.environ, "ASYNCBATCH_DECODE_KERNEL": "fast", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", "import asyncbatch.model.triton_attention"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and "ASYNCBATCH_DECODE_KERNEL must be one of" in done.stderr


def prefill_case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int):
    # (q_len, ctx_len): a whole prompt, a later chunk after cached context, one token, a multi-tile chunk.
    shapes = [(7, 7), (20, 33), (1, 40), (70, 75)]
    rows, start = [], 0
    for q_len, ctx_len in shapes:
        rows.append((start, q_len, ctx_len))
        start += q_len
    needed = [-(-c // block_size) for _, c in shapes]
    num_blocks = sum(needed) + 4
    k_cache, v_cache = make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=3)
    tables = random_tables(len(rows), max(needed) + 2, needed, num_blocks, seed=4)
    q = torch.randn(start, heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    return rows, tables, needed, k_cache, v_cache, q


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (9, 3, 64, 16)])
def test_prefill_kernel_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    rows, tables, needed, k_cache, v_cache, q = prefill_case(dtype, heads, kv_heads, head_dim, block_size)
    decode_rows = 2  # tokens before the chunks belong to someone else: the kernel must not write them
    q_all = torch.cat([torch.zeros(decode_rows, heads, head_dim, dtype=dtype), q])
    out = torch.full_like(q_all, POISON).to(DEVICE)
    meta = torch.tensor([(s + decode_rows, n, c) for s, n, c in rows], dtype=torch.int64)
    kernels.prefill_attention(q_all.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE),
                              meta.to(DEVICE), max(n for _, n, _ in rows), head_dim**-0.5, out)
    assert torch.isnan(out[:decode_rows]).all()
    for i, (s, n, c) in enumerate(rows):
        ref = reference.prefill_attention(q[s:s + n].double(), k_cache.double(), v_cache.double(), c,
                                          tables[i, :needed[i]], head_dim**-0.5)
        assert relative_error(out[decode_rows + s:decode_rows + s + n], ref) < TOLERANCE[dtype], (i, n, c)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_kernel_reads_shared_cached_blocks(dtype):
    """Prefix-cache hits: rows list the same cached blocks first (written by no row of this launch) and compute
    only their chunk after them, from a block boundary; one row recomputes just the last block of a prompt
    that was entirely cached, one computes a single token."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    cached = torch.randperm(5, generator=torch.Generator().manual_seed(7)) + 1  # 5 shared blocks, 80 tokens
    # (cached blocks listed, q_len): the chunk sits at positions cached * block_size .. + q_len - 1.
    shapes = [(5, 23), (3, 16), (2, 1), (4, 40)]
    rows, start, tables, needed = [], 0, [], []
    g = torch.Generator().manual_seed(8)
    for k, q_len in shapes:
        ctx = k * block_size + q_len
        need = -(-ctx // block_size)
        own = torch.randperm(39 - 6, generator=g)[:need - k] + 6  # fresh blocks, disjoint from the shared ones
        tables.append(torch.cat([cached[:k], own, torch.full((8 - need,), 39)]))
        rows.append((start, q_len, ctx))
        needed.append(need)
        start += q_len
    table = torch.stack(tables)
    assert (table[:, 0] == cached[0]).all()
    k_cache, v_cache = make_cache(40, block_size, kv_heads, head_dim, dtype, seed=9)
    q = torch.randn(start, heads, head_dim, generator=torch.Generator().manual_seed(10)).to(dtype)
    out = torch.full_like(q, POISON).to(DEVICE)
    meta = torch.tensor(rows, dtype=torch.int64)
    kernels.prefill_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE),
                              meta.to(DEVICE), max(n for _, n, _ in rows), head_dim**-0.5, out)
    for i, (s, n, c) in enumerate(rows):
        ref = reference.prefill_attention(q[s:s + n].double(), k_cache.double(), v_cache.double(), c,
                                          table[i, :needed[i]], head_dim**-0.5)
        assert relative_error(out[s:s + n], ref) < TOLERANCE[dtype], (i, n, c)


@kernel_test
@pytest.mark.parametrize("decode_kernel", kernels.DECODE_KERNELS)
@pytest.mark.parametrize("paged", [True, False], ids=["uploaded-rows", "rows-built-here"])
def test_mixed_batch_dispatch_matches_reference(paged, decode_kernel):
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    rows, tables, needed, k_cache, v_cache, q_pre = prefill_case(torch.float32, heads, kv_heads, head_dim, block_size)
    decode_lens = torch.tensor([5, 12], dtype=torch.int64)
    decode_tables = random_tables(2, 6, [2, 3], k_cache.shape[0], seed=6)
    q = torch.cat([torch.randn(2, heads, head_dim), q_pre])
    t = q.shape[0]
    prefill_rows = [PrefillRow(s + 2, n, c, tables[i, :needed[i]].to(DEVICE)) for i, (s, n, c) in enumerate(rows)]
    fields = {"input_ids": torch.zeros(t, dtype=torch.int64), "positions": torch.zeros(t, dtype=torch.int64),
                  "slot_mapping": torch.zeros(t, dtype=torch.int64), "num_decode": 2,
                  "decode_block_tables": decode_tables.to(DEVICE), "decode_context_lens": decode_lens.to(DEVICE),
                  "prefill_rows": prefill_rows, "logits_indices": torch.zeros(1, dtype=torch.int64)}
    if paged:
        meta = torch.tensor([(r.token_start, r.q_len, r.ctx_len) for r in prefill_rows], dtype=torch.int64)
        batch = kernels.PagedForwardBatch(**fields, prefill_meta=meta.to(DEVICE), prefill_tables=tables.to(DEVICE),
                                          max_prefill_len=max(r.q_len for r in prefill_rows))
    else:
        batch = ForwardBatch(**fields)
    previous = kernels.decode_kernel()
    kernels.set_decode_kernel(decode_kernel)
    try:
        out = kernels.paged_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), batch, 0.25)
    finally:
        kernels.set_decode_kernel(previous)
    ref = torch.empty(q.shape, dtype=torch.float64)
    ref[:2] = reference.decode_attention(q[:2].double(), k_cache.double(), v_cache.double(),
                                         clean(decode_tables, k_cache.shape[0]), decode_lens, 0.25)
    for i, (s, n, c) in enumerate(rows):
        ref[s + 2:s + 2 + n] = reference.prefill_attention(q[s + 2:s + 2 + n].double(), k_cache.double(),
                                                           v_cache.double(), c, tables[i, :needed[i]], 0.25)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not _IN_FRESH_PROCESS, reason="the kernel tests above run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
               "-k", "not test_kernels_in_a_fresh_interpreter_process"]
    result = subprocess.run(command, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, result.stdout[-2000:]
