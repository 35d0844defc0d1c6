"""Repetition, presence and frequency penalties against a plain-Python reference."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from asyncbatch.sampling.penalties import PenaltyState

NUM_ROWS, VOCAB = 6, 11


class ReferenceState:
    """The penalty state spelled out with sets and counters."""

    def __init__(self) -> None:
        self.seen: dict[int, set[int]] = {s: set() for s in range(NUM_ROWS)}
        self.outputs: dict[int, Counter[int]] = {s: Counter() for s in range(NUM_ROWS)}

    def reset(self, rows: list[int]) -> None:
        for s in rows:
            self.seen[s] = set()
            self.outputs[s] = Counter()

    def add(self, row: int, token: int, is_output: bool) -> None:
        self.seen[row].add(token)
        if is_output:
            self.outputs[row][token] += 1

    def apply(self, logits: np.ndarray, rows: list[int], presence, frequency, repetition) -> np.ndarray:
        out = logits.astype(np.float64).copy()
        for r, row in enumerate(rows):
            for token in range(VOCAB):
                if token in self.seen[row]:
                    if out[r, token] > 0:
                        out[r, token] /= repetition[r]
                    else:
                        out[r, token] *= repetition[r]
                count = self.outputs[row][token]
                out[r, token] -= frequency[r] * count + presence[r] * (count > 0)
        return out


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(8))
def test_matches_reference_under_random_updates(seed: int):
    rng = random.Random(seed)
    state, ref = PenaltyState(NUM_ROWS, VOCAB, torch.device("cpu")), ReferenceState()
    for _ in range(12):
        op = rng.choice(["reset", "context", "record", "record_valid"])
        if op == "reset":
            rows = rng.sample(range(NUM_ROWS), rng.randint(1, 3))
            state.reset_rows(_ints(rows + rows[:1]))  # a duplicate row is harmless
            ref.reset(rows)
        elif op == "context":
            n = rng.randint(1, 20)
            # few distinct tokens, so (row, token) pairs repeat within the chunk
            rows, tokens = [rng.randrange(NUM_ROWS) for _ in range(n)], [rng.randrange(4) for _ in range(n)]
            is_output = [rng.random() < 0.5 for _ in range(n)]
            state.add_context(_ints(rows), _ints(tokens), torch.tensor(is_output))
            for s, t, o in zip(rows, tokens, is_output):
                ref.add(s, t, o)
        else:
            n = rng.randint(1, 8)
            rows, tokens = [rng.randrange(NUM_ROWS) for _ in range(n)], [rng.randrange(VOCAB) for _ in range(n)]
            valid = [rng.random() < 0.7 for _ in range(n)] if op == "record_valid" else [True] * n
            state.record(_ints(rows), _ints(tokens), torch.tensor(valid) if op == "record_valid" else None)
            for s, t, v in zip(rows, tokens, valid):
                if v:
                    ref.add(s, t, True)
    rows = [rng.randrange(NUM_ROWS) for _ in range(9)]
    logits = np.float32(np.random.default_rng(seed).normal(0, 3, size=(9, VOCAB)))
    logits[:, 0] = 0.0  # zero is multiplied, like a negative logit, and stays zero
    presence = [rng.uniform(-2, 2) for _ in rows]
    frequency = [rng.uniform(-2, 2) for _ in rows]
    repetition = [rng.uniform(0.5, 2.0) for _ in rows]
    got = state.apply(
        torch.from_numpy(logits), _ints(rows), torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition)
    )
    expected = ref.apply(logits, rows, presence, frequency, repetition)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    for s in range(NUM_ROWS):
        assert set(torch.nonzero(state.seen[s]).flatten().tolist()) == ref.seen[s]
        assert {t: int(state.counts[s, t]) for t in ref.outputs[s]} == dict(ref.outputs[s])
        assert int(state.counts[s].sum()) == sum(ref.outputs[s].values())


def test_recompute_via_add_context_equals_incremental_record():
    prompt, outputs = [3, 1, 3, 7], [5, 3, 5, 5, 0]
    incremental = PenaltyState(4, 9, torch.device("cpu"))
    incremental.reset_rows(_ints([2]))
    incremental.add_context(_ints([2] * len(prompt)), _ints(prompt), torch.zeros(len(prompt), dtype=torch.bool))
    for token in outputs:
        incremental.record(_ints([2]), _ints([token]))

    recomputed = PenaltyState(4, 9, torch.device("cpu"))
    recomputed.record(_ints([2]), _ints([8]))  # stale state from the row's previous owner
    recomputed.reset_rows(_ints([2]))
    tokens = prompt + outputs
    is_output = torch.tensor([False] * len(prompt) + [True] * len(outputs))
    recomputed.add_context(_ints([2] * len(tokens)), _ints(tokens), is_output)

    assert torch.equal(incremental.seen, recomputed.seen)
    assert torch.equal(incremental.counts, recomputed.counts)
    assert incremental.counts[2].tolist() == [1, 0, 0, 1, 0, 3, 0, 0, 0]
    logits = torch.randn(3, 9)
    args = (_ints([2, 2, 0]), torch.tensor([0.5, 0.0, 1.0]), torch.tensor([0.2, -0.3, 1.0]), torch.tensor([1.3, 0.7, 2.0]))
    assert torch.equal(incremental.apply(logits, *args), recomputed.apply(logits, *args))


def test_semantics_on_a_worked_example():
    state = PenaltyState(1, 5, torch.device("cpu"))
    state.add_context(_ints([0, 0]), _ints([0, 1]), torch.tensor([False, False]))  # prompt tokens 0, 1
    state.record(_ints([0]), _ints([2]))
    state.record(_ints([0]), _ints([2]))
    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0, -1.0]])
    rep_only = state.apply(logits, _ints([0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([2.0]))
    assert rep_only.tolist() == [[1.0, -4.0, 2.0, 1.0, -1.0]]
    additive = state.apply(logits, _ints([0]), torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([1.0]))
    # only output token 2 (count 2): 4 - 0.5 - 0.25 * 2; prompt tokens get no additive penalty
    assert additive.tolist() == [[2.0, -2.0, 3.0, 1.0, -1.0]]


def test_neutral_rows_unchanged_and_input_not_modified():
    state = PenaltyState(3, 7, torch.device("cpu"))
    state.add_context(_ints([0, 1, 1]), _ints([1, 2, 2]), torch.tensor([True, True, False]))
    logits = torch.randn(3, 7)
    before = logits.clone()
    out = state.apply(logits, _ints([0, 1, 2]), torch.zeros(3), torch.zeros(3), torch.ones(3))
    assert torch.equal(out, before)
    assert torch.equal(logits, before)


def test_record_skips_invalid_rows():
    state = PenaltyState(2, 4, torch.device("cpu"))
    state.record(_ints([0, 1, 1]), _ints([3, 2, 1]), torch.tensor([False, True, False]))
    assert not bool(state.seen[0].any())
    assert state.seen[1].tolist() == [False, False, True, False]
    assert state.counts.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]


def test_allocates_lazily():
    state = PenaltyState(1024, 50_000, torch.device("cpu"))
    assert not state.allocated
    state.reset_rows(_ints([3]))
    assert state.allocated
    assert state.counts.shape == (1024, 50_000)
    with pytest.raises(ValueError, match="num_rows"):
        PenaltyState(0, 10, torch.device("cpu"))
