"""What every results document states about where it was measured, and how it is written.

One place for the machine's description (CPU, cores, library versions, GPU) and for writing a
results JSON (validated against its schema first, non-finite numbers refused or written as null), so
the serving benchmark and the scripts under ``scripts/`` describe a machine the same way.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path

from asyncbatch.bench.schema import validate
from asyncbatch.profiling.host_info import cpu_name


def machine_info(device: str) -> dict:
    """The machine and the libraries a figure was measured with."""
    import numpy
    import torch
    import transformers

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": device,
            "switch_interval_s": sys.getswitchinterval()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command_line() -> str:
    """This process's command line, quoted for a shell (the report's ``command``)."""
    return " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def _nan_as_null(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_as_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_as_null(v) for v in value]
    return value


def write_json(doc: dict, path: Path, schema: dict | None = None, what: str = "results",
               nan_as_null: bool = False, indent: int = 1) -> Path:
    """Validate ``doc`` against ``schema`` (when given) and write it to ``path``, creating its folder.

    JSON has no NaN or infinity: they raise ``ValueError``, or with ``nan_as_null`` are written as null
    ("not measured"), for documents whose figures may legitimately be missing.
    """
    if schema is not None:
        validate(doc, schema, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = _nan_as_null(doc) if nan_as_null else doc
    path.write_text(json.dumps(body, indent=indent, allow_nan=False) + "\n")
    return path
