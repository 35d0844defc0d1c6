"""``DraftModel``: its proposals are the draft's greedy continuation (against transformers' ``generate``), over
a KV cache that ``follow`` filled through the target's block tables; the drafting policy and the reserved KV
bound how many drafts a row makes."""

from __future__ import annotations

import torch
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM

from asyncbatch.model.forward_batch import ForwardBatch, PrefillRow
from asyncbatch.model.loader import load_model
from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.speculative.device_state import SpeculativeState
from asyncbatch.speculative.draft_model import DraftModel

BLOCK = 4
PROMPTS = [[5, 9, 17, 33, 2, 81, 7, 44, 12], [100, 3, 250]]
TABLES = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # block 0 is the dummy block


def prefill(prompts: list[list[int]]) -> ForwardBatch:
    """All but each prompt's last token, one prefill chunk a row, through ``TABLES`` (as the target's step)."""
    ids, positions, slots, rows = [], [], [], []
    for i, prompt in enumerate(prompts):
        n = len(prompt) - 1
        rows.append(PrefillRow(len(ids), n, n, TABLES[i, :(n + BLOCK - 1) // BLOCK]))
        ids += prompt[:-1]
        positions += list(range(n))
        slots += [int(TABLES[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    return ForwardBatch(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), 0,
                        torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), rows,
                        torch.tensor([len(ids) - 1]))


def test_drafts_are_the_draft_models_greedy_tokens_and_the_policy_bounds_them(tmp_path):
    folder = save_tiny_model(tmp_path / "draft", "LlamaForCausalLM")
    model = load_model(folder, torch.float32, "cpu", max_positions=64)
    draft = DraftModel(model, model.new_kv_caches(16, BLOCK), max_model_len=64)
    config = SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=3)
    rows = torch.tensor([0, 1])
    lasts = torch.tensor([p[-1] for p in PROMPTS])
    lengths = torch.tensor([len(p) - 1 for p in PROMPTS])  # each row's next input: its last prompt token

    def fresh() -> SpeculativeState:
        state = SpeculativeState(config, num_rows=2, max_model_len=64, device=torch.device("cpu"))
        state.start_rows(rows, lengths, torch.ones(2, dtype=torch.int64), lasts)
        return state

    draft.follow(prefill(PROMPTS), 0, None)
    buffer = torch.cat([lasts, torch.zeros(1, dtype=torch.int64)])
    state = fresh()
    draft.propose(state, rows, 3, TABLES, torch.tensor([16, 16]), buffer, dummy_slot=0)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, min_new_tokens=3)
        assert state.drafts[i].tolist() == greedy[0, len(prompt):].tolist(), i
    assert state.num_drafts[:2].tolist() == [3, 3]

    # Row 0 has KV reserved for its input and two drafts only; row 1's recent acceptance is below
    # min_acceptance (0.1): it drafts nothing, but its input token's KV is still written (``follow`` will not).
    state = fresh()
    state.acceptance[1] = 0.0
    k_cache = draft.kv_caches[0][0].view(-1, *draft.kv_caches[0][0].shape[2:])  # [slots, kv_heads, head_dim]
    slot = int(TABLES[1, int(lengths[1]) // BLOCK]) * BLOCK + int(lengths[1]) % BLOCK
    k_cache[slot] = 0
    draft.propose(state, rows, 3, TABLES, lengths + torch.tensor([3, 16]), buffer, dummy_slot=0)
    assert state.num_drafts[:2].tolist() == [2, 0]
    assert k_cache[slot].abs().sum() > 0
