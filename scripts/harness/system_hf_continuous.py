"""transformers' continuous batching (the engine behind ``generate_batch``) under test.

``generate_batch`` takes one ``max_new_tokens`` for all prompts, so this drives
the same manager directly, as ``generate_batch`` does, adding each request
with its own ``max_new_tokens``. Limits equal asyncbatch's: at most
``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens per step, and
the same KV capacity in tokens (left to itself it sizes the cache from
available memory: 11 GiB of RAM for a 2-layer test model). On
CPU transformers keeps the model's ``sdpa`` attention (flash attention is
unavailable) and turns CUDA graphs and its async batching off by itself.

Each run opens a fresh manager (its KV cache sized for the workload, as
``generate_batch`` does) outside the timed window; the window runs from the
first ``add_request`` to the last finished result.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

import torch
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from asyncbatch.bench.workloads import WorkItem
from asyncbatch.engine.builder import kv_bytes_per_token
from harness.hf_common import effective_eos, generation_config, load_hf_model
from harness.memory import MemorySampler
from harness.records import RequestRecord, RunResult
from harness.system_base import BenchSettings, BenchSystem, ThreadErrors, timed_replay

_PAGE_SIZE = 256  # transformers' default page (block) size
_POLL_S = 0.05  # result-queue poll; a result wakes the consumer at once, the timeout only bounds liveness checks


class HFContinuousSystem(BenchSystem):
    name = "transformers-generate_batch"
    description = "transformers continuous batching (generate_batch's manager), per-request max_new_tokens"

    def __init__(self, settings: BenchSettings) -> None:
        self.settings = settings
        self.hf = load_hf_model(settings)
        self.load_mib = self.hf.load_mib
        self._resolved: dict = {}

    def _kv_mib(self) -> float:
        """The KV cache each run's manager allocates (equal capacity to asyncbatch's)."""
        per_token = kv_bytes_per_token(self.hf.model.config, self.hf.dtype)
        return -(-self.hf.kv_capacity_tokens // _PAGE_SIZE) * _PAGE_SIZE * per_token / (1 << 20)

    def config(self) -> dict:
        return {"attn_implementation": self.hf.model.config._attn_implementation, "dtype": str(self.hf.dtype),
                "device": str(self.hf.device), "resolved_cb_config": self._resolved}

    def _manager(self, items: list[WorkItem]):
        hints = WorkloadHints(max_prompt_length=max(len(it.prompt_token_ids) for it in items),
                              max_generated_length=max(it.max_tokens for it in items), num_requests=len(items))
        num_blocks = -(-self.hf.kv_capacity_tokens // _PAGE_SIZE)
        cb = ContinuousBatchingConfig(page_size=_PAGE_SIZE, num_blocks=num_blocks,
                                      max_batch_tokens=self.settings.max_num_batched_tokens,
                                      max_requests_per_batch=self.settings.max_num_seqs, seed=self.settings.seed)
        gc = generation_config(self.settings, self.hf, max(it.max_tokens for it in items))
        gc.eos_token_id = effective_eos(self.settings, self.hf)  # -1: never matches, as ``ignore_eos``
        return self.hf.model.continuous_batching_context_manager(
            generation_config=gc, block=True, timeout=5, continuous_batching_config=cb, workload_hints=hints)

    def _remember_config(self, manager) -> None:
        if not self._resolved:
            self._resolved = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                              for k, v in asdict(manager.continuous_batching_config).items()}

    def _collect(self, manager, records: dict[str, RequestRecord], total: int, streaming: bool) -> None:
        """Read results until ``total`` requests finished; per-delivery times when ``streaming``."""
        finished = 0
        while finished < total:
            result = manager.get_result(timeout=_POLL_S)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"{self.name}: the generation thread stopped with {total - finished} "
                                       "requests unfinished")
                continue
            now = time.perf_counter()
            if result.error is not None:
                raise RuntimeError(f"{self.name}: request {result.request_id} failed: {result.error}")
            rec = records[result.request_id]
            tokens = list(result.generated_tokens)
            if streaming and len(tokens) > len(rec.token_ids):
                rec.chunk_times.append(now)
                rec.first_token = rec.first_token if rec.first_token is not None else now
                rec.finish = now
            rec.token_ids, rec.output_len = tokens, len(tokens)
            if result.is_finished():
                finished += 1
                if not streaming:
                    stamps = result.timestamps or [now]
                    rec.first_token, rec.finish = stamps[0], stamps[-1]

    def run_offline(self, items: list[WorkItem]) -> RunResult:
        eos = effective_eos(self.settings, self.hf)
        records: dict[str, RequestRecord] = {}
        with MemorySampler() as mem, torch.inference_mode(), self._manager(items) as manager:
            self._remember_config(manager)
            start, cpu0 = time.perf_counter(), time.process_time()
            for i, it in enumerate(items):
                rid = f"r{i}"
                records[rid] = RequestRecord(len(it.prompt_token_ids), 0, time.perf_counter(), None, None)
                manager.add_request(it.prompt_token_ids, request_id=rid, max_new_tokens=it.max_tokens,
                                    record_timestamps=True, eos_token_id=eos)
            self._collect(manager, records, len(items), streaming=False)
            end, cpu_s = time.perf_counter(), time.process_time() - cpu0
        ordered = [records[f"r{i}"] for i in range(len(items))]
        return RunResult(self.name, ordered, start, end, None, None, mem.result(self.load_mib, self._kv_mib()), cpu_s=cpu_s)

    def run_online(self, items: list[WorkItem], offsets: list[float]) -> RunResult:
        eos = effective_eos(self.settings, self.hf)
        records = {f"r{i}": RequestRecord(len(it.prompt_token_ids), 0, 0.0, None, None, [])
                   for i, it in enumerate(items)}
        errors = ThreadErrors()
        with MemorySampler() as mem, torch.inference_mode(), self._manager(items) as manager:
            self._remember_config(manager)

            def consume() -> None:
                try:
                    self._collect(manager, records, len(items), streaming=True)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.add(exc)

            def submit(i: int) -> None:
                rid = f"r{i}"
                records[rid].arrival = time.perf_counter()
                manager.add_request(items[i].prompt_token_ids, request_id=rid, max_new_tokens=items[i].max_tokens,
                                    streaming=True, eos_token_id=eos)

            consumer = threading.Thread(target=consume, name="bench-hf-consumer", daemon=True)
            consumer.start()
            start, end, cpu_s = timed_replay(offsets, submit, consumer.join)
        errors.raise_first()
        ordered = [records[f"r{i}"] for i in range(len(items))]
        return RunResult(self.name, ordered, start, end, None, None, mem.result(self.load_mib, self._kv_mib()), cpu_s=cpu_s)
