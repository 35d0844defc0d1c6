"""How much device memory steps and graphs need, measured before the KV cache is sized.

The KV cache must be allocated before graphs are captured (a graph bakes in
its addresses), yet its size should be what is left after the graphs and the
eager steps' working memory. So, with the weights loaded and no cache yet:

    free after weights ──► profile one worst-case eager step on a 2-block scratch cache
                           (max_num_batched_tokens tokens, max_num_seqs sampled rows, full sampler)
                       ──► reserve = peak (eager steps at run time)
                                   + peak again if graphs are on (their pool holds one decode step's peak)
                                   + a fixed margin (cuBLAS workspaces, Triton modules, fragmentation)
    KV budget = gpu_memory_utilization × (free after weights − reserve)

Over-estimates rather than under: the profile step is larger than any real
step (all tokens in one prefill row, every sampled row on the filtered path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncbatch.engine.step_contract import blocks_for_tokens
from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM
from asyncbatch.sampling.sampler import SamplingTensors, sample

MARGIN_BYTES = 512 << 20


@dataclass(slots=True)
class StepMemory:
    step_peak_bytes: int  # activations + sampler scratch of the profile step
    graphs: bool

    @property
    def reserve_bytes(self) -> int:
        return self.step_peak_bytes * (2 if self.graphs else 1) + MARGIN_BYTES


def profile_step_memory(model: CausalLM, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                        graphs: bool) -> StepMemory:
    """Run one worst-case eager step on a scratch cache and measure its peak (CUDA only)."""
    device = model.output_weight.device
    scratch = model.new_kv_caches(2, block_size)
    t = max_num_batched_tokens
    r = min(max_num_seqs, t)
    i64 = {"dtype": torch.int64, "device": device}
    table = torch.ones(blocks_for_tokens(t, block_size), **i64)  # every position in scratch block 1
    batch = ForwardBatch(
        input_ids=torch.zeros(t, **i64), positions=torch.arange(t, **i64) % model.rope_cos.shape[0],
        slot_mapping=block_size + torch.arange(t, **i64) % block_size, num_decode=0,
        decode_block_tables=torch.zeros(0, 1, **i64), decode_context_lens=torch.zeros(0, **i64),
        prefill_rows=[PrefillRow(0, t, t, table)], logits_indices=torch.arange(t - r, t, **i64))
    f32 = {"dtype": torch.float32, "device": device}
    sampling = SamplingTensors(temperature=torch.ones(r, **f32), top_k=torch.full((r,), 50, **i64),
                               top_p=torch.full((r,), 0.9, **f32), min_p=torch.full((r,), 0.05, **f32),
                               seed=torch.arange(r, **i64), step=torch.zeros(r, **i64))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        logits = model(batch, scratch)
        sample(logits, sampling, all_greedy=False, any_top_k_top_p_min_p=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, batch, logits
    torch.cuda.empty_cache()
    return StepMemory(int(peak), graphs)
