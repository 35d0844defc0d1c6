"""The decode step as a ``cuda_graphs.CapturableStep``: what a captured graph runs.

A decode-only step is a function of per-row inputs that the planner already
writes into the staging buffer (token row, position, KV slot, block table row,
context length, sampling parameters); everything else it touches has a fixed
address (weights, KV cache, the device token buffer). So one graph per padded
batch size serves every step of that size:

    input_ids = token_buffer[decode_token_rows]        # last step's tokens, never via the host
    logits    = model(input_ids, positions, KV through block_tables/context_lens)
    tokens    = sample(logits, per-row parameters)       # greedy, sample or filtered variant
    token_buffer[decode_token_rows] = tokens

(The ``HIDDEN`` variant stops before the LM head and returns the final hidden states; the executor samples
after the replay, eagerly, for steps whose sampling needs more than the per-row parameters above.)

Padding rows (``rows .. bucket``) are made harmless by their pad values, not
by masks sprinkled through the model: they read and write the dummy token row
(``dummy_token_row``, one past the last token row), write their key/value
to the first slot of the dummy KV block (``DUMMY_BLOCK``, never allocated to a
request), attend over that one slot (context length 1) and sample greedily.
Real rows never read the dummy block or the dummy token row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

import torch

from asyncbatch.engine.step_contract import DUMMY_BLOCK, StagingBuffer, StepMeta
from asyncbatch.model.forward_batch import ForwardBatch
from asyncbatch.model.llama import CausalLM
from asyncbatch.sampling.sampler import SamplingTensors, sample
from cuda_graphs import BufferSpec, OutputSpec


class SamplingVariant(Enum):
    """Which sampler path a graph contains; chosen per step from host-known flags."""

    GREEDY = "greedy"  # every row greedy: argmax only
    SAMPLE = "sample"  # some random rows, no top-k/top-p/min-p: Gumbel-max without the sort
    FILTERED = "filtered"  # some row filters: the full path
    # No sampler: the forward up to the final norm. A step with penalties or sampler extras (logit_bias,
    # min_tokens, logprobs, grammar masks) replays it, then computes its logits and samples eagerly.
    HIDDEN = "hidden"

    @classmethod
    def for_step(cls, meta: StepMeta) -> SamplingVariant:
        if meta.all_greedy:
            return cls.GREEDY
        return cls.FILTERED if meta.any_filter else cls.SAMPLE


class DecodeGraphStep:
    """Decode-only step over static inputs; see the module docstring for the padding rules."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 token_buffer: torch.Tensor, max_rows: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.token_buffer = token_buffer  # [max_num_seqs + 1], the last row is the dummy
        self.dummy_token_row = token_buffer.shape[0] - 1
        self.block_size = kv_caches[0][0].shape[1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self._row_ids = torch.arange(max_rows, dtype=torch.int64, device=token_buffer.device)  # logits rows
        self._host_names = tuple(spec.host for spec in self.input_specs())

    def input_specs(self) -> Sequence[BufferSpec]:
        i64, f32 = torch.int64, torch.float32
        return (
            BufferSpec("token_rows", (), i64, self.dummy_token_row, "decode_token_rows"),
            BufferSpec("positions", (), i64, 0, "positions"),
            BufferSpec("slot_mapping", (), i64, DUMMY_BLOCK * self.block_size, "slot_mapping"),
            BufferSpec("block_tables", (self.max_blocks_per_seq,), i64, DUMMY_BLOCK, "decode_block_tables"),
            BufferSpec("context_lens", (), i64, 1, "decode_context_lens"),
            BufferSpec("temperature", (), f32, 0.0, "sample_temperature"),
            BufferSpec("top_k", (), i64, 0, "sample_top_k"),
            BufferSpec("top_p", (), f32, 1.0, "sample_top_p"),
            BufferSpec("min_p", (), f32, 0.0, "sample_min_p"),
            BufferSpec("seed", (), i64, 0, "sample_seed"),
            BufferSpec("step", (), i64, 0, "sample_step"),
        )

    def output_specs(self) -> Sequence[OutputSpec]:
        """Tokens and their finiteness (the sampling variants), the final hidden states (``HIDDEN``)."""
        hidden = self.model.model.embed_tokens.weight
        return (OutputSpec("token_ids", (), torch.int64), OutputSpec("finite", (), torch.bool),
                OutputSpec("hidden", (hidden.shape[1],), hidden.dtype))

    def host_arrays(self, staging: StagingBuffer) -> dict[str, object]:
        """The staging buffer's arrays that ``input_specs`` copy from, by their ``BufferSpec.host`` names."""
        return {name: getattr(staging, name) for name in self._host_names}

    def run(self, inputs: Mapping[str, torch.Tensor], variant: SamplingVariant) -> dict[str, torch.Tensor]:
        token_rows = inputs["token_rows"]  # [rows]
        rows = token_rows.shape[0]
        batch = ForwardBatch(
            input_ids=self.token_buffer[token_rows], positions=inputs["positions"], slot_mapping=inputs["slot_mapping"],
            num_decode=rows, decode_block_tables=inputs["block_tables"], decode_context_lens=inputs["context_lens"],
            prefill_rows=[], logits_indices=self._row_ids[:rows])
        if variant is SamplingVariant.HIDDEN:
            return {"hidden": self.model.hidden_states(batch, self.kv_caches)}  # [rows, hidden]
        logits = self.model(batch, self.kv_caches)  # [rows, vocab] float32
        sampling = SamplingTensors(temperature=inputs["temperature"], top_k=inputs["top_k"], top_p=inputs["top_p"],
                                   min_p=inputs["min_p"], seed=inputs["seed"], step=inputs["step"])
        result = sample(logits, sampling, all_greedy=variant is SamplingVariant.GREEDY,
                        any_top_k_top_p_min_p=variant is SamplingVariant.FILTERED)
        self.token_buffer[token_rows] = result.token_ids
        return {"token_ids": result.token_ids, "finite": result.finite}
