"""asyncbatch under test, in overlap or synchronous mode.

Offline runs call ``LLM.generate`` (TTFT and finish times from the engine's
per-request metrics); online runs give every request its own thread reading
``LLM.stream``, which timestamps each delta as it reaches the caller.

Every timed run starts with an empty prefix cache, so warm-up and earlier
repeats of the same requests do not make later runs faster; reuse within a run
(shared prefixes) is what prefix caching is for and counts.
"""

from __future__ import annotations

import threading
import time

from asyncbatch.bench.workloads import WorkItem
from asyncbatch.llm import LLM
from asyncbatch.sampling_params import SamplingParams
from harness.memory import MemorySampler
from harness.records import RequestRecord, RunResult
from harness.system_base import BenchSettings, BenchSystem, ThreadErrors, timed_replay


class AsyncBatchSystem(BenchSystem):
    def __init__(self, settings: BenchSettings, overlap: bool, name: str | None = None) -> None:
        self.settings = settings
        self.overlap = overlap
        self.name = name or ("asyncbatch-overlap" if overlap else "asyncbatch-sync")
        self.description = ("asyncbatch, planner one step ahead (overlap=True)" if overlap
                            else "asyncbatch, synchronous loop (overlap=False)")
        if settings.quantization:
            self.description += f", {settings.quantization} weights"
        if not settings.enable_prefix_caching:
            self.name += "-no-prefix-cache"
            self.description += ", prefix caching off"
        self.llm = LLM(settings.model, device=settings.device, dtype=settings.dtype, overlap=overlap,
                       quantization=settings.quantization, num_threads=settings.num_threads,
                       max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                       seed=settings.seed, enable_prefix_caching=settings.enable_prefix_caching)
        info = self.llm.executor_info  # the engine's own tensors, counted in the core process
        self.load_mib = info.get("weights_mib", 0.0) + info.get("kv_cache_mib", 0.0)

    def _params(self, item: WorkItem) -> SamplingParams:
        return SamplingParams(max_tokens=item.max_tokens, temperature=self.settings.temperature,
                              top_k=-1, top_p=1.0, ignore_eos=self.settings.ignore_eos)

    def config(self) -> dict:
        c = self.llm.config
        return {"overlap": self.overlap, "device": self.llm.device, "dtype": str(self.llm.dtype),
                "quantization": self.settings.quantization,
                "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                "block_size": c.block_size, "num_kv_blocks": self.llm.num_usable_blocks + 1,
                "simulated": self.llm.simulated, "enable_prefix_caching": c.enable_prefix_caching}

    def _stats(self) -> dict:
        stats = self.llm.stats()
        stats["computed_tokens"] = round(stats.get("tokens_per_step", 0.0) * stats.get("steps", 0))
        return stats

    def run_offline(self, items: list[WorkItem]) -> RunResult:
        prompts = [it.prompt_token_ids for it in items]
        params = [self._params(it) for it in items]
        with MemorySampler() as mem:
            self.llm.reset_stats()
            self.llm.reset_prefix_cache()
            start, cpu0 = time.perf_counter(), time.process_time()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            end, cpu_s = time.perf_counter(), time.process_time() - cpu0
        records = []
        for prompt, out in zip(prompts, outs):
            if out.error is not None:
                raise RuntimeError(f"{self.name}: request {out.request_id} failed: {out.error}")
            m = out.metrics
            records.append(RequestRecord(len(prompt), len(out.token_ids), m.arrival_time, m.first_token_time,
                                         m.finished_time, None, list(out.token_ids)))
        stats = self._stats()
        return RunResult(self.name, records, start, end, stats["computed_tokens"], stats,
                         mem.result(self.load_mib), cpu_s=cpu_s)

    def run_online(self, items: list[WorkItem], offsets: list[float]) -> RunResult:
        records: list[RequestRecord | None] = [None] * len(items)
        errors = ThreadErrors()
        threads: list[threading.Thread] = []

        def consume(i: int) -> None:
            item = items[i]
            try:
                arrival = time.perf_counter()
                times: list[float] = []
                ids: list[int] = []
                for delta in self.llm.stream(item.prompt_token_ids, self._params(item)):
                    if delta.token_ids:
                        times.append(time.perf_counter())
                        ids.extend(delta.token_ids)
                records[i] = RequestRecord(len(item.prompt_token_ids), len(ids), arrival,
                                           times[0] if times else None, times[-1] if times else None, times, ids)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                errors.add(exc)

        def submit(i: int) -> None:
            thread = threading.Thread(target=consume, args=(i,), name=f"bench-stream-{i}", daemon=True)
            thread.start()
            threads.append(thread)

        def join_all() -> None:
            for thread in threads:
                thread.join()

        with MemorySampler() as mem:
            self.llm.reset_stats()
            self.llm.reset_prefix_cache()
            start, end, cpu_s = timed_replay(offsets, submit, join_all)
        errors.raise_first()
        stats = self._stats()
        return RunResult(self.name, [r for r in records if r is not None], start, end, stats["computed_tokens"],
                         stats, mem.result(self.load_mib), cpu_s=cpu_s)

    def close(self) -> None:
        self.llm.close()
