"""The shipped prompts of ``scripts/bench_speculative.py`` and how they become token ids.

Two workloads, written for this benchmark (``data/speculative/*.json``, a list of ``{"id", "task",
"messages"}``):

- ``grounded``: the answer copies its input -- prose rewritten with one change or with typos fixed, a
  summary that reuses the text's words, code edited (a variable renamed, a parameter or a check added), a
  passage's questions answered by quoting it, an email edited. Prompt lookup drafts well here.
- ``open``: open-ended chat (a story, an explanation, advice); nothing to copy but the answer's own words.

Prompts go through the model's chat template; a model without one (the tests' tiny byte-level model) gets
``"User: ...\\nAssistant:"`` as plain text, so the script runs end to end on any tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "speculative"
WORKLOADS = ("grounded", "open")


def load_workload(name: str) -> list[dict]:
    """The shipped conversations of workload ``name`` (``grounded`` or ``open``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    return json.loads((DATA / f"{name}.json").read_text())


def spread(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (all of them for ``n`` <= 0 or ``n`` >= len): one-request runs
    take a few prompts of every kind rather than the first few."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def cycle(items: list, n: int) -> list:
    """``n`` items taking ``items`` in turn (the many-request case repeats the shipped prompts)."""
    return [items[i % len(items)] for i in range(n)]


def prompt_ids(llm, messages: list[dict]) -> list[int]:
    """The conversation's prompt token ids under ``llm``'s chat template, or as plain text without one."""
    try:
        return llm.chat_prompt_ids(messages)
    except ValueError as exc:
        if "chat template" not in str(exc):
            raise
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return list(llm.tokenizer.encode(text, add_special_tokens=False))
