"""The model's own sampling defaults: its ``generation_config.json``, as vLLM reads it.

Model makers ship recommended sampling in ``generation_config.json`` (Qwen2.5-Instruct: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM's default, ``generation_config="auto"``, applies those
fields to every request that does not set them: ``LLM.generate`` without ``SamplingParams``, and the fields an
OpenAI request leaves out. ``"vllm"`` ignores the file (the neutral defaults: temperature 1, no top-k/p);
a folder path reads that folder's file instead. ``override_generation_config`` (a dict of the same fields,
``max_new_tokens`` included) is laid over what was read.

Only the sampling fields are taken, as in vLLM: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (which becomes ``max_tokens``). Invariant: the returned dict
builds a valid ``SamplingParams`` (checked once at engine start; a bad file is a ``ValueError`` naming it and
the field), so no request can fail later on a default it did not choose.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from asyncbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's field -> SamplingParams' field
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
SETTINGS = ("auto", "vllm")


def sampling_defaults(model_dir: Path | None, setting: str = "auto",
                      overrides: dict[str, object] | None = None) -> dict[str, object]:
    """``SamplingParams`` keyword defaults for one engine (module doc): ``setting`` is ``"auto"`` (the model
    folder's file), ``"vllm"`` (none) or a folder holding a ``generation_config.json``."""
    if setting == "vllm":
        found: dict[str, object] = {}
        source = "no file (generation_config='vllm')"
    else:
        folder = model_dir if setting == "auto" else Path(setting).expanduser()
        if setting != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a generation_config.json; "
                             f"{str(folder)!r} holds none")
        found = _read(folder / "generation_config.json") if folder is not None else {}
        source = str(folder / "generation_config.json") if folder is not None else "no model folder"
    unknown = sorted(set(overrides or {}) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config takes {sorted(SAMPLING_FIELDS)}, got {unknown}")
    found.update(overrides or {})
    defaults = {SAMPLING_FIELDS[key]: value for key, value in found.items()
                if key in SAMPLING_FIELDS and value is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the sampling defaults from {source} (with override_generation_config) are invalid: {exc}"
                         ) from None
    if defaults:
        logger.warning("sampling defaults %s come from %s (the model maker's recommendation, as vLLM applies it); "
                       "generation_config='vllm' ignores them", defaults, source)
    return defaults


def _read(path: Path) -> dict[str, object]:
    """The file's fields through transformers' ``GenerationConfig`` (its legacy names mapped); {} without one."""
    if not path.is_file():
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(path.parent)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation_config: {path} cannot be read: {exc}") from None
    return config.to_diff_dict()
