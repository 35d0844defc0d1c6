"""What a weight precision costs in quality: teacher-forced top-1 agreement with float32, and perplexity.

The text (``data/quality_text.txt``, prose written for this project and
shipped with it) is tokenized once and fed through the model in chunks of
``chunk`` tokens over the paged KV cache, exactly as chunked prefill feeds the
engine; every position's logits are kept. Agreement is the fraction of
positions whose argmax equals the float32 model's argmax at the same position
(both read the true text, so one disagreement does not derail the rest);
perplexity is ``exp`` of the mean negative log-likelihood of the next token.

``chunk`` sets how many rows each linear sees per call (8 by default, a small
decode batch; every precision's kernels are the same at any row count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.llama import CausalLM

QUALITY_TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
BLOCK_SIZE = 16


@dataclass(slots=True)
class TeacherForced:
    """Per position ``i`` (predicting token ``i + 1``): the argmax and the log-likelihood of the true token."""

    argmax: torch.Tensor  # [N - 1] int64
    log_likelihood: torch.Tensor  # [N - 1] float64
    margin: torch.Tensor  # [N - 1] float64, probability of the top-1 token minus that of the top-2

    @property
    def perplexity(self) -> float:
        return math.exp(-self.log_likelihood.mean().item())


def teacher_forced(model: CausalLM, token_ids: list[int], chunk: int = 8) -> TeacherForced:
    """Run ``token_ids`` through ``model`` in chunks of ``chunk`` tokens; logits at every position."""
    n = len(token_ids)
    blocks = -(-n // BLOCK_SIZE)
    kv = model.new_kv_caches(blocks + 1, BLOCK_SIZE)
    table = torch.arange(1, blocks + 1, dtype=torch.int64)  # block 0 unused, as the engine's dummy block
    ids = torch.tensor(token_ids, dtype=torch.int64)
    argmax, loglik, margin = [], [], []
    with torch.inference_mode():
        for start in range(0, n - 1, chunk):
            end = min(start + chunk, n - 1)
            positions = torch.arange(start, end, dtype=torch.int64)
            slots = table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
            q_len = end - start
            batch = ForwardBatch(input_ids=ids[start:end], positions=positions, slot_mapping=slots, num_decode=0,
                                 decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                                 decode_context_lens=torch.zeros(0, dtype=torch.int64),
                                 prefill_rows=[PrefillRow(0, q_len, end, table[:-(-end // BLOCK_SIZE)])],
                                 logits_indices=torch.arange(q_len))
            logits = model(batch, kv).double()  # [q_len, vocab]
            argmax.append(logits.argmax(-1))
            logp = torch.log_softmax(logits, -1)
            loglik.append(logp.gather(1, ids[start + 1:end + 1, None])[:, 0])
            top2 = logp.topk(2, dim=-1).values.exp()  # [q_len, 2]
            margin.append(top2[:, 0] - top2[:, 1])
    return TeacherForced(torch.cat(argmax), torch.cat(loglik), torch.cat(margin))


def agreement(result: TeacherForced, reference: TeacherForced, min_margin: float = 0.0) -> float:
    """Fraction of positions where both pick the same top-1 token; with ``min_margin``, only positions where
    the reference's top-1 probability exceeds its top-2 by more than that (near-ties left out)."""
    keep = reference.margin > min_margin if min_margin > 0 else torch.ones_like(reference.margin, dtype=torch.bool)
    return (result.argmax == reference.argmax)[keep].double().mean().item()
