"""``SpeculativeState``: a row's verify inputs from what the device holds, acceptance, and the drafting policy."""

from __future__ import annotations

import pytest
import torch

from asyncbatch.speculative.config import SpeculativeConfig
from asyncbatch.speculative.device_state import SpeculativeState

BLOCK = 4


def started(config: SpeculativeConfig, tokens: list[int]) -> SpeculativeState:
    """Row 0 holds ``tokens`` (its last one the next input, one output so far)."""
    state = SpeculativeState(config, num_rows=2, max_model_len=64, device=torch.device("cpu"))
    n = len(tokens)
    state.write_prefill(torch.zeros(n - 1, dtype=torch.int64), torch.arange(n - 1), torch.tensor(tokens[:-1]))
    state.start_rows(torch.tensor([0]), torch.tensor([n - 1]), torch.tensor([1]), torch.tensor([tokens[-1]]))
    return state


def test_verify_inputs_follow_the_device_length_and_stop_at_the_reserved_kv():
    state = started(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), [7, 8, 9, 7, 8])
    tokens = [7, 8, 9, 7, 8]  # row 1: the same history
    state.write_prefill(torch.ones(4, dtype=torch.int64), torch.arange(4), torch.tensor(tokens[:-1]))
    state.start_rows(torch.tensor([1]), torch.tensor([4]), torch.tensor([1]), torch.tensor([8]))
    rows = torch.tensor([0, 1])
    state.propose(rows)
    assert state.drafts[0].tolist() == [9, 7, 8] and state.num_drafts[:2].tolist() == [3, 3]
    buffer = torch.tensor([8, 8, 0])
    tables = torch.tensor([[5, 6, 0], [1, 2, 3]])
    # Positions 4..7. Row 0 has 7 tokens of KV reserved: position 7 writes the dummy block and only two of its
    # drafts can be checked; row 1 has room for all three, so the step computes four positions a row.
    v = state.decode_inputs(rows, 3, tables, torch.tensor([7, 12]), buffer, BLOCK, dummy_slot=0)
    assert v.width == 4 and v.usable_drafts.tolist() == [2, 3]
    assert v.input_ids.tolist() == [8, 9, 7, 8] * 2
    assert v.positions.tolist() == [4, 5, 6, 7] * 2
    assert v.slot_mapping.tolist() == [6 * BLOCK + 0, 6 * BLOCK + 1, 6 * BLOCK + 2, 0,
                                       2 * BLOCK + 0, 2 * BLOCK + 1, 2 * BLOCK + 2, 2 * BLOCK + 3]
    assert v.context_lens.tolist() == [5, 6, 7, 1, 5, 6, 7, 8]
    assert v.sample_steps.tolist() == [1, 2, 3, 4] * 2
    # Fewer usable drafts everywhere: fewer positions computed; none: a plain decode step.
    assert state.decode_inputs(rows, 3, tables, torch.tensor([7, 7]), buffer, BLOCK, 0).width == 3
    state.num_drafts[:2] = 0
    assert state.decode_inputs(rows, 3, tables, torch.tensor([7, 12]), buffer, BLOCK, 0).width == 1


def test_accept_keeps_the_confirmed_run_and_advances_the_row():
    state = started(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), [7, 8, 9, 7, 8])
    state.propose(torch.tensor([0]))  # drafts 9, 7, 8
    samples = torch.tensor([[9, 7, 5, 1]])  # confirms 9 and 7, rejects 8 (the target says 5)
    verified = state.accept(torch.tensor([0]), samples, torch.ones(1, 4, dtype=torch.bool), torch.tensor([3]))
    assert verified.tokens[0, :3].tolist() == [9, 7, 5] and int(verified.num_emitted[0]) == 3
    assert (verified.num_drafts, verified.num_draft_tokens, verified.num_accepted) == (1, 3, 2)
    assert int(state.length[0]) == 7 and int(state.num_outputs[0]) == 4
    assert state.history[0, :8].tolist() == [7, 8, 9, 7, 8, 9, 7, 5]
    # Non-finite logits at position 1: nothing from there on is emitted, even a confirmed draft.
    state.propose(torch.tensor([0]))
    bad = torch.tensor([[True, False, True, True]])
    verified = state.accept(torch.tensor([0]), torch.tensor([[1, 2, 3, 4]]), bad, torch.tensor([3]))
    assert int(verified.num_emitted[0]) == 1


