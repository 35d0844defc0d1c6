"""A folder's tokenizer is built once per process (asyncbatch/model/tokenizer_cache.py): each caller gets its
own object over the shared Rust tokenizer, and a changed file means a fresh build."""

from __future__ import annotations

import json
import os

from tiny_models import save_tiny_model

from asyncbatch.model.loader import load_tokenizer


def test_one_build_per_folder_state_and_a_copy_per_caller(tmp_path):
    folder = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    first, second = load_tokenizer(folder), load_tokenizer(folder)
    assert first is not second and first.backend_tokenizer is second.backend_tokenizer
    assert first.encode("hello") == second.encode("hello")
    second.chat_template = "{{ 'mine' }}"  # what the engine sets (chat_template=): the other caller's stays
    assert first.chat_template != second.chat_template

    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    config.write_text(json.dumps(settings, indent=1))  # same content, another size: a changed folder
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    third = load_tokenizer(folder)
    assert third.backend_tokenizer is not first.backend_tokenizer
    assert third.encode("hello") == first.encode("hello")
