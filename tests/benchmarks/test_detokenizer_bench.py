"""Incremental detokenization: ``IncrementalDetokenizer.push`` over a 256-token output.

Measured for the tiny byte-level test tokenizer and for SmolLM2's BPE
tokenizer (skipped when the default model is not installed). The output
thread pays this per token, per request.
"""

from __future__ import annotations

import pytest

from asyncbatch.frontend.detokenizer import IncrementalDetokenizer

TEXT = ("The planner runs one step ahead of the device, so the CPU builds batch N+1 while the GPU executes "
        "batch N. Café, naïve, 日本語 and emoji 🎉 keep multi-byte characters in the mix. ") * 8
NUM_TOKENS = 256


def _byte_tokenizer():
    from tiny_models import build_byte_tokenizer

    return build_byte_tokenizer()


def _smollm2_tokenizer():
    try:
        from asyncbatch.model.loader import load_tokenizer, resolve_model_path

        return load_tokenizer(resolve_model_path(None))
    except Exception as exc:  # noqa: BLE001 - any failure means the model is not installed here
        pytest.skip(f"default model unavailable: {exc}")


@pytest.mark.parametrize("which", ["byte", "smollm2"])
def test_detokenize_256_tokens(benchmark, which):
    tokenizer = _byte_tokenizer() if which == "byte" else _smollm2_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    benchmark.group = "detokenize 256 tokens"
    benchmark.extra_info["tokens"] = NUM_TOKENS

    def run() -> str:
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
        for token in ids:
            detok.push(token)
        detok.finish()
        return detok.text

    text = benchmark(run)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
