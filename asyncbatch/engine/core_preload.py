"""What the fork server imports once, before it forks any engine core (``CoreClient``'s process context).

Each import here would otherwise be paid by every core process at start-up, or
by every program that imports ``asyncbatch`` (the CLI, the server, scripts)
whether or not it starts a core:

* the core's entry point and both CPU-side executors (torch's model code, the sim);
* transformers' config module of each model family the engine runs: transformers
  imports it on first use, and it pulls in much of transformers (about 2 s here);
* ``torch._dynamo``: building the model with empty (meta) parameters runs their
  initialisers through ``torch._refs``, whose first call imports it (about 2 s).
"""

from __future__ import annotations

import contextlib
import importlib

import asyncbatch.engine.core_process
import asyncbatch.executors.sim_executor
import asyncbatch.executors.torch_executor  # noqa: F401 - imported for the fork server, not used here

MODEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
for _family in MODEL_FAMILIES:
    with contextlib.suppress(ImportError):
        importlib.import_module(f"transformers.models.{_family}.configuration_{_family}")
with contextlib.suppress(ImportError):
    importlib.import_module("torch._dynamo")
