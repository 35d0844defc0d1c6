"""The systems a benchmark can compare, by name.

Built lazily, so a run of asyncbatch alone never imports transformers' batching
code, and the transformers baselines are built only when asked for. ``llama.cpp``
needs the optional ``llamacpp`` extra; without it building it raises
``LlamaCppUnavailable`` and the scripts skip it with that message (``OPTIONAL``).
"""

from __future__ import annotations

from collections.abc import Callable

from harness.system_base import BenchSettings, BenchSystem

OVERLAP, SYNC = "asyncbatch-overlap", "asyncbatch-sync"
GENERATE_BATCH, STATIC = "transformers-generate_batch", "transformers-static"
LLAMACPP = "llama.cpp"
SYSTEM_NAMES = (OVERLAP, SYNC, GENERATE_BATCH, STATIC)  # "all"; llama.cpp is asked for by name
ALIASES = {"overlap": OVERLAP, "sync": SYNC, "generate_batch": GENERATE_BATCH, "cb": GENERATE_BATCH,
           "static": STATIC, "llamacpp": LLAMACPP}


def _overlap(s: BenchSettings) -> BenchSystem:
    from harness.system_asyncbatch import AsyncBatchSystem

    return AsyncBatchSystem(s, overlap=True)


def _sync(s: BenchSettings) -> BenchSystem:
    from harness.system_asyncbatch import AsyncBatchSystem

    return AsyncBatchSystem(s, overlap=False)


def _generate_batch(s: BenchSettings) -> BenchSystem:
    from harness.system_hf_continuous import HFContinuousSystem

    return HFContinuousSystem(s)


def _static(s: BenchSettings) -> BenchSystem:
    from harness.system_hf_static import HFStaticSystem

    return HFStaticSystem(s)


def _llamacpp(s: BenchSettings) -> BenchSystem:
    from harness.system_llamacpp import LlamaCppSystem

    return LlamaCppSystem(s)


BUILDERS: dict[str, Callable[[BenchSettings], BenchSystem]] = {
    OVERLAP: _overlap, SYNC: _sync, GENERATE_BATCH: _generate_batch, STATIC: _static, LLAMACPP: _llamacpp}
# Systems that need an optional extra: skipped with the builder's message when it is missing.
OPTIONAL = (LLAMACPP,)


def parse_systems(text: str) -> list[str]:
    """``"all"`` or a comma list of names or aliases (overlap, sync, generate_batch, static, llamacpp)."""
    if text.strip() == "all":
        return list(SYSTEM_NAMES)
    names = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name = ALIASES.get(part, part)
        if name not in BUILDERS:
            raise ValueError(f"unknown system {part!r}; known: {list(BUILDERS)} or {sorted(ALIASES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no systems given")
    return names


def build_system(name: str, settings: BenchSettings) -> BenchSystem:
    return BUILDERS[name](settings)
