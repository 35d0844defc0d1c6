"""llama.cpp under test, through llama-cpp-python's low-level batched API (the optional ``llamacpp`` extra).

The same requests (token ids), the same GGUF file asyncbatch converts (the
default model's, or ``--model`` when it is a ``.gguf``), greedy (argmax of each
row's logits), every request to its own ``max_tokens`` (EOS ignored, as the other
systems' ``ignore_eos``). It batches like ``llama-batched-bench`` and
``llama-server``: one context holds up to ``max_num_seqs`` sequences, each in its
own KV stream (``kv_unified`` off), and every ``llama_decode`` takes one ``llama_batch``
with the next token of every decoding sequence plus the prompts of newly admitted
ones (at most ``max_num_batched_tokens`` tokens), so a finished sequence's slot takes
the next waiting request at once. Threads: every core (``n_threads`` and
``n_threads_batch``), as asyncbatch's torch threads.

Without llama-cpp-python the system cannot be built: ``LlamaCppUnavailable`` says
how to install it, and the benchmark scripts skip the system with that message.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from pathlib import Path

import numpy as np

from asyncbatch.bench.workloads import WorkItem
from harness.memory import MemorySampler
from harness.records import RequestRecord, RunResult
from harness.system_base import BenchSettings, BenchSystem

INSTALL_HINT = "pip install 'asyncbatch[llamacpp]' (compiles llama.cpp: ~10 min on 2 cores)"


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python is not installed, or the model is not a GGUF file."""


def gguf_path(model: str | None) -> Path:
    from asyncbatch.model.default_model import default_gguf_path, is_default_model

    if model is None or is_default_model(model):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise LlamaCppUnavailable(f"the llama.cpp baseline needs a .gguf model file, got {model!r}")
    return path


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppUnavailable(f"llama-cpp-python is not installed ({exc}); {INSTALL_HINT}") from exc
    return llama_cpp


class LlamaCppSystem(BenchSystem):
    name = "llama.cpp"
    description = "llama.cpp (llama-cpp-python low-level API), batched sequences in one context, greedy"

    def __init__(self, settings: BenchSettings, threads: int | None = None) -> None:
        if settings.device not in ("cpu", "auto"):
            raise LlamaCppUnavailable(f"the llama.cpp baseline runs on the cpu here, not {settings.device!r}")
        if settings.temperature > 0:
            raise ValueError("the llama.cpp baseline is greedy only (temperature 0)")
        self.lib = import_llama_cpp()
        self.settings = settings
        self.path = gguf_path(settings.model)
        self.threads = threads or settings.num_threads or os.cpu_count() or 1
        lib = self.lib
        lib.llama_backend_init()
        lib.llama_log_set(_silent_log, ctypes.c_void_p(0))
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.load_mib = self.path.stat().st_size / 2**20
        self._ctx = None
        self._ctx_shape: tuple[int, int] | None = None

    def config(self) -> dict:
        return {"gguf": str(self.path), "threads": self.threads, "llama_cpp_python": self.lib.__version__,
                "max_num_seqs": self.settings.max_num_seqs, "n_batch": self.settings.max_num_batched_tokens,
                "kv_unified": False, "sampling": "greedy (argmax of the logits)"}

    def _context(self, seqs: int, per_seq: int):
        """A context for ``seqs`` sequences of up to ``per_seq`` tokens (reused when it is big enough)."""
        lib = self.lib
        if self._ctx is not None and self._ctx_shape is not None and self._ctx_shape[0] >= seqs \
                and self._ctx_shape[1] >= per_seq:
            lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
            return self._ctx
        self._free_context()
        per_seq = -(-per_seq // 256) * 256
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = seqs * per_seq
        cparams.n_batch = self.settings.max_num_batched_tokens
        cparams.n_ubatch = min(512, self.settings.max_num_batched_tokens)
        cparams.n_seq_max = seqs
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.kv_unified = False
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._ctx, self._ctx_shape = ctx, (seqs, per_seq)
        return ctx

    def _free_context(self) -> None:
        if self._ctx is not None:
            self.lib.llama_free(self._ctx)
            self._ctx = None

    def generate(self, items: list[WorkItem], records: list[RequestRecord]) -> None:
        """Continuous batching over ``items``; fills ``records`` (times, token ids) in place."""
        lib = self.lib
        max_seqs = min(self.settings.max_num_seqs, len(items), 256)
        budget = self.settings.max_num_batched_tokens
        longest = max(len(it.prompt_token_ids) + it.max_tokens for it in items)
        if max(len(it.prompt_token_ids) for it in items) > budget:
            raise ValueError("a prompt is longer than max_num_batched_tokens (no chunked prefill here)")
        ctx = self._context(max_seqs, longest)
        mem = lib.llama_get_memory(ctx)
        batch = lib.llama_batch_init(budget + max_seqs, 0, 1)
        try:
            waiting = deque(range(len(items)))
            free = list(range(max_seqs))[::-1]
            running: dict[int, int] = {}  # seq slot -> request index
            pos = [0] * len(items)
            while waiting or running:
                n, rows = 0, []  # rows: (batch index with logits, request)
                for slot, i in running.items():
                    _put(batch, n, records[i].token_ids[-1], pos[i], slot, True)
                    pos[i] += 1
                    rows.append((n, i))
                    n += 1
                while waiting and free and n + len(items[waiting[0]].prompt_token_ids) <= budget:
                    i, slot = waiting.popleft(), free.pop()
                    prompt = items[i].prompt_token_ids
                    for j, tok in enumerate(prompt):
                        _put(batch, n + j, tok, j, slot, j == len(prompt) - 1)
                    n += len(prompt)
                    pos[i] = len(prompt)
                    rows.append((n - 1, i))
                    running[slot] = i
                batch.n_tokens = n
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                now = time.perf_counter()
                for row, i in rows:
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                    rec = records[i]
                    rec.token_ids.append(int(logits.argmax()))
                    rec.first_token = rec.first_token if rec.first_token is not None else now
                    if len(rec.token_ids) >= items[i].max_tokens:
                        rec.finish, rec.output_len = now, len(rec.token_ids)
                        slot = next(s for s, r in running.items() if r == i)
                        del running[slot]
                        lib.llama_memory_seq_rm(mem, slot, -1, -1)
                        free.append(slot)
        finally:
            lib.llama_batch_free(batch)

    def run_offline(self, items: list[WorkItem]) -> RunResult:
        with MemorySampler() as mem:
            start, cpu0 = time.perf_counter(), time.process_time()
            records = [RequestRecord(len(it.prompt_token_ids), 0, start, None, None, None, []) for it in items]
            self.generate(items, records)
            end, cpu_s = time.perf_counter(), time.process_time() - cpu0
        return RunResult(self.name, records, start, end, None, None, mem.result(self.load_mib), cpu_s=cpu_s)

    def run_online(self, items: list[WorkItem], offsets: list[float]) -> RunResult:
        raise ValueError("the llama.cpp baseline runs offline throughput only (bench_throughput.py)")

    def close(self) -> None:
        self._free_context()
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None


def _put(batch, k: int, token: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[k] = token
    batch.pos[k] = pos
    batch.n_seq_id[k] = 1
    batch.seq_id[k][0] = seq
    batch.logits[k] = logits


def _silent(level, text, user_data) -> None:  # llama.cpp's log lines would interleave with the table
    return None


try:  # the callback type exists only where llama-cpp-python is installed
    import llama_cpp as _lc

    _silent_log = _lc.llama_log_callback(_silent)
except ImportError:  # pragma: no cover - without the extra the system is never built
    _silent_log = None
