"""The committed reference tokens are used only under the key they were made with, and rewritten otherwise."""

from __future__ import annotations

import json

import pytest
from golden_tokens import DEFAULT_MODEL_GREEDY, GoldenTokens, current_key, request_key

pytestmark = pytest.mark.model


def test_committed_golden_tokens_match_this_checkout():
    golden = GoldenTokens.load()
    assert golden.matches, (f"{DEFAULT_MODEL_GREEDY} was made for another GGUF or transformers version; "
                            "run scripts/update_golden_tokens.py (the greedy test regenerates it too)")
    assert len(golden.tokens) == 16 and all(golden.tokens.values())


def test_a_stale_key_is_ignored_and_save_rewrites_the_file(tmp_path):
    path = tmp_path / "golden.json"
    key = request_key([1, 2, 3], 4, 2)
    stale = GoldenTokens(path, {**current_key(), "transformers": "0.0.0"}, {}, False)
    stale.save({key: [5, 6, 7, 8]})
    loaded = GoldenTokens.load(path)
    assert not loaded.matches and loaded.tokens == {} and not loaded.covers([key])
    fresh = GoldenTokens.load(path)
    fresh.save({key: [5, 6, 7, 8]})
    again = GoldenTokens.load(path)
    assert again.matches and again.covers([key]) and again.tokens[key] == [5, 6, 7, 8]
    assert not again.covers([request_key([1, 2, 3], 5, 2)])
    assert json.loads(path.read_text())["key"] == current_key()
