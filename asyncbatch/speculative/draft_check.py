"""Where a draft model is, and whether it can draft for the target: checked once, when the engine resolves
its model (before any weights load), so a bad ``speculative_config.model`` fails at engine start.

A draft's tokens are ids in the target's vocabulary (they are verified against the target's samples and fed
to it), so the draft must share it: the same ``vocab_size`` and, where both tokenizers are available, the
same token-to-id map. It must also reach the engine's ``max_model_len``: it computes every position the
target computes.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from asyncbatch.model.loader import load_config, load_tokenizer, max_model_len, resolve_model_path
from asyncbatch.speculative.config import SpeculativeConfig


def resolve_draft(spec: SpeculativeConfig | None, target_path: Path, target: PretrainedConfig,
                  target_tokenizer: PreTrainedTokenizerBase | None, max_len: int,
                  cache_dir: str | None = None) -> Path | None:
    """The draft model's folder (a GGUF converted once, like the target's), or None without a draft model.
    A draft that cannot serve is a ``ValueError`` naming ``speculative_config.model``."""
    if spec is None or not spec.uses_draft_model:
        return None
    field = f"speculative_config.model {spec.model!r}"
    try:
        path = resolve_model_path(spec.model, cache_dir)
        config, _arch = load_config(path)
    except ValueError as exc:
        raise ValueError(f"{field} cannot be loaded: {exc}") from exc
    if int(config.vocab_size) != int(target.vocab_size):
        raise ValueError(f"{field} has vocab_size {config.vocab_size}, the target model {int(target.vocab_size)}: "
                         "a draft model must share the target's vocabulary")
    if max_model_len(config) < max_len:
        raise ValueError(f"{field} serves at most {max_model_len(config)} positions, the engine's max_model_len is "
                         f"{max_len}: lower max_model_len or pick a draft with a longer context")
    if target_tokenizer is not None and Path(path).resolve() != Path(target_path).resolve():
        _check_tokenizers(field, path, target_tokenizer)
    return Path(path)


def _check_tokenizers(field: str, path: Path, target: PreTrainedTokenizerBase) -> None:
    """Equal token-to-id maps, where the draft's folder has a tokenizer (one without: ``vocab_size`` decides)."""
    try:
        draft = load_tokenizer(path)
    except (ValueError, OSError):
        return
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours != theirs:
        token = min((t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t)),
                    key=lambda t: min(ours.get(t, 1 << 62), theirs.get(t, 1 << 62)))
        raise ValueError(f"{field} has another tokenizer vocabulary than the target model ({len(theirs)} vs "
                         f"{len(ours)} tokens; e.g. {token!r} is id {theirs.get(token)} in the draft, "
                         f"{ours.get(token)} in the target): a draft model must share the target's vocabulary")
