"""Tokenizers loaded once per process and folder.

Building SmolLM2's fast tokenizer (``tokenizer.json`` parsed by transformers and again by the Rust
library) costs ~0.5 s of CPU, and one process often builds many engines on the same model: the test
suite, a benchmark comparing configurations, a server restarting its engine. The first load of a folder
is kept while none of its files has changed (name, size and mtime); later loads return a shallow
copy of it.

Invariant: each caller gets its own Python object, so what it sets on it (``chat_template``, the one
attribute the engine sets) stays its own; the Rust tokenizer underneath is shared, and the engine only
reads it (encode, decode, chat templates), never with truncation or padding, the two settings that
change its state.
"""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_MAX_KEPT = 8
_kept: dict[tuple, PreTrainedTokenizerBase] = {}
_lock = threading.Lock()


def _folder_stamp(folder: Path) -> tuple:
    """What identifies the folder's current files: their names, sizes and modification times."""
    entries = []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.is_file():
                st = entry.stat()
                entries.append((entry.name, st.st_size, st.st_mtime_ns))
    return (str(folder.resolve()), tuple(sorted(entries)))


def load_tokenizer_cached(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)``, built once per folder state (see the module docstring)."""
    folder = Path(path)
    if not folder.is_dir():
        return AutoTokenizer.from_pretrained(path)  # let transformers report what is wrong with it
    key = _folder_stamp(folder)
    with _lock:
        kept = _kept.get(key)
    if kept is None:
        kept = AutoTokenizer.from_pretrained(path)
        with _lock:
            if len(_kept) >= _MAX_KEPT:
                _kept.pop(next(iter(_kept)))
            _kept[key] = kept
    return copy.copy(kept)