def test_a_step_without_drafts_advances_each_row_by_its_one_token():
    """A one-position step (no row verifies a draft) takes ``accept``'s short path: the same state as the general
    path gives a row that verified no draft in a wider step, and nothing counted."""
    tokens = [7, 8, 9, 7, 8]
    short, wide = (started(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), tokens) for _ in range(2))
    row = torch.tensor([0])
    for finite in (True, False):  # non-finite logits: the row errs, its one token still lands (as before)
        verified = short.accept(row, torch.tensor([[5]]), torch.tensor([[finite]]), torch.tensor([0]))
        general = wide.accept(row, torch.tensor([[5, 6]]), torch.tensor([[finite, True]]), torch.tensor([0]))
        assert verified.tokens.tolist() == [[5]] and verified.num_emitted.tolist() == [1] == general.num_emitted.tolist()
        assert bool(verified.finite[0]) is finite is bool(general.finite[0])
        assert (verified.num_drafts, verified.num_draft_tokens, verified.num_accepted) == (0, 0, 0)
        for name in ("length", "num_outputs", "history", "acceptance"):
            assert torch.equal(getattr(short, name), getattr(wide, name)), name
    assert int(short.length[0]) == 6 and int(short.num_outputs[0]) == 3
    assert short.history[0, :7].tolist() == [7, 8, 9, 7, 8, 5, 5] and float(short.acceptance[0]) == 1.0


def test_a_row_that_keeps_rejecting_stops_drafting_and_retries():
    config = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, min_acceptance=0.5, retry_every=4)
    state = started(config, [3, 4, 5, 3, 4])
    row = torch.tensor([0])
    state.propose(row)
    assert state.drafts[0].tolist() == [5, 3] and int(state.num_drafts[0]) == 2
    # Both drafts rejected: the average falls from 1 to 0.7 (one step of ACCEPTANCE_DECAY), then to 0.49.
    for expected in (0.7, 0.49):
        state.accept(row, torch.tensor([[9, 9, 9]]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([2]))
        assert float(state.acceptance[0]) == pytest.approx(expected)
    state.history[0, :4] = torch.tensor([3, 4, 5, 3])  # a history the lookup matches again
    state.length[0] = 3
    for outputs, drafts in ((5, 0), (6, 0), (8, 2)):  # quiet below 0.5, except every 4th output (a retry)
        state.num_outputs[0] = outputs
        state.propose(row)
        assert int(state.num_drafts[0]) == drafts, outputs


def test_more_rows_than_disable_by_batch_size_propose_nothing():
    """A step sampling more rows than ``disable_by_batch_size`` skips the lookup and leaves every row without
    drafts (the planner verifies none there); at the limit the rows draft as usual."""
    tokens = [7, 8, 9, 7, 8]
    state = started(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=1), tokens)
    state.write_prefill(torch.ones(4, dtype=torch.int64), torch.arange(4), torch.tensor(tokens[:-1]))
    state.start_rows(torch.tensor([1]), torch.tensor([4]), torch.tensor([1]), torch.tensor([8]))
    state.propose(torch.tensor([0]))
    assert state.num_drafts[0].item() == 3
    state.propose(torch.tensor([0, 1]))  # two rows > 1: no drafts, the earlier ones withdrawn
    assert state.num_drafts[:2].tolist() == [0, 0]
    state.propose(torch.tensor([1]))
    assert state.num_drafts[:2].tolist() == [0, 3] and state.drafts[1].tolist() == [9, 7, 8]
