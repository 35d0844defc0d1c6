"""The n-gram proposer (``asyncbatch.speculative.ngram``) against a plain-Python statement of vLLM's rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncbatch.speculative.ngram import ngram_propose


def reference(tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int | None) -> list[int]:
    """The longest suffix n-gram (min_n..max_n) found earlier with a token after it, its earliest occurrence,
    and up to k tokens after it (cut at the end and at max_model_len)."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        suffix = tokens[total - n:]
        for s in range(total - n):  # s + n <= total - 1
            if tokens[s:s + n] == suffix:
                room = k if max_model_len is None else min(k, max_model_len - total)
                return tokens[s + n:s + n + max(room, 0)]
    return []


def run(rows: list[list[int]], k: int, min_n: int, max_n: int, max_model_len: int | None = None,
        width: int | None = None) -> list[list[int]]:
    width = width or max(len(r) for r in rows) + 3
    history = torch.full((len(rows), width), 7, dtype=torch.int64)  # junk past each row's end
    for i, r in enumerate(rows):
        history[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    drafts, counts = ngram_propose(history, lengths, k, min_n, max_n, max_model_len)
    assert drafts.shape == (len(rows), k) and counts.shape == (len(rows),)
    out = [drafts[i, :int(counts[i])].tolist() for i in range(len(rows))]
    assert all((drafts[i, int(counts[i]):] == 0).all() for i in range(len(rows)))
    return out


def test_vllms_documented_example_and_simple_cases():
    # [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no earlier match, [2,3] matches at 1 -> [4,2,3].
    assert run([[1, 2, 3, 4, 2, 3]], 4, 2, 3) == [[4, 2, 3]]
    assert run([[5, 6, 7, 8]], 3, 1, 2) == [[]]  # nothing repeats
    assert run([[9, 9, 9, 9]], 2, 1, 3) == [[9]]  # the suffix may overlap its earlier occurrence
    # The longest n wins over an earlier, shorter match.
    assert run([[1, 2, 9, 5, 1, 2, 3, 8, 1, 2, 3]], 2, 1, 3) == [[8, 1]]
    assert run([[1, 2, 3, 4, 1, 2]], 5, 1, 2, max_model_len=8) == [[3, 4]]  # two more tokens fit the model
    assert run([[1, 2, 3, 4, 1, 2]], 5, 1, 2, max_model_len=6) == [[]]


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=6),
       k=st.integers(1, 5), min_n=st.integers(1, 3), extra=st.integers(0, 3),
       max_model_len=st.one_of(st.none(), st.integers(0, 30)))
def test_matches_the_reference_on_random_rows(rows, k, min_n, extra, max_model_len):
    """A 4-token alphabet makes repeats, overlaps and ties common."""
    max_n = min_n + extra
    got = run(rows, k, min_n, max_n, max_model_len, width=26)
    assert got == [reference(r, k, min_n, max_n, max_model_len) for r in rows]


def test_bad_sizes_are_value_errors_naming_the_field():
    history, lengths = torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        ngram_propose(history, lengths, 2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ngram_propose(history, lengths, 0, 1, 2)
